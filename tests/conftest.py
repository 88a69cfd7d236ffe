"""Shared fixtures: the tiny transformers-made checkpoints, their golden outputs, and invariant checks."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stepllm

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = ["llama", "qwen2", "qwen3", "llama3"]


def model_dir(name: str) -> str:
    return str(FIXTURES / name)


def expected(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The safetensors format by hand: u64 header length, JSON header, raw little-endian data."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        assert meta["dtype"] == "F32", meta
        start, end = meta["data_offsets"]
        out[key] = np.frombuffer(data[start:end], dtype="<f4").reshape(meta["shape"])
    return out


def expected_logits(name: str) -> dict[str, np.ndarray]:
    return read_safetensors(FIXTURES / name / "expected.safetensors")


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def config(name: str = "llama", **kw: Any) -> stepllm.Config:
    kw.setdefault("device", "cpu")
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("kv_cache_tokens", 4096)
    return stepllm.Config(model=model_dir(name), **kw)


@contextmanager
def long_contexts_allowed() -> Iterator[None]:
    """Lets a test build a runtime whose max_model_len exceeds the tiny fixtures' 256 trained positions (the
    long-running requests that cancellation tests need); the runtime refuses that otherwise."""
    before = os.environ.get("STEPLLM_ALLOW_LONG_MAX_MODEL_LEN")
    os.environ["STEPLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["STEPLLM_ALLOW_LONG_MAX_MODEL_LEN"]
        else:
            os.environ["STEPLLM_ALLOW_LONG_MAX_MODEL_LEN"] = before


def coordinator(name: str = "llama", **kw: Any) -> stepllm.RuntimeCoordinator:
    return stepllm.RuntimeCoordinator(config(name, **kw))


def greedy(max_tokens: int = 12, **kw: Any) -> stepllm.SamplingParams:
    return stepllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def row_request(row: dict[str, Any], sampling: stepllm.SamplingParams | None = None) -> stepllm.GenerationRequest:
    """A fixture row's prompt as the caller gives it: raw text (no special tokens, as transformers was run)
    or the chat messages."""
    sampling = sampling or greedy(len(row["greedy_ids"]))
    if row["kind"] == "chat":
        return stepllm.GenerationRequest(prompt=row["prompt"], sampling=sampling)
    return stepllm.GenerationRequest(prompt=row["prompt"], sampling=sampling, add_special_tokens=False)


def run_alone(coord: stepllm.RuntimeCoordinator, request: stepllm.GenerationRequest) -> stepllm.GenerationResponse:
    """`request` as the founder of a stepped session of its own: prefill, then decode until it ends."""
    stepped = coord.begin_stepped(request)
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    while stepped.residents():
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    return stepped.finish()


def check_invariants(counts: dict[str, int]) -> None:
    assert counts["free_slots"] + counts["live_slots"] == counts["slot_capacity"], counts
    assert counts["free_blocks"] + counts["leased_blocks"] + counts["cached_blocks"] == counts["total_blocks"], counts


def check_every_rank(coord: stepllm.RuntimeCoordinator) -> None:
    """A tensor-parallel group: every rank keeps the invariants, and all ranks hold the same counts."""
    counts = coord.rank_counts()
    assert len(counts) == coord.world_size()
    for c in counts:
        check_invariants(c)
        assert c == counts[0]


def same_except_cache(before: dict[str, int], after: dict[str, int]) -> None:
    """Pool counts as before, cached blocks aside (cached blocks come out of the free ones)."""
    skip = {"free_blocks", "cached_blocks", "pinned_blocks"}
    assert {k: v for k, v in after.items() if k not in skip} == {k: v for k, v in before.items() if k not in skip}
    assert after["free_blocks"] + after["cached_blocks"] == before["free_blocks"] + before["cached_blocks"]
    assert after["leased_blocks"] == 0 and after["live_slots"] == 0


@pytest.fixture(params=MODELS)
def model_name(request: pytest.FixtureRequest) -> str:
    return request.param
