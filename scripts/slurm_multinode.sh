#!/usr/bin/env bash
# Example SLURM job: multi-node SFT then GRPO with DeepSpeed ZeRO-2 through accelerate (docs/scaling.md#multi-node).
#   sbatch scripts/slurm_multinode.sh                                                # params.yaml as committed
#   RECIPE=configs/recipes/qwen3-0.6b-gsm8k.yaml sbatch scripts/slurm_multinode.sh   # a recipe applied first
# The submit directory must be a clone on a filesystem every node sees (its .venv set up: make setup).
# Step 1 runs once, on the first node, and every node starts step 2 only after it has finished.
#SBATCH --job-name=agentrl
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | awk 'NR == 1')  # awk reads to the end: head would close the pipe early (SIGPIPE under pipefail)
NPROC=$((SLURM_NNODES * GPUS_PER_NODE))
# 1. the recipe written into params.yaml (a no-op when already there), then the data and the base model
if [ -n "${RECIPE:-}" ]; then  # unquoted on purpose: RECIPE may name several files, applied in order
  srun --nodes=1 --ntasks=1 .venv/bin/python scripts/recipe.py apply $RECIPE
fi
srun --nodes=1 --ntasks=1 .venv/bin/dvc repro prepare base
# 2. each stage on every node at once (one make per node; srun returns when all of them have finished)
for STAGE in sft grpo; do
  srun --ntasks-per-node=1 bash -c "make train-multinode STAGE=$STAGE NPROC=$NPROC NUM_MACHINES=$SLURM_NNODES \
    MACHINE_RANK=\$SLURM_NODEID MAIN_IP=$MAIN_IP MAIN_PORT=${MAIN_PORT:-29500}"
done
# 3. record the trained stages in dvc.lock, then evaluate and export on one node:
.venv/bin/dvc commit -f sft grpo
.venv/bin/dvc repro
