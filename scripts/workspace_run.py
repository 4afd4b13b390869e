"""Run a command that writes the workspace (dvc repro, a workspace dvc exp run), refusing at once when another run
holds it (agentrl.experiments.queue.workspace_run: a second run would rewrite params.yaml under the first).

    python scripts/workspace_run.py dvc exp run -S seed=7
"""

import sys

from agentrl.experiments.queue import run_in_workspace

if __name__ == "__main__":
    sys.exit(run_in_workspace(sys.argv[1:]) if sys.argv[1:] else __doc__)
