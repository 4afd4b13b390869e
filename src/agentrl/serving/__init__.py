"""The HTTP servers: the one over a saved model (`uvicorn agentrl.serving.app:app`; docs/serving.md), and
openenv_server.py, our environments over OpenEnv (`make env-server`; docs/environments.md).

  app.py           the FastAPI app: routes, the model's lifetime
  schema.py        request and response bodies
  errors.py        errors naming the field (OpenAI's shape on /v1 routes), the request-body limit
  engine.py        tokenization, the micro-batching worker over the agent's tool loop, cancellation
  streaming.py     server-sent events for `stream: true`
  openai_tools.py  client-side function calling: a request's `tools` to the policy's call format and back
  local.py         the server started on a free local port and polled until healthy (load test, tests)

How a request flows:
  1. BodyLimit (errors.py) refuses a body over 1 MiB with 413 before anything parses it.
  2. The pydantic bodies (schema.py) validate every field; the route checks what they cannot (roles' fields,
     n=1, max_tokens against serve.max_tokens_limit) and raises ApiError naming the field.
  3. `Engine.prompt` tokenizes on a tokenizer thread; a prompt that does not fit the context is a 413.
  4. `complete()` queues a job; the worker micro-batches jobs (serve.max_batch_size, serve.batch_wait_ms) and
     runs each batch through agent.generate_with_tools on the model thread. Without `tools` in the request the
     policy's calls run server-side (agent.* toolset); with `tools` generation stops at the policy's call and
     the reply carries it as `tool_calls` for the client to run.
  5. A client that disconnects cancels its job: a queued job is dropped, a running one ends at its next token
     (streaming: Starlette cancels the response; plain: a watcher on the ASGI receive channel).
"""
