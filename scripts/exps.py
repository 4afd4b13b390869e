#!/usr/bin/env python
"""`make exps`: the command line of agentrl.experiments.exps (its --help says how)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's package, also in a copy

# rows and table: tests/test_makefile.py loads this file and calls them
from agentrl.experiments.exps import main, rows, table  # noqa: E402, F401

if __name__ == "__main__":
    sys.exit(main())
