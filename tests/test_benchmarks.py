"""The GPU benchmark's bookkeeping, run on the CPU with the tiny fixture: the stepped host-tick loop, the mixed
workload through both paths, the K/V-read floor it reports (checked against a direct sum), the profiler's
exposed-time accounting, and the server load test's clients spread over processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_decode  # noqa: E402
import gpu_profile  # noqa: E402


def test_kv_read_floor_counts_every_context_a_decode_step_reads() -> None:
    path = Path(model_dir("llama"))
    cfg = json.loads((path / "config.json").read_text())
    work = gpu_decode.mixed_workload(cfg["vocab_size"], n=7, lo=3, hi=9, seed=5)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 2
    # the k-th generated token (k = 0..out-1) follows a context of prompt + k tokens
    direct = sum(len(p) + k for p, out in work for k in range(out)) * per_token
    assert gpu_decode.decode_kv_read_bytes(work, path) == direct
    assert gpu_decode.decode_kv_read_bytes(work, path, bytes_per_value=1) * 2 == direct  # an fp8 cache


def test_host_ticks_run_keeps_every_row_for_every_tick_on_cpu() -> None:
    res = gpu_decode.host_ticks_run(Path(model_dir("llama")), [1, 3], prompt_len=6, ticks=4, warmup=1, device="cpu")
    for b in (1, 3):
        r = res[b]
        assert r["ticks"] == 4 and r["graph_ticks"] == 0  # no graphs on the CPU
        assert r["elapsed_us"] >= r["device_wait_us"] >= 0
        assert r["host_us"] == r["elapsed_us"] - r["device_wait_us"]


def test_mixed_run_generates_every_budgeted_token_on_both_paths() -> None:
    path = Path(model_dir("llama"))
    res = gpu_decode.mixed_run(path, 5, ["engine", "dispatch"], lo=3, hi=8, seed=2, device="cpu")
    for kind in ("engine", "dispatch"):
        assert res[kind]["generated"] == res["max_tokens"]
        assert res[kind]["graphs"] is False
        assert kind in gpu_decode.mixed_line("llama", kind, res)
    assert res["kv_read_bytes"] > 0
    assert "output tok/s" in gpu_decode.mixed_floor_line(res)


def test_mixed_config_takes_the_asked_block_size() -> None:
    path = Path(model_dir("llama"))
    work = gpu_decode.mixed_workload(json.loads((path / "config.json").read_text())["vocab_size"], 5, 3, 8, 2)
    assert gpu_decode.mixed_config(path, work, device="cpu").block_size == 16  # the default's
    cfg = gpu_decode.mixed_config(path, work, device="cpu", block=32)
    assert cfg.block_size == 32
    assert cfg.kv_cache_tokens == gpu_decode.mixed_kv_tokens(work, 32)
    res = gpu_decode.mixed_run(path, 5, ["engine"], lo=3, hi=8, seed=2, device="cpu", block=32)
    assert res["engine"]["generated"] == res["max_tokens"]


def test_exposed_spans_charge_overlaps_once_and_count_gaps_as_idle() -> None:
    # b overlaps a's last 2 µs (programmatic dependent launch), c starts 3 µs after b ends, d lies inside c.
    spans = [(10.0, 15.0, "b"), (0.0, 12.0, "a"), (18.0, 25.0, "c"), (19.0, 21.0, "d")]
    exposed, idle = gpu_profile.exposed_spans(spans)
    assert exposed == {"a": [12.0], "b": [3.0], "c": [7.0], "d": [0.0]}
    assert idle == 3.0
    assert sum(sum(v) for v in exposed.values()) + idle == 25.0  # first start to last end
    assert gpu_profile.exposed_spans([]) == ({}, 0.0)
    assert gpu_profile.family(gpu_profile.IDLE) == "idle (no kernel running)"
    assert gpu_profile.family("paged_attention_fp8_mma_rope_d128_g2") == "decode attention"


def test_cpu_prefill_times_one_prompt_per_run_on_cpu() -> None:
    import cpu_prefill

    for dtype in ["f32", "a8"]:
        seconds = cpu_prefill.stepllm_seconds(model_dir("llama"), 20, dtype)
        assert 0.0 < seconds < 60.0
    assert cpu_prefill.prompt(20, 1) != cpu_prefill.prompt(20, 2), "each run gets fresh tokens (no cache hits)"


@pytest.mark.parametrize("input_len", [0, 24])
def test_serve_load_merges_the_clients_of_every_process(input_len: int) -> None:
    """Chat prompts from the pool, or (input_len) random token ids through /v1/completions."""
    pytest.importorskip("uvicorn")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
    cmd = [sys.executable, str(script), "--model", model_dir("qwen3"), "--clients", "4", "--processes", "2"]
    cmd += ["--duration", "1.5", "--max-tokens", "6", "--disconnect-share", "0", "--max-batch-size", "4"]
    cmd += ["--input-len", str(input_len), "--max-id", "400"]  # the fixture's vocabulary has 400 ids
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {k.strip(): v.strip() for k, _, v in (line.strip("| ").partition("|") for line in out.stdout.splitlines())}
    assert rows["clients / processes"] == "4 / 2"
    assert rows["clients that finished a request"] == "4"  # both processes' clients, merged
    assert int(rows["requests finished"]) >= 4
    assert float(rows["output tokens/s"]) > 0
    assert rows["errors by kind"] == "none"
    assert rows["after: running / waiting"] == "0 / 0"
    if input_len:
        assert rows["prompt tokens per finished request"] == f"{input_len:.1f}"
