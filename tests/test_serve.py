"""The FastAPI service through a real uvicorn server on loopback (not only TestClient)."""
import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from agentrl.config import TinyModelParams
    from agentrl.modeling import build_tiny_model, train_tokenizer

    d = tmp_path_factory.mktemp("served")
    texts = ["Tom has 3 apples. He buys 4 more apples. How many apples does Tom have now?", "3+4=7\n#### 7"] * 50
    tok = train_tokenizer(texts, 320)
    model = build_tiny_model(tok, TinyModelParams(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                                  max_position_embeddings=128), seed=0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = tmp_path_factory.mktemp("cfg") / "params.yaml"
    params.write_text((ROOT / "params.yaml").read_text().replace("max_tokens_limit: 512", "max_tokens_limit: 64"))
    env = {**os.environ, "AGENTRL_MODEL_PATH": str(tiny_model_dir), "AGENTRL_PARAMS": str(params)}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "agentrl.serve:app", "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "warning"], env=env)
    base = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("server did not start")
    yield base
    proc.terminate()
    proc.wait(timeout=20)


def test_health(server, tiny_model_dir):
    r = httpx.get(server + "/health").json()
    assert r["status"] == "ok" and r["model_loaded"] and r["model_path"] == str(tiny_model_dir)
    assert r["device"] in ("cpu", "cuda")


def test_generate(server):
    q = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    r = httpx.post(server + "/generate", json={"text": q, "max_tokens": 12, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"text", "answer", "confidence", "tokens"}
    assert 0 < body["confidence"] <= 1
    assert 1 <= body["tokens"] <= 12


def test_confidence_differs_between_prompts(server):
    confs = {httpx.post(server + "/generate", json={"text": t, "max_tokens": 8}, timeout=60).json()["confidence"]
             for t in ("Tom has 3 apples.", "How many books does Anna have now?", "9")}
    assert len(confs) > 1 and all(0 < c <= 1 for c in confs)


def test_openai_client_chat_completions(server):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key="unused")
    resp = client.chat.completions.create(model="agentrl", messages=[{"role": "user", "content": "Tom has 3 apples."}],
                                          max_tokens=8, temperature=0)
    assert resp.object == "chat.completion"
    assert isinstance(resp.choices[0].message.content, str)
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens >= 1 and resp.usage.prompt_tokens >= 1


@pytest.mark.parametrize(
    "route, payload, field, status",
    [
        ("/generate", {"text": "", "max_tokens": 4}, "text", 422),
        ("/generate", {"text": "   ", "max_tokens": 4}, "text", 422),
        ("/generate", {"text": 42, "max_tokens": 4}, "text", 422),
        ("/generate", {"max_tokens": 4}, "text", 422),
        ("/generate", {"text": "hi", "max_tokens": 0}, "max_tokens", 422),
        ("/generate", {"text": "hi", "max_tokens": 65}, "max_tokens", 422),
        ("/generate", {"text": "hi", "max_tokens": 4, "temperature": -1}, "temperature", 422),
        ("/generate", {"text": "1 " * 200, "max_tokens": 4}, "text", 413),
        ("/v1/chat/completions", {"messages": [], "max_tokens": 4}, "messages", 422),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", 422),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000}, "max_tokens", 422),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "content", 422),
    ],
)
def test_bad_input_names_the_field(server, route, payload, field, status):
    r = httpx.post(server + route, json=payload, timeout=30)
    assert r.status_code == status, r.text
    assert field in r.text


def test_concurrent_requests_are_micro_batched(server):
    async def go():
        async with httpx.AsyncClient(base_url=server, timeout=60) as c:
            before = (await c.get("/health")).json()["batches_run"]
            rs = await asyncio.gather(*(c.post("/generate", json={"text": f"Tom has {i} apples.", "max_tokens": 6})
                                        for i in range(16)))
            after = (await c.get("/health")).json()["batches_run"]
            return rs, after - before

    rs, batches = asyncio.run(go())
    assert all(r.status_code == 200 for r in rs)
    assert batches < 16  # several requests shared a batch
