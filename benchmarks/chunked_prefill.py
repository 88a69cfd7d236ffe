"""What chunked prefill is for: running streams keep their pace when a long prompt arrives. An Engine decodes
--streams requests (prompt 128, greedy, EOS ignored); once each has streamed --warm tokens, one request with a
--long-prompt-token prompt is submitted. For each Config(max_prefill_tokens=B) in --budgets the table gives the
running streams' inter-token gaps (median and the largest, over the chunks that arrived while the long prompt was
being prefilled and the same number of chunks after), the long request's time to first token, and the wall time.
The budget at or above the long prompt computes it in one step (no chunking): the baseline in the same run.

    python benchmarks/chunked_prefill.py [--model DIR] [--models /tmp/gpu_models --shape qwen3] [--device cuda]
        [--streams 8] [--long-prompt 3800] [--budgets 256 1024 8192] [--new 300] [--warm 40]

Without --model, a random-weight checkpoint of --shape (benchmarks/gpu_models.py) is made under --models.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import stepllm


def stream_gaps(stream: stepllm.RequestStream, times: list[float]) -> None:
    for _ in stream:
        times.append(time.perf_counter())


def run(model: str, device: str, budget: int, streams: int, long_prompt: int, new: int, warm: int, vocab: int) -> dict:
    cfg = stepllm.Config(model=model, device=device, max_batch_size=streams + 1, max_prefill_tokens=budget,
                         kv_cache_tokens=(streams + 1) * (long_prompt + new + 64))
    greedy = stepllm.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    with stepllm.Engine(cfg) as engine:
        prompts = [[(31 * i + 7 * k) % (vocab - 2) + 2 for i in range(128)] for k in range(streams)]
        # Warm-up: a long prompt beside running requests first, so that the timed run pays no first-use costs
        # (activation buffers grown to the chunk's size, kernels loaded, cuBLAS's choices).
        warm_long = [(17 * i + 3) % (vocab - 2) + 2 for i in range(long_prompt)]
        warming = engine.submit(stepllm.GenerationRequest(prompts[0], stepllm.SamplingParams(max_tokens=16, temperature=0.0)))
        engine.submit(stepllm.GenerationRequest(warm_long, stepllm.SamplingParams(max_tokens=2, temperature=0.0))).wait()
        warming.wait()
        started = time.perf_counter()
        times: list[list[float]] = [[] for _ in range(streams)]
        threads = []
        for k in range(streams):
            s = engine.submit(stepllm.GenerationRequest(prompts[k], greedy))
            t = threading.Thread(target=stream_gaps, args=(s, times[k]))
            t.start()
            threads.append(t)
        while min(len(t) for t in times) < warm:
            time.sleep(0.001)
        long_ids = [(13 * i + 5) % (vocab - 2) + 2 for i in range(long_prompt)]
        submitted = time.perf_counter()
        long_stream = engine.submit(stepllm.GenerationRequest(long_ids, stepllm.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
        first = None
        for _ in long_stream:
            first = first or time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
    # The gaps of each running stream from the long request's submission to as many chunks again after its first
    # token: the window in which a one-step prefill stalls them.
    window = []
    for ts in times:
        after = [i for i, x in enumerate(ts) if x >= submitted]
        during = [i for i in after if ts[i] <= first]
        stop = min(len(ts), (during[-1] if during else after[0]) + len(during) + 2)
        window += [ts[i] - ts[i - 1] for i in range(max(after[0], 1), stop)]
    return {"budget": budget, "gap_p50_ms": 1e3 * statistics.median(window), "gap_max_ms": 1e3 * max(window),
            "ttft_ms": 1e3 * (first - submitted), "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--models", default="/tmp/gpu_models")
    ap.add_argument("--shape", default="qwen3")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long-prompt", type=int, default=3800)
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 1024, 8192])
    ap.add_argument("--new", type=int, default=300)
    ap.add_argument("--warm", type=int, default=40)
    args = ap.parse_args()
    if args.model is None:
        import gpu_models

        args.model = str(gpu_models.make(args.shape, Path(args.models)))
    import json

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"] if Path(args.model).is_dir() else 49152
    print(f"{args.streams} running streams, a {args.long_prompt}-token prompt joins; {args.model} on {args.device}")
    print("| max_prefill_tokens | running streams' gap p50 ms | largest gap ms | long prompt's TTFT ms | wall s |")
    print("|---|---|---|---|---|")
    for budget in args.budgets:
        r = run(args.model, args.device, budget, args.streams, args.long_prompt, args.new, args.warm, vocab)
        whole = " (whole prompt in one step)" if budget >= args.long_prompt else ""
        print(f"| {budget}{whole} | {r['gap_p50_ms']:.2f} | {r['gap_max_ms']:.2f} | {r['ttft_ms']:.1f} | {r['wall_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
