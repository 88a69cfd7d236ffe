"""What logprobs cost on the GPU: decode steps with and without `logprobs`, and prompt scoring (`prompt_logprobs`,
lm-eval's loglikelihood) against the same prompts without it.

Decode: --batch requests with --prompt-token prompts generate --new greedy tokens through one dispatch, once
without logprobs and once with `logprobs=--top`; ms per decode step is the wall time over --new. Prompt scoring:
--score-prompts prompts of --score-len tokens, max_tokens 1, with and without `prompt_logprobs=--top`. Each timing
is the median of three dispatches after a warm-up one.

    python3 benchmarks/gpu_logprobs.py --models /tmp/gm --shape qwen3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import gpu_models
import stepllm


def timed(coord: stepllm.RuntimeCoordinator, make: callable) -> float:
    """Median wall seconds of three dispatches of make()'s requests, after one warm-up."""
    coord.dispatch_request(make())
    times = []
    for _ in range(3):
        reqs = make()
        t = time.perf_counter()
        coord.dispatch_request(reqs)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="/tmp/gpu_models")
    ap.add_argument("--shape", default="qwen3", choices=sorted(gpu_models.SHAPES))
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--score-prompts", type=int, default=4)
    ap.add_argument("--score-len", type=int, default=1000)
    a = ap.parse_args()

    path = gpu_models.make(a.shape, Path(a.models))
    cfg = stepllm.Config(model=str(path), device="cuda", max_batch_size=a.batch, kv_cache_tokens=65536)
    coord = stepllm.RuntimeCoordinator(cfg)
    coord.capture_decoding_cuda_graph()
    rng = random.Random(0)

    def requests(n: int, length: int, **sampling) -> list[stepllm.GenerationRequest]:
        # Fresh prompts each time: no prefix-cache hits between the timed dispatches.
        return [stepllm.GenerationRequest([rng.randrange(2, 1000) for _ in range(length)],
                                          stepllm.SamplingParams(temperature=0.0, ignore_eos=True, **sampling))
                for _ in range(n)]

    plain = timed(coord, lambda: requests(a.batch, a.prompt, max_tokens=a.new))
    scored = timed(coord, lambda: requests(a.batch, a.prompt, max_tokens=a.new, logprobs=a.top))
    print(f"{a.shape} decode, batch {a.batch}, {a.new} new tokens: {plain / a.new * 1e3:.3f} ms a step without "
          f"logprobs, {scored / a.new * 1e3:.3f} ms with logprobs={a.top} (the prefill included in both)", flush=True)
    plain = timed(coord, lambda: requests(a.score_prompts, a.score_len, max_tokens=1))
    scored = timed(coord, lambda: requests(a.score_prompts, a.score_len, max_tokens=1, prompt_logprobs=a.top))
    print(f"{a.shape} prompt scoring, {a.score_prompts} prompts of {a.score_len} tokens: {plain * 1e3:.1f} ms without "
          f"prompt_logprobs, {scored * 1e3:.1f} ms with prompt_logprobs={a.top}", flush=True)


if __name__ == "__main__":
    main()
