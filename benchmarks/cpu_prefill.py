"""CPU prompt processing (prefill): stepllm vs llama.cpp on one GGUF, in one run.

    python benchmarks/cpu_prefill.py [--gguf FILE] [--prompt 512] [--dtypes f32,a8] [--llama-cpp-python /path/to/python]

Each side processes one prompt of --prompt random tokens and produces its first token: stepllm through
`LLM.generate(max_tokens=1)` with the whole prompt in one prefill step, once per weight dtype (f32: the GGUF's
blocks, exact; a8: the same blocks times 8-bit activations in integer dot products, as llama.cpp computes), llama.cpp through llama-cpp-python's `eval` with the whole prompt in one batch (its quantized dot products: Q8
activations). Best of 3, each with fresh tokens (no cache hits), all threads of the machine. Without
--llama-cpp-python only stepllm runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def prompt(n: int, shift: int, vocab: int = 49152) -> list[int]:
    """n token ids from 200 up, shifted by `shift` (< 4) so that each run misses the prefix cache."""
    return [(1000 + 11 * j) % min(40000, vocab - 204) + 200 + shift for j in range(n)]


def stepllm_seconds(model: str, n: int, dtype: str) -> float:
    import stepllm

    llm = stepllm.LLM(model=model, device="cpu", kv_cache_tokens=n + 64, max_prefill_tokens=n, dtype=dtype)
    vocab = llm.info()["vocab_size"]
    first = stepllm.SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt(16, 0, vocab)], first)  # warm-up
    best = float("inf")
    for r in range(3):
        start = time.perf_counter()
        llm.generate([prompt(n, r + 1, vocab)], first)
        best = min(best, time.perf_counter() - start)
    llm.close()
    return best


def llama_cpp_seconds(gguf: str, n: int) -> float:
    from llama_cpp import Llama

    model = Llama(model_path=gguf, n_ctx=n + 16, n_batch=n, n_ubatch=n, n_threads=os.cpu_count() or 1, verbose=False)
    vocab = model.n_vocab()
    model.eval(prompt(16, 0, vocab))  # warm-up
    best = float("inf")
    for r in range(3):
        model.reset()
        start = time.perf_counter()
        model.eval(prompt(n, r + 1, vocab))
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--dtypes", default="f32", help="stepllm weight dtypes to run, comma-separated (f32, a8, ...)")
    p.add_argument("--llama-cpp-python", default=None, help="an interpreter with llama-cpp-python")
    p.add_argument("--only-llama-cpp", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.only_llama_cpp:
        print(json.dumps({"seconds": llama_cpp_seconds(args.gguf, args.prompt)}))
        return
    import stepllm

    gguf = args.gguf or stepllm.default_model_path()
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    rows = [(f"stepllm {dtype}", stepllm_seconds(gguf, args.prompt, dtype)) for dtype in dtypes]
    if args.llama_cpp_python:
        cmd = [args.llama_cpp_python, __file__, "--only-llama-cpp", "--gguf", gguf, "--prompt", str(args.prompt)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        rows.append(("llama.cpp", json.loads(out)["seconds"]))
    print(f"# {os.path.basename(gguf)}, prompt {args.prompt} tokens, {os.cpu_count()} threads, best of 3")
    for name, seconds in rows:
        print(f"{name:>12}: {seconds * 1000:8.0f} ms  {args.prompt / seconds:8.0f} prompt tok/s")


if __name__ == "__main__":
    sys.exit(main())
