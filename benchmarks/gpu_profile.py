"""GPU time per kernel of stepped decode ticks, as CUPTI sees it (through torch.profiler).

CUPTI records every kernel of the process, so it sees stepllm's driver-API launches and the kernels inside its
CUDA graph replays. One stepped session: `batch` requests with `context`-token prompts are admitted and
prefilled, a few decode ticks warm up, then `--ticks` decode ticks are profiled; the table gives each kernel's
launches and GPU time per tick.

    python3 benchmarks/gpu_profile.py --models /tmp/gm --shape qwen3 --batch 256 --context 256
    STEPLLM_NO_PDL=1 python3 benchmarks/gpu_profile.py --shape qwen3 --batch 1 --context 128

--mixed profiles gpu_decode.py's mixed workload through the engine instead (256 requests, prompt and output
lengths uniform in [100, 1024]) and sums GPU time by kernel family, twice: the whole workload, and the same
requests with max_tokens 1 (their prefills and first tokens), so that the decode steps' share is the difference:

    STEPLLM_NO_PDL=1 python3 benchmarks/gpu_profile.py --models /tmp/gm --shape qwen3 --mixed --kv-cache-dtype fp8

With programmatic dependent launch (the default on Hopper) a kernel's time includes the part it spent waiting
for its predecessor, so per-kernel figures overlap; set STEPLLM_NO_PDL=1 for a breakdown that adds up.

--exposed keeps PDL on and charges each kernel only the time by which it moved the end of the work on: the time
from the later of its own start and its predecessor's end to its own end (time with no kernel running, between
graph replays, is listed as idle). The exposed times and the idle time add up to the wall time of the ticks
(with --mixed, of the GPU's timeline from its first kernel to its last):

    python3 benchmarks/gpu_profile.py --models /tmp/gm --shape qwen3 --batch 1 --context 128 --exposed
    python3 benchmarks/gpu_profile.py --models /tmp/gm --shape qwen3 --mixed --kv-cache-dtype fp8 --exposed
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import gpu_models
import stepllm
from gpu_decode import greedy_request, mixed_config, mixed_warmup, mixed_workload, seat_residents


def gpu_events(prof) -> list:
    """The GPU-side events (kernels, copies) a torch.profiler run recorded."""
    import torch

    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_times(prof) -> dict[str, list[float]]:
    """GPU time (µs) of every kernel launch a torch.profiler run recorded, by kernel name (first 60 characters)."""
    kernels: dict[str, list[float]] = {}
    for event in gpu_events(prof):
        kernels.setdefault(event.name[:60], []).append(event.device_time)
    return kernels


def exposed_times(prof, ticks: int = 1) -> dict[str, list[float]]:
    """exposed_spans of the GPU events a torch.profiler run recorded (names cut to 60 characters, as in
    kernel_times), with the idle time listed as the kernel IDLE, once per tick."""
    spans = [(e.time_range.start, e.time_range.end, e.name[:60]) for e in gpu_events(prof)]
    exposed, idle = exposed_spans(spans)
    exposed[IDLE] = [idle / ticks] * ticks
    return exposed


def exposed_spans(spans: list[tuple[float, float, str]]) -> tuple[dict[str, list[float]], float]:
    """Each (start, end, name) span's exposed time (µs, by name), and the idle time between spans: spans are taken
    in start order, and a span's exposed time runs from the later of its start and the latest end so far to its own
    end. The exposed times and the idle time add up to the first start to last end."""
    exposed: dict[str, list[float]] = {}
    spans = sorted(spans)
    idle, last_end = 0.0, spans[0][0] if spans else 0.0
    for start, end, name in spans:
        idle += max(0.0, start - last_end)
        exposed.setdefault(name, []).append(max(0.0, end - max(start, last_end)))
        last_end = max(last_end, end)
    return exposed, idle


def profile_ticks(path: Path, batch: int, context: int, ticks: int, graphs: bool, exposed: bool = False,
                  kv_cache_dtype: str = "auto") -> tuple[dict[str, list[float]], float]:
    """Per-kernel GPU times of `ticks` decode ticks and their total per tick; with `exposed`, exposed times
    (exposed_times) and the idle time per tick (listed as the kernel IDLE)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg = stepllm.Config(model=str(path), device="cuda", max_batch_size=batch, block_size=16,
                         kv_cache_tokens=batch * (context + ticks + 32), kv_cache_dtype=kv_cache_dtype)
    coord = stepllm.RuntimeCoordinator(cfg)
    if graphs:
        coord.capture_decoding_cuda_graph()
    rng = random.Random(1)
    sampling = stepllm.SamplingParams(max_tokens=ticks + 16, temperature=0.0, ignore_eos=True)

    def request() -> stepllm.GenerationRequest:
        return stepllm.GenerationRequest([rng.randrange(2, 1000) for _ in range(context)], sampling)

    stepped = coord.begin_stepped(request(), request_id=1, original_index=0)
    try:
        decode = seat_residents(stepped, request, batch)
        for _ in range(5):
            stepped.decode(decode)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(ticks):
                stepped.decode(decode)
            torch.cuda.synchronize()
    finally:
        stepped.abort()
    kernels = exposed_times(prof, ticks) if exposed else kernel_times(prof)
    total = sum(sum(v) for v in kernels.values()) / ticks
    return kernels, total


# The pseudo-kernel under which --exposed lists the time with no kernel running.
IDLE = "(idle: no kernel running)"

# Kernel families by a fragment of the kernel name, first match wins (our kernels' names are in kernels/*.cu;
# cuBLAS's vary by version, so every other name with "gemm", "nvjet", "xmma" or "cutlass" counts as cuBLAS).
FAMILIES = [
    ("idle (no kernel running)", (IDLE,)),
    ("prefill attention", ("prefill_attention",)),
    ("decode attention", ("paged_attention", "attention_")),
    ("GEMV (ours)", ("gemv",)),
    ("skinny GEMM (ours)", ("skinny_gemm",)),
    ("cuBLAS GEMM", ("gemm", "nvjet", "xmma", "cutlass", "splitk", "splitK")),
    ("RoPE + KV write", ("rope",)),
    ("RMSNorm", ("rms_norm",)),
    ("SiLU, bias, residual add", ("silu", "add_bias", "add_into")),
    ("sampling, argmax", ("sample", "argmax", "softmax", "top_")),
    ("embedding, row select", ("embed", "select_rows")),
]


def family(name: str) -> str:
    return next((f for f, keys in FAMILIES if any(k in name for k in keys)), "other")


def profile_mixed(path: Path, kv_cache_dtype: str, first_token_only: bool,
                  exposed: bool = False) -> tuple[dict[str, list[float]], float, int]:
    """GPU time per kernel over gpu_decode.py's mixed workload through the engine: (kernels, wall s, tokens); with
    `exposed`, exposed times (exposed_times) and the time with no kernel running as the kernel IDLE."""
    import json
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    work = mixed_workload(vocab)
    if first_token_only:
        work = [(p, 1) for p, _ in work]
    engine = stepllm.Engine(mixed_config(path, work, kv_cache_dtype=kv_cache_dtype))
    try:
        engine.submit(mixed_warmup()).wait()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            out = [s.wait() for s in [engine.submit(greedy_request(p, o)) for p, o in work]]
            wall = time.perf_counter() - t
            torch.cuda.synchronize()
    finally:
        engine.shutdown()
    return exposed_times(prof) if exposed else kernel_times(prof), wall, sum(len(r.output_ids) for r in out)


def print_mixed(models: Path, shape: str, kv_cache_dtype: str, top: int, exposed: bool = False) -> None:
    runs = {}
    for label, first_only in (("prefills and first tokens", True), ("whole workload", False)):
        kernels, wall, tokens = profile_mixed(gpu_models.make(shape, models), kv_cache_dtype, first_only, exposed)
        fams: dict[str, float] = {}
        for name, times in kernels.items():
            fams[family(name)] = fams.get(family(name), 0.0) + sum(times) / 1e6
        runs[label] = (fams, wall, tokens, kernels)
        what = "GPU timeline (exposed kernel time + idle)" if exposed else "GPU kernel time"
        print(f"{shape}, mixed workload ({label}), kv cache {kv_cache_dtype}: wall {wall:.3f} s, {tokens} tokens, "
              f"{what} {sum(fams.values()):.3f} s", flush=True)
    first, whole = runs["prefills and first tokens"], runs["whole workload"]
    print("\n| kernel family | prefills + first tokens, s | whole workload, s | decode steps (difference), s |")
    print("|---|---|---|---|")
    for fam in sorted(whole[0], key=lambda f: -whole[0][f]):
        a, b = first[0].get(fam, 0.0), whole[0][fam]
        print(f"| {fam} | {a:.3f} | {b:.3f} | {b - a:.3f} |")
    a, b = sum(first[0].values()), sum(whole[0].values())
    print(f"| {'all, idle included' if exposed else 'all kernels'} | {a:.3f} | {b:.3f} | {b - a:.3f} |")
    print(f"| wall | {first[1]:.3f} | {whole[1]:.3f} | {whole[1] - first[1]:.3f} |")
    print("\nTop kernels of the whole workload:\n\n| kernel | family | launches | us each | s |\n|---|---|---|---|---|")
    for name, times in sorted(whole[3].items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"| {name} | {family(name)} | {len(times)} | {sum(times) / len(times):.2f} | {sum(times) / 1e6:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="/tmp/gpu_models")
    ap.add_argument("--shape", default="qwen3", choices=sorted(gpu_models.SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of every request")
    ap.add_argument("--ticks", type=int, default=20)
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly instead of replaying CUDA graphs")
    ap.add_argument("--top", type=int, default=14, help="kernels to list")
    ap.add_argument("--mixed", action="store_true", help="profile the mixed workload through the engine instead")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--exposed", action="store_true",
                    help="charge each kernel only the time it adds past its predecessor's end (PDL stays on)")
    args = ap.parse_args()
    if args.mixed:
        print_mixed(Path(args.models), args.shape, args.kv_cache_dtype, args.top, args.exposed)
        return
    path = gpu_models.make(args.shape, Path(args.models))
    kernels, total = profile_ticks(path, args.batch, args.context, args.ticks, not args.no_graphs, args.exposed,
                                   args.kv_cache_dtype)
    if args.exposed:
        what = "PDL on, exposed times: wall time"
    else:
        what = f"PDL {'off' if os.environ.get('STEPLLM_NO_PDL') else 'on (per-kernel times overlap)'}: GPU time"
    print(f"{args.shape}, batch {args.batch}, context ~{args.context + 8}, kv cache {args.kv_cache_dtype}, "
          f"{what} per decode tick {total:.1f} us\n")
    print("| kernel | launches per tick | us each | us per tick |")
    print("|---|---|---|---|")
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[: args.top]
    for name, times in ranked:
        per_tick = sum(times) / args.ticks
        print(f"| {name} | {len(times) / args.ticks:.1f} | {sum(times) / len(times):.2f} | {per_tick:.1f} |")


if __name__ == "__main__":
    main()
