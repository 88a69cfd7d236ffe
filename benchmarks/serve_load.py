"""Load test of `stepllm serve`: N concurrent streaming chat clients on loopback for a bounded time, a share of
which hang up mid-stream; then throughput, TTFT / TPOT percentiles, errors by kind, and the server's resource
counts once it has settled (no request should be left running, no KV block leased).

    python benchmarks/serve_load.py [--model M] [--clients 16] [--duration 30] [--disconnect-share 0.2]
                                    [--max-tokens 64] [--max-batch-size 8] [--max-waiting 256] [--url URL]
                                    [--input-len N [--max-id ID]] [--processes P]

Without --url the engine and server run in this process (uvicorn on 127.0.0.1, a free port); with --url the
clients drive that server instead (loopback only). Each client loops until the time is up: a random prompt from a
small pool (or, with --input-len N, N random token ids through /v1/completions, as vLLM's benchmark's "random"
dataset sends), stream=True, greedy, EOS ignored so every finished request generates --max-tokens tokens; with
probability --disconnect-share it closes the connection after a random number of content chunks. New requests
stop at --duration; requests still open then get --grace seconds to finish, after which they are abandoned.
TTFT = request sent -> first content chunk; TPOT = (last chunk - first chunk) / (completion tokens - 1), finished
requests only. Output tok/s counts the tokens of finished requests (from the usage chunk) plus the content chunks
the disconnecting clients read, which is a floor: a server that falls behind sends several tokens in one chunk.

Each client has its own connection, and the clients are spread over --processes processes (default: one per 16
clients, at most one per CPU) that start together. With one process and one shared connection pool the load
generator, not the server, set the pace at 64 clients (2-core development machine, tiny fixture, same server:
12,600 output tok/s against 28,700 with a connection per client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import queue
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

# Random prompt ids start past the ids that tokenizers usually give special tokens.
FIRST_RANDOM_ID = 10

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a bicycle works.",
    "List three facts about the Moon.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a sunrise in the mountains.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarize the plot of a detective story in a few sentences.",
]


@dataclass
class Results:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    finished: int = 0
    disconnected: int = 0
    tokens: int = 0
    prompt_tokens: int = 0  # of the finished requests, as the server counted them
    errors: Counter[str] = field(default_factory=Counter)
    served: set[int] = field(default_factory=set)  # the clients that finished at least one request

    def merge(self, other: Results) -> None:
        self.ttft += other.ttft
        self.tpot += other.tpot
        self.e2e += other.e2e
        self.finished += other.finished
        self.disconnected += other.disconnected
        self.tokens += other.tokens
        self.prompt_tokens += other.prompt_tokens
        self.errors.update(other.errors)
        self.served |= other.served


def loopback_only(url: str) -> str:
    host = httpx.URL(url).host
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        sys.exit(f"--url must point at a loopback address, got {host!r}")
    return url.rstrip("/")


async def one_request(
    client: httpx.AsyncClient, model: str, args: argparse.Namespace, rng: random.Random, out: Results, who: int
) -> None:
    hang_up_after = rng.randint(1, max(1, args.max_tokens // 2)) if rng.random() < args.disconnect_share else None
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.input_len:  # random token ids, vLLM's "random" dataset: prompts of a known length, no prefix shared
        body["prompt"] = [rng.randrange(FIRST_RANDOM_ID, args.max_id) for _ in range(args.input_len)]
        endpoint = "/v1/completions"
    else:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        endpoint = "/v1/chat/completions"
    sent = time.monotonic()
    first = last = None
    chunks = 0
    completion_tokens = prompt_tokens = 0
    try:
        async with client.stream("POST", endpoint, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                out.errors[f"http_{r.status_code}"] += 1
                if r.status_code == 429:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.errors["stream_error"] += 1
                    return
                if event.get("usage"):
                    completion_tokens = event["usage"]["completion_tokens"]
                    prompt_tokens = event["usage"]["prompt_tokens"]
                for choice in event.get("choices", []):
                    if choice.get("text") or choice.get("delta", {}).get("content"):
                        last = time.monotonic()
                        first = first or last
                        chunks += 1
                if hang_up_after is not None and chunks >= hang_up_after:
                    out.disconnected += 1
                    out.tokens += chunks  # at least one token a chunk (the usage chunk never comes)
                    return  # leaving the block closes the connection mid-stream
    except httpx.TimeoutException:
        out.errors["timeout"] += 1
        return
    except httpx.TransportError as e:
        out.errors[f"transport_{type(e).__name__}"] += 1
        return
    if first is None or last is None:
        out.errors["no_content"] += 1
        return
    out.finished += 1
    out.served.add(who)
    out.tokens += completion_tokens
    out.prompt_tokens += prompt_tokens
    out.ttft.append(first - sent)
    out.e2e.append(last - sent)
    if completion_tokens > 1:
        out.tpot.append((last - first) / (completion_tokens - 1))


async def run_clients(url: str, model: str, args: argparse.Namespace, clients: range) -> Results:
    """Drive the server with these clients until --duration, then give open requests --grace seconds. Each client
    has its own connection: one pool shared by all of them costs the load generator more per chunk than the
    server spends (httpcore scans its pool on every request), so it, not the server, would set the pace."""
    out = Results()
    deadline = time.monotonic() + args.duration
    timeout = httpx.Timeout(args.duration + args.grace, connect=10)

    async def worker(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
            while time.monotonic() < deadline:
                await one_request(client, model, args, rng, out, i)

    tasks = [asyncio.create_task(worker(i)) for i in clients]
    _, pending = await asyncio.wait(tasks, timeout=args.duration + args.grace)
    for t in pending:  # past the grace period: abandon (the server cancels them as the connections close)
        t.cancel()
        out.errors["abandoned"] += 1
    await asyncio.gather(*pending, return_exceptions=True)
    return out


def client_process(url: str, model: str, args: argparse.Namespace, clients: range, start: Any, done: Any) -> None:
    """One load-generating process: wait for the common start, run its share of the clients, send the results."""
    start.wait()
    done.put(asyncio.run(run_clients(url, model, args, clients)))


def client_processes(args: argparse.Namespace) -> int:
    """--processes, or by default one per 16 clients and at most one per CPU."""
    return min(args.processes or max(1, min(os.cpu_count() or 1, args.clients // 16)), args.clients)


def drive(url: str, model: str, args: argparse.Namespace) -> tuple[Results, float]:
    """All clients, spread over client processes (one Python process parses only so many chunks a second),
    started together; the merged results and the wall time from the start to the last client's end."""
    processes = client_processes(args)
    if processes == 1:
        started = time.monotonic()
        res = asyncio.run(run_clients(url, model, args, range(args.clients)))
        return res, time.monotonic() - started
    ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold an engine's threads
    start, done = ctx.Barrier(processes + 1), ctx.Queue()
    shares = [range(args.clients * k // processes, args.clients * (k + 1) // processes) for k in range(processes)]
    workers = [ctx.Process(target=client_process, args=(url, model, args, share, start, done), daemon=True) for share in shares]
    for w in workers:
        w.start()
    start.wait(timeout=120)  # every process has imported and waits: the clock starts with all clients at once
    started = time.monotonic()
    merged = Results()
    for res in collect(workers, done, args.duration + args.grace + 60):
        merged.merge(res)
    elapsed = time.monotonic() - started
    for w in workers:
        w.join()
    return merged, elapsed


def collect(workers: list[Any], done: Any, limit: float) -> list[Results]:
    """Each client process's results; exits with a message if one of them died or they overran `limit` seconds."""
    results: list[Results] = []
    deadline = time.monotonic() + limit
    while len(results) < len(workers):
        try:
            results.append(done.get(timeout=0.5))
        except queue.Empty:
            if any(w.exitcode not in (None, 0) for w in workers):
                sys.exit("a client process failed (its traceback is above)")
            if time.monotonic() > deadline:
                sys.exit(f"the client processes did not finish within {limit:.0f} s")
    return results


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            values[name] = float(value)
    return values


def settle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """The server's counts once nothing runs (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        idle = m.get("stepllm_requests_running", 0) == m.get("stepllm_requests_waiting", 0) == m.get("stepllm_kv_blocks_used", 0) == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def report(args: argparse.Namespace, model: str, res: Results, elapsed: float, after: dict[str, float], inflight: int | None) -> str:
    ms = 1000.0
    rows: list[tuple[str, str]] = [
        ("model", model),
        ("clients / duration / max_tokens", f"{args.clients} / {args.duration:.0f} s / {args.max_tokens}"),
        ("disconnect share (asked)", f"{args.disconnect_share:.0%}"),
        ("wall time", f"{elapsed:.1f} s"),
        ("clients / processes", f"{args.clients} / {client_processes(args)}"),
        ("clients that finished a request", str(len(res.served))),
        ("requests finished", str(res.finished)),
        ("prompt tokens per finished request", f"{res.prompt_tokens / max(res.finished, 1):.1f}"),
        ("requests disconnected by clients", str(res.disconnected)),
        ("throughput (finished req/s)", f"{res.finished / elapsed:.2f}"),
        ("output tokens/s", f"{res.tokens / elapsed:.1f}"),
    ]
    for name, values, unit in (("TTFT", res.ttft, ms), ("TPOT", res.tpot, ms), ("E2E", res.e2e, 1.0)):
        label = "ms" if unit == ms else "s"
        rows.append((f"{name} p50 / p90 / p99 ({label})", " / ".join(f"{pct(values, q) * unit:.1f}" if unit == ms else f"{pct(values, q):.2f}" for q in (50, 90, 99))))
    errors = ", ".join(f"{k}={v}" for k, v in sorted(res.errors.items())) or "none"
    rows.append(("errors by kind", errors))
    rows.append(("after: running / waiting", f"{after.get('stepllm_requests_running', 0):.0f} / {after.get('stepllm_requests_waiting', 0):.0f}"))
    rows.append(("after: live slots / capacity", f"{after.get('stepllm_slots_live', 0):.0f} / {after.get('stepllm_slots_capacity', 0):.0f}"))
    rows.append(
        (
            "after: KV blocks used / cached / free / total",
            " / ".join(f"{after.get(f'stepllm_kv_blocks_{k}', 0):.0f}" for k in ("used", "cached", "free", "total")),
        )
    )
    rows.append(("after: prefix-cache hit rate", f"{after.get('stepllm_prefix_cache_hit_rate', 0):.1%}"))
    if inflight is not None:
        rows.append(("after: server requests in flight", str(inflight)))
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric':<{width}} | value", f"|{'-' * (width + 2)}|{'-' * 30}"]
    lines += [f"| {k:<{width}} | {v}" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--url", default=None, help="drive this running server (loopback) instead of starting one")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=30.0, help="seconds during which new requests start")
    p.add_argument("--grace", type=float, default=60.0, help="seconds open requests get after --duration")
    p.add_argument("--disconnect-share", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--max-waiting", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input-len", type=int, default=0, help="prompts of this many random token ids through "
                   "/v1/completions (default 0: short chat prompts)")
    p.add_argument("--max-id", type=int, default=1000, help="random prompt ids are below this (keep it under the vocabulary)")
    p.add_argument("--processes", type=int, default=0, help="client processes (default: one per 16 clients, at most one per CPU)")
    args = p.parse_args(argv)
    if args.clients < 1 or args.duration <= 0 or not 0 <= args.disconnect_share <= 1 or args.processes < 0:
        p.error("need --clients >= 1, --duration > 0, --disconnect-share in [0, 1] and --processes >= 0")
    if args.input_len < 0 or (args.input_len and args.max_id <= FIRST_RANDOM_ID):
        p.error(f"need --input-len >= 0 and, with it, --max-id > {FIRST_RANDOM_ID}")

    if args.url:
        url = loopback_only(args.url)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        res, elapsed = drive(url, model, args)
        print(report(args, model, res, elapsed, settle(url), None))
        return 0

    import stepllm
    from stepllm.server import BackgroundServer

    engine = stepllm.Engine(
        model=stepllm.resolve_model(args.model), device=args.device, max_batch_size=args.max_batch_size, kv_cache_tokens=args.kv_cache_tokens
    )
    try:
        with BackgroundServer(engine, max_waiting=args.max_waiting) as server:
            model = server.app.state.stepllm.model_name
            print(f"serving {model} on {server.url} ({engine.info()['device']}); {args.clients} clients for {args.duration:.0f} s", file=sys.stderr)
            res, elapsed = drive(server.url, model, args)
            after = settle(server.url)
            print(report(args, model, res, elapsed, after, server.app.state.stepllm.inflight))
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
