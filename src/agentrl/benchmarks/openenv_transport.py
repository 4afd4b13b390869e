"""What OpenEnv's transport costs (`make bench-tools`, issue 42): our tool loop's rollouts with an environment's
episodes in-process against over OpenEnv (`agent.environment_url: serve`), on the same forced demonstrations."""

from __future__ import annotations

import statistics
import time

import torch

from .decoding import LOOP_ROUNDS
from .measure import stats


def forced_demonstrations(tok, rows: list[dict]):
    """A LogitsProcessor that makes the policy write each row's demonstration (inline format): the text before each
    `<<expr=` and the call itself; the loop appends what the environment answers (`result>>`), then the next piece.

    Args:
        tok: the policy's tokenizer (Qwen3-style chat template: `<|im_start|>assistant` opens the completion).
        rows: task rows with "question" and "answer" (the demonstration with its `<<expr=result>>` calls).
    """
    from transformers import LogitsProcessor

    from agentrl.agent.tools import _ANNOTATION

    def pieces(answer: str) -> list[list[int]]:
        out, pos = [], 0
        for m in _ANNOTATION.finditer(answer):
            out.append(answer[pos : m.start()] + f"<<{m.group(1)}=")
            pos = m.end()
        return [tok(x, add_special_tokens=False)["input_ids"] for x in out + [answer[pos:]]]

    demos = [(r["question"], pieces(r["answer"])) for r in rows]

    class Forced(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for i in range(input_ids.shape[0]):
                text = tok.decode([t for t in input_ids[i].tolist() if t != tok.pad_token_id])
                prompt, _, completion = text.rpartition("<|im_start|>assistant\n")
                ids = next(p for q, p in demos if q in prompt)
                done, tail = completion.count(">>"), completion.rpartition(">>")[2]
                piece = ids[done] if done < len(ids) else []
                j = next((j for j in range(len(piece)) if tok.decode(piece[:j]) == tail), None)
                want = piece[j] if j is not None else tok.eos_token_id
                scores[i, :] = -1e9
                scores[i, want] = 0
            return scores

    return Forced()


def _forced_policy(params, rows: list[dict]):
    """A model of params.model.tiny's size (the default pipeline's), its tokenizer trained on the rows, in eval
    mode, and the logits processor that makes it write the rows' demonstrations.

    Args:
        rows: task rows with "question" and "answer".

    Returns:
        (model, tokenizer, LogitsProcessorList).
    """
    from transformers import LogitsProcessorList

    from agentrl.config import TinyModelParams
    from agentrl.modeling import build_tiny_model, train_tokenizer

    tiny = params.model.tiny
    tok = train_tokenizer([r["question"] + r["answer"] for r in rows], tiny.vocab_size)
    model = build_tiny_model(tok, TinyModelParams(**tiny.model_dump()), params.seed).eval()
    return model, tok, LogitsProcessorList([forced_demonstrations(tok, rows)])


@torch.inference_mode()
def openenv_transport(params, n: int = 64, rounds: int = LOOP_ROUNDS, environment: str = "countdown") -> dict:
    """Rollout time of our tool loop with `environment`'s episodes in-process against over OpenEnv (issue 42:
    agent.environment_url serve, a server subprocess on 127.0.0.1, one WebSocket session per completion). The
    policy (_forced_policy) writes `n` held-out rows' demonstrations, greedy, in batches of params.eval.batch_size:
    both sides decode the same tokens and make the same calls. torch runs one thread here: with two on a busy
    2-core machine each small matmul waits for the other thread (rounds measured 1 s and 17 s apart), and the
    server process gets the other core.

    Args:
        rounds: in-process/OpenEnv pairs back to back; the ratio is the median of the paired ratios.
        environment: a registered environment name with a task.

    Returns:
        environment, rollouts, tool_calls, both sides' seconds (stats), the ratio and each round's.
    """
    import random

    from agentrl.agent.loop import generate_with_tools
    from agentrl.agent.tools import toolset_from_params
    from agentrl.data import messages
    from agentrl.envs import openenv_client
    from agentrl.envs.tasks import TASKS

    rows = TASKS[environment].make_rows(n, random.Random(0), "test")
    prompts = [messages("", r["question"]) for r in rows]
    model, tok, forced = _forced_policy(params, rows)
    agent = params.agent.model_copy(update={"tools": [], "format": "inline", "environment": environment})

    def rollout(url) -> tuple[float, list]:
        agent_at_url = agent.model_copy(update={"environment_url": url})
        toolset = toolset_from_params(agent_at_url, tok.eos_token, params.environments)
        start = time.perf_counter()
        out = generate_with_tools(model, tok, prompts, toolset, 96, params.eval.batch_size, rows=rows,
                                  logits_processor=forced)  # fmt: skip
        return time.perf_counter() - start, [r[0] for r in out]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rollout(None), rollout("serve")  # warm-up: the first calls of both paths, and the server's start
        pairs = [(rollout(None), rollout("serve")) for _ in range(rounds)]
    finally:
        openenv_client._stop_served()
        torch.set_num_threads(threads)
    (_, local), (_, remote) = pairs[0]
    if [r.completion_ids for r in local] != [r.completion_ids for r in remote]:
        raise RuntimeError("openenv_transport: the rollouts over OpenEnv differ from in-process ones")
    return {
        "environment": environment,
        "rollouts": n,
        "tool_calls": sum(len(r.calls) for r in local),
        "in_process_seconds": stats([a[0] for a, _ in pairs]),
        "openenv_seconds": stats([b[0] for _, b in pairs]),
        "ratio": statistics.median(b[0] / a[0] for a, b in pairs),
        "round_ratios": [b[0] / a[0] for a, b in pairs],
    }
