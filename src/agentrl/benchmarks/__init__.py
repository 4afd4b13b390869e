"""Benchmarks and checks around the pipeline, run by `make bench`, `make bench-tools`, `make bench-repro`,
`make gpu-check` and `make loadtest` through thin CLIs in scripts/ (docs/benchmarks.md, docs/scaling.md).

  measure.py            the machine's description, device sync, median (min–max) summaries, model FLOPs and MFU
  decoding.py           the tool loop against plain `generate`, the decode ceiling, evaluation speed
  training.py           SFT and GRPO step timings (paired plain-PyTorch steps, merged-LoRA rollouts)
  openenv_transport.py  rollouts with the episodes in-process against over OpenEnv
  pipeline.py           `dvc repro` timings in a scratch copy (no-op, GRPO-only change, full)
  bench.py              `make bench` (scripts/bench.py): every figure, BENCHMARKS.md and metrics/bench.json
  bench_tools.py        `make bench-tools`: BENCHMARKS-tools.md and metrics/bench_tools.json; chat-format GRPO
                        through our tool loop against TRL's environment loop
  reproducibility.py    `make bench-repro`: reproducibility.mode portable against native
  gpu_check.py          `make gpu-check` (scripts/gpu_check.sh, scripts/gpu_check.py): the recipe's code paths
  gpu_check_setup.py    the GPU check's params, its random Qwen3-0.6B-sized stand-in model, its tool-loop speed row
  memory_plan.py        `make memory-plan` (scripts/memory_plan.py): predicted peak memory per process, SFT and GRPO
  loadtest.py           `make loadtest` (scripts/loadtest.py): latency and throughput of a served model

The top tier of the layering: benchmarks may import any other package; nothing imports benchmarks.
"""
