"""Tensor parallelism on CUDA against one GPU (issue #6): batch-1 latency and batch-N throughput of the same
random-weight checkpoint with tensor_parallel_size 1 and N, in one run.

    python3 benchmarks/gpu_parallel.py --models DIR [--shape llama1b] [--tp 2] [--devices 0 1] [--batches 1 64]

Without --devices the ranks take consecutive GPUs (cuda:0, cuda:1, ...) and all-reduce through NCCL;
`--devices 0 0` runs both ranks on one GPU, all-reducing through host memory (a correctness setup, not a fast
one). Prompts are 128 random tokens and each request decodes --new tokens greedily (EOS ignored); tensor
parallelism runs eagerly (no decode CUDA graphs), the single GPU with its graphs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import stepllm

import gpu_decode
import gpu_models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="/tmp/gpu_models")
    ap.add_argument("--shape", default="llama1b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--devices", nargs="*", type=int, default=[])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 64])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    path = gpu_models.make(args.shape, Path(args.models))
    runs = [("tp=1", None), (f"tp={args.tp}", stepllm.ParallelConfig(tensor_parallel_size=args.tp, devices=args.devices or None))]
    print("| run | device | batch | ms/step | tok/s | load s |")
    print("|---|---|---|---|---|---|")
    for name, parallel in runs:
        r = gpu_decode.stepllm_run(path, args.batches, args.prompt, args.new, parallel=parallel)
        for b in args.batches:
            print(f"| {name} | {r['device']} | {b} | {r[b]['ms_step']:.3f} | {r[b]['tok_s']:,.0f} | {r['load_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
