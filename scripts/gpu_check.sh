#!/usr/bin/env bash
# GPU smoke check of the same pipeline code, at small step counts, in a scratch copy of the repository:
#   1. prepare -> base -> sft -> eval -> grpo -> eval -> compare -> export -> int8 eval with
#      model.precision: auto (must resolve to bf16 on a bf16-capable GPU), single-process accelerate;
#   2. sft (LoRA) + grpo under DeepSpeed ZeRO-2, ZeRO-3 and ZeRO-3 with CPU offload (1 process),
#      each followed by evaluation of the GRPO adapter and, for ZeRO-3, the merged export.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (needs the pinned requirements and a CUDA GPU)
#        GPU_CHECK_OVERRIDES='sft.trainer.max_steps=5 ...' adds params overrides (key.path=yaml-value).
# Writes OUT_DIR/summary.txt (one line per step: rc and seconds) and OUT_DIR/logs.tar.gz.
set -u
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mkdir -p "${1:-gpu_check}" && cd "${1:-gpu_check}" && pwd)
WORK=$(mktemp -d)
cp -r "$ROOT/src" "$ROOT/configs" "$ROOT/params.yaml" "$WORK/"
cd "$WORK"
export PYTHONPATH="$WORK/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/logs"
: > "$OUT/summary.txt"

setp() {  # setp key.path=value ... : edit params.yaml in the scratch copy
  "$PY" - "$@" <<'EOF'
import sys, yaml
p = yaml.safe_load(open("params.yaml"))
for kv in sys.argv[1:]:
    k, v = kv.split("=", 1)
    d = p
    *head, last = k.split(".")
    for h in head:
        d = d[h]
    d[last] = yaml.safe_load(v)
yaml.safe_dump(p, open("params.yaml", "w"), sort_keys=False)
EOF
}

step() {  # step NAME CMD... : run with a timeout, log, record rc and seconds, keep going
  local name=$1; shift
  local t0=$(date +%s)
  timeout "${STEP_TIMEOUT:-300}" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
  for f in metrics/*.json; do [ -e "$f" ] && cp "$f" "$OUT/logs/${name}__$(basename "$f")"; done
  return 0
}

LAUNCH=("$PY" -m accelerate.commands.launch --num_processes 1 --config_file)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/logs/nvidia-smi.txt" 2>&1
"$PY" -c "import torch, transformers, trl, peft, accelerate, deepspeed; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'bf16', torch.cuda.is_bf16_supported()); print('transformers', transformers.__version__, 'trl', trl.__version__, 'peft', peft.__version__, 'accelerate', accelerate.__version__, 'deepspeed', deepspeed.__version__)" >> "$OUT/logs/nvidia-smi.txt" 2>&1

# 1. The default pipeline, fewer GRPO steps; dvclive/wandb are left out (only tensorboard is needed here).
setp tracking.report_to='[tensorboard]' grpo.trainer.max_steps=40 grpo.trainer.save_steps=20 ${GPU_CHECK_OVERRIDES:-}
step prepare "$PY" -m agentrl.prepare
step base "$PY" -m agentrl.base
step sft_single "${LAUNCH[@]}" configs/accelerate/single.yaml -m agentrl.sft
step eval_base "$PY" -m agentrl.evaluate --stage base
step eval_sft "$PY" -m agentrl.evaluate --stage sft
step grpo_single "${LAUNCH[@]}" configs/accelerate/single.yaml -m agentrl.grpo
step eval_grpo "$PY" -m agentrl.evaluate --stage grpo
step compare "$PY" -m agentrl.compare
step export "$PY" -m agentrl.export
step eval_int8 "$PY" -m agentrl.export --quantized-eval

# 2. DeepSpeed on CUDA, LoRA for both stages (the hub-model setting).
setp sft.use_lora=true sft.trainer.max_steps=30 sft.trainer.save_steps=15 grpo.trainer.max_steps=4 grpo.trainer.save_steps=2 grpo.trainer.logging_steps=1 ${GPU_CHECK_OVERRIDES:-}
for cfg in zero2 zero3 zero3_offload; do
  rm -rf checkpoints models/sft models/grpo
  step "sft_$cfg" "${LAUNCH[@]}" "configs/accelerate/$cfg.yaml" -m agentrl.sft
  step "grpo_$cfg" "${LAUNCH[@]}" "configs/accelerate/$cfg.yaml" -m agentrl.grpo
  step "eval_grpo_$cfg" "$PY" -m agentrl.evaluate --stage grpo
done
step export_after_zero3_offload "$PY" -m agentrl.export

tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs && rm -rf "$OUT/logs"
cd / && rm -rf "$WORK"
cat "$OUT/summary.txt"
