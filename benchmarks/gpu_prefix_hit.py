"""Time to first token of a 100-token prompt tail after a long cached prefix (prefix-cache hit), Qwen3-0.6B shape
with random weights (benchmarks/gpu_models.py, made under /tmp/gm if missing): the median of 12 timed dispatches
(after two warm-ups), each a fresh tail behind the same cached prefix.

    python3 benchmarks/gpu_prefix_hit.py [PREFIX_LEN (3000)]
"""
import statistics, sys, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
import gpu_models
import stepllm

prefix_len = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
path = gpu_models.make("qwen3", Path("/tmp/gm"))
coord = stepllm.RuntimeCoordinator(stepllm.Config(model=str(path), device="cuda", max_batch_size=4, kv_cache_tokens=16384))
one = stepllm.SamplingParams(max_tokens=1, temperature=0.0)
prefix = [(7 * i + 3) % 991 + 2 for i in range(prefix_len)]
coord.dispatch_request([stepllm.GenerationRequest(prefix, one)])
times = []
for k in range(14):
    tail = [(13 * i + 17 * k) % 997 + 2 for i in range(100)]
    t = time.perf_counter()
    out = coord.dispatch_request([stepllm.GenerationRequest(prefix + tail, one)])[0]
    times.append(time.perf_counter() - t)
    assert out.cached_prompt_tokens >= prefix_len - 16, out.cached_prompt_tokens
print(f"prefix {prefix_len} + tail 100: ttft median {1e3 * statistics.median(times[2:]):.2f} ms, min {1e3 * min(times[2:]):.2f} ms")
