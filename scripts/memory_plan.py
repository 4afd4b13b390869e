#!/usr/bin/env python
"""`make memory-plan`: a thin CLI over agentrl.benchmarks.memory_plan (`--help`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without the package installed

from agentrl.benchmarks.memory_plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
