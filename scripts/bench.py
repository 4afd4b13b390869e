#!/usr/bin/env python
"""`make bench`, `make bench-tools`, `make bench-repro`: a thin CLI over agentrl.benchmarks.bench (`--help`)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # runs without the package installed

from agentrl.benchmarks.bench import main  # noqa: E402

if __name__ == "__main__":
    main()
