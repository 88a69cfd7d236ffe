"""Weight dtypes on the CPU: Config(dtype=...), the CLI's --dtype, bf16/int8/a8 generation on the fixtures, and a8 on
the default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import stepllm
from conftest import config, expected, expected_logits, log_softmax, model_dir
from test_cli import default_model_or_skip, stepllm_cli

REFERENCE = Path(__file__).parent / "fixtures" / "smollm2_transformers.json"


def test_config_dtype_defaults_to_the_device_choice() -> None:
    assert stepllm.Config().dtype is None
    assert stepllm.Config(dtype="auto").dtype is None
    for name in ["f32", "bf16", "int8", "a8"]:
        c = stepllm.Config(dtype=name)
        assert c.dtype == name and f"dtype='{name}'" in repr(c)
    assert stepllm.Config(dtype="bfloat16").dtype == "bf16"
    assert stepllm.Config(dtype="bf16") != stepllm.Config(dtype="f32")
    assert len({stepllm.Config(dtype="bf16"), stepllm.Config(dtype="bf16"), stepllm.Config()}) == 2


def test_unknown_dtype_is_invalid() -> None:
    with pytest.raises(stepllm.InvalidRequestError, match="dtype"):
        stepllm.Config(dtype="fp8")
    with pytest.raises(ValueError):
        stepllm.Config(dtype="float64")


@pytest.mark.parametrize("dtype", ["bf16", "int8", "a8"])
def test_compact_dtypes_generate_close_to_transformers(model_name: str, dtype: str) -> None:
    coord = stepllm.RuntimeCoordinator(config(model_name, dtype=dtype))
    assert dtype in coord.info()["device"]
    rows = expected(model_name)["rows"]
    logits = expected_logits(model_name)
    ids = [list(r["prompt_ids"]) for r in rows]
    requests = [stepllm.GenerationRequest(p, stepllm.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=1)) for p in ids]
    for i, response in enumerate(coord.dispatch_request(requests)):
        reference = log_softmax(logits[f"logits_{i}"][len(ids[i]) - 1])
        ours = response.logprobs[0]
        # the chosen token is one transformers rates nearly as highly as its own choice
        assert reference[ours.token_id] >= reference.max() - (0.1 if dtype == "bf16" else 0.4)
        assert abs(ours.logprob - reference[ours.token_id]) < (0.05 if dtype == "bf16" else 0.2)


def test_cli_dtype_reaches_the_backend() -> None:
    out = stepllm_cli("info", "--model", model_dir("llama"), "--device", "cpu", "--dtype", "bf16", "--kv-cache-tokens", "256")
    assert out.returncode == 0, out.stderr
    fields = dict(line.split(None, 1) for line in out.stdout.splitlines())
    assert "bf16" in fields["device"]
    bad = stepllm_cli("info", "--model", model_dir("llama"), "--device", "cpu", "--dtype", "fp8")
    assert bad.returncode != 0 and "--dtype" in bad.stderr


def test_default_dtype_is_exact_f32() -> None:
    coord = stepllm.RuntimeCoordinator(config("llama"))
    assert "f32" in coord.info()["device"] and "bf16" not in coord.info()["device"]


def test_a8_follows_transformers_on_the_default_model() -> None:
    """a8 keeps the GGUF's Q4_1 and Q8_0 blocks and rounds activations to 8 bits, as llama.cpp does; fed
    transformers' greedy ids (f32 over the same dequantized weights), it ranks transformers' choice first or second
    at every position, and first at most of them."""
    llm = stepllm.LLM(model=default_model_or_skip(), device="cpu", dtype="a8", kv_cache_tokens=1024)
    exact = stepllm.LLM(model=default_model_or_skip(), device="cpu", kv_cache_tokens=1024)
    assert "a8" in llm.info()["device"]
    assert llm.info()["weight_bytes"] == exact.info()["weight_bytes"], "the blocks are kept, not rounded again"
    ranks = []
    for row in json.loads(REFERENCE.read_text())["rows"]:
        prompt, greedy = list(row["prompt_ids"]), list(row["greedy_ids"])
        fed = prompt + greedy[:-1]
        top = stepllm.SamplingParams(temperature=0.0, max_tokens=1, logprobs=5, ignore_eos=True)
        contexts = [fed[:n] for n in range(len(prompt), len(fed) + 1)]
        for want, response in zip(greedy, llm.generate(contexts, top)):
            choices = [token for token, _ in response.logprobs[0].top]
            ranks.append(choices.index(want) if want in choices else len(choices))
    assert len(ranks) > 40 and max(ranks) <= 1, ranks
    assert ranks.count(0) >= 0.85 * len(ranks), ranks
