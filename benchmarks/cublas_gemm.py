"""cuBLAS (through torch) bf16 GEMM time for the projections of a Qwen3-0.6B layer at decode batch sizes.

Each projection runs with 28 distinct weights (as in the model, so L2 does not hold them), replayed from one CUDA
graph; the table gives µs per GEMM, the bandwidth its weights reach, and the layer's total against the time its
31.5 MB of weights need at 4.8 TB/s. This is what stepllm's decode steps pay from 5 rows on, where the projections
go to cuBLAS (benchmarks/RESULTS.md).

    python3 benchmarks/cublas_gemm.py
"""

import torch

SHAPES = {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)}  # (k, n)
LAYERS = 28
PEAK_BYTES_PER_US = 4.8e6


def gemm_us(m: int, k: int, n: int, reps: int = 20) -> float:
    """µs per [m, k] x [n, k]ᵀ GEMM over LAYERS distinct weights, replayed from a CUDA graph."""
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm up cuBLAS's heuristics outside the capture
        for w in ws:
            x @ w.t()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            x @ w.t()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / LAYERS


def main() -> None:
    floor = sum(n * k * 2 for k, n in SHAPES.values()) / PEAK_BYTES_PER_US
    print("| M | " + " | ".join(f"{name} µs (TB/s)" for name in SHAPES) + " | µs per layer | floor µs |")
    print("|---" * (len(SHAPES) + 3) + "|")
    for m in [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256]:
        cells, total = [], 0.0
        for k, n in SHAPES.values():
            us = gemm_us(m, k, n)
            total += us
            cells.append(f"{us:.2f} ({n * k * 2 / us / 1e6:.2f})")
        print(f"| {m} | " + " | ".join(cells) + f" | {total:.1f} | {floor:.1f} |", flush=True)


if __name__ == "__main__":
    main()
