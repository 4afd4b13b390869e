"""agentrl: a reproducible DVC pipeline for SFT and GRPO (LoRA) on language models."""

# params.yaml `reproducibility` pins the CPU kernels (ATen, MKL, FBGEMM, threads) through environment variables
# that torch and MKL read when they start: set them here, before any stage module imports torch.
from .reproducibility import apply_from_file as _apply_reproducibility

_apply_reproducibility()

__version__ = "0.1.0"
