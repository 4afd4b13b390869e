"""Environments: stateful, multi-turn episodes in the shape of TRL's `environment_factory` (issue 29)."""
