"""Stage `grpo`: reinforcement learning with TRL's GRPOTrainer and a fresh LoRA over the SFT model.

Start point: the SFT adapter is merged into the base weights (models/base + models/sft), then a new
LoRA from grpo.lora (peft.LoraConfig arguments) is trained on top (grpo.use_lora: false trains all
weights instead). The adapter saved in models/grpo/ therefore applies to base+SFT merged; `export`
merges both.

grpo.trainer is passed to trl.GRPOConfig unchanged (tests check it): its own learning rate (far below
SFT's: HelloAgents' shared 5e-5 collapsed Qwen3-0.6B from 57.0% to 2.4% on GSM8K), beta (a reference
model is only created when beta > 0), num_generations, use_vllm/vllm_mode, ... The stage sets the derived
values (config.DERIVED): the scaled learning rate, reward_weights from grpo.rewards, seed, precision,
output and tracking. Rewards come from the registry in rewards.py with the weights in grpo.rewards.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from typing import Optional

from trl import GRPOTrainer

from ..agent.linear_kernels import OneDNNLinear, use_linear_kernels
from ..agent.loop import BrokenEnvironmentError, BrokenEpisodes
from ..agent.rewards import build_rewards
from ..agent.tools import toolset_from_params
from ..common import file_digest, get_logger, model_files_digest, resolve_precision, torch_dtype, world_size
from ..config import Params, ParamsError
from ..envs.openenv_client import OpenEnvError
from ..envs.registry import episode_solved
from ..modeling import STAGE_DIRS, attach, load_model, load_tokenizer
from ..passthrough import passthrough_value
from . import training

DATA = "data/prepared/rl_train.jsonl"
CHECKPOINTS = "checkpoints/grpo"
METRICS = "metrics/grpo_train.json"
log = get_logger("grpo")


class GRPOSettingsError(ValueError):
    """GRPO settings that cannot run together (batch sizes, the rollout path, merged rollouts): the stage ends in one
    line naming them."""


def check_batch(params: Params, num_processes: int | None = None) -> int:
    """The generation batch (completions per optimizer step), computed as GRPOConfig does, must divide into
    groups of num_generations. Checked before anything loads, with the number of processes of the launch.

    Args:
        num_processes: the launch's processes (default: this launch's).

    Returns:
        The generation batch. GRPOSettingsError naming the keys when it does not divide.
    """
    trainer = params.grpo.trainer

    def value(name):
        return passthrough_value("grpo.trainer", trainer, name)

    processes = num_processes or world_size()
    per_device, num_generations = value("per_device_train_batch_size"), value("num_generations")
    if value("generation_batch_size") is not None:
        gen_batch = value("generation_batch_size")
        how = f"generation_batch_size ({gen_batch})"
    else:
        steps_key = (
            "steps_per_generation" if value("steps_per_generation") is not None else "gradient_accumulation_steps"
        )
        gen_batch = per_device * processes * value(steps_key)
        how = (
            f"per_device_train_batch_size ({per_device}) x processes ({processes}) x {steps_key} "
            f"({value(steps_key)}) = {gen_batch}"
        )
    if gen_batch % num_generations:
        raise GRPOSettingsError(
            f"grpo.trainer: the generation batch {how} completions must be divisible by "
            f"grpo.trainer.num_generations ({num_generations}); e.g. set per_device_train_batch_size to a multiple "
            f"of {num_generations}"
        )
    return gen_batch


def grpo_config(params: Params, output_dir: str = CHECKPOINTS, **tracking_kwargs):
    """trl.GRPOConfig(**grpo.trainer) plus what the stage derives (training.trainer_config) and reward_weights, the
    weights of grpo.rewards.

    Args:
        **tracking_kwargs: report_to, run_name.
    """
    weights = [float(w) for w in params.grpo.rewards.values()]
    return training.trainer_config(params, "grpo", output_dir, reward_weights=weights, **tracking_kwargs)


def check_generation(args) -> None:
    """TRL's vLLM rollouts (grpo.trainer.use_vllm, vllm_mode colocate | server) need CUDA and vllm: say so
    before anything loads instead of failing inside the trainer.
    """
    if not args.use_vllm:
        return
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        raise ParamsError("grpo.trainer.use_vllm: vLLM generation needs a CUDA GPU (it is off on CPU); set it to false")
    if importlib.util.find_spec("vllm") is None:
        raise ParamsError("grpo.trainer.use_vllm: vllm is not installed (pip install vllm), or set it to false")


def starting_model(params: Params | None = None):
    """models/base with the SFT result merged in: the policy GRPO starts from, in the training dtype
    (model.precision) with model.attn_implementation when params are given.

    Args:
        params: the run's params (None: the saved dtype and attention).
    """
    kw = (
        {}
        if params is None
        else {"dtype": torch_dtype(params.model.precision), "attn_implementation": params.model.attn_implementation}
    )
    return attach(load_model(STAGE_DIRS["base"], **kw), STAGE_DIRS["sft"], merge=True)


class ToolRollout:
    """TRL `rollout_func`: the trainer's sampling settings, generation through the tool loop
    (agent.generate_with_tools, the same loop evaluation and the server run). Returns per completion the
    prompt and completion ids, `env_mask` (0 on tool-inserted tokens: TRL turns it into the tool_mask that
    keeps them out of the loss) and the tool calls/errors, which reach reward functions as keyword arguments
    `tool_calls` and `tool_errors`. Accumulates the seconds spent generating (also read by scripts/bench.py) and
    the tool-use curves (agent.tool_stats per batch of rollouts) until the trainer logs them (pop_curves).
    `merged` (grpo.merged_rollouts): generation runs on a plain copy of the policy whose weights are the LoRA's
    merged in (merged_policy), not on the PEFT model, whose Linear layers run `kernels`
    (grpo.rollout_linear_kernels: agent/linear_kernels.py).

    Each completion's episode is reset with its own dataset row (seed, map). TRL hands a rollout_func the prompts
    only, so the stage's trainer (EpisodeRowsGRPOTrainer) sets `batch_rows` to the batch's rows before each
    generation; rows cannot be found from the prompt text (FrozenLake with a hidden map: every prompt is the same)."""

    def __init__(self, toolset, merged: bool = False, max_broken_share: float = 0.0, kernels: str = "aten"):
        self.toolset = toolset
        self.merged = merged
        self.kernels = kernels  # grpo.rollout_linear_kernels: the merged copy's Linear kernels
        self.plain = None  # the merged copy, made on the first rollout and refreshed on every one
        self.batch_rows: Optional[list[dict]] = None
        self.max_broken_share = max_broken_share
        self.broken, self.first_broken = 0, None  # episodes whose environment failed (check_broken_episodes)
        self.seconds = 0.0
        self.completions = 0
        self.tokens = 0
        self.curves: dict[str, list[float]] = defaultdict(list)

    def take_batch_rows(self, prompts: list) -> Optional[list[dict]]:
        """The rows the trainer handed for these prompts (taken: each batch's rows serve one generation); None
        without a toolset, whose plain sampling needs no row."""
        batch, self.batch_rows = self.batch_rows, None
        if batch is None:
            if self.toolset is None:
                return None
            raise RuntimeError(
                "grpo: the tool loop's episodes need each prompt's dataset row, which only the stage's trainer hands "
                "over (grpo.build_trainer; ToolRollout.batch_rows)"
            )
        if len(batch) != len(prompts) or any(
            _prompt_text(r.get("prompt")) != _prompt_text(p) for r, p in zip(batch, prompts)
        ):
            raise RuntimeError("grpo: the batch's rows are not the prompts' TRL asked completions for")
        return [dict(r) for r in batch]

    def pop_curves(self) -> dict[str, float]:
        """tools/<stat> averaged over the batches since the last call, as TRL averages its own metrics."""
        out = {k: sum(v) / len(v) for k, v in self.curves.items()}
        self.curves.clear()
        return out

    def __call__(self, prompts: list, trainer) -> dict:
        import torch
        from trl.models import unwrap_model_for_generation

        from ..agent.loop import check_broken_episodes, generate_with_tools, tool_stats

        rows = self.take_batch_rows(prompts)
        started = time.perf_counter()
        extra = {
            k: v
            for k, v in (("min_p", trainer.min_p), ("repetition_penalty", trainer.repetition_penalty))
            if v is not None
        }
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                generation_kwargs=getattr(trainer, "generation_kwargs", None),
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as model,
            torch.no_grad(),
        ):
            if self.merged:
                fresh = self.plain is None
                model = self.plain = merged_policy(model, self.plain)
                if fresh:
                    log.info(
                        "rollouts sample from a plain copy of the policy with the LoRA merged in (grpo.merged_rollouts)"
                        ", its Linear layers on %s kernels (grpo.rollout_linear_kernels)",
                        self.kernels,
                    )
                    use_linear_kernels(model, self.kernels, len(prompts), "grpo.rollout_linear_kernels")
            rolls = [
                r[0]
                for r in generate_with_tools(
                    model,
                    trainer.processing_class,
                    prompts,
                    self.toolset,
                    trainer.max_completion_length,
                    batch_size=len(prompts),
                    temperature=trainer.temperature,
                    top_p=trainer.top_p,
                    top_k=trainer.top_k or 0,
                    rows=rows,
                    chat_template_kwargs=self.toolset.chat_template_kwargs() if self.toolset is not None else None,
                    **extra,
                )
            ]
        self.seconds += time.perf_counter() - started
        self.completions += len(rolls)
        self.tokens += sum(sum(r.env_mask) for r in rolls)
        if self.toolset is not None:
            for stat, value in tool_stats(rolls).items():
                self.curves[f"tools/{stat}"].append(value)
            broken = [r.broken for r in rolls if r.broken is not None]
            self.broken, self.first_broken = self.broken + len(broken), self.first_broken or next(iter(broken), None)
            check_broken_episodes(self.broken, self.completions, self.first_broken, self.max_broken_share, "grpo")
        out = {}
        if rows and self.toolset is not None:  # an environment with its own success rule decides `accuracy`
            solved = [episode_solved(row, r.text, r.episode.env if r.episode else None) for row, r in zip(rows, rolls)]
            if any(s is not None for s in solved):
                out["solved"] = solved
        for roll in rolls:  # judged: each episode's environment may end (its optional close(): a session, ...)
            if roll.episode is not None:
                roll.episode.close()
        return {
            **out,
            "prompt_ids": [r.prompt_ids for r in rolls],
            "completion_ids": [r.completion_ids for r in rolls],
            "logprobs": None,
            "env_mask": [r.env_mask for r in rolls],
            "tool_calls": [len(r.calls) for r in rolls],
            "tool_errors": [r.tool_errors for r in rolls],
        }


def merged_policy(model, plain=None):
    """A plain (non-PEFT) model whose weights are `model`'s with its active LoRA adapters merged in: each
    adapted Linear gets base weight + PEFT's own get_delta_weight (scaling included), which is what
    merge_and_unload computes. `plain`, the copy an earlier call returned, is refreshed in place (the adapter
    trains between rollouts; the base weights are frozen, and they are never modified, unlike merge_adapter +
    unmerge_adapter, whose round trip drifts by float rounding). The first call deep-copies the model and gives the
    copy its class's forward; it refuses a model that trains anything besides LoRA A/B weights, which the refresh
    would leave stale.

    Args:
        plain: the copy an earlier call returned, or None.
    """
    import copy
    import re

    import torch
    from peft.tuners.lora import LoraLayer

    if plain is None:
        stale = [
            n
            for n, p in model.named_parameters()
            if p.requires_grad and not re.search(r"\.lora_[AB]\.[^.]+\.weight$", n)
        ]
        if stale:
            raise GRPOSettingsError(
                "grpo.merged_rollouts refreshes the merged copy from the LoRA A/B weights only; these trained "
                f"parameters would go stale in it: {', '.join(stale[:3])}{' ...' if len(stale) > 3 else ''} "
                "(DoRA magnitudes, modules_to_save, LoRA biases, trainable tokens): set merged_rollouts: false"
            )
        plain = copy.deepcopy(model).merge_and_unload()
        # a forward patched onto an instance is dropped: the copy computes with its class's own. TRL's fused LM head
        # (GRPOTrainer patches it on) closes over the original model's bound forward, so a copy that kept it would
        # still run the original, adapter and all
        for module in plain.modules():
            module.__dict__.pop("forward", None)
        plain.eval()
    targets = dict(plain.named_modules())
    with torch.no_grad():
        for name, mod in model.get_base_model().named_modules():
            if isinstance(mod, LoraLayer):
                weight = mod.get_base_layer().weight.detach().clone()
                for adapter in mod.active_adapters:
                    if adapter in mod.lora_A:
                        weight += mod.get_delta_weight(adapter)
                targets[name].weight.copy_(weight)
                if isinstance(targets[name], OneDNNLinear):  # grpo.rollout_linear_kernels onednn: reorder it again
                    targets[name].repack()
    return plain


def check_merged_rollouts(trainer, rollout) -> None:
    """grpo.merged_rollouts copies the whole policy on each process: refused, before the first step, where the
    weights are sharded (DeepSpeed ZeRO-3, FSDP); its onednn kernels (grpo.rollout_linear_kernels) where the policy
    is not fp32 on the CPU.

    Args:
        rollout: our rollout function, or None.
    """
    import torch

    if rollout is None or not rollout.merged:
        return
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if getattr(trainer, "is_fsdp_enabled", False) or (
        getattr(trainer, "is_deepspeed_enabled", False) and plugin is not None and plugin.zero_stage == 3
    ):
        raise GRPOSettingsError(
            "grpo.merged_rollouts copies the whole policy on each process; with sharded weights (DeepSpeed ZeRO-3, "
            "FSDP) set it to false"
        )
    if rollout.kernels != "onednn":
        return
    weight = next(trainer.model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        raise GRPOSettingsError(
            f"grpo.rollout_linear_kernels: onednn runs fp32 weights on the CPU; the policy is {weight.dtype} on "
            f"{weight.device.type} (set rollout_linear_kernels: aten)"
        )


def _prompt_text(prompt) -> str:
    """A prompt (chat messages or a string) as comparable text."""
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def rollout_plan(params: Params, args, tok):
    """(rollout_func, environment_factory) for GRPOTrainer. Inline tools and plain sampling run through
    ToolRollout (the project's tool loop, one environment episode per completion, reset with its row);
    agent.format chat hands the environment class to TRL's own multi-turn loop
    (GRPOTrainer(environment_factory=...), one instance per rollout); TRL's vLLM generation is used when grpo
    asks for it and no inline tool is set.

    Returns:
        (rollout_func or None, environment_factory or None).
    """
    toolset = toolset_from_params(params.agent, tok.eos_token, params.environments)
    merged = params.grpo.merged_rollouts
    if toolset is not None and params.agent.format == "chat":
        if merged:
            raise GRPOSettingsError(
                "grpo.merged_rollouts: agent.format 'chat' with an environment runs TRL's own loop, which generates "
                "with the PEFT model; set merged_rollouts: false (it speeds up the project's loop only)"
            )
        return None, toolset.factory
    if getattr(args, "use_vllm", False):
        if toolset is not None:
            raise GRPOSettingsError(
                "agent.format 'inline' runs the project's own tool loop (transformers generate); "
                "TRL's use_vllm needs agent.tools: [] or agent.format: chat"
            )
        if merged:
            raise GRPOSettingsError(
                "grpo.merged_rollouts: with use_vllm TRL merges the LoRA itself when it syncs vLLM; "
                "set merged_rollouts: false"
            )
        return None, None
    return ToolRollout(toolset, merged, params.agent.max_broken_share, params.grpo.rollout_linear_kernels), None


def baked_tool_template(tok):
    """TRL's tool loop (GRPOTrainer(tools=...)) recognises a chat template by its exact text, to pick the tool-call
    parser (add_response_schema) and the training variant of the template (get_training_chat_template).
    model.chat_template_kwargs baked in front of it (`{%- set enable_thinking = false %}`,
    modeling.bake_chat_template_kwargs) hide a known template such as Qwen3's. Both are therefore picked on the
    template without those lines, the lines are put back in front of the training variant, and the tokenizer
    holds that variant while GRPOTrainer is built. Returns `finish(trainer)`, which gives the tokenizer its
    template back (the one saved with the result) and the trainer the training variant; None when nothing is
    baked or TRL does not know the template (it then says so itself).

    Args:
        tok: the policy's tokenizer (its chat_template is replaced).

    Returns:
        A function that restores the template and hands the trainer the training one, or None.
    """
    import copy
    import re

    from trl.chat_template_utils import add_response_schema, get_training_chat_template

    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    set_lines = re.match(r"(\{%- set \w+ = [^%]*%\})+", template)
    if not set_lines:
        return None
    prefix, probe = set_lines.group(0), copy.copy(tok)
    probe.chat_template = template[set_lines.end() :]
    try:
        if getattr(tok, "response_template", None) is None and getattr(tok, "response_schema", None) is None:
            add_response_schema(probe)
            for attr in ("response_template", "response_schema"):
                if getattr(probe, attr, None) is not None:
                    setattr(tok, attr, getattr(probe, attr))
        training = prefix + (get_training_chat_template(probe) or probe.chat_template)
    except ValueError:
        return None
    tok.chat_template = training

    def finish(trainer):
        tok.chat_template = template
        trainer.chat_template = training

    return finish


def _series(history: list[dict], *keys: str) -> list[float]:
    """The logged values of the first of `keys` that the history has (our loop's name, then TRL's)."""
    for key in keys:
        if values := [h[key] for h in history if key in h]:
            return values
    return []


def _log_plan(params: Params, args, num_prompts: int, gen_batch: int) -> None:
    """Log what this GRPO run does: prompts, precision, completions per step, lr, beta, rewards, LoRA, vLLM."""
    log.info(
        "%d prompts; precision %s; %d completions per step (%d prompts x %d generations); lr %.3g; beta %g; "
        "rewards %s; lora=%s; vllm=%s",
        num_prompts,
        resolve_precision(params.model.precision),
        gen_batch,
        gen_batch // args.num_generations,
        args.num_generations,
        args.learning_rate,
        args.beta,
        params.grpo.rewards,
        params.grpo.use_lora,
        args.use_vllm and args.vllm_mode,
    )


def _resume_checkpoint(params: Params, args) -> Optional[str]:
    """The checkpoint to resume from, if one was written for the same params, data and starting models."""
    return training.resume_checkpoint(
        args,
        params,
        "grpo",
        params.seed,
        params.grpo.model_dump(),
        params.agent.model_dump(),
        params.environments,
        file_digest(DATA),
        model_files_digest(STAGE_DIRS["base"]),
        model_files_digest(STAGE_DIRS["sft"]),
    )


def _curve_metrics(
    history: list[dict], rollout: Optional[ToolRollout], runtime: float, completions_per_step: int
) -> dict:
    """The training curves' headline figures for metrics/grpo_train.json: reward, KL, completion length and tool
    use at the start and end, and the rollout function's share of the time.

    Args:
        rollout: our rollout function (None when TRL generates itself: vLLM or agent.format chat).
        completions_per_step: the generation batch (check_batch), reported with the curves.

    Returns:
        The metrics, in the order metrics/grpo_train.json lists them.
    """
    rewards, kls = _series(history, "reward"), _series(history, "kl")
    lengths = _series(history, "completions/mean_length")
    fifth = max(1, len(rewards) // 5)
    return {
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_mean_first_20pct": sum(rewards[:fifth]) / fifth if rewards else None,
        "reward_mean_last_20pct": sum(rewards[-fifth:]) / fifth if rewards else None,
        "kl_last": kls[-1] if kls else None,
        "completion_length_first": lengths[0] if lengths else None,
        "completion_length_last": lengths[-1] if lengths else None,
        "completions_per_step": completions_per_step,
        # measured around the rollout function (None when TRL generates itself: vLLM or agent.format chat)
        "generation_seconds": round(rollout.seconds, 2) if rollout else None,
        "generation_seconds_share": round(rollout.seconds / runtime, 4) if rollout and runtime else None,
        "rollout_tokens_per_second": round(rollout.tokens / rollout.seconds, 1)
        if rollout and rollout.seconds
        else None,
        "tool_use_rate_first": (_series(history, "tools/tool_use_rate") or [None])[0],
        "tool_use_rate_last": (_series(history, "tools/tool_use_rate") or [None])[-1],
        # TRL's own loop (agent.format chat) logs tools/call_frequency (calls per completion) and no tool-use rate
        "tool_calls_per_completion_last": (
            _series(history, "tools/tool_calls_per_problem", "tools/call_frequency") or [None]
        )[-1],
        "tool_error_rate_last": (_series(history, "tools/tool_error_rate") or [None])[-1],
    }


class EpisodeRowsGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer that hands each batch's dataset rows to the project's rollout function (TRL gives a
    rollout_func the prompts only; each episode is reset with its own row), adds the tool loop's curves (tools/*)
    to every log, and, under TRL's own multi-turn loop (agent.format chat), stops on too many broken episodes
    after each batch. Built by build_trainer, for the stage and the benchmarks alike."""

    def __init__(self, *args, tool_rollout: Optional[ToolRollout] = None, ledger=None, **kwargs):
        self.tool_rollout = tool_rollout
        self.ledger = ledger  # agent.loop.BrokenEpisodes over TRL's environment instances, or None
        super().__init__(*args, rollout_func=tool_rollout, **kwargs)

    def log(self, logs, start_time=None):
        curves = self.tool_rollout or self.ledger
        logs.update(curves.pop_curves() if curves else {})
        super().log(logs, start_time)

    def _generate_and_score_completions(self, inputs):
        # the prompts TRL 1.16 hands rollout_func are built from these inputs, in this order
        if self.tool_rollout is not None:
            self.tool_rollout.batch_rows = inputs
        batch = super()._generate_and_score_completions(inputs)
        if self.ledger is not None:
            self.ledger.check()
        return batch


def build_trainer(
    params: Params, args, model, tok, dataset, callbacks: Optional[list] = None, plan: Optional[tuple] = None
) -> EpisodeRowsGRPOTrainer:
    """The stage's trainer: rewards, LoRA and the LM head's scored positions from params, the rollout plan (`plan`,
    default rollout_plan's), TRL's broken-episode ledger and baked chat template for agent.format chat, the
    merged-rollouts check. The benchmarks build theirs here too, so they time what the stage runs.

    Args:
        params, args: the run's params and its GRPOConfig.
        model, tok: the starting policy and its tokenizer (whose chat template may be swapped, baked_tool_template).
        dataset: the RL rows (a datasets.Dataset).
        plan: (rollout_func, environment_factory) instead of rollout_plan's (a benchmark's side by side).
    """
    funcs, _ = build_rewards(params.grpo.rewards, params.grpo.reward_kwargs.model_dump())
    training.fused_lm_head_positions(params.model.lm_head_positions)  # the stage set it in start(); a bench did not
    rollout, environment_factory = plan or rollout_plan(params, args, tok)
    finish = baked_tool_template(tok) if environment_factory else None
    ledger = BrokenEpisodes(params.agent.max_broken_share) if environment_factory else None
    trainer = EpisodeRowsGRPOTrainer(
        model=model,
        reward_funcs=funcs,
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        peft_config=training.peft_config(params, "grpo"),
        callbacks=callbacks,
        tool_rollout=rollout,
        ledger=ledger,
        environment_factory=ledger.track(environment_factory) if ledger else None,
    )
    if finish:
        finish(trainer)
    check_merged_rollouts(trainer, rollout)
    return trainer


def train(params: Params) -> dict:
    """Train the GRPO stage: TRL's GRPOTrainer over the SFT model, rollouts through our tool loop (or TRL's
    environment_factory loop for agent.format chat); saves models/grpo and metrics/grpo_train.json.

    Returns:
        The metrics written to metrics/grpo_train.json.
    """
    from datasets import load_dataset

    gen_batch = check_batch(params)
    args, callbacks = training.start(params, "grpo", grpo_config)
    check_generation(args)
    tok = load_tokenizer(STAGE_DIRS["sft"])
    model = starting_model(params)
    ds = load_dataset("json", data_files=DATA, split="train")
    _log_plan(params, args, len(ds), gen_batch)
    resume = _resume_checkpoint(params, args)
    trainer = build_trainer(params, args, model, tok, ds, callbacks)
    try:
        _, run = training.train(trainer, resume)
    finally:
        if trainer.ledger is not None:  # TRL's loop pools its environments and never ends an episode: closed here
            trainer.ledger.close_all()
    metrics = {
        **_curve_metrics(trainer.state.log_history, trainer.tool_rollout, run["runtime_s"], gen_batch),
        "beta": args.beta,
        **run,
    }
    training.save(trainer, tok, "grpo", METRICS, metrics)
    log.info(
        "reward %.3f -> %.3f over %d steps (%.1fs); saved %s",
        metrics["reward_mean_first_20pct"] or 0,
        metrics["reward_mean_last_20pct"] or 0,
        metrics["steps"],
        run["runtime_s"],
        STAGE_DIRS["grpo"],
    )
    return metrics


if __name__ == "__main__":
    training.main("grpo", train, GRPOSettingsError, BrokenEnvironmentError, OpenEnvError)
