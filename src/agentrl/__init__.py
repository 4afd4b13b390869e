"""agentrl: a reproducible DVC pipeline for SFT and GRPO (LoRA) on language models."""

__version__ = "0.1.0"
