"""Run a command that writes the workspace (dvc repro, a workspace dvc exp run), refusing at once when another run
holds it (agentrl.experiments.queue.workspace_run: a second run would rewrite params.yaml under the first).

    python scripts/workspace_run.py dvc exp run -S seed=7
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from agentrl.experiments.queue import WorkspaceBusy, workspace_run


def main() -> None:
    command = sys.argv[1:]
    if not command:
        raise SystemExit(__doc__)
    try:
        with workspace_run(Path.cwd(), shlex.join(command)):
            code = subprocess.call(command)
    except WorkspaceBusy as e:
        raise SystemExit(f"refused: {e}") from None
    sys.exit(code)


if __name__ == "__main__":
    main()
