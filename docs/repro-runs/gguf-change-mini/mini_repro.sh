#!/bin/bash
# mini_repro.sh REV DIR: the tests' miniature params (that tree's own conftest.mini_params) through `dvc repro` at REV
set -e
rev=$1; dir=$2
rm -rf "$dir"; mkdir -p "$dir"
if [ "$rev" = WORKTREE ]; then (cd /work/main && git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} cp --parents {} "$dir"/ 2>/dev/null || true)
else git -C /work/main archive "$rev" | tar -x -C "$dir"; fi
cd "$dir"
export PATH=/work/main/.venv/bin:$PATH OMP_NUM_THREADS=2 WANDB_MODE=offline HF_HUB_OFFLINE=1
PYTHONPATH=$dir/src:$dir/tests python -c "
import yaml; from conftest import mini_params
text = yaml.safe_dump(mini_params()); open('params.yaml','w').write(text)"
git init -q && git add -A && git -c user.email=a@b -c user.name=a commit -qm mini
dvc repro > repro.log 2>&1
echo "$rev done: $(grep -c 'Running stage' repro.log) stages"
