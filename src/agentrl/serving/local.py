"""The server started locally and polled until healthy, on a free port: scripts/loadtest.py,
scripts/client_tools_eval.py and the tests run `uvicorn agentrl.serving.app:app` this way."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator, Optional


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float, log: Optional[Path] = None) -> dict:
    """Poll `base`/health until it answers 200 and return its JSON; RuntimeError (naming `log`) when the
    process exits first or `timeout_s` passes (the process is then terminated)."""
    import httpx

    where = f"; see {log}" if log else ""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {base}/health answered{where}")
        try:
            response = httpx.get(base + "/health", timeout=2)
            if response.status_code == 200:
                return response.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.terminate()
    raise RuntimeError(f"{base}/health did not answer 200 within {timeout_s:g} s{where}")


def start_server(
    model: str | Path,
    port: int,
    *,
    params: Optional[str | Path] = None,
    output: Optional[IO] = None,
    timeout_s: float = 120,
) -> tuple[subprocess.Popen, str]:
    """`uvicorn agentrl.serving.app:app` on 127.0.0.1:`port` serving `model` (AGENTRL_MODEL_PATH; AGENTRL_PARAMS
    when `params` is given), stdout/stderr to `output` (else inherited); (process, base URL) once healthy."""
    env = {**os.environ, "AGENTRL_MODEL_PATH": str(model)}
    if params is not None:
        env["AGENTRL_PARAMS"] = str(params)
    cmd = [sys.executable, "-m", "uvicorn", "agentrl.serving.app:app", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--http", "agentrl.http_limits:HeaderDeadline"]  # as `make serve`: a request header arrives whole in 10 s
    proc = subprocess.Popen(
        cmd + ["--log-level", "warning"],
        env=env,
        stdout=output,
        stderr=subprocess.STDOUT if output else None,
    )
    base = f"http://127.0.0.1:{port}"
    wait_healthy(proc, base, timeout_s, Path(output.name) if output and hasattr(output, "name") else None)
    return proc, base


@contextmanager
def served(
    model: str | Path, url: Optional[str] = None, *, params: Optional[str | Path] = None, log: Optional[str] = None
) -> Iterator[tuple[str, Optional[int]]]:
    """(base URL, server pid) of `url` when given (a running server; pid None), else of a server started on a
    free port (output to the file `log`), stopped on exit. The scripts' way to talk to a server either way."""
    if url is not None:
        yield url, None
        return
    out = Path(log).open("w") if log else None
    proc = None
    try:
        proc, base = start_server(model, free_port(), params=params, output=out)
        yield base, proc.pid
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
        if out is not None:
            out.close()
