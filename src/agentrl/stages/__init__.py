"""The DVC stages (dvc.yaml), one module each with a main(): prepare, base, sft, grpo, evaluate, compare, export,
quantize, card; training.py is the skeleton sft and grpo share. `python -m agentrl.stages.<name>` runs one."""
