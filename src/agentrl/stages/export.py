"""Stage `export`: merge the LoRA adapter(s) into the base weights -> models/merged/.

base + SFT adapter (merged) + GRPO adapter -> `merge_and_unload` -> save_pretrained (weights,
tokenizer, generation config), loadable by plain AutoModelForCausalLM without PEFT. The merge is
verified by reloading models/merged/ and comparing its logits with the unmerged adapter model on a
fixed prompt set, and its greedy completions; the stage fails when they differ. The new model is written to
models/merged.partial and swapped in (one atomic exchange of the names on Linux) only once its check has passed,
with export_check.json beside its files saying so: a failed check or a kill at any moment leaves the previous
verified models/merged in place (dvc.yaml marks it `persist` so DVC does not delete it first), and `make serve`
refuses a directory whose export_check.json does not say passed.

With `export.gguf` (f32, f16, q8_0), the merged model is also written as GGUF files to models/gguf/ with gguf's
writer, for llama.cpp, Ollama and LM Studio; each is read back through transformers and its greedy completions on
the verify prompts compared with the merged model's: an f32 file must agree on every prompt (else the stage fails),
f16 and q8_0 round the weights, so how many agree is recorded (`gguf` in diagnostics/export.json).

Stage `eval_quantized` (python -m agentrl.stages.export --quantized-eval): evaluates models/merged in full
precision and int8 (export.quantize: bitsandbytes on CUDA, torch dynamic int8 on CPU; quantize.py is
the one int8 path, also behind `evaluate --quantize int8`) through the normal evaluation code and records
the accuracy delta, the backend and the measured speed ratio in metrics/quantize.json.
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
from pathlib import Path

import torch

from .. import gguf_files
from ..common import get_logger, peak_rss_mb, write_json, write_metrics
from ..config import Params, load_params_or_exit
from ..data import load_jsonl
from ..modeling import EXPORT_CHECK, STAGE_DIRS, load_model, load_policy, load_tokenizer
from .evaluate import evaluate, generate
from .quantize import int8_backend, load_quantized

log = get_logger("export")
METRICS = "metrics/export.json"
GGUF_DIR = Path("models/gguf")


class ExportVerificationError(RuntimeError):
    """The merged model's logits differ from the adapter's beyond export.max_abs_logit_diff."""

    pass


@torch.inference_mode()
def logits(model, tokenizer, prompts: list[list[dict]]) -> torch.Tensor:
    """The model's logits on the prompts (chat-rendered, left-padded), padding positions zeroed.

    Returns:
        A (prompts, tokens, vocabulary) tensor.
    """
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model(**enc).logits
    return out.masked_fill(~enc["attention_mask"].bool()[..., None], 0.0)


def export(params: Params) -> dict:
    """The export stage: merge the GRPO adapter into the base+SFT weights, save models/merged, and verify it
    against the adapter model (logits within export.max_abs_logit_diff, greedy completions identical).

    Returns:
        The metrics written. ExportVerificationError when the check fails.
    """
    prompts = [r["prompt"] for r in load_jsonl("data/prepared/test.jsonl")[: params.export.num_verify_prompts]]
    adapter_model, tok = load_policy("grpo", dtype=torch.float32, merge=False)
    adapter_model.eval()
    ref_logits = logits(adapter_model, tok, prompts)
    ref_text = [s[0][0] for s in generate(adapter_model, tok, prompts, len(prompts), params.eval.max_new_tokens)]

    merged = adapter_model.merge_and_unload() if hasattr(adapter_model, "merge_and_unload") else adapter_model
    out_dir = STAGE_DIRS["merged"]
    restore_interrupted_swap(out_dir)
    restore_interrupted_swap(GGUF_DIR)
    staging = staging_dir(out_dir)  # models/merged stays the previous verified model until this one passes
    merged.save_pretrained(staging)
    tok.save_pretrained(staging)
    merged.generation_config.save_pretrained(staging)
    write_json(staging / EXPORT_CHECK, {"passed": None, "note": "export was checking this model"})

    reloaded = load_model(staging)  # plain transformers, no PEFT
    reloaded.eval()
    reloaded_tok = load_tokenizer(staging)  # the saved tokenizer, as a user of models/merged loads it
    diff = (logits(reloaded, reloaded_tok, prompts) - ref_logits).abs().max().item()
    new_text = [s[0][0] for s in generate(reloaded, tok, prompts, len(prompts), params.eval.max_new_tokens)]
    same = sum(a == b for a, b in zip(ref_text, new_text))
    metrics = {
        "max_abs_logit_diff": diff,
        "tolerance": params.export.max_abs_logit_diff,
        "greedy_identical": same == len(prompts),
        "greedy_identical_count": same,
        "num_prompts": len(prompts),
        "parameters": sum(p.numel() for p in reloaded.parameters()),
        "passed": diff <= params.export.max_abs_logit_diff and same == len(prompts),
    }
    if metrics["passed"] and (written := export_gguf(reloaded, reloaded_tok, prompts, new_text, params)):
        metrics["gguf"] = written
        metrics["passed"] = all(g["passed"] for g in written.values())
    metrics["peak_rss_mb"] = peak_rss_mb()
    write_metrics(METRICS, metrics)
    if not metrics["passed"]:  # neither the model nor its GGUF files replace the previous verified ones
        shutil.rmtree(staging)
        shutil.rmtree(staging_dir(GGUF_DIR), ignore_errors=True)
        raise ExportVerificationError(failure_message(metrics, out_dir))
    write_json(staging / EXPORT_CHECK, {k: metrics[k] for k in VERDICT_KEYS})
    swap_in(staging, out_dir)
    swap_in(staging_dir(GGUF_DIR), GGUF_DIR)
    log.info(
        "merged model saved to %s; max |logit diff| %.2e, greedy identical %d/%d", out_dir, diff, same, len(prompts)
    )
    return metrics


VERDICT_KEYS = ("passed", "max_abs_logit_diff", "tolerance", "greedy_identical_count", "num_prompts")


def failure_message(metrics: dict, out_dir: Path) -> str:
    """What failed the check (the GGUF round trip, or the merge itself), and that the previous model stays."""
    kept = f"{out_dir} {'keeps the previous verified model' if out_dir.exists() else 'was not written'}; see {METRICS}"
    if metrics.get("gguf"):
        failed = {k: f"{g['greedy_identical_count']}/{g['num_prompts']}" for k, g in metrics["gguf"].items()}
        return f"GGUF round trip failed (greedy completions identical: {failed}); {kept}"
    return (
        f"merge verification failed: max |logit diff| {metrics['max_abs_logit_diff']:.3g} (tolerance "
        f"{metrics['tolerance']:g}), greedy completions identical on {metrics['greedy_identical_count']}/"
        f"{metrics['num_prompts']} prompts; {kept}"
    )


def staging_dir(final: Path) -> Path:
    """Where export writes `final`'s new contents until they pass its check (models/merged.partial)."""
    return final.with_name(final.name + ".partial")


def swap_in(staging: Path, final: Path) -> None:
    """`final` replaced by `staging`: on Linux in one atomic exchange of the two names (renameat2), so `final` is
    never missing; elsewhere with two renames, a kill between which leaves the old one at <final>.previous for
    restore_interrupted_swap to put back at the next start."""
    if final.exists() and exchange_names(staging, final):
        shutil.rmtree(staging)  # now the old contents
        return
    previous = final.with_name(final.name + ".previous")
    shutil.rmtree(previous, ignore_errors=True)
    if final.exists():
        final.rename(previous)
    staging.rename(final)
    shutil.rmtree(previous, ignore_errors=True)


def exchange_names(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux's renameat2(RENAME_EXCHANGE); False where the C library or the file
    system has no such call (the caller then renames twice)."""
    import ctypes
    import os

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    error = ctypes.get_errno()
    if error in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(error, os.strerror(error), str(a))


def restore_interrupted_swap(final: Path) -> None:
    """Undo what a kill can leave: <final>.previous back in place when `final` is missing (two-rename swap_in),
    and the staging folder of an export that did not finish removed."""
    previous = final.with_name(final.name + ".previous")
    if previous.exists() and not final.exists():
        previous.rename(final)
        log.warning("%s restored from %s (an export was killed while swapping it)", final, previous)
    shutil.rmtree(staging_dir(final), ignore_errors=True)


def export_gguf(merged, tokenizer, prompts: list, merged_text: list[str], params: Params) -> dict:
    """models/gguf/model-<type>.gguf for each type in export.gguf, each read back through transformers and checked
    against the merged model's greedy completions; with none asked for, models/gguf/SKIPPED.txt says why it is empty.
    The files are written to models/gguf.partial, which export swaps in once every check has passed.

    Returns:
        {type: {file, bytes, sha256, tensor types, greedy agreement, passed}}; an f32 file passes only when every
        completion is identical, f16/q8_0 round the weights and always pass with their agreement recorded.
    """
    staging = staging_dir(GGUF_DIR)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if not params.export.gguf:
        (staging / "SKIPPED.txt").write_text("export.gguf is [] (no GGUF files asked for)\n")
        return {}
    source = STAGE_DIRS["base"] / gguf_files.SOURCE_RECORD
    tokenizer_kind = json.loads(source.read_text()).get("tokenizer", {}) if source.exists() else {}
    results = {}
    for out_type in params.export.gguf:
        path = staging / f"model-{out_type}.gguf"
        written = gguf_files.write_gguf(merged, tokenizer, path, out_type, "agentrl merged", tokenizer_kind)
        model, gguf_tok = gguf_files.load_plain(path)
        text = [s[0][0] for s in generate(model, gguf_tok, prompts, len(prompts), params.eval.max_new_tokens)]
        same = sum(a == b for a, b in zip(merged_text, text))
        results[out_type] = {
            "file": str(GGUF_DIR / path.name),
            **written,
            "sha256": gguf_files.sha256(path),
            "greedy_identical_count": same,
            "num_prompts": len(prompts),
            "passed": same == len(prompts) or out_type != "f32",
        }
        log.info(
            "%s: %.1f MB, greedy completions identical to the merged model's on %d/%d",
            GGUF_DIR / path.name,
            written["bytes"] / 1e6,
            same,
            len(prompts),
        )
        del model
    return results


def quantized_eval(params: Params) -> dict:
    """The eval_quantized stage: models/merged evaluated in fp32 and, with export.quantize int8, in int8.

    Returns:
        metrics/quantize.json: the merged model's accuracy and samples/s and, with int8, the int8 backend,
        accuracy, samples/s and their ratios to the merged model's.
    """
    full = evaluate(params, "merged", name="merged")
    out = {
        "quantize": params.export.quantize,
        "merged_accuracy": full["accuracy"],
        "merged_samples_per_second": full["samples_per_second"],
    }
    if params.export.quantize == "int8":
        int8 = evaluate(
            params,
            "merged",
            name="merged_int8",
            quantize="int8",
            model=load_quantized(STAGE_DIRS["merged"]),
            tokenizer=load_tokenizer(STAGE_DIRS["merged"]),
        )
        out.update(
            {
                "int8_backend": int8_backend(),
                "int8_accuracy": int8["accuracy"],
                "accuracy_delta": int8["accuracy"] - full["accuracy"],
                "int8_samples_per_second": int8["samples_per_second"],
                "int8_speed_ratio": int8["samples_per_second"] / full["samples_per_second"],
                "note": "speed ratio measured in this run on this machine; > 1 means int8 is faster",
            }
        )
    else:  # keep the stage's declared outputs, saying why they are empty
        write_metrics("metrics/eval_merged_int8.json", {"skipped": "export.quantize is none"})
        skipped = Path("eval/merged_int8")
        skipped.mkdir(parents=True, exist_ok=True)
        (skipped / "SKIPPED.txt").write_text("export.quantize is none\n")
    write_metrics("metrics/quantize.json", out)
    return out


def main() -> None:
    """`python -m agentrl.stages.export [--quantized-eval]`: exit status 1 when the merge check fails."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantized-eval", action="store_true", help="evaluate models/merged in fp32 and int8")
    args = ap.parse_args()
    params = load_params_or_exit()
    try:
        quantized_eval(params) if args.quantized_eval else export(params)
    except (ExportVerificationError, gguf_files.GgufError) as error:  # a failed check, or export.gguf on a model
        log.error("%s", error)  # it cannot write (not Llama): one line, no traceback
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
