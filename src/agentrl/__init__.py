"""agentrl: a reproducible DVC pipeline for SFT and GRPO (LoRA) on language models."""

import os as _os

# An idle OpenMP worker spins 300,000 iterations (GNU libgomp's default, torch's OpenMP on Linux) before it sleeps.
# When another process shares the cores, each small op then waits for a spinner the OS has descheduled: beside one
# CPU-bound process a training step ran 2.8x (SmolLM2 LoRA) and 3.3x (the tiny default) slower than alone; with
# 1000, 1.9x and 1.7x, for 13% alone on the tiny model and nothing measurable on SmolLM2 (`make bench-shared`,
# docs/benchmarks.md). The numerics do not change: the same threads split the same work (the same weight bytes).
# libgomp reads it when torch loads, so it is set before any stage imports torch; a value the user set wins.
SPIN_COUNT = "1000"
_os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

# params.yaml `reproducibility` pins the CPU kernels (ATen, MKL, FBGEMM, threads) through environment variables
# that torch and MKL read when they start: set them here, before any stage module imports torch.
from .reproducibility import apply_from_file as _apply_reproducibility  # noqa: E402

_apply_reproducibility()

__version__ = "0.1.0"
