"""The `stepllm` command: generate, chat, run (TensorRT Edge-LLM JSON), bench, info.

Generated text goes to stdout and nothing else does; progress, stats and errors go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from . import _core
from .engine import Engine
from .models import resolve_model

EXIT_USAGE = 2
EXIT_FAILURE = 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (_core.StepllmError, OSError, ValueError) as e:
        print(f"stepllm: error: {e}", file=sys.stderr)
        return EXIT_FAILURE


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stepllm", description="Stepped LLM inference: generate, chat, serve, benchmark.")
    p.add_argument("--version", action="version", version=f"stepllm {_core.__version__}")
    sub = p.add_subparsers(metavar="COMMAND")

    g = sub.add_parser("generate", help="generate a continuation of PROMPT; only the text goes to stdout")
    g.add_argument("prompt")
    add_model_args(g)
    add_sampling_args(g)
    g.add_argument("--chat", action="store_true", help="send PROMPT as one user message through the chat template")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="an interactive conversation (/reset clears history, Ctrl-D quits)")
    add_model_args(c)
    add_sampling_args(c, max_tokens=512, temperature=0.7)
    c.add_argument("--system", default=None, help="system message placed before the conversation")
    c.set_defaults(func=cmd_chat)

    r = sub.add_parser("run", help="run a TensorRT Edge-LLM llm_inference input file")
    r.add_argument("--input-file", required=True, type=Path)
    r.add_argument("--output-file", required=True, type=Path)
    add_model_args(r)
    r.set_defaults(func=cmd_run)

    b = sub.add_parser("bench", help="prompt and decode throughput, time to first token, batch 1..N")
    add_model_args(b)
    b.add_argument("--prompt-tokens", type=int, default=128)
    b.add_argument("--new-tokens", type=int, default=64)
    b.add_argument("--batch-sizes", default="1,2,4,8", help="comma-separated batch sizes")
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("info", help="model, architecture, parameters, weight memory, device, dtype, KV budget")
    add_model_args(i)
    i.set_defaults(func=cmd_info)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None)
    s.add_argument("--max-waiting", type=int, default=256)
    s.set_defaults(func=cmd_serve)
    return p


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="most sequences live at once (default: the device's, 8 on the CPU and 256 on a GPU)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache budget in tokens (default: 16384 on the CPU; on a GPU, what "
                        "--gpu-memory-utilization of its memory leaves after the weights)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="share of the GPU's memory to fill when it sizes the KV cache itself (default 0.9)")
    p.add_argument("--max-prefill-tokens", type=int, default=None,
                   help="most prompt tokens one step computes: prompts are prefilled together up to it, a longer "
                        "one in chunks of it (default: Config's, 8192)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["f32", "bf16", "int8", "a8"],
        help="how weights are kept: f32 (exact), bf16 or int8 (faster on the CPU, approximate), a8 (integer "
        "levels times 8-bit activations, llama.cpp's arithmetic: the fastest CPU format, approximate); "
        "default: the device's (f32 on the CPU, bf16 on CUDA)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="rank threads, each stepping its own shard of the model (tensor parallelism: CPU, or a GPU per rank)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="how the KV cache stores K and V: auto (bf16 on CUDA, f32 on the CPU) or fp8 (e4m3, CUDA only: "
        "half the memory and decode-step reads, approximate)",
    )


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 256, temperature: float = 0.0) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def sampling_from(args: argparse.Namespace) -> _core.SamplingParams:
    return _core.SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )


def open_engine(args: argparse.Namespace, max_batch_size: int | None = None) -> Engine:
    """`max_batch_size`: the fewest slots the command needs; --max-batch-size may ask for more."""
    model = resolve_model(args.model)
    config = _core.Config(
        model=model,
        device=args.device,
        max_batch_size=max((n for n in (max_batch_size, args.max_batch_size) if n is not None), default=None),
        kv_cache_tokens=args.kv_cache_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        max_prefill_tokens=args.max_prefill_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        parallel=_core.ParallelConfig(tensor_parallel_size=args.tensor_parallel_size),
    )
    started = time.perf_counter()
    engine = Engine(config, progress=ProgressBar(f"loading {Path(model).name}"))
    print(f"loaded {Path(model).name} in {time.perf_counter() - started:.2f} s", file=sys.stderr)
    return engine


class ProgressBar:
    """A progress bar on stderr, fed (done, total) by the model loader."""

    def __init__(self, label: str, width: int = 30) -> None:
        self.label, self.width, self.last = label, width, -1
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if pct == self.last or (not self.tty and done not in (0, total)):
            return
        self.last = pct
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        if self.tty:  # redraw one line in place
            print(f"\r{self.label} [{bar}] {pct:3d}%", end="\n" if done >= total else "", file=sys.stderr, flush=True)
        else:  # logs get whole lines
            print(f"{self.label} [{bar}] {pct:3d}%", file=sys.stderr, flush=True)


def stream_to_stdout(engine: Engine, request: _core.GenerationRequest) -> tuple[_core.GenerationResponse, float, float]:
    """Print text as it arrives; returns the response, time to first token and total seconds."""
    started = time.perf_counter()
    first = None
    stream = engine.submit(request)
    for chunk in stream:
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    response = stream.response
    assert response is not None
    return response, first or 0.0, time.perf_counter() - started


def print_stats(response: _core.GenerationResponse, ttft: float, total: float) -> None:
    n = len(response.output_ids)
    decode_rate = (n - 1) / (total - ttft) if n > 1 and total > ttft else 0.0
    print(
        f"[{len(response.prompt_ids)} prompt tokens, {n} generated, finish {str(response.finish_reason).split('.')[-1].lower()}, "
        f"TTFT {ttft * 1000:.0f} ms, {decode_rate:.1f} tok/s]",
        file=sys.stderr,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = sampling_from(args)  # bad values fail before the model loads
    with open_engine(args, max_batch_size=1) as engine:
        prompt: Any = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        response, ttft, total = stream_to_stdout(engine, _core.GenerationRequest(prompt=prompt, sampling=sampling))
        sys.stdout.write("\n")
        print_stats(response, ttft, total)
        return EXIT_FAILURE if response.error else 0


def cmd_chat(args: argparse.Namespace) -> int:
    sampling = sampling_from(args)  # bad values fail before the model loads
    with open_engine(args, max_batch_size=1) as engine:
        history = fresh_history(args.system)
        print("chat: type a message; /reset clears the conversation; Ctrl-D quits", file=sys.stderr)
        while True:
            try:
                line = input("> " if sys.stdin.isatty() else "")
            except EOFError:
                print(file=sys.stderr)
                return 0
            if not line.strip():
                continue
            if line.strip() == "/reset":
                history = fresh_history(args.system)
                print("(conversation cleared)", file=sys.stderr)
                continue
            request = _core.GenerationRequest(prompt=[*history, {"role": "user", "content": line}], sampling=sampling)
            try:
                response, ttft, total = stream_to_stdout(engine, request)
            except _core.InvalidRequestError as e:  # e.g. the conversation outgrew the context: keep the session
                print(f"stepllm: {e} (the message was not added; /reset starts over)", file=sys.stderr)
                continue
            history.append({"role": "user", "content": line})
            sys.stdout.write("\n")
            print_stats(response, ttft, total)
            history.append({"role": "assistant", "content": response.output_text})


def fresh_history(system: str | None) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}] if system else []


def cmd_run(args: argparse.Namespace) -> int:
    from .edge_llm import load_input, run_edge_llm_input

    spec = load_input(args.input_file)  # validates before the model loads
    with open_engine(args, max_batch_size=max(spec.batch_size, 1)) as engine:
        output = run_edge_llm_input(engine, spec)
    args.output_file.write_text(json.dumps(output, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {len(output['responses'])} responses to {args.output_file}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError("--batch-sizes must list positive integers, e.g. 1,2,4,8")
    with open_engine(args, max_batch_size=max(sizes)) as engine:
        table = run_bench(engine, sizes, args.prompt_tokens, args.new_tokens)
    print(table)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    with open_engine(args) as engine:
        info = engine.info()
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .server import serve
    except ImportError as e:
        print(f"stepllm serve needs the server packages ({e.name or e}); pip install 'stepllm[serve]'", file=sys.stderr)
        return EXIT_FAILURE
    if args.max_waiting < 0:
        raise ValueError("--max-waiting must be >= 0")
    with open_engine(args) as engine:
        print(f"serving {Path(engine.info()['source']).name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
        serve(engine, args.host, args.port, api_key=args.api_key, max_waiting=args.max_waiting)
    return 0


if __name__ == "__main__":
    sys.exit(main())
