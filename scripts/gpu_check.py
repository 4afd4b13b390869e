"""GPU check: the recipe's code paths on one CUDA GPU, offline, in one go, as one table.

    python scripts/gpu_check.py [--out DIR] [--budget SECONDS]      # needs a CUDA GPU (exit 2 without one)
    python scripts/gpu_check.py --cpu-smoke [--out DIR]             # same sequence, tiny model, CPU only

Everything runs in a scratch copy (src/, configs/, params.yaml): the repository's params.yaml and outputs are
never touched, and nothing is fetched (HF_HUB_OFFLINE=1; no hub model, no hub data set). The params are
params.yaml with configs/recipes/qwen3-0.6b-gsm8k.yaml applied (the recipe's LoRA, GRPO, chat template and
agent settings), then overridden for a local, short run: `data.source: synthetic`, `model.base_model`: a
randomly initialised Qwen3-0.6B-sized model built here (hidden 1024, 28 layers, 16/8 heads, head_dim 128,
intermediate 3072, tied embeddings, Qwen3-0.6B's 151,936-row vocabulary: the project's tokenizer trained on
the synthetic data, padded with never-produced filler tokens so the embedding, LM head and log-prob costs are
the real model's), `distributed.num_processes: 1`, a few optimizer steps. Rows:

  1. recipe: prepare, stand-in model, `agentrl.stages.base` on the local directory (bf16, sdpa), LoRA SFT and
     GRPO-LoRA (`accelerate launch` of agentrl.stages.sft / .grpo, configs/accelerate/single.yaml), evaluation;
  2. DeepSpeed ZeRO-2 and ZeRO-3 (configs/accelerate/zero2.yaml, zero3.yaml, 1 process): SFT + GRPO;
  3. vLLM colocate rollouts (grpo.trainer.use_vllm, vllm_mode colocate), if `import vllm` works;
  4. export (merge + verify) and the int8 evaluation (bitsandbytes on CUDA, if it imports);
  5. the tool loop's tokens/s (agent.generate_with_tools) against plain `generate` on the same prompts.

Each row has its own timeout and all rows share a time budget (--budget); a failed row never stops the others
(a row whose input a failed row should have made is 'skipped'). The table goes to stdout and to
DIR/gpu_check.md + DIR/gpu_check.json, the logs to DIR/logs.tar.gz. Exit code 0 when no row failed, else 1.
--cpu-smoke runs the same sequence on the CPU with a tiny model and tiny step counts and skips the CUDA-only
rows (DeepSpeed on CUDA, vLLM), so the script's own logic is tested without a GPU (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs/recipes/qwen3-0.6b-gsm8k.yaml"

# Qwen/Qwen3-0.6B's config.json dimensions
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
)
SMOKE_MODEL = dict(
    vocab_size=1024,  # padded like the GPU model's, so the padding path runs here too
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    max_position_embeddings=2048,
    rope_theta=10000.0,
)

# step counts and sizes: GPU (about 6-8 minutes on one H200 in all) and the CPU smoke run
SIZES = {
    "gpu": dict(
        num_train=2000,
        num_test=64,
        eval_n=64,
        eval_new=128,
        sft_steps=8,
        grpo_steps=3,
        gens=8,
        grpo_batch=16,
        completion=128,
        verify=4,
        budget=570,
    ),
    "cpu": dict(
        num_train=120,
        num_test=8,
        eval_n=4,
        eval_new=8,
        sft_steps=2,
        grpo_steps=1,
        gens=2,
        grpo_batch=2,
        completion=8,
        verify=2,
        budget=900,
    ),
}


# ------------------------------------------------------------------------------------------ params
def check_params(cpu: bool, stand_in: str) -> dict:
    """params.yaml + the recipe (applied as scripts/recipe.py applies it: DVC's `-S` code) + the local, short-run
    overrides of the check."""
    sys.path.insert(0, str(ROOT / "src"))
    from agentrl.experiments import overrides
    from recipe import overrides as recipe_args

    s = SIZES["cpu" if cpu else "gpu"]
    p = overrides.load(overrides.apply((ROOT / "params.yaml").read_text(), recipe_args(RECIPE)))
    over = {
        "data.source": "synthetic",
        "data.max_samples": None,
        "data.eval_max_samples": s["eval_n"],
        "data.synthetic.num_train": s["num_train"],
        "data.synthetic.num_test": s["num_test"],
        "model.base_model": stand_in,
        "model.revision": "main",
        "model.precision": "fp32" if cpu else "bf16",
        "model.attn_implementation": "sdpa",
        "distributed.accelerate_config": "configs/accelerate/single.yaml",
        "distributed.num_processes": 1,
        "distributed.scale_lr": "none",
        "tracking.report_to": [],
        "tracking.wandb_mode": "disabled",
        "sft.trainer.max_steps": s["sft_steps"],
        "sft.trainer.logging_steps": 1,
        "sft.trainer.save_steps": 1000,
        "grpo.trainer.max_steps": s["grpo_steps"],
        "grpo.trainer.num_generations": s["gens"],
        "grpo.trainer.per_device_train_batch_size": s["grpo_batch"],
        "grpo.trainer.gradient_accumulation_steps": 1,
        "grpo.trainer.max_completion_length": s["completion"],
        "grpo.trainer.logging_steps": 1,
        "grpo.trainer.save_steps": 1000,
        "grpo.trainer.use_vllm": False,  # vLLM is its own row
        "eval.batch_size": 64,
        "eval.max_new_tokens": s["eval_new"],
        "export.quantize": "int8",
        "export.num_verify_prompts": s["verify"],
    }
    if cpu:  # activation checkpointing only costs time on the tiny model; a smaller SFT batch
        over["sft.trainer.activation_checkpointing"] = False
        over["grpo.trainer.activation_checkpointing"] = False
        over["sft.trainer.per_device_train_batch_size"] = 4
        over["sft.trainer.gradient_accumulation_steps"] = 1
    for k, v in over.items():
        overrides.set_value(p, k, v)
    return p


# ------------------------------------------------------------------------------- helper subcommands
def pad_vocab(tok, size: int):
    """The tokenizer with filler tokens appended to its BPE vocabulary up to `size` entries: the encoder never
    produces them (no merge leads there) but every id a random model samples decodes."""
    from tokenizers import Tokenizer

    from agentrl.modeling import wrap_tokenizer

    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    nxt = max(max(vocab.values()), *(t["id"] for t in spec["added_tokens"])) + 1
    i = 0
    while nxt < size:
        name = f"<filler_{i}>"
        i += 1
        if name not in vocab:
            vocab[name] = nxt
            nxt += 1
    return wrap_tokenizer(Tokenizer.from_str(json.dumps(spec)))


def build_stand_in(out: str, cpu: bool) -> dict:
    """A randomly initialised Qwen3 (QWEN3_0_6B dimensions, or SMOKE_MODEL) + the project's tokenizer trained on
    the prepared data, saved like a hub snapshot. Run from the scratch copy after `prepare`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from agentrl.agent.tools import split_annotated
    from agentrl.config import load_params
    from agentrl.data import load_jsonl
    from agentrl.modeling import train_tokenizer

    params = load_params()
    dims = dict(SMOKE_MODEL if cpu else QWEN3_0_6B)
    rows = load_jsonl("data/prepared/sft_train.jsonl")
    completions = [r["completion"][0]["content"] for r in rows]
    chat = bool(params.agent.tools) and params.agent.format == "chat"
    if chat:
        completions = ["".join(seg for seg, _ in split_annotated(c, "chat")) for c in completions]
    texts = [m["content"] for r in rows for m in r["prompt"]] + completions
    tok = pad_vocab(train_tokenizer(texts, 512), dims.pop("vocab_size"))
    if chat:  # as base.build_tiny: Qwen3's template renders tool calls and tool turns
        from trl.chat_template_utils import qwen3_chat_template

        tok.chat_template = qwen3_chat_template
    dtype = torch.float32 if cpu else torch.bfloat16
    cfg = Qwen3Config(
        vocab_size=len(tok),
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **dims,
    )
    torch.manual_seed(params.seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    texts = [tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=False) for r in rows[:200]]
    lengths = [len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    max_len = params.sft.trainer.get("max_length", 1024) or 1024
    return {
        "parameters": n_params,
        "vocab_size": len(tok),
        "mean_sft_tokens": sum(min(n, max_len) for n in lengths) / len(lengths),
    }


def tool_speed(n: int) -> dict:
    """bench.py's tool_loop_speed on the device (bench.tool_loop_vs_plain): tokens/s of
    agent.generate_with_tools (the GRPO policy, params.agent's tools) against one plain `model.generate` per
    batch on the same prompts, greedy."""
    import torch

    from agentrl.agent.tools import toolset_from_params
    from agentrl.common import torch_dtype
    from agentrl.config import load_params
    from agentrl.data import load_jsonl
    from agentrl.modeling import load_policy
    from bench import tool_loop_vs_plain  # scripts/ is on sys.path (run as a script, and in the tests)

    params = load_params()
    model, tok = load_policy("grpo", dtype=torch_dtype(params.model.precision))
    if torch.cuda.is_available():
        model = model.cuda()
    model.eval()
    toolset = toolset_from_params(params.agent, tok.eos_token)
    kw = toolset.chat_template_kwargs() if toolset else None
    prompts = [r["prompt"] for r in load_jsonl("data/prepared/test.jsonl")[:n]]
    return tool_loop_vs_plain(model, tok, prompts, toolset, params.eval.max_new_tokens, params.eval.batch_size, kw)


# ------------------------------------------------------------------------------------------ the run
class Check:
    def __init__(self, args):
        self.cpu = args.cpu_smoke
        self.size = SIZES["cpu" if self.cpu else "gpu"]
        self.out = Path(args.out).resolve()
        self.logs = self.out / "logs"
        self.deadline = time.time() + (args.budget or self.size["budget"])
        self.py = args.python
        self.rows: list[dict] = []
        self.status: dict[str, str] = {}
        self.work = Path(tempfile.mkdtemp(prefix="agentrl-gpu-check-"))
        self.stand_in = str(self.work / "stand-in" / ("tiny-random" if self.cpu else "qwen3-0.6b-sized-random"))
        self.params = check_params(self.cpu, self.stand_in)  # puts ROOT/src on sys.path
        from agentrl.experiments.scratch import copy_repo

        # dvc.yaml: the training stages' resume fingerprint hashes the code deps it lists (stage.code_digest)
        copy_repo(ROOT, self.work, only=("src", "configs", "dvc.yaml"))
        self.env = {
            **os.environ,
            "PYTHONPATH": str(self.work / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "WANDB_MODE": "disabled",
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PATH": str(Path(self.py).parent) + os.pathsep + os.environ.get("PATH", ""),
        }
        if self.cpu:
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.logs.mkdir(parents=True, exist_ok=True)

    def write_params(self, overrides: dict | None = None) -> None:
        import copy

        import yaml

        from agentrl.experiments.overrides import set_value

        p = copy.deepcopy(self.params)
        for k, v in (overrides or {}).items():
            set_value(p, k, v)
        (self.work / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))

    def metric(self, name: str) -> dict:
        """A stage's headline metrics merged with its diagnostics (common.read_metrics), or this script's own
        metrics/gpu_check_*.json; {} when nothing was written."""
        from agentrl.common import diagnostics_path, read_metrics

        f = self.work / "metrics" / f"{name}.json"
        if not f.is_file():
            return {}
        return read_metrics(f) if diagnostics_path(f).is_file() else json.loads(f.read_text())

    def add(self, path, status, seconds=None, tps=None, note="") -> None:
        note = note.replace("|", "/")  # a table cell
        self.rows.append({"path": path, "status": status, "seconds": seconds, "tokens_per_s": tps, "note": note})
        self.status[path] = status
        sec = "" if seconds is None else f"{seconds:.1f}s"
        print(f"[gpu_check] {path}: {status} {sec} {note}", flush=True)

    def run(self, path, cmd, timeout, needs=(), skip=None, overrides=None, clean=(), after=None) -> None:
        """Run one row: `cmd` in the scratch copy with its own timeout (and the shared budget); `after()` turns
        its metrics into (tokens/s, note). Never raises."""
        missing = [n for n in needs if self.status.get(n) != "ok"]
        if skip:
            return self.add(path, "skipped", note=skip)
        if missing:
            return self.add(path, "skipped", note=f"needs '{missing[0]}'")
        left = self.deadline - time.time()
        if left < 15:
            return self.add(path, "skipped", note="time budget spent (--budget)")
        timeout = min(timeout, left)
        for c in clean:
            shutil.rmtree(self.work / c, ignore_errors=True)
        self.write_params(overrides)
        log = self.logs / (re.sub(r"[^A-Za-z0-9.-]+", "_", path).strip("_") + ".log")
        t0 = time.time()
        with open(log, "w") as fh:
            fh.write("$ " + " ".join(map(str, cmd)) + "\n")
            fh.flush()
            proc = subprocess.Popen(
                cmd, cwd=self.work, env=self.env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # accelerate's and DeepSpeed's children too
                except ProcessLookupError:
                    pass
                proc.wait()
                rc = None
        secs = time.time() - t0
        if rc is None:
            return self.add(path, "fail", secs, note=f"timeout after {timeout:.0f}s (log: {log.name})")
        if rc:
            return self.add(path, "fail", secs, note=f"exit {rc}: {last_error(log)} (log: {log.name})")
        try:
            tps, note = after() if after else (None, "")
        except Exception as e:  # a metrics file missing or malformed: the row ran but did not report
            return self.add(path, "fail", secs, note=f"ran, but its metrics are unreadable: {e!r}")
        self.add(path, "ok", secs, tps, note)

    # ---------------------------------------------------------------------------- rows' metrics
    def stand_in_after(self):
        return None, "{parameters:,} parameters, vocab {vocab_size:,}".format(**self.metric("gpu_check_stand_in"))

    def base_after(self):
        return None, f"resolved {self.metric('base')['resolved_commit']} (offline, no hub lookup)"

    def sft_after(self):
        m, info = self.metric("sft_train"), self.metric("gpu_check_stand_in")
        sps = m.get("train_samples_per_second") or 0
        tps = sps * info["mean_sft_tokens"] if info.get("mean_sft_tokens") else None
        return tps, (
            f"{m['steps']} steps, {m['seconds_per_step']} s/step, loss {fmt(m['first_loss'])} -> "
            f"{fmt(m['final_loss'])}, {launch_kind(m)}; tokens/s = samples/s x mean example tokens"
        )

    def grpo_after(self):
        m = self.metric("grpo_train")
        length = m.get("completion_length_last") or 0
        tps = m["completions_per_step"] * length / m["seconds_per_step"] if m.get("seconds_per_step") else None
        roll = f", rollout {m['rollout_tokens_per_second']:.0f} tok/s" if m.get("rollout_tokens_per_second") else ""
        return tps, (
            f"{m['steps']} steps, {m['seconds_per_step']} s/step, {m['completions_per_step']} completions/step, "
            f"mean length {fmt(length)}{roll}, {launch_kind(m)}; tokens/s = completion tokens / step time"
        )

    def eval_after(self, name):
        def after():
            m = self.metric(f"eval_{name}")
            return m["samples_per_second"] * m["mean_completion_tokens"], (
                f"accuracy {m['accuracy']:.3f} on {self.size['eval_n']} problems "
                f"(random weights: ~0 expected), {m['samples_per_second']:.2f} problems/s"
            )

        return after

    def export_after(self):
        m = self.metric("export")
        same = f"{m['greedy_identical_count']}/{m['num_prompts']}"
        return None, f"merge verified: max abs logit diff {m['max_abs_logit_diff']:.2e}, greedy identical {same}"

    def quant_after(self):
        q, m8 = self.metric("quantize"), self.metric("eval_merged_int8")
        tps = q["int8_samples_per_second"] * m8.get("mean_completion_tokens", 0)
        return tps, (
            f"{q['int8_backend']}: int8 {q['int8_samples_per_second']:.2f} vs full "
            f"{q['merged_samples_per_second']:.2f} problems/s (ratio {q['int8_speed_ratio']:.2f}), "
            f"accuracy delta {q['accuracy_delta']:+.3f}"
        )

    def tool_after(self):
        m = json.loads((self.work / "metrics" / "gpu_check_tool_speed.json").read_text())
        return m["loop_tokens_per_second"], (
            f"plain generate {m['plain_tokens_per_second']:.0f} tok/s, ratio {m['ratio']:.2f}, "
            f"{m['tool_calls']} tool calls, {m['problems']} problems, {m['device']}"
        )

    # --------------------------------------------------------------------------------- the rows
    def sequence(self) -> None:
        py, me = self.py, str(Path(__file__).resolve())

        def launch(cfg, stage):
            return [py, "-m", "accelerate.commands.launch", "--config_file", f"configs/accelerate/{cfg}.yaml",
                    "--num_processes", "1", "-m", f"agentrl.stages.{stage}"]  # fmt: skip

        smoke = ["--cpu-smoke"] if self.cpu else []
        cuda_only = "CUDA-only (--cpu-smoke)" if self.cpu else None
        prepare, stand_in = "recipe: prepare (synthetic)", "recipe: stand-in model (random, local dir)"
        base = f"recipe: base (local dir, {'fp32' if self.cpu else 'bf16'}, sdpa)"
        sft, grpo = "recipe: sft LoRA (single)", "recipe: grpo LoRA (single)"
        export = "export: merge + verify"

        # 1. the recipe's code paths, single process
        self.run(prepare, [py, "-m", "agentrl.stages.prepare"], 180)
        self.run(
            stand_in, [py, me, "--_stand-in", self.stand_in, *smoke], 240, needs=[prepare], after=self.stand_in_after
        )
        self.run(base, [py, "-m", "agentrl.stages.base"], 180, needs=[stand_in], after=self.base_after)
        self.run(sft, launch("single", "sft"), 240, needs=[base], clean=["checkpoints"], after=self.sft_after)
        self.run(grpo, launch("single", "grpo"), 300, needs=[sft], after=self.grpo_after)
        evaluate = [py, "-m", "agentrl.stages.evaluate", "--stage", "grpo"]
        self.run("recipe: eval grpo (tool loop)", evaluate, 180, needs=[grpo], after=self.eval_after("grpo"))
        # 4. export, then the int8 evaluation (bitsandbytes on CUDA, torch dynamic int8 on CPU)
        self.run(export, [py, "-m", "agentrl.stages.export"], 240, needs=[grpo], after=self.export_after)
        bnb = None if self.cpu or importable(py, "bitsandbytes", self.env) else "bitsandbytes not installed"
        quantized = [py, "-m", "agentrl.stages.export", "--quantized-eval"]
        self.run("int8: eval merged + int8", quantized, 240, needs=[export], skip=bnb, after=self.quant_after)
        # 5. the tool loop against plain generate
        speed = [py, me, "--_tool-speed", *smoke]
        self.run("tool loop: generate_with_tools vs generate", speed, 180, needs=[grpo], after=self.tool_after)
        # 2. DeepSpeed ZeRO-2 / ZeRO-3 on CUDA, one process
        for z in ("zero2", "zero3"):
            over = {"distributed.accelerate_config": f"configs/accelerate/{z}.yaml"}
            kw = {"skip": cuda_only, "overrides": over}
            self.run(
                f"{z}: sft LoRA", launch(z, "sft"), 240, needs=[base], clean=["checkpoints"], after=self.sft_after, **kw
            )
            self.run(f"{z}: grpo LoRA", launch(z, "grpo"), 300, needs=[f"{z}: sft LoRA"], after=self.grpo_after, **kw)
        # 3. vLLM colocate rollouts (TRL's generation; the recipe's agent.format chat keeps the calculator), on the
        # last SFT result that was saved
        vllm = cuda_only or (None if importable(py, "vllm", self.env) else "vllm not installed")
        sft_ok = [n for n in ("zero3: sft LoRA", "zero2: sft LoRA", sft) if self.status.get(n) == "ok"]
        over = {
            "grpo.trainer.use_vllm": True,
            "grpo.trainer.vllm_mode": "colocate",
            "grpo.trainer.vllm_gpu_memory_utilization": 0.3,
            "grpo.trainer.vllm_max_model_length": 1024,
        }
        self.run(
            "vllm: grpo LoRA colocate",
            launch("single", "grpo"),
            360,
            needs=sft_ok[:1] or [sft],
            skip=vllm,
            overrides=over,
            clean=["checkpoints/grpo"],
            after=self.grpo_after,
        )

    def finish(self, header: list[str]) -> int:
        lines = ["| path | status | seconds | tokens/s | note |", "|---|---|---:|---:|---|"]
        for r in self.rows:
            sec = "" if r["seconds"] is None else f"{r['seconds']:.1f}"
            tps = "" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
            lines.append(f"| {r['path']} | {r['status']} | {sec} | {tps} | {r['note']} |")
        text = "\n".join(header + [""] + lines) + "\n"
        (self.out / "gpu_check.md").write_text(text)
        (self.out / "gpu_check.json").write_text(json.dumps({"header": header, "rows": self.rows}, indent=2) + "\n")
        print("\n" + text, flush=True)
        for r in self.rows:  # the end of each failed row's log, for a caller that sees only the output's tail
            if r["status"] == "fail" and "(log: " in r["note"]:
                log = self.logs / r["note"].rsplit("(log: ", 1)[1].rstrip(")")
                tail = log.read_text(errors="replace").splitlines()[-25:] if log.is_file() else []
                print(f"--- {log.name} (last lines)\n" + "\n".join(tail), file=sys.stderr)
        with tarfile.open(self.out / "logs.tar.gz", "w:gz") as t:
            t.add(self.logs, arcname="logs")
        shutil.rmtree(self.logs, ignore_errors=True)
        shutil.rmtree(self.work, ignore_errors=True)
        return 1 if any(r["status"] == "fail" for r in self.rows) else 0


def launch_kind(m: dict) -> str:
    kind = "no DeepSpeed" if m.get("distributed_type") == "NO" else m.get("distributed_type")
    return f"{kind}, {m.get('num_processes')} process(es)"


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def last_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):  # the stage's own error, not the launcher's CalledProcessError about it
        if ("Error" in ln or "error" in ln or "Exception" in ln) and "CalledProcessError" not in ln:
            return ln[:200].replace("|", "/")
    return (lines[-1][:200] if lines else "no output").replace("|", "/")


def importable(py: str, module: str, env: dict) -> bool:
    return subprocess.run([py, "-c", f"import {module}"], env=env, capture_output=True, timeout=300).returncode == 0


def environment(py: str, env: dict) -> list[str]:
    code = (
        "import torch, transformers, trl, peft, accelerate, importlib.metadata as md\n"
        "def v(m):\n"
        "    try: return md.version(m)\n"
        "    except Exception: return 'not installed'\n"
        "dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU'\n"
        "print(f'{dev}; torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, '"
        "f'peft {peft.__version__}, accelerate {accelerate.__version__}, deepspeed {v(\"deepspeed\")}, '"
        'f\'vllm {v("vllm")}, bitsandbytes {v("bitsandbytes")}\')\n'
    )
    r = subprocess.run([py, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    return [r.stdout.strip() or f"(versions unavailable: {r.stderr.strip()[-200:]})"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="tiny model, tiny step counts, CPU; CUDA-only rows skipped"
    )
    ap.add_argument("--out", default=str(ROOT / "gpu_check"), help="gpu_check.md, gpu_check.json, logs.tar.gz")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all rows (GPU 570, CPU smoke 900)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter the stages run with")
    ap.add_argument("--_stand-in", dest="stand_in", help=argparse.SUPPRESS)
    ap.add_argument("--_tool-speed", dest="tool_speed", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.python = shutil.which(a.python) or a.python
    if a.stand_in:  # helper: run in the scratch copy
        from agentrl.common import write_json

        write_json("metrics/gpu_check_stand_in.json", build_stand_in(a.stand_in, a.cpu_smoke))
        return
    if a.tool_speed:
        from agentrl.common import write_json

        write_json("metrics/gpu_check_tool_speed.json", tool_speed(SIZES["cpu" if a.cpu_smoke else "gpu"]["eval_n"]))
        return
    if not a.cpu_smoke:
        probe = subprocess.run([a.python, "-c", "import torch; assert torch.cuda.is_available()"], capture_output=True)
        if probe.returncode:
            print(
                "gpu_check: no CUDA device (torch.cuda.is_available() is false for "
                f"{a.python}); run it on a GPU machine, or use --cpu-smoke to test the script's logic on the CPU",
                file=sys.stderr,
            )
            raise SystemExit(2)
    check = Check(a)
    t0 = time.time()
    header = [
        "# GPU check" + (" (--cpu-smoke: tiny model on the CPU)" if check.cpu else ""),
        "",
        f"{environment(a.python, check.env)[0]}",
    ]
    try:
        check.sequence()
    finally:
        header.append(f"Total {time.time() - t0:.0f} s (budget {a.budget or check.size['budget']:.0f} s).")
        rc = check.finish(header)
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
