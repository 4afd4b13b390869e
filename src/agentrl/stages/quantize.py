"""The one int8 path (export.quantize: int8), shared by the `eval_quantized` stage and `evaluate --quantize int8`:
bitsandbytes LLM.int8() on CUDA, PyTorch dynamic int8 of every Linear layer on CPU."""

from __future__ import annotations

import torch

from ..modeling import load_model


def quantize_int8(model):
    """The one int8 path (export.quantize: int8), shared by the export stage and evaluation: bitsandbytes
    LLM.int8() on CUDA (needs `pip install bitsandbytes`; the model is saved to a scratch directory and
    loaded back 8-bit), PyTorch dynamic int8 of every Linear layer on CPU.
    """
    if torch.cuda.is_available():
        import tempfile

        with tempfile.TemporaryDirectory(prefix="agentrl-int8-") as scratch:
            model.save_pretrained(scratch)
            return _bitsandbytes_int8(scratch)
    return _torch_dynamic_int8(model)


def load_quantized(path):
    """models/merged (or any saved model) in int8, through quantize_int8's backends: bitsandbytes loads it
    8-bit directly on CUDA; on CPU it is loaded and dynamically quantized.
    """
    if torch.cuda.is_available():
        return _bitsandbytes_int8(path)
    return _torch_dynamic_int8(load_model(path))


def int8_backend() -> str:
    """Which int8 backend quantize_int8 uses on this machine (bitsandbytes on CUDA, else torch_dynamic)."""
    return "bitsandbytes" if torch.cuda.is_available() else "torch_dynamic"


def _torch_dynamic_int8(model):
    from torch.ao.quantization import quantize_dynamic

    return quantize_dynamic(model.float().cpu(), {torch.nn.Linear}, dtype=torch.qint8)


def _bitsandbytes_int8(path):
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise RuntimeError(
            "export.quantize: int8 on CUDA uses bitsandbytes, which is not installed: "
            "pip install bitsandbytes (or set export.quantize: none)"
        )
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    return AutoModelForCausalLM.from_pretrained(
        str(path),
        quantization_config=BitsAndBytesConfig(load_in_8bit=True),
        device_map={"": torch.cuda.current_device()},
    )
