#!/usr/bin/env python
"""`make seeds N=3`: the command line of agentrl.experiments.seeds (its --help says how)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's package, also in a copy

from agentrl.experiments import seeds  # noqa: E402

if __name__ == "__main__":
    seeds.main()
