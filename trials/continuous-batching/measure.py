"""Evaluation with and without continuous batching (eval.continuous_batching), paired, on one trained model.

    python trials/continuous-batching/measure.py MODEL_DIR TEST_JSONL [--batch 64] [--kernels onednn] [--rounds 2]

MODEL_DIR: a plain transformers model (a pipeline's models/merged); TEST_JSONL: its data/prepared/test.jsonl.
Greedy, the project's calculator (params.yaml's agent section), eval.max_new_tokens; the two modes take turns for
--rounds rounds (the first mode alternates). Prints one JSON object: per mode the seconds of each round, problems/s
(median), accuracy, sampled tokens, and whether every completion is the same token for token in both modes.
"""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentrl.agent.linear_kernels import use_linear_kernels
from agentrl.agent.loop import generate_with_tools
from agentrl.agent.tools import toolset_from_params
from agentrl.config import load_params
from agentrl.data import load_jsonl
from agentrl.stages.evaluate import score


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("test_jsonl")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--kernels", default="aten")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    params = load_params("params.yaml")
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32).eval()
    use_linear_kernels(model, args.kernels, args.batch, "eval.linear_kernels")
    rows = load_jsonl(args.test_jsonl)[: args.limit]
    toolset = toolset_from_params(params.agent, tok.eos_token, params.environments)
    runs = {False: [], True: []}
    out = {}
    for r in range(args.rounds):
        for continuous in ((False, True) if r % 2 == 0 else (True, False)):
            start = time.perf_counter()
            rolls = generate_with_tools(
                model, tok, [row["prompt"] for row in rows], toolset, args.max_new_tokens, batch_size=args.batch,
                rows=rows, continuous_batching=continuous, desc=f"continuous={continuous}",
                chat_template_kwargs=toolset.chat_template_kwargs() if toolset else None,
            )
            seconds = time.perf_counter() - start
            runs[continuous].append((seconds, rolls))
    for continuous, done in runs.items():
        rolls = done[0][1]
        metrics, _ = score(rows, [[(r.text, r.num_tokens) for r in rs] for rs in rolls], {"accuracy": 1.0}, {})
        seconds = [s for s, _ in done]
        out["continuous" if continuous else "fixed"] = {
            "seconds": [round(s, 2) for s in seconds],
            "problems_per_second": round(len(rows) / statistics.median(seconds), 3),
            "accuracy": metrics["accuracy"],
            "sampled_tokens": sum(sum(r.env_mask) for rs in rolls for r in rs),
        }
    same = all(
        [(r.completion_ids, r.env_mask) for r in a] == [(r.completion_ids, r.env_mask) for r in b]
        for done_f, done_c in zip(runs[False], runs[True])
        for a, b in zip(done_f[1], done_c[1])
    )
    out["same_completions"] = same
    out["speedup"] = round(out["continuous"]["problems_per_second"] / out["fixed"]["problems_per_second"], 3)
    out.update(batch=args.batch, kernels=args.kernels, problems=len(rows), threads=torch.get_num_threads())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
