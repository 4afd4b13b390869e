#!/usr/bin/env bash
# GPU check of the recipe's code paths on one CUDA GPU, offline, in one go (about 6-8 minutes on one H200):
# a randomly initialised Qwen3-0.6B-sized model built locally, LoRA SFT + GRPO-LoRA through the real stage
# modules, DeepSpeed ZeRO-2/ZeRO-3, vLLM colocate rollouts (if vllm imports), export + bitsandbytes int8
# evaluation (if bitsandbytes imports) and the tool loop's tokens/s; one table (path | status | seconds |
# tokens/s | note) on stdout and in OUT_DIR/gpu_check.md (+ gpu_check.json, logs.tar.gz). Details:
# scripts/gpu_check.py (the driver this calls: agentrl.benchmarks.gpu_check) and README "GPU check".
#
#   bash scripts/gpu_check.sh [--out OUT_DIR] [--budget SECONDS]   # exit 2 without a CUDA device
#   bash scripts/gpu_check.sh --cpu-smoke                          # the same sequence on the CPU, tiny model
#   bash scripts/gpu_check.sh --cpu-full-size --out rehearsal      # `make rehearse`: 0.6B-sized model on the CPU
#
# PYTHON=... picks the interpreter (default: .venv/bin/python when present, else python3). Exit 0: no row failed.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" --python "$PYTHON" "$@"
