"""agentrl: a reproducible DVC pipeline for SFT and GRPO (LoRA) on language models."""

import importlib.abc
import sys

# params.yaml `reproducibility` pins the CPU kernels (ATen, MKL, FBGEMM, threads) through environment variables
# that torch and MKL read when they start: set them here, before any stage module imports torch.
from .reproducibility import apply_from_file as _apply_reproducibility

_apply_reproducibility()

__version__ = "0.1.0"

# Modules that moved into sub-packages (issue 43): old path -> (new path, how it is run). `agentrl.agent` is not
# here: the name is now the agent/ package (the tool loop is agentrl.agent.loop, see agent/__init__.py).
MOVED_MODULES = {
    "agentrl.agent_api": ("agentrl.api.actions", "python -m agentrl.api.actions"),
    "agentrl.agent_checks": ("agentrl.api.checks", "import agentrl.api.checks"),
    "agentrl.base": ("agentrl.stages.base", "python -m agentrl.stages.base"),
    "agentrl.card": ("agentrl.stages.card", "python -m agentrl.stages.card"),
    "agentrl.compare": ("agentrl.stages.compare", "python -m agentrl.stages.compare"),
    "agentrl.env_server": ("agentrl.envs.openenv_server", "python -m agentrl.envs.openenv_server"),
    "agentrl.evaluate": ("agentrl.stages.evaluate", "python -m agentrl.stages.evaluate"),
    "agentrl.exp_queue": ("agentrl.experiments.queue", "import agentrl.experiments.queue"),
    "agentrl.export": ("agentrl.stages.export", "python -m agentrl.stages.export"),
    "agentrl.grpo": ("agentrl.stages.grpo", "python -m agentrl.stages.grpo"),
    "agentrl.mcp_server": ("agentrl.api.mcp_server", "python -m agentrl.api.mcp_server"),
    "agentrl.overrides": ("agentrl.experiments.overrides", "import agentrl.experiments.overrides"),
    "agentrl.prepare": ("agentrl.stages.prepare", "python -m agentrl.stages.prepare"),
    "agentrl.quantize": ("agentrl.stages.quantize", "import agentrl.stages.quantize"),
    "agentrl.report": ("agentrl.experiments.report", "python -m agentrl.experiments.report"),
    "agentrl.rewards": ("agentrl.agent.rewards", "import agentrl.agent.rewards"),
    "agentrl.scratch": ("agentrl.experiments.scratch", "import agentrl.experiments.scratch"),
    "agentrl.serve": ("agentrl.serving.app", "uvicorn agentrl.serving.app:app"),
    "agentrl.sft": ("agentrl.stages.sft", "python -m agentrl.stages.sft"),
    "agentrl.share": ("agentrl.experiments.share", "python -m agentrl.experiments.share"),
    "agentrl.stage": ("agentrl.stages.training", "import agentrl.stages.training"),
    "agentrl.tools": ("agentrl.agent.tools", "import agentrl.agent.tools"),
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Refuses an old module path (`import agentrl.sft`, `python -m agentrl.sft`) with a ModuleNotFoundError that
    names the new one, instead of Python's bare "No module named 'agentrl.sft'"."""

    def find_spec(self, fullname, path=None, target=None):
        """Args:
            fullname: the dotted module name being imported.
            path, target: unused (the meta-path finder protocol).

        Returns:
            None for every module that did not move (the other finders look for it); raises for a moved one.
        """
        if fullname in MOVED_MODULES:
            new, how = MOVED_MODULES[fullname]
            raise ModuleNotFoundError(f"{fullname} moved to {new}: {how}", name=fullname)
        return None


if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModuleFinder())
