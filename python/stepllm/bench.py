"""`stepllm bench`: prompt and decode throughput and time to first token at several batch sizes."""

from __future__ import annotations

import time

from . import _core
from .engine import Engine


def run_bench(engine: Engine, batch_sizes: list[int], prompt_tokens: int, new_tokens: int) -> str:
    vocab = int(engine.info()["vocab_size"])
    rows = []
    warm = _requests(1, 8, 2, vocab, salt=-1)
    _run(engine, warm)
    for b in batch_sizes:
        rows.append((b, *_run(engine, _requests(b, prompt_tokens, new_tokens, vocab, salt=b))))
    header = f"{'batch':>5}  {'prompt tok/s':>12}  {'TTFT ms':>8}  {'decode tok/s':>12}  {'total s':>8}"
    lines = [f"prompt {prompt_tokens} tokens, {new_tokens} new tokens per request (greedy, EOS ignored)", header]
    for b, prompt_rate, ttft, decode_rate, total in rows:
        lines.append(f"{b:>5}  {prompt_rate:>12.1f}  {ttft * 1000:>8.1f}  {decode_rate:>12.1f}  {total:>8.2f}")
    return "\n".join(lines)


def _requests(n: int, prompt_tokens: int, new_tokens: int, vocab: int, salt: int) -> list[_core.GenerationRequest]:
    sampling = _core.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    # distinct token prompts so the context cache cannot serve one request from another
    return [
        _core.GenerationRequest(
            prompt=[(97 + 31 * i + 7 * j + 1009 * salt) % (vocab - 256) + 256 for j in range(prompt_tokens)],
            sampling=sampling,
        )
        for i in range(n)
    ]


def _run(engine: Engine, requests: list[_core.GenerationRequest]) -> tuple[float, float, float, float]:
    """Returns prompt tok/s (all prompts until every first token), mean TTFT, decode tok/s after, total s."""
    started = time.perf_counter()
    streams = [engine.submit(r) for r in requests]
    firsts: list[float] = []
    for s in streams:
        for chunk in s:
            if chunk.token_ids and len(firsts) < len(streams):
                firsts.append(time.perf_counter() - started)
                break
    for s in streams:
        for _ in s:
            pass
    total = time.perf_counter() - started
    prompt = sum(len(s.response.prompt_ids) for s in streams)  # type: ignore[union-attr]
    generated = sum(len(s.response.output_ids) for s in streams)  # type: ignore[union-attr]
    prefill_done = max(firsts) if firsts else total
    decode_time = max(total - prefill_done, 1e-9)
    return prompt / prefill_done, sum(firsts) / max(len(firsts), 1), (generated - len(streams)) / decode_time, total
