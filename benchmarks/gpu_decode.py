"""GPU decode benchmark: stepllm's CUDA backend against transformers (bf16, same GPU, same run).

    python3 benchmarks/gpu_decode.py --models DIR [--shapes smollm2 qwen3] [--batches 1 8 64 256]
                                     [--host-ticks] [--mixed]

Prints ms/step at batch 1, output tok/s per batch size (prompt 128, 256 new tokens), cold start (load +
graph capture) and device memory. Checkpoints are random weights of real shapes (gpu_models.py). The load time
includes whatever the driver JIT-compiles (nothing on Hopper, whose sm_90 machine code is in the wheel; the PTX of
other GPUs on a machine's first run): prefix `CUDA_CACHE_PATH=$(mktemp -d)` to time a first run.

--host-ticks  drives decode ticks through the stepped API (RuntimeCoordinator.begin_stepped, admit + prefill
              of B requests with --prompt tokens each, CUDA graphs captured) at --host-batches (1 8 64) and
              reports per decode tick the runtime's own StepExecution timing: elapsed_us, device_wait_us and
              host = elapsed - device_wait (mean, median, p90, p99, max), the ticks whose metadata stayed on
              the device, plus the Python-side wall time per tick of the decode loop. --host-ticks-dump FILE
              writes every timed tick's host µs in tick order (JSON), to see whether slow ticks come periodically.
--mixed       the mixed workload: --mixed-requests (256) requests whose prompt and output lengths are each
              uniform in [100, 1024] (random token ids, seed 0, greedy, EOS ignored so each runs to its
              max_tokens), all submitted at once, continuously batched with max_batch_size = the request count;
              reports output tok/s (generated tokens / wall time) and total time. --mixed-paths picks the
              path: "engine" (stepllm.Engine, what LLM.generate and the server use; it captures decode CUDA
              graphs when it starts) and/or "dispatch" (RuntimeCoordinator.dispatch_request after
              capture_decoding_cuda_graph; the same prefill-first FIFO scheduling). No transformers peer for it: `generate` cannot give each
              row of a batch its own max_new_tokens, so it would measure padded static batches instead.

--max-prefill-tokens N  Config.max_prefill_tokens for stepllm's runs: the most prompt tokens prefilled together
              in one step (default 8192); 1 prefills one request per step, as before batched prefill.
--kv-cache-dtype fp8  Config.kv_cache_dtype for stepllm's runs (default auto: bf16); the mixed workload's K/V-read
              floor then counts one byte per value.

Pass `--batches` and `--hf-batches` with no values to skip the default sweep and its transformers peer
(e.g. `--batches --hf-batches --host-ticks`).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import gpu_models
import stepllm


def stepllm_run(path: Path, batches: list[int], prompt_len: int, new: int, max_prefill_tokens: int | None = None,
                kv_cache_dtype: str = "auto", parallel: stepllm.ParallelConfig | None = None) -> dict:
    import torch

    t0 = time.perf_counter()
    cfg = stepllm.Config(model=str(path), device="cuda", max_batch_size=max(batches), kv_cache_tokens=max(batches) * (prompt_len + new + 16),
                         max_prefill_tokens=max_prefill_tokens, kv_cache_dtype=kv_cache_dtype, parallel=parallel)
    coord = stepllm.RuntimeCoordinator(cfg)
    t_load = time.perf_counter() - t0
    t1 = time.perf_counter()
    graphs = coord.capture_decoding_cuda_graph()
    t_capture = time.perf_counter() - t1
    free, total = torch.cuda.mem_get_info()
    res = {"load_s": t_load, "capture_s": t_capture, "graphs": graphs, "mem_gib": (total - free) / 2**30, "device": coord.info()["device"]}
    rng = random.Random(0)
    vocab = coord.info()["vocab_size"]
    for b in batches:
        reqs = [greedy_request([rng.randrange(2, vocab) for _ in range(prompt_len)], new) for _ in range(b)]
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


def host_ticks_run(path: Path, batches: list[int], prompt_len: int, ticks: int, warmup: int = 10,
                   device: str = "cuda", kv_cache_dtype: str = "auto") -> dict:
    """Per decode tick at each batch size: the runtime's StepExecution timing and the Python loop's wall time.

    One stepped session per batch size: the founder (begin_stepped + its first prefill tick), then b - 1
    admissions, each prefilled at once; then `warmup` decode ticks and `ticks` timed ones over all b residents.
    Every request has max_tokens past the last tick and ignores EOS, so the batch stays b for every tick.
    """
    new = warmup + ticks + 2
    block = 16
    per_request = -(-(prompt_len + new) // block) * block + block
    cfg = stepllm.Config(model=str(path), device=device, max_batch_size=max(batches), block_size=block,
                         kv_cache_tokens=max(batches) * per_request, kv_cache_dtype=kv_cache_dtype)
    coord = stepllm.RuntimeCoordinator(cfg)
    graphs = coord.capture_decoding_cuda_graph()
    vocab = coord.info()["vocab_size"]
    rng = random.Random(1)
    sampling = stepllm.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)

    def request() -> stepllm.GenerationRequest:
        return stepllm.GenerationRequest([rng.randrange(2, vocab) for _ in range(prompt_len)], sampling)

    res: dict = {"graphs": graphs}
    for b in batches:
        stepped = coord.begin_stepped(request(), request_id=1, original_index=0)
        try:
            batch = seat_residents(stepped, request, b)
            for _ in range(warmup):
                stepped.decode(batch)
            steps = []
            t = time.perf_counter()
            for _ in range(ticks):
                steps.append(stepped.decode(batch))
            wall = time.perf_counter() - t
        finally:
            stepped.abort()
        bad = [s for s in steps if not s.ok or s.execution.rows != b or s.finished]
        if bad:
            raise RuntimeError(f"host ticks: a timed tick at batch {b} failed or lost a row: {bad[0]!r}")
        ex = [s.execution for s in steps]
        host = sorted(e.elapsed_us - e.device_wait_us for e in ex)
        res[b] = {
            "elapsed_us": statistics.fmean(e.elapsed_us for e in ex),
            "device_wait_us": statistics.fmean(e.device_wait_us for e in ex),
            "host_us": statistics.fmean(e.elapsed_us - e.device_wait_us for e in ex),
            "host_us_median": statistics.median(host),
            "host_us_p90": host[len(host) * 9 // 10],
            "host_us_p99": host[len(host) * 99 // 100],
            "host_us_max": host[-1],
            # In tick order, to see whether the slow ticks come periodically (--host-ticks-dump).
            "host_us_ticks": [e.elapsed_us - e.device_wait_us for e in ex],
            "python_us": wall / ticks * 1e6,
            "graph_ticks": sum(e.cuda_graph for e in ex),
            # getattr: the wheels of earlier commits have no such field, and the benchmark measures them too.
            "on_device_ticks": sum(getattr(e, "metadata_on_device", False) for e in ex),
            "ticks": ticks,
        }
    return res


def seat_residents(stepped, request, b: int) -> stepllm.ImmutableDecodeBatch:
    """Prefill the founder of a fresh stepped session, admit and prefill b - 1 more `request()`s, and return
    the decode batch of all b residents."""
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    for i in range(1, b):
        adm = stepped.admit(request(), original_index=i, request_id=i + 1)
        if adm.status != stepllm.AdmissionStatus.ADMITTED:
            raise RuntimeError(f"request {i} of {b} not admitted: {adm.status} {adm.reason}")
        stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
    batch = stepllm.ImmutableDecodeBatch(residents=stepped.residents())
    if len(batch.residents) != b:
        raise RuntimeError(f"{len(batch.residents)} residents, expected {b}")
    return batch


def host_ticks_line(shape: str, b: int, r: dict) -> str:
    return (f"host ticks {shape} batch {b}: elapsed {r['elapsed_us']:.1f} us/tick, device wait {r['device_wait_us']:.1f} us, "
            f"host {r['host_us']:.1f} us (elapsed - device wait; median {r['host_us_median']:.1f}, p90 {r['host_us_p90']}, "
            f"p99 {r['host_us_p99']}, max {r['host_us_max']}), "
            f"python loop {r['python_us']:.1f} us/tick, graph replays {r['graph_ticks']}/{r['ticks']}, "
            f"metadata on the device {r['on_device_ticks']}/{r['ticks']}")


def mixed_workload(vocab: int, n: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt ids, max_tokens) pairs; prompt length and max_tokens each uniform in [lo, hi]."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        prompt_len, out_len = rng.randint(lo, hi), rng.randint(lo, hi)
        work.append(([rng.randrange(2, vocab) for _ in range(prompt_len)], out_len))
    return work


def mixed_kv_tokens(work: list[tuple[list[int], int]], block: int) -> int:
    """KV tokens for every request's whole generate budget at once (admission reserves prompt + max_tokens up
    front and queues, never preempts, when short), plus a block of slack per request: all are admitted at once."""
    return sum(-(-(len(p) + o) // block) * block + block for p, o in work)


def mixed_config(path: Path, work: list[tuple[list[int], int]], device: str = "cuda", max_prefill_tokens: int | None = None,
                 kv_cache_dtype: str = "auto", block: int = 16) -> stepllm.Config:
    """The engine configuration of the mixed workload: every request seated at once, KV blocks of `block` positions
    (the default's 16 unless asked)."""
    return stepllm.Config(model=str(path), device=device, max_batch_size=len(work), block_size=block,
                          kv_cache_tokens=mixed_kv_tokens(work, block), max_prefill_tokens=max_prefill_tokens,
                          kv_cache_dtype=kv_cache_dtype)


def greedy_request(ids: list[int], out: int) -> stepllm.GenerationRequest:
    """`out` greedy tokens after `ids`, EOS ignored."""
    return stepllm.GenerationRequest(ids, stepllm.SamplingParams(max_tokens=out, temperature=0.0, ignore_eos=True))


def mixed_warmup() -> stepllm.GenerationRequest:
    """The request run before the timed mixed workload: not a prefix of any of its requests, so no cache hit later."""
    return greedy_request(list(range(2, 18)), 4)


def mixed_run(path: Path, n: int, paths: list[str], lo: int = 100, hi: int = 1024, seed: int = 0,
              device: str = "cuda", max_prefill_tokens: int | None = None, kv_cache_dtype: str = "auto",
              block: int = 16) -> dict:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    work = mixed_workload(vocab, n, lo, hi, seed)
    cfg = mixed_config(path, work, device, max_prefill_tokens, kv_cache_dtype, block)
    warm = mixed_warmup()
    res: dict = {"requests": n, "prompt_tokens": sum(len(p) for p, _ in work), "max_tokens": sum(o for _, o in work),
                 "kv_read_bytes": decode_kv_read_bytes(work, path, 1 if kv_cache_dtype == "fp8" else 2)}
    for kind in paths:
        graphs = False
        if kind == "engine":
            # Engine captures decode graphs when it starts on a GPU (it warns and decodes eagerly if it cannot).
            graphs = device == "cuda"
            engine = stepllm.Engine(cfg)
            try:
                engine.submit(warm).wait()
                t = time.perf_counter()
                streams = [engine.submit(greedy_request(p, o)) for p, o in work]
                out = [s.wait() for s in streams]
                dt = time.perf_counter() - t
            finally:
                engine.shutdown()
            del engine
        elif kind == "dispatch":
            coord = stepllm.RuntimeCoordinator(cfg)
            graphs = coord.capture_decoding_cuda_graph()
            coord.dispatch_request([warm])
            t = time.perf_counter()
            out = coord.dispatch_request([greedy_request(p, o) for p, o in work])
            dt = time.perf_counter() - t
            del coord
        else:
            raise ValueError(f"unknown mixed path {kind!r}; use engine or dispatch")
        short = [(i, r.finish_reason, r.error) for i, (r, (_, o)) in enumerate(zip(out, work)) if len(r.output_ids) != o]
        if short:
            raise RuntimeError(f"mixed ({kind}): {len(short)} requests did not run to max_tokens, e.g. {short[0]}")
        generated = sum(len(r.output_ids) for r in out)
        res[kind] = {"total_s": dt, "generated": generated, "tok_s": generated / dt, "graphs": graphs}
    return res


# HBM3e bandwidth of one H200 by its data sheet; a device-to-device copy reaches about 4.3 TB/s.
H200_PEAK_BYTES_PER_S = 4.8e12


def decode_kv_read_bytes(work: list[tuple[list[int], int]], path: Path, bytes_per_value: int = 2) -> int:
    """Bytes of K and V that the workload's decode steps must read at the least: the token that follows a
    context of c tokens reads all c of them (every layer, K and V, bytes_per_value each), whatever the batching."""
    cfg = json.loads((path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * bytes_per_value
    contexts = sum(len(p) * o + o * (o - 1) // 2 for p, o in work)
    return contexts * per_token


def mixed_floor_line(res: dict) -> str:
    floor_s = res["kv_read_bytes"] / H200_PEAK_BYTES_PER_S
    best = max(r["generated"] for k, r in res.items() if isinstance(r, dict) and "generated" in r)
    return (f"mixed: decode attention must read {res['kv_read_bytes'] / 1e12:.2f} TB of K/V: {floor_s:.2f} s at "
            f"{H200_PEAK_BYTES_PER_S / 1e12:.1f} TB/s, so at most {best / floor_s:,.0f} output tok/s before any weight, "
            f"prefill or host time")


def mixed_line(shape: str, kind: str, res: dict) -> str:
    r = res[kind]
    return (f"mixed {shape} ({kind}{', CUDA graphs' if r['graphs'] else ', no CUDA graphs'}): {res['requests']} requests, "
            f"{res['prompt_tokens']:,} prompt tokens, {r['generated']:,} generated tokens in {r['total_s']:.2f} s = "
            f"{r['tok_s']:,.0f} output tok/s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="/tmp/gpu_models")
    ap.add_argument("--shapes", nargs="*", default=["smollm2", "qwen3", "llama1b"])
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 8, 64, 256])
    ap.add_argument("--hf-batches", nargs="*", type=int, default=[1, 64])
    ap.add_argument("--gemv-sweep", nargs="*", type=int, default=[],
                    help="STEPLLM_GEMV_MAX_ROWS values to time batches 1, 2, 4 and 8 with (rows above the limit go "
                         "to the skinny GEMM, and above STEPLLM_SKINNY_GEMM_MAX_ROWS to cuBLAS)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--host-ticks", action="store_true", help="per-tick host vs device time through the stepped API")
    ap.add_argument("--host-batches", nargs="*", type=int, default=[1, 8, 64])
    ap.add_argument("--ticks", type=int, default=200, help="timed decode ticks per batch size (--host-ticks)")
    ap.add_argument("--host-ticks-dump", type=Path, default=None,
                    help="write every timed tick's host µs, in tick order, per shape and batch to this JSON file")
    ap.add_argument("--mixed", action="store_true", help="256 requests, prompt and output lengths uniform in [100, 1024]")
    ap.add_argument("--mixed-requests", type=int, default=256)
    ap.add_argument("--mixed-block-size", type=int, default=16, help="Config.block_size of the mixed workload")
    ap.add_argument("--mixed-paths", nargs="+", choices=["engine", "dispatch"], default=["engine", "dispatch"])
    ap.add_argument("--max-prefill-tokens", type=int, default=None,
                    help="Config.max_prefill_tokens for stepllm's runs (1 prefills one request per step)")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto", help="Config.kv_cache_dtype for stepllm's runs")
    args = ap.parse_args()
    print(f"stepllm kv_cache_dtype={args.kv_cache_dtype}", flush=True)
    rows = []
    tick_rows = []
    mixed_rows = []
    for shape in args.shapes:
        path = gpu_models.make(shape, Path(args.models))
        if args.batches:
            ours = stepllm_run(path, args.batches, args.prompt, args.new, args.max_prefill_tokens, args.kv_cache_dtype)
            peer = hf_run(path, args.hf_batches, args.prompt, args.new) if args.hf_batches else {}
            print(f"{shape}: load {ours['load_s']:.2f} s, graph capture {ours['capture_s']:.2f} s (graphs={ours['graphs']}), "
                  f"device memory {ours['mem_gib']:.1f} GiB", flush=True)
            for b in args.batches:
                hf = peer.get(b)
                rows.append((shape, b, ours[b]["ms_step"], ours[b]["tok_s"], hf["ms_step"] if hf else None, hf["tok_s"] if hf else None))
                print(rows[-1], flush=True)
        if args.host_ticks:
            ticks = host_ticks_run(path, args.host_batches, args.prompt, args.ticks, kv_cache_dtype=args.kv_cache_dtype)
            for b in args.host_batches:
                tick_rows.append((shape, b, ticks[b]))
                print(host_ticks_line(shape, b, ticks[b]), flush=True)
            if args.host_ticks_dump:
                dump = json.loads(args.host_ticks_dump.read_text()) if args.host_ticks_dump.exists() else {}
                dump[shape] = {str(b): ticks[b]["host_us_ticks"] for b in args.host_batches}
                args.host_ticks_dump.write_text(json.dumps(dump))
        if args.mixed:
            mixed = mixed_run(path, args.mixed_requests, args.mixed_paths, max_prefill_tokens=args.max_prefill_tokens,
                              kv_cache_dtype=args.kv_cache_dtype, block=args.mixed_block_size)
            for kind in args.mixed_paths:
                mixed_rows.append((shape, kind, mixed))
                print(mixed_line(shape, kind, mixed), flush=True)
            print(mixed_floor_line(mixed), flush=True)
    # The GEMV crossover at small batches (STEPLLM_GEMV_MAX_ROWS: 0 = no GEMV).
    import os

    for rows_limit in args.gemv_sweep:
        os.environ["STEPLLM_GEMV_MAX_ROWS"] = str(rows_limit)
        r = stepllm_run(gpu_models.make(args.shapes[0], Path(args.models)), [1, 2, 4, 8], args.prompt, 64)
        print(f"gemv<= {rows_limit}: " + ", ".join(f"b{b} {r[b]['ms_step']:.3f} ms" for b in [1, 2, 4, 8]), flush=True)
    print_tables(rows, tick_rows, mixed_rows)


def print_tables(rows: list, tick_rows: list, mixed_rows: list) -> None:
    if rows:
        print("\n| shape | batch | stepllm ms/step | stepllm tok/s | transformers ms/step | transformers tok/s |")
        print("|---|---|---|---|---|---|")
        for s, b, ms, ts, hms, hts in rows:
            hf = f"{hms:.2f} | {hts:,.0f}" if hms else "- | -"
            print(f"| {s} | {b} | {ms:.3f} | {ts:,.0f} | {hf} |")
    if tick_rows:
        print("\nPer decode tick (stepped API, CUDA graphs captured; host = elapsed_us - device_wait_us):\n")
        print("| shape | batch | elapsed µs | device wait µs | host µs mean / median / p99 | Python loop µs | graph replays "
              "| metadata on the device |")
        print("|---|---|---|---|---|---|---|---|")
        for s, b, r in tick_rows:
            print(f"| {s} | {b} | {r['elapsed_us']:.1f} | {r['device_wait_us']:.1f} | {r['host_us']:.1f} / "
                  f"{r['host_us_median']:.1f} / {r['host_us_p99']} | {r['python_us']:.1f} | {r['graph_ticks']}/{r['ticks']} | "
                  f"{r['on_device_ticks']}/{r['ticks']} |")
    if mixed_rows:
        print("\nMixed workload (prompt and output lengths uniform in [100, 1024], greedy, EOS ignored, all submitted at once):\n")
        print("| shape | path | requests | generated tokens | total s | output tok/s |")
        print("|---|---|---|---|---|---|")
        for s, kind, m in mixed_rows:
            r = m[kind]
            path = f"{kind} ({'graphs' if r['graphs'] else 'no graphs'})"
            print(f"| {s} | {path} | {m['requests']} | {r['generated']:,} | {r['total_s']:.2f} | {r['tok_s']:,.0f} |")


if __name__ == "__main__":
    main()
