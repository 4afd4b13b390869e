"""`make loadtest` (scripts/loadtest.py calls `main`): start the service on 127.0.0.1 (serving.local.served), send
requests at a concurrency, check every response, report latency percentiles and throughput; `--drop N` measures
what clients that leave cost (docs/serving.md)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

from agentrl.serving.local import served

HELP = """Load test: start the service on 127.0.0.1, send N requests at concurrency C, check every
response, print p50/p95 latency and throughput (and write them as JSON with --out).

    python scripts/loadtest.py --model models/merged -n 200 -c 8
    python scripts/loadtest.py --model models/merged --drop 24

--drop N measures what clients that leave cost (issue 26 item 7): N streaming clients disconnect after the
first chunk; reported are the server's CPU seconds from then until a following /generate is answered, and that
request's latency, next to the same request on an idle server (CPU from /proc, so only for a server it started).
"""

QUESTIONS = [
    "Tom has 3 apples. He buys 4 more apples. How many apples does Tom have now?",
    "Anna has 12 books. She gives away 5 books. How many books does Anna have now?",
    "Liam has 6 coins. Then he gets 3 times as many coins as he has. How many coins does Liam have now?",
    "Mia has 9 shells. She finds 7 more shells. She loses 4 shells. How many shells does Mia have now?",
]


async def run(base: str, n: int, concurrency: int, max_tokens: int) -> dict:
    """Send `n` greedy /generate requests, at most `concurrency` at a time, and check each response (200, a text,
    a confidence in (0, 1], at least one token).

    Args:
        max_tokens: each request's max_tokens.

    Returns:
        requests, concurrency, errors (+ up to 5 samples), p50_ms, p95_ms, throughput_rps, wall_s, max_tokens.
    """
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    errors: list[str] = []

    async with httpx.AsyncClient(base_url=base, timeout=120) as client:

        async def one(i: int) -> None:
            async with sem:
                t0 = time.perf_counter()
                try:
                    r = await client.post(
                        "/generate",
                        json={"text": QUESTIONS[i % len(QUESTIONS)], "max_tokens": max_tokens, "temperature": 0},
                    )
                    body = r.json()
                    ok = (
                        r.status_code == 200
                        and isinstance(body.get("text"), str)
                        and 0 < body.get("confidence", -1) <= 1
                        and body.get("tokens", 0) >= 1
                    )
                    if not ok:
                        errors.append(f"request {i}: {r.status_code} {str(body)[:200]}")
                except httpx.HTTPError as e:
                    errors.append(f"request {i}: {type(e).__name__}: {e}")
                latencies.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {
        "requests": n,
        "concurrency": concurrency,
        "errors": len(errors),
        "error_samples": errors[:5],
        "p50_ms": round(1000 * statistics.median(lat), 1),
        "p95_ms": round(1000 * lat[int(0.95 * (len(lat) - 1))], 1),
        "throughput_rps": round(n / wall, 2),
        "wall_s": round(wall, 2),
        "max_tokens": max_tokens,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drop(base: str, pid: Optional[int], n: int, max_tokens: int) -> dict:
    """n SSE clients that leave after the first chunk; then one /generate: its latency and the server's CPU.

    Args:
        pid: the server's process id (CPU from /proc), or None for a server this did not start (CPU: nan).
        max_tokens: each request's max_tokens.

    Returns:
        The next request's latency and CPU against the same request on the idle server, their ratio, the
        server's cancelled jobs (/health).
    """
    probe = {"text": QUESTIONS[0], "max_tokens": max_tokens, "temperature": 0}
    body = {"messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": max_tokens, "stream": True}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:

        async def timed_probe() -> tuple[float, float]:
            cpu, t0 = cpu_seconds(pid) if pid else float("nan"), time.perf_counter()
            r = await client.post("/generate", json=probe)
            r.raise_for_status()
            return time.perf_counter() - t0, (cpu_seconds(pid) - cpu) if pid else float("nan")

        await timed_probe()  # warm-up
        idle_latency, idle_cpu = await timed_probe()

        async def leave() -> None:
            async with client.stream("POST", "/v1/chat/completions", json=body) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data: "):
                        return

        cpu0, t0 = cpu_seconds(pid) if pid else float("nan"), time.perf_counter()
        await asyncio.gather(*(leave() for _ in range(n)))
        latency, _ = await timed_probe()
        cpu = (cpu_seconds(pid) - cpu0) if pid else float("nan")
        health = (await client.get("/health")).json()
    return {
        "dropped_streams": n,
        "max_tokens": max_tokens,
        "next_request_s": round(latency, 3),
        "idle_request_s": round(idle_latency, 3),
        "server_cpu_s": round(cpu, 2),
        "idle_request_cpu_s": round(idle_cpu, 2),
        "latency_ratio": round(latency / idle_latency, 2),
        "wall_s": round(time.perf_counter() - t0, 2),
        "jobs_cancelled": health.get("jobs_cancelled"),
    }


def parser() -> argparse.ArgumentParser:
    """scripts/loadtest.py's flags.

    Returns:
        The parser (its help is HELP).
    """
    ap = argparse.ArgumentParser(description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/merged")
    ap.add_argument("-n", "--requests", type=int, default=200)
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--url", default=None, help="use a running server instead of starting one")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--drop", type=int, default=0, help="measure N streaming clients that leave after one chunk")
    return ap


def main(argv: list[str] | None = None) -> None:
    """Serve the model (or use --url), run the load test or the --drop measurement, print and write the results;
    exits 1 when a request failed its checks.

    Args:
        argv: the arguments (None: sys.argv[1:]).
    """
    args = parser().parse_args(argv)
    with served(args.model, args.url, log="loadtest_server.log") as (base, pid):
        if args.drop:
            res = asyncio.run(drop(base, pid, args.drop, args.max_tokens))
            print(json.dumps(res, indent=2))
            if args.out:
                Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
            return
        res = asyncio.run(run(base, args.requests, args.concurrency, args.max_tokens))
    print(
        f"{res['requests']} requests at concurrency {res['concurrency']}: {res['errors']} errors; "
        f"p50 {res['p50_ms']} ms, p95 {res['p95_ms']} ms, {res['throughput_rps']} req/s"
    )
    for e in res["error_samples"]:
        print("  ", e)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    sys.exit(1 if res["errors"] else 0)


if __name__ == "__main__":
    main()
