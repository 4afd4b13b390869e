"""Serve a model (dir or .gguf) with the project's server and drive it with the OpenAI client: server-side tools,
client-side tool calls, streaming. Prints a transcript."""
import json, os, subprocess, sys, time
from pathlib import Path
import httpx
from openai import OpenAI

model, port = sys.argv[1], int(sys.argv[2])
env = {**os.environ, "AGENTRL_MODEL_PATH": model, "OMP_NUM_THREADS": "2"}
srv = subprocess.Popen([sys.executable, "-m", "uvicorn", "agentrl.serving.app:app", "--host", "127.0.0.1", "--port", str(port)],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/work/main")
try:
    t0 = time.time()
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200: break
        except Exception: pass
        if srv.poll() is not None: print(srv.stdout.read()[-3000:]); raise SystemExit("server died")
        time.sleep(2)
    print(f"# model {model}: server up in {time.time()-t0:.0f}s")
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    q = "Mia has 41 stamps. She buys 27 more stamps. Then she gives away 9 stamps. How many stamps does Mia have now?"
    r = client.chat.completions.create(model="agentrl", messages=[{"role": "user", "content": q}], max_tokens=128, temperature=0)
    print("## server-side tools\ncontent:", repr(r.choices[0].message.content))
    print("server tool_calls:", json.dumps(r.model_extra.get("tool_calls")), "answer:", r.model_extra.get("answer"))
    calc = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
    msgs = [{"role": "user", "content": q}]
    print("## client-side tool calls")
    for turn in range(6):
        r = client.chat.completions.create(model="agentrl", messages=msgs, tools=[calc], max_tokens=128, temperature=0)
        m = r.choices[0].message
        print(f"turn {turn}: finish={r.choices[0].finish_reason} content={m.content!r} tool_calls={[ (c.function.name, c.function.arguments) for c in (m.tool_calls or [])]}")
        if r.choices[0].finish_reason != "tool_calls": break
        msgs.append(m.model_dump(exclude_none=True))
        for c in m.tool_calls:
            expr = json.loads(c.function.arguments)["expression"]
            result = str(eval(expr, {"__builtins__": {}}))  # the client's own calculator (a fixed arithmetic test string)
            msgs.append({"role": "tool", "tool_call_id": c.id, "content": result})
    print("## streaming")
    chunks = list(client.chat.completions.create(model="agentrl", messages=[{"role": "user", "content": q}], max_tokens=128, temperature=0, stream=True))
    text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    print(f"{len(chunks)} chunks; text={text!r}")
finally:
    srv.terminate(); srv.wait(timeout=30)
