"""`make wandb-report`: the command line of agentrl.experiments.wandb_report (its --help says how)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # this checkout's package, also in a copy

from agentrl.experiments.wandb_report import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
