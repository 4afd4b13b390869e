#!/bin/sh
# The interpreter of dvc.yaml's stage commands (`sh scripts/stage-python.sh -m agentrl.stages.<stage>`), the same whichever
# way `dvc` was started: `make repro`, `.venv/bin/dvc repro <stage>` with another python first on PATH, a
# `dvc exp run` temporary workspace or queue worker (copies under .dvc/tmp/exps without a .venv of their own).
#   1. $AGENTRL_PYTHON, when set;
#   2. the project's venv of the repository DVC runs for: $DVC_ROOT/.venv/bin/python (DVC sets DVC_ROOT for every
#      stage command, to the main repository also in experiments' temporary workspaces);
#   3. python3 on PATH (a machine without that venv, e.g. a container with the package installed).
# The interpreter must import agentrl, else the stage stops here naming what it tried.
set -eu
if [ -n "${AGENTRL_PYTHON:-}" ]; then
  py=$AGENTRL_PYTHON
  how="AGENTRL_PYTHON"
elif [ -n "${DVC_ROOT:-}" ] && [ -x "$DVC_ROOT/.venv/bin/python" ]; then
  py=$DVC_ROOT/.venv/bin/python
  how="the venv of DVC_ROOT=$DVC_ROOT"
else
  py=$(command -v python3 || command -v python || echo python3)
  how="python3 on PATH (no .venv in DVC_ROOT=${DVC_ROOT:-unset})"
fi
# The workspace's own code first: a `dvc exp run --queue/--temp` copy runs the code it was queued with, not the main
# repository's src/ (where the venv's editable install points, and which may have been edited since).
if [ -d src/agentrl ]; then
  PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH
fi
if ! "$py" -c "import agentrl" 2>/dev/null; then
  echo "scripts/stage-python.sh: $py ($how) cannot import agentrl; run 'make setup' in the repository or set AGENTRL_PYTHON to the project's interpreter" >&2
  exit 3
fi
# A fixed hash seed: PEFT keeps LoRA's target_modules in a set, so adapter_config.json's order (and the md5 DVC
# records for models/sft and models/grpo) otherwise changes from run to run while the weights do not.
PYTHONHASHSEED=${PYTHONHASHSEED:-0}
export PYTHONHASHSEED
exec "$py" "$@"
