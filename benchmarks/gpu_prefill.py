"""Time to first token of one prompt on the GPU, and where a long prefill's GPU time goes.

For each prompt length, one request with max_tokens 1 is dispatched five times (after one warm-up request); the
median and the fastest wall time are printed. Then one prefill of --profile-len tokens runs under torch.profiler
(CUPTI), and its kernels are listed by total GPU time. --hf adds the peer: transformers (bf16, sdpa attention) on
the same GPU, one forward of the same prompt lengths (median of the last three of four).

    python3 benchmarks/gpu_prefill.py --models /tmp/gm --shape qwen3 --lens 512 2048 3800 --hf
    python3 benchmarks/gpu_prefill.py --models /tmp/gm --shape qwen3 --kv-cache-dtype fp8

--cached-prefix N puts one prefix of N tokens, dispatched once first, before every prompt: a prefix-cache hit, so
only the --lens tokens after it are computed (each time fresh ones), against its cached K/V:

    python3 benchmarks/gpu_prefill.py --models /tmp/gm --shape qwen3 --cached-prefix 3000 --lens 100 --profile-len 100

The random-weight checkpoints of benchmarks/gpu_models.py allow prompts up to 4,095 tokens (max_model_len 4096),
prefix included.
--ncu runs only two prefills of --profile-len tokens, for Nsight Compute, e.g.
`ncu -k regex:prefill_attention --launch-skip 30 --launch-count 1 python3 benchmarks/gpu_prefill.py --ncu`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import gpu_models
import stepllm
from gpu_decode import greedy_request
from gpu_profile import kernel_times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="/tmp/gpu_models")
    ap.add_argument("--shape", default="qwen3", choices=sorted(gpu_models.SHAPES))
    ap.add_argument("--lens", type=int, nargs="*", default=[512, 2048, 3800])
    ap.add_argument("--profile-len", type=int, default=3800)
    ap.add_argument("--cached-prefix", type=int, default=0, help="tokens of a cached prefix before every prompt")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--top", type=int, default=12, help="kernels to list")
    ap.add_argument("--hf", action="store_true", help="also time transformers (bf16, sdpa) on the same prompts")
    ap.add_argument("--ncu", action="store_true", help="only two prefills of --profile-len tokens")
    a = ap.parse_args()

    path = gpu_models.make(a.shape, Path(a.models))
    cfg = stepllm.Config(model=str(path), device="cuda", max_batch_size=4, block_size=16, kv_cache_tokens=40000,
                         max_prefill_tokens=16384, kv_cache_dtype=a.kv_cache_dtype)
    coord = stepllm.RuntimeCoordinator(cfg)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(2, 1000) for _ in range(n)]

    prefix = prompt(a.cached_prefix)
    if prefix:
        coord.dispatch_request([greedy_request(prefix, 1)])  # computes and publishes the prefix's full blocks

    def ttft(n: int) -> float:
        request = greedy_request(prefix + prompt(n), 1)
        t = time.perf_counter()
        response = coord.dispatch_request([request])[0]
        elapsed = time.perf_counter() - t
        if response.cached_prompt_tokens < len(prefix) - cfg.block_size:
            raise RuntimeError(f"only {response.cached_prompt_tokens} of the {len(prefix)}-token prefix were cached")
        return elapsed

    if a.ncu:
        ttft(a.profile_len)
        ttft(a.profile_len)
        return
    ttft(a.lens[0] if a.lens else 512)  # warm-up
    for n in a.lens:
        ts = [ttft(n) for _ in range(5)]
        after = f" after a cached prefix of {len(prefix)}" if prefix else ""
        print(f"stepllm {a.shape} kv_cache_dtype={a.kv_cache_dtype} prompt {n}{after}: time to first token median "
              f"{statistics.median(ts) * 1e3:.2f} ms (fastest {min(ts) * 1e3:.2f})", flush=True)

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ttft(a.profile_len)
        torch.cuda.synchronize()
    kernels = kernel_times(prof)
    total = sum(sum(v) for v in kernels.values())
    print(f"prefill of {a.profile_len} tokens{' after the cached prefix' if prefix else ''}: kernels {total / 1e3:.2f} ms")
    for name, v in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:a.top]:
        print(f"  {sum(v) / 1e3:8.3f} ms  {len(v):4d} x {statistics.fmean(v):8.1f} us  {name}")

    if a.hf:
        # The whole prompt, prefix included: the peer keeps no prefix cache across requests.
        hf_forward_times(path, [prefix + prompt(n) for n in a.lens], a.shape)


def hf_forward_times(path: Path, prompts: list[list[int]], shape: str) -> None:
    """transformers' forward of each prompt (bf16, sdpa), the logits of the last position only where supported."""
    import torch
    import transformers

    # torch_dtype, as gpu_decode.py and the GPU tests load it: newer transformers warn but honour it, older ones
    # would silently ignore `dtype` and load f32.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16,
                                                              attn_implementation="sdpa").cuda().eval()
    last_only = "logits_to_keep" in model.forward.__code__.co_varnames
    for ids in prompts:
        x = torch.tensor([ids], device="cuda")
        ts = []
        with torch.no_grad():
            for _ in range(4):
                torch.cuda.synchronize()
                t = time.perf_counter()
                model(x, logits_to_keep=1) if last_only else model(x)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
        print(f"transformers sdpa {shape} prompt {len(ids)}: forward median {statistics.median(ts[1:]) * 1e3:.2f} ms",
              flush=True)


if __name__ == "__main__":
    main()
