"""GPU decode benchmark: stepllm's CUDA backend against transformers (bf16, same GPU, same run).

    python3 benchmarks/gpu_decode.py --models DIR [--shapes smollm2 qwen3] [--batches 1 8 64 256]

Prints ms/step at batch 1, output tok/s per batch size (prompt 128, 256 new tokens), cold start (load +
graph capture) and device memory. Checkpoints are random weights of real shapes (gpu_models.py).
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import gpu_models
import stepllm


def stepllm_run(path: Path, batches: list[int], prompt_len: int, new: int) -> dict:
    import torch

    t0 = time.perf_counter()
    cfg = stepllm.Config(model=str(path), device="cuda", max_batch_size=max(batches), kv_cache_tokens=max(batches) * (prompt_len + new + 16))
    coord = stepllm.RuntimeCoordinator(cfg)
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    graphs = coord.capture_decoding_cuda_graph()
    t_capture = time.perf_counter() - t1
    free, total = torch.cuda.mem_get_info()
    res = {"load_s": t_load, "capture_s": t_capture, "graphs": graphs, "mem_gib": (total - free) / 2**30}
    rng = random.Random(0)
    vocab = coord.info()["vocab_size"]
    for b in batches:
        reqs = [
            stepllm.GenerationRequest([rng.randrange(2, vocab) for _ in range(prompt_len)],
                                      stepllm.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
            for _ in range(b)
        ]
        coord.dispatch_request(reqs[:1])  # warm-up
        t = time.perf_counter()
        out = coord.dispatch_request(reqs)
        dt = time.perf_counter() - t
        n = sum(len(o.output_ids) for o in out)
        res[b] = {"tok_s": n / dt, "ms_step": dt / new * 1e3}
    return res


def hf_run(path: Path, batches: list[int], prompt_len: int, new: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    res = {}
    for b in batches:
        ids = torch.randint(2, vocab, (b, prompt_len), device="cuda")
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=4, do_sample=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        res[b] = {"tok_s": b * new / dt, "ms_step": dt / new * 1e3}
    del model
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="/tmp/gpu_models")
    ap.add_argument("--shapes", nargs="*", default=["smollm2", "qwen3", "llama1b"])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--hf-batches", nargs="*", type=int, default=[1, 64])
    ap.add_argument("--gemv-sweep", nargs="*", type=int, default=[])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        path = gpu_models.make(shape, Path(args.models))
        ours = stepllm_run(path, args.batches, args.prompt, args.new)
        peer = hf_run(path, args.hf_batches, args.prompt, args.new)
        print(f"{shape}: load {ours['load_s']:.2f} s, graph capture {ours['capture_s']:.2f} s (graphs={ours['graphs']}), "
              f"device memory {ours['mem_gib']:.1f} GiB", flush=True)
        for b in args.batches:
            hf = peer.get(b)
            rows.append((shape, b, ours[b]["ms_step"], ours[b]["tok_s"], hf["ms_step"] if hf else None, hf["tok_s"] if hf else None))
            print(rows[-1], flush=True)
    # GEMV-vs-cuBLAS crossover at small batches (STEPLLM_GEMV_MAX_ROWS: 0 = cuBLAS only).
    import os

    for rows_limit in args.gemv_sweep:
        os.environ["STEPLLM_GEMV_MAX_ROWS"] = str(rows_limit)
        r = stepllm_run(gpu_models.make(args.shapes[0], Path(args.models)), [1, 2, 4, 8], args.prompt, 64)
        print(f"gemv<= {rows_limit}: " + ", ".join(f"b{b} {r[b]['ms_step']:.3f} ms" for b in [1, 2, 4, 8]), flush=True)
    print("\n| shape | batch | stepllm ms/step | stepllm tok/s | transformers ms/step | transformers tok/s |")
    print("|---|---|---|---|---|---|")
    for s, b, ms, ts, hms, hts in rows:
        hf = f"{hms:.2f} | {hts:,.0f}" if hms else "- | -"
        print(f"| {s} | {b} | {ms:.3f} | {ts:,.0f} | {hf} |")


if __name__ == "__main__":
    main()
