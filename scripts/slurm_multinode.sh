#!/usr/bin/env bash
# Example SLURM job: multi-node SFT (then GRPO) with DeepSpeed ZeRO-2 through accelerate.
# Every node runs the same command; SLURM provides the node's rank and rank 0's address.
#SBATCH --job-name=agentrl
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MAIN_IP=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
NPROC=$((SLURM_NNODES * GPUS_PER_NODE))
for STAGE in sft grpo; do
  srun --ntasks-per-node=1 bash -c "make train-multinode STAGE=$STAGE NPROC=$NPROC NUM_MACHINES=$SLURM_NNODES \
    MACHINE_RANK=\$SLURM_NODEID MAIN_IP=$MAIN_IP MAIN_PORT=${MAIN_PORT:-29500}"
done
# Record the trained stages in dvc.lock, then evaluate and export on one node:
.venv/bin/dvc commit -f sft grpo
.venv/bin/dvc repro
