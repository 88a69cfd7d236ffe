"""Tensor parallelism on CUDA (issue #6; marker `gpu`, skipped without a GPU).

On any GPU machine: two ranks sharing cuda:0 (ParallelConfig(devices=[0, 0])), which all-reduce through host
memory. With two or more GPUs also: ranks on cuda:0 and cuda:1, which all-reduce through NCCL. Against the same
checkpoint with one rank on one GPU: greedy ids agree until transformers' first near-tie (bf16 partial sums
are added in another order, so a near-tie may flip) through the stepped API and LLM.generate; every rank keeps
the invariants; abort releases every rank; a failing rank fails the step on every rank without hanging.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import stepllm

from conftest import check_every_rank
# test_gpu skips itself, and so this module, where torch, a GPU or stepllm's CUDA backend is missing.
from test_gpu import PROMPT, assert_greedy_agrees, forced_logits, gpu_models, greedy, hf_model, top2, torch

pytestmark = pytest.mark.gpu

TWO_GPUS = torch.cuda.device_count() >= 2
LAYOUTS = [pytest.param([0, 0], id="shared-gpu-host-all-reduce"),
           pytest.param([0, 1], id="two-gpus-nccl", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs 2 GPUs"))]


@pytest.fixture(scope="module")
def llama1b() -> Path:
    """Llama-3.2-1B's shape (32 heads over 8 KV heads, vocab 128,256): 16 heads and 64,128 ids per rank."""
    return gpu_models.make("llama1b", Path(os.environ.get("STEPLLM_GPU_MODELS", "/tmp/gm")))


def coordinator(path: Path, devices: list[int] | None, **kw) -> stepllm.RuntimeCoordinator:
    parallel = stepllm.ParallelConfig(tensor_parallel_size=len(devices), devices=devices) if devices else None
    cfg = stepllm.Config(model=str(path), device="cuda", max_batch_size=8, kv_cache_tokens=4096, parallel=parallel, **kw)
    return stepllm.RuntimeCoordinator(cfg)


def prompts() -> list[list[int]]:
    return [PROMPT[: 12 + 9 * i] for i in range(3)]


def stepped_greedy(coord: stepllm.RuntimeCoordinator, n: int) -> list[list[int]]:
    """The three prompts through the stepped API: the first founds the session, the others are admitted after
    its first decode step; every rank checked after every step."""
    ps = prompts()
    stepped = coord.begin_stepped(stepllm.GenerationRequest(ps[0], greedy(n)), request_id=1, original_index=0)
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    out: dict[int, list[int]] = {}
    for i, p in enumerate(ps[1:], start=1):
        adm = stepped.admit(stepllm.GenerationRequest(p, greedy(n)), original_index=i, request_id=i + 1)
        assert adm.status == stepllm.AdmissionStatus.ADMITTED
        stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.resident))
        check_every_rank(coord)
    while stepped.residents():
        step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
        assert coord.local_ranks_succeeded()
        out.update({r.identity.request_id: list(r.output_ids) for _, r in step.finished})
        check_every_rank(coord)
    out[1] = list(stepped.finish().output_ids)
    check_every_rank(coord)
    return [out[i + 1] for i in range(len(ps))]


def assert_agrees_with_transformers_ties(path: Path, got: list[list[int]], ref: list[list[int]], what: object) -> None:
    model = hf_model(path)
    try:
        for p, g, r in zip(prompts(), got, ref):
            rows = forced_logits(model, p + r)[len(p) - 1 : len(p) - 1 + len(r)]
            assert_greedy_agrees(g, r, top2(rows), (what, len(p)))
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.parametrize("devices", LAYOUTS)
def test_tp2_agrees_with_one_gpu_through_the_stepped_api_and_generate(llama1b: Path, devices: list[int]) -> None:
    single = coordinator(llama1b, None)
    want = stepped_greedy(single, 12)
    del single
    coord = coordinator(llama1b, devices)
    path = "NCCL" if devices == [0, 1] else "host memory"
    device = coord.info()["device"]
    assert f"all-reduce through {path}" in device and device.endswith("x2 (tensor parallel)"), device
    assert coord.world_size() == 2 and coord.supports_stepped_execution()
    got = stepped_greedy(coord, 12)
    del coord
    assert_agrees_with_transformers_ties(llama1b, got, want, ("stepped", devices))
    with stepllm.LLM(model=str(llama1b), device="cuda", kv_cache_tokens=4096,
                     parallel=stepllm.ParallelConfig(tensor_parallel_size=2, devices=devices)) as llm:
        generated = [list(o.output_ids) for o in llm.generate(prompts(), greedy(12))]
    assert_agrees_with_transformers_ties(llama1b, generated, want, ("generate", devices))


@pytest.mark.parametrize("devices", LAYOUTS)
def test_tp2_abort_releases_every_rank(llama1b: Path, devices: list[int]) -> None:
    coord = coordinator(llama1b, devices)
    before = coord.rank_counts()
    stepped = coord.begin_stepped(stepllm.GenerationRequest(PROMPT, greedy(8)))
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    stepped.abort()
    for b, a in zip(before, coord.rank_counts()):
        assert a["live_slots"] == 0 and a["leased_blocks"] == b["leased_blocks"]


@pytest.mark.parametrize("devices", LAYOUTS)
def test_a_failing_rank_fails_the_step_on_every_rank_without_hanging(llama1b: Path, devices: list[int]) -> None:
    """Rank 1 fails at its next collective. Through host memory the group then serves the next session; through
    NCCL its communicators were aborted (the other rank's all-reduce waited on the device), so the next step
    fails with an error that says to load the model again, again without hanging."""
    coord = coordinator(llama1b, devices)
    stepped = coord.begin_stepped(stepllm.GenerationRequest(PROMPT, greedy(6)))
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    coord._inject_rank_fault(1)
    started = time.monotonic()
    step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    assert time.monotonic() - started < 30
    [(_, result)] = step.finished
    assert result.finish_reason == stepllm.FinishReason.ERROR and "rank 1" in result.error, result.error
    check_every_rank(coord)
    stepped.finish()
    started = time.monotonic()
    nxt = coord.begin_stepped(stepllm.GenerationRequest(PROMPT[:10], greedy(4)))
    first = nxt.prefill(stepllm.ImmutablePrefillBatch(target=nxt.founder()))
    assert time.monotonic() - started < 30
    if devices == [0, 1]:
        [(_, failed)] = first.finished
        assert failed.finish_reason == stepllm.FinishReason.ERROR and "load the model again" in failed.error, failed.error
    else:
        assert not first.finished
        while nxt.residents():
            nxt.decode(stepllm.ImmutableDecodeBatch(residents=nxt.residents()))
        assert len(nxt.finish().output_ids) == 4
    check_every_rank(coord)


def test_more_ranks_than_gpus_is_a_clear_error_naming_the_fix(llama1b: Path) -> None:
    world = torch.cuda.device_count() + 1
    with pytest.raises(stepllm.DeviceError, match=f"needs cuda:{world - 1}, but {world - 1} CUDA device"):
        stepllm.RuntimeCoordinator(stepllm.Config(model=str(llama1b), device="cuda",
                                                  parallel=stepllm.ParallelConfig(tensor_parallel_size=world)))
