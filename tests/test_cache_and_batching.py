"""Outputs do not depend on context-cache hits, on batch neighbours, or on when a request was admitted."""

from __future__ import annotations

from typing import Any

import pytest

import stepllm
from conftest import check_invariants, coordinator, greedy, run_alone, same_except_cache

LONG_PROMPT = "Once upon a time there was a little cat who liked to sleep in the sun. The quick brown fox jumps over the lazy dog."


def test_greedy_output_identical_on_cache_hit_and_miss(model_name: str) -> None:
    coord = coordinator(model_name)
    request = stepllm.GenerationRequest(LONG_PROMPT, greedy(16))
    before = coord.counts()
    miss = run_alone(coord, request)
    assert miss.cached_prompt_tokens == 0
    assert len(miss.prompt_ids) > 32
    assert coord.counts()["cached_blocks"] > 0
    hit = run_alone(coord, request)
    assert hit.cached_prompt_tokens > 0
    assert hit.cached_prompt_tokens % 16 == 0 and hit.cached_prompt_tokens < len(hit.prompt_ids)
    assert hit.output_ids == miss.output_ids
    assert hit.output_text == miss.output_text
    same_except_cache(before, coord.counts())
    # and against a runtime whose cache is off
    cold = coordinator(model_name, context_cache=stepllm.ContextCacheConfig(enabled=False))
    off = run_alone(cold, request)
    assert off.cached_prompt_tokens == 0 and off.output_ids == miss.output_ids
    assert cold.counts()["cached_blocks"] == 0


def test_cache_hit_reported_in_prefill_descriptor() -> None:
    coord = coordinator()
    request = stepllm.GenerationRequest(LONG_PROMPT, greedy(4))
    run_alone(coord, request)
    stepped = coord.begin_stepped(request)
    first = stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    (p,) = first.participants
    assert p.past_length > 0 and p.past_length % 16 == 0
    assert p.past_length + p.query_length == coord.count_prompt_tokens(request)
    assert p.work == stepllm.SequenceWork.CONTEXT and p.select_last_token_logits
    stepped.abort()


def test_cache_salt_separates_entries() -> None:
    coord = coordinator()
    run_alone(coord, stepllm.GenerationRequest(LONG_PROMPT, greedy(4), cache_salt="a"))
    other = run_alone(coord, stepllm.GenerationRequest(LONG_PROMPT, greedy(4), cache_salt="b"))
    same = run_alone(coord, stepllm.GenerationRequest(LONG_PROMPT, greedy(4), cache_salt="a"))
    assert other.cached_prompt_tokens == 0
    assert same.cached_prompt_tokens > 0
    assert other.output_ids == same.output_ids


def test_bypass_lookup_never_hits() -> None:
    coord = coordinator(context_cache=stepllm.ContextCacheConfig(lookup="bypass"))
    a = run_alone(coord, stepllm.GenerationRequest(LONG_PROMPT, greedy(4)))
    b = run_alone(coord, stepllm.GenerationRequest(LONG_PROMPT, greedy(4)))
    assert b.cached_prompt_tokens == 0 and a.output_ids == b.output_ids


def test_system_prompt_kv_cache_is_pinned_and_reused() -> None:
    coord = coordinator()
    cached = coord.gen_and_save_system_prompt_kv_cache(LONG_PROMPT)
    assert cached > 0 and cached % 16 == 0
    counts = coord.counts()
    assert counts["pinned_blocks"] == cached // 16
    check_invariants(counts)
    response = run_alone(coord, stepllm.GenerationRequest(LONG_PROMPT, greedy(8)))
    assert response.cached_prompt_tokens >= cached
    cold = run_alone(coordinator(context_cache=stepllm.ContextCacheConfig(enabled=False)), stepllm.GenerationRequest(LONG_PROMPT, greedy(8)))
    assert response.output_ids == cold.output_ids
    with pytest.raises(stepllm.InvalidRequestError):
        coord.gen_and_save_system_prompt_kv_cache("Hi")  # shorter than one block


def test_mid_stream_admission_matches_running_alone(model_name: str) -> None:
    """B admitted after A has decoded a few steps gives what B gives alone, and A is not disturbed."""
    a_req = stepllm.GenerationRequest("The capital of France is", greedy(20))
    b_req = stepllm.GenerationRequest(LONG_PROMPT, greedy(12))
    alone_a = run_alone(coordinator(model_name), a_req)
    alone_b = run_alone(coordinator(model_name), b_req)
    coord = coordinator(model_name)
    stepped = coord.begin_stepped(a_req)
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    for _ in range(5):
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    adm = stepped.admit(b_req, original_index=1, request_id=2)
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
    done: dict[int, stepllm.GenerationResponse] = {}
    while stepped.residents():
        step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
        assert step.execution.rows == len(step.participants)
        for _, result in step.finished:
            done[result.identity.original_index] = stepped.materialize(result)
    founder = stepped.finish()
    assert founder.output_ids == alone_a.output_ids
    assert done[1].output_ids == alone_b.output_ids


def test_decoding_a_subset_of_residents() -> None:
    """A resident left out of some decode steps still produces what it produces alone."""
    coord = coordinator()
    a_req = stepllm.GenerationRequest("Hello", greedy(10))
    b_req = stepllm.GenerationRequest("The capital of France is", greedy(10))
    alone = {0: run_alone(coordinator(), a_req).output_ids, 1: run_alone(coordinator(), b_req).output_ids}
    stepped = coord.begin_stepped(a_req)
    founder = stepped.founder()
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    adm = stepped.admit(b_req, original_index=1, request_id=2)
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
    outputs: dict[int, list[int]] = {}
    for _ in range(4):  # only B moves
        step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=[adm.ref]))
        assert [p.identity.resident for p in step.participants] == [adm.ref]
        assert founder not in [r for r, _ in step.deltas]
    while stepped.residents():
        step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
        for _, result in step.finished:
            outputs[result.identity.original_index] = result.output_ids
    outputs[0] = stepped.finish().output_ids
    assert outputs == alone


# ------------------------------------------------------------------------------------------------ seeded sampling

def sampled(seed: int | None, max_tokens: int = 12, **kw: Any) -> stepllm.SamplingParams:
    kw.setdefault("temperature", 0.9)
    kw.setdefault("top_p", 0.95)
    return stepllm.SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True, **kw)


def test_seeded_sampling_is_reproducible(model_name: str) -> None:
    coord = coordinator(model_name)
    request = stepllm.GenerationRequest("Hello", sampled(1234))
    first = coord.dispatch_request([request])[0].output_ids
    again = coord.dispatch_request([request])[0].output_ids
    assert first == again
    fresh = coordinator(model_name).dispatch_request([request])[0].output_ids
    assert fresh == first
    others = {tuple(coord.dispatch_request([stepllm.GenerationRequest("Hello", sampled(s))])[0].output_ids) for s in range(1, 6)}
    assert len(others | {tuple(first)}) > 1, "different seeds should not all give the same sample"


def test_seeded_sampling_is_independent_of_batch_neighbours(model_name: str) -> None:
    target = stepllm.GenerationRequest("The capital of France is", sampled(77, top_k=50, min_p=0.01, repetition_penalty=1.1))
    alone = coordinator(model_name).dispatch_request([target])[0].output_ids
    neighbours = [
        stepllm.GenerationRequest("Hello", sampled(None, temperature=1.0)),
        stepllm.GenerationRequest(LONG_PROMPT, greedy(7)),
        stepllm.GenerationRequest("Once upon a time", sampled(5, max_tokens=20, presence_penalty=0.5)),
    ]
    coord = coordinator(model_name)
    batch = coord.dispatch_request([neighbours[0], target, neighbours[1], neighbours[2]])
    assert batch[1].output_ids == alone
    # and admitted mid-stream into a stepped session with different neighbours
    stepped = coord.begin_stepped(neighbours[2])
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    for _ in range(3):
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    adm = stepped.admit(target, original_index=1, request_id=2)
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
    out = None
    while stepped.residents():
        step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
        for _, result in step.finished:
            if result.identity.request_id == 2:
                out = result.output_ids
    stepped.finish()
    assert out == alone


def test_unseeded_sampling_runs() -> None:
    out = coordinator().dispatch_request([stepllm.GenerationRequest("Hello", sampled(None))] * 3)
    assert all(len(o.output_ids) == 12 for o in out)
