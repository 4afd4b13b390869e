"""What the machine can hold: a model whose estimated memory exceeds all of it is refused when params are validated
(config.ModelParams), before a download or an allocation; the parameter counts are shared with the benchmarks.

model.tiny at its maxima is 5.3e12 parameters; a 405B hub id on a CPU machine used to start downloading. Estimates
are lower bounds; a size that cannot be known offline is not checked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

ALLOW_LARGE_MODEL_ENV = "AGENTRL_ALLOW_LARGE_MODEL"  # =1: skip the check (a machine this code cannot measure)
TRAIN_BYTES_PER_PARAM = 16  # full fp32 training with AdamW: weights, gradients and two moments, 4 bytes each
BYTES_PER_PARAM = {"fp32": 4, "bf16": 2, "fp16": 2}  # a hub model's weights in the training dtype
# a parameter count in a hub id's name: Qwen3-0.6B, Llama-3.1-405B, SmolLM2-135M, Mixtral-8x7B (8 x 7B)
SIZE_IN_NAME = re.compile(r"(?<![A-Za-z0-9.])(?:(\d{1,4})x)?(\d{1,6}(?:\.\d{1,4})?)([MBT])(?![A-Za-z0-9])", re.I)
_SIZE_UNITS = {"m": 1e6, "b": 1e9, "t": 1e12}
MAX_SAFETENSORS_HEADER = 100 << 20  # a header claiming more is not a safetensors file


def matmul_parameters(dims: dict) -> int:
    """The weights every token multiplies through: each layer's q/k/v/o and SwiGLU gate/up/down projections and
    the LM head (the embedding lookup is no matmul; norms are negligible). The N of the benchmarks' FLOP formulas
    (benchmarks/measure.py) and the bulk of a Qwen3/Llama model's parameters.

    Args:
        dims: hidden_size, head_dim, num_attention_heads, num_key_value_heads, intermediate_size,
            num_hidden_layers and vocab_size.
    """
    h, d = dims["hidden_size"], dims["head_dim"]
    attention = 2 * h * d * (dims["num_attention_heads"] + dims["num_key_value_heads"])  # q, o; k, v
    mlp = 3 * h * dims["intermediate_size"]
    return dims["num_hidden_layers"] * (attention + mlp) + dims["vocab_size"] * h


def tiny_parameter_count(tiny) -> int:
    """The parameters of modeling.build_tiny_model's Qwen3 (tied embeddings, no attention bias), from the params:
    matmul_parameters plus each layer's norms (two RMSNorms and q/k norms) and the final norm.

    Args:
        tiny: the model.tiny section (vocab_size as asked; the trained tokenizer adds at most a few tokens).

    Returns:
        The exact count for a vocabulary of tiny.vocab_size tokens.
    """
    names = ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    dims = {k: getattr(tiny, k) for k in (*names, "num_hidden_layers", "vocab_size")}
    norms = tiny.num_hidden_layers * (2 * tiny.head_dim + 2 * tiny.hidden_size) + tiny.hidden_size
    return matmul_parameters(dims) + norms


def _safetensors_parameters(path: Path) -> Optional[int]:
    """The parameter count a safetensors file's header declares (only the header is read), None if unreadable."""
    import json
    import math

    try:
        with path.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size <= MAX_SAFETENSORS_HEADER:
                return None
            header = json.loads(f.read(size))
        return sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def known_parameter_count(base_model: str) -> tuple[Optional[int], str]:
    """What can be known offline of a model's size: a local directory's safetensors headers, else a size written in
    the hub id's name (the largest, e.g. Qwen3-30B-A3B -> 30B). (None, reason) when neither says.

    Args:
        base_model: model.base_model (a hub id or a local directory).

    Returns:
        (parameter count or None, where the count comes from).
    """
    path = Path(base_model)
    try:
        is_dir = path.is_dir()
    except OSError:  # a name the filesystem cannot hold (ENAMETOOLONG, ...) is no local copy
        is_dir = False
    if is_dir:
        files = sorted(path.glob("*.safetensors"))
        counts = [_safetensors_parameters(f) for f in files]
        if files and None not in counts:
            return sum(counts), f"the safetensors headers in {path}"
        return None, f"{path} has no readable safetensors files"
    sizes = [
        int(m.group(1) or 1) * float(m.group(2)) * _SIZE_UNITS[m.group(3).lower()]
        for m in SIZE_IN_NAME.finditer(base_model.rsplit("/", 1)[-1])
    ]
    if sizes:
        return int(max(sizes)), "the size in its name"
    return None, "no size in its name and no local copy"


def ram_bytes() -> int:
    """The machine's physical memory, capped by a cgroup v2 limit (a container's) where one is set."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def gpu_bytes() -> int:
    """The memory of every visible CUDA device together (0 without one). Imports torch: called only for a model
    that does not fit in RAM, so validating ordinary params never loads it."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))


def _allow_large_model() -> bool:
    value = os.environ.get(ALLOW_LARGE_MODEL_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"environment variable {ALLOW_LARGE_MODEL_ENV} must be 1 (skip the check) or 0, got {value!r}")
    return value == "1"


def check_model_fits(model) -> None:
    """ValueError when the model's estimated memory exceeds all the machine has (RAM, plus the GPUs' memory when
    there are GPUs): model.tiny trained in fp32 with AdamW, or a hub/local model's weights in the training dtype
    (precision auto: fp32 without a GPU, bf16 with one). A size not knowable offline is not checked.
    """
    if _allow_large_model():
        return
    if model.base_model == "tiny":
        parameters = tiny_parameter_count(model.tiny)
        need_with_gpu = need_cpu = parameters * TRAIN_BYTES_PER_PARAM
        what = f"model.tiny: {parameters:,} parameters need ~{need_cpu / 1e9:,.1f} GB to train in fp32 with AdamW"
    else:
        parameters, how = known_parameter_count(model.base_model)
        if parameters is None:
            return
        # precision auto: fp32 on a CPU, bf16 (2 bytes) on a GPU
        bytes_cpu, bytes_gpu = BYTES_PER_PARAM.get(model.precision, 4), BYTES_PER_PARAM.get(model.precision, 2)
        need_cpu, need_with_gpu = parameters * bytes_cpu, parameters * bytes_gpu
        what = (
            f"model.base_model: {model.base_model} has ~{parameters:,.0f} parameters ({how}), "
            f"~{need_cpu / 1e9:,.1f} GB of weights in {model.precision if model.precision != 'auto' else 'fp32'}"
        )
    ram = ram_bytes()
    if need_cpu <= ram:
        return
    gpu = gpu_bytes()
    if gpu and need_with_gpu <= ram + gpu:
        return
    has = f"{ram / 1e9:,.1f} GB of RAM" + (f" and {gpu / 1e9:,.1f} GB of GPU memory" if gpu else " and no GPU")
    raise ValueError(
        f"{what}, more than this machine's {has}; use a smaller model, or on a machine this check cannot "
        f"measure set {ALLOW_LARGE_MODEL_ENV}=1"
    )
