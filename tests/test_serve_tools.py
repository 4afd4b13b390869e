"""The server runs the policy's tool calls itself, through the same loop as GRPO and evaluation."""

from __future__ import annotations

import math

import pytest
import yaml
from fastapi.testclient import TestClient
from transformers import LogitsProcessor, LogitsProcessorList

from conftest import mini_params
from test_agent import ForceCalls


class Hostile(LogitsProcessor):
    """Every turn writes a call the calculator must refuse: '<<9**9**9='."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, input_ids, scores):
        for r in range(input_ids.shape[0]):
            row = [t for t in input_ids[r].tolist() if t != self.tok.pad_token_id]
            comp = self.tok.decode(row).rpartition("<|im_start|>assistant\n")[2]
            tail = comp.rpartition(">>")[2]
            script = "<<9**9**9="
            if len(tail) < len(script) and script.startswith(tail):
                scores[r, :] = -1e9
                scores[r, self.tok.convert_tokens_to_ids(script[len(tail)])] = 0
        return scores


@pytest.fixture
def client(tiny_model_dir, tmp_path, monkeypatch):
    from agentrl.serving import engine
    from agentrl.serving.app import app

    cfg = mini_params()
    cfg["agent"].update(max_tool_calls=1)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("AGENTRL_MODEL_PATH", str(tiny_model_dir))
    monkeypatch.setenv("AGENTRL_PARAMS", str(tmp_path / "params.yaml"))
    forcing = {"cls": ForceCalls}
    real = engine.generate_with_tools

    def forced(model, tok, prompts, toolset, *a, **kw):
        return real(model, tok, prompts, toolset, *a, logits_processor=LogitsProcessorList([forcing["cls"](tok)]), **kw)

    monkeypatch.setattr(engine, "generate_with_tools", forced)
    with TestClient(app) as c:
        c.forcing = forcing
        yield c


def test_generate_returns_the_tool_trace(client):
    r = client.post("/generate", json={"text": "Tom has 12 apples. He buys 7 more. How many now?", "max_tokens": 30})
    assert r.status_code == 200, r.text
    body = r.json()
    calls = body["tool_calls"]
    assert len(calls) == 1 and calls[0]["name"] == "calculator" and calls[0]["ok"]
    a, _, b = calls[0]["arguments"]["expression"].partition("+")
    assert calls[0]["result"] == str(int(a) + int(b))
    assert f"<<{calls[0]['arguments']['expression']}={calls[0]['result']}>>" in body["text"]
    assert math.isfinite(body["confidence"]) and 0 <= body["confidence"] <= 1 and body["tokens"] <= 30


def test_chat_completion_plain_and_streamed_carry_the_same_tool_result(client):
    msg = [{"role": "user", "content": "Anna has 30 coins. She finds 12 more. How many now?"}]
    r = client.post("/v1/chat/completions", json={"messages": msg, "max_tokens": 30})
    assert r.status_code == 200, r.text
    plain = r.json()
    assert plain["tool_calls"] and plain["tool_calls"][0]["ok"]
    text = plain["choices"][0]["message"]["content"]
    assert f"={plain['tool_calls'][0]['result']}>>" in text
    with client.stream("POST", "/v1/chat/completions", json={"messages": msg, "max_tokens": 30, "stream": True}) as s:
        chunks = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    import json

    streamed = "".join(
        json.loads(c)["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if json.loads(c)["choices"]
    )
    assert streamed == text and chunks[-1] == "[DONE]"


def test_hostile_expressions_get_error_results_and_the_call_limit_ends_the_completion(client):
    client.forcing["cls"] = Hostile
    r = client.post("/generate", json={"text": "Compute something huge.", "max_tokens": 85})
    assert r.status_code == 200, r.text
    calls, text = r.json()["tool_calls"], r.json()["text"]
    assert len(calls) == 1  # agent.max_tool_calls 1: the second call ends the completion, unanswered
    assert not calls[0]["ok"] and calls[0]["result"].startswith("error: unsupported operator")
    assert text.endswith(f"<<9**9**9={calls[0]['result']}>><<9**9**9=")
    assert client.get("/health").json()["status"] == "ok"
