"""GPU time per kernel of stepped decode ticks, as CUPTI sees it (through torch.profiler).

CUPTI records every kernel of the process, so it sees stepllm's driver-API launches and the kernels inside its
CUDA graph replays. One stepped session: `batch` requests with `context`-token prompts are admitted and
prefilled, a few decode ticks warm up, then `--ticks` decode ticks are profiled; the table gives each kernel's
launches and GPU time per tick.

    python3 benchmarks/gpu_profile.py --models /tmp/gm --shape qwen3 --batch 256 --context 256
    STEPLLM_NO_PDL=1 python3 benchmarks/gpu_profile.py --shape qwen3 --batch 1 --context 128

With programmatic dependent launch (the default on Hopper) a kernel's time includes the part it spent waiting
for its predecessor, so per-kernel figures overlap; set STEPLLM_NO_PDL=1 for a breakdown that adds up.
"""

from __future__ import annotations

import argparse
import os
import random
from pathlib import Path

import gpu_models
import stepllm
from gpu_decode import seat_residents


def profile_ticks(path: Path, batch: int, context: int, ticks: int, graphs: bool) -> tuple[dict[str, list[float]], float]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg = stepllm.Config(model=str(path), device="cuda", max_batch_size=batch, block_size=16,
                         kv_cache_tokens=batch * (context + ticks + 32))
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
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name[:60], []).append(event.device_time)
    total = sum(sum(v) for v in kernels.values()) / ticks
    return kernels, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="/tmp/gpu_models")
    ap.add_argument("--shape", default="qwen3", choices=sorted(gpu_models.SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of every request")
    ap.add_argument("--ticks", type=int, default=20)
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly instead of replaying CUDA graphs")
    ap.add_argument("--top", type=int, default=14, help="kernels to list")
    args = ap.parse_args()
    path = gpu_models.make(args.shape, Path(args.models))
    kernels, total = profile_ticks(path, args.batch, args.context, args.ticks, not args.no_graphs)
    pdl = "off" if os.environ.get("STEPLLM_NO_PDL") else "on (per-kernel times overlap)"
    print(f"{args.shape}, batch {args.batch}, context ~{args.context + 8}, PDL {pdl}: "
          f"GPU time per decode tick {total:.1f} us\n")
    print("| kernel | launches per tick | us each | us per tick |")
    print("|---|---|---|---|")
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[: args.top]
    for name, times in ranked:
        per_tick = sum(times) / args.ticks
        print(f"| {name} | {len(times) / args.ticks:.1f} | {sum(times) / len(times):.2f} | {per_tick:.1f} |")


if __name__ == "__main__":
    main()
