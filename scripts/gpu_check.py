"""`make gpu-check` (scripts/gpu_check.sh): a thin CLI over agentrl.benchmarks.gpu_check (`--help`)."""

import sys
from pathlib import Path

# PYTHON=... may be an interpreter without the package installed (scripts/gpu_check.sh)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from agentrl.benchmarks.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    main()
