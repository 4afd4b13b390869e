"""What every benchmark shares (`make bench`, `make bench-tools`, `make bench-repro`, `make gpu-check`): the machine's
description, a device sync before a timer is read, median (min–max) summaries of repeated runs, and model FLOP
utilisation (model FLOPs per token from the config, a timed GEMM as the machine's matmul peak)."""

from __future__ import annotations

import os
import platform
import statistics
from pathlib import Path

import torch

from ..sizing import matmul_parameters


def machine() -> str:
    """The CPU model (from /proc/cpuinfo where there is one: kernels and timings depend on it), cores, torch.

    Returns:
        One line such as "Intel(R) Xeon(R) ... (family 6 model 143, AVX-512), 2 cores, torch 2.x".
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
        field = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in text.split("\n\n")[0].splitlines())}
        flags = field.get("flags", "").split()
        isa = next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2")) if flag in flags), "no AVX2")
        cpu = f"{field['model name']} (family {field.get('cpu family')} model {field.get('model')}, {isa})"
    except (OSError, KeyError):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def sync(model) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so a timer reads what it ran.

    Args:
        model: a torch model; only its `device` is read.
    """
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def stats(values: list[float]) -> dict:
    """The summary every repeated figure is reported as.

    Args:
        values: one figure per run (at least one).

    Returns:
        {"median", "min", "max", "runs"}.
    """
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def median_range(summary: dict, number_format: str = "{:.3f}") -> str:
    """A `stats` summary as a table cell: "median (min–max)".

    Args:
        summary: a dict with "median", "min" and "max".
        number_format: the format of each of the three numbers.
    """
    median, low, high = (number_format.format(summary[k]) for k in ("median", "min", "max"))
    return f"{median} ({low}–{high})"


# ------------------------------------------------------------------------ model FLOP utilisation (MFU)
# A Qwen3-architecture decoder's dimensions, as config.json / transformers' Qwen3Config / params' model.tiny name them
MODEL_DIMS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def model_dims(config, source: str) -> dict:
    """The MODEL_DIMS of a model config, each required.

    Args:
        config: a dict (config.json, a recipe's table), a transformers config or params' model.tiny.
        source: where the config comes from, named in the error.

    Returns:
        {dim: int} for every name in MODEL_DIMS.

    Raises:
        ValueError: naming the first missing dimension and the source.
    """
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    dims = {k: get(k) for k in MODEL_DIMS}
    missing = [k for k, v in dims.items() if v is None]
    if missing:
        raise ValueError(f"{source}: model config has no '{missing[0]}' (a Qwen3-style config needs {MODEL_DIMS})")
    return {k: int(v) for k, v in dims.items()}


def flops_per_token(dims: dict, context: float, mode: str) -> float:
    """Model FLOPs per token, PaLM's accounting (Chowdhery et al. 2022, appendix B): a forward pass costs 2*N for the
    weight matmuls plus 4 * layers * context * heads * head_dim for attention (Q.K^T and weights.V over `context`
    positions); a backward pass costs twice the forward. Recomputation (activation checkpointing) is not model
    FLOPs and is not counted.

    Args:
        context: the positions each token attends to (the sequence length for training, the mean context for
            decoding).
        mode: "forward" (decoding, 2N + attention), "train" (forward + backward: 6N + 3x attention) or
            "train_frozen" (LoRA: the frozen weights get no weight gradient, only the activation gradient: 4N +
            3x attention; the adapters' own FLOPs are left out).

    Returns:
        FLOPs per token.
    """
    multiple = {"forward": 1, "train": 3, "train_frozen": 2}
    if mode not in multiple:
        raise ValueError(f"flops_per_token: mode must be one of {sorted(multiple)}, got {mode!r}")
    attention = 4 * dims["num_hidden_layers"] * context * dims["num_attention_heads"] * dims["head_dim"]
    attention_multiple = 1 if mode == "forward" else 3  # the activation gradient of attention is always needed
    return 2 * multiple[mode] * matmul_parameters(dims) + attention_multiple * attention


def matmul_peak(dtype=torch.float32, size: int = 2048, repeats: int = 7, device: str = "cpu") -> dict:
    """This machine's measured matmul peak: a size x size GEMM (torch.matmul), median of `repeats` timed runs after
    one warm-up, 2 * size^3 FLOPs each.

    Args:
        dtype: the GEMM's dtype (fp32 on the CPU benches, bf16 on a GPU).

    Returns:
        {"flops_per_second" (the median run's), "dtype", "size", "runs": stats of FLOP/s}.
    """
    import time

    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    torch.matmul(a, b)
    rates = []
    for _ in range(repeats):
        if a.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.matmul(a, b)
        if a.is_cuda:
            torch.cuda.synchronize()
        rates.append(2 * size**3 / (time.perf_counter() - start))
    summary = stats(rates)
    return {"flops_per_second": summary["median"], "dtype": str(dtype).removeprefix("torch."), "size": size, **summary}


def mfu(tokens_per_second: float, flops_per_token_: float, peak_flops_per_second: float) -> float:
    """Model FLOP utilisation: the model FLOPs a throughput achieves over the measured peak.

    Args:
        flops_per_token_: flops_per_token's figure for what those tokens went through.

    Returns:
        The fraction (0.12 is 12%).
    """
    if peak_flops_per_second <= 0:
        raise ValueError(f"mfu: the peak must be positive, got {peak_flops_per_second}")
    return tokens_per_second * flops_per_token_ / peak_flops_per_second
