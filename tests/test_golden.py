"""Greedy ids and logprobs against transformers' outputs for every fixture, through every API."""

from __future__ import annotations

import json

import numpy as np
import pytest

import stepllm
from conftest import (
    FIXTURES,
    check_invariants,
    coordinator,
    expected,
    expected_logits,
    greedy,
    log_softmax,
    model_dir,
    row_request,
)


def test_prompt_ids_match_transformers(model_name: str) -> None:
    coord = coordinator(model_name)
    for row in expected(model_name)["rows"]:
        assert coord.count_prompt_tokens(row_request(row)) == len(row["prompt_ids"])
    stepped = coord.begin_stepped(row_request(expected(model_name)["rows"][3]))
    stepped.abort()


def test_stepped_greedy_with_mid_stream_admissions(model_name: str) -> None:
    """Founder begun alone; every other row admitted after some decode steps; all match transformers."""
    rows = expected(model_name)["rows"]
    coord = coordinator(model_name)
    before = coord.counts()
    stepped = coord.begin_stepped(row_request(rows[0]), request_id=1, original_index=0)
    founder = stepped.founder()
    first = stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    assert first.work == stepllm.SequenceWork.CONTEXT and first.ok
    assert first.deltas[0][0] == founder
    assert first.deltas[0][1].token_ids == rows[0]["greedy_ids"][:1]
    outputs: dict[int, stepllm.GenerationResponse] = {}

    def collect(step: stepllm.StepResult) -> None:
        for ref, result in step.finished:
            assert ref == result.identity.resident
            outputs[result.identity.original_index] = stepped.materialize(result)

    streamed: dict[int, list[int]] = {0: list(rows[0]["greedy_ids"][:1])}
    index_of = {founder: 0}
    for i, row in enumerate(rows[1:], start=1):
        step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
        for ref, delta in step.deltas:
            streamed[index_of[ref]] += delta.token_ids
        collect(step)
        adm = stepped.admit(row_request(row), original_index=i, request_id=i + 1)
        assert adm.status == stepllm.AdmissionStatus.ADMITTED, adm.reason
        index_of[adm.ref] = i
        streamed[i] = []
        step = stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
        assert [p.identity.resident for p in step.participants] == [adm.ref]
        assert step.participants[0].query_length + step.participants[0].past_length == len(row["prompt_ids"])
        for ref, delta in step.deltas:
            streamed[index_of[ref]] += delta.token_ids
        collect(step)
        check_invariants(stepped.counts())
    while stepped.residents():
        step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
        assert step.work == stepllm.SequenceWork.DECODE
        for ref, delta in step.deltas:
            streamed[index_of[ref]] += delta.token_ids
        collect(step)
        check_invariants(stepped.counts())
    founder_response = stepped.finish()
    outputs[0] = founder_response
    for i, row in enumerate(rows):
        assert outputs[i].prompt_ids == row["prompt_ids"], (model_name, i)
        assert outputs[i].output_ids == row["greedy_ids"], (model_name, i)
        assert outputs[i].finish_reason == stepllm.FinishReason.LENGTH
        # what the deltas streamed is a prefix of the output (the last tokens travel in the BatchResult)
        assert row["greedy_ids"][: len(streamed[i])] == streamed[i]
    after = coord.counts()
    assert after["live_slots"] == 0 and after["leased_blocks"] == 0
    assert after["free_slots"] == before["free_slots"]


def test_dispatch_request_matches_transformers(model_name: str) -> None:
    rows = expected(model_name)["rows"]
    coord = coordinator(model_name, max_batch_size=2)
    responses = coord.dispatch_request([row_request(r) for r in rows])
    assert [r.output_ids for r in responses] == [r["greedy_ids"] for r in rows]
    assert [r.original_index for r in responses] == list(range(len(rows)))


def test_llm_generate_and_chat_match_transformers(model_name: str) -> None:
    rows = expected(model_name)["rows"]
    raw = [r for r in rows if r["kind"] == "raw"]
    chat = [r for r in rows if r["kind"] == "chat"]
    with stepllm.LLM(model=model_dir(model_name), device="cpu") as llm:
        # raw text: the fixtures' prompts were tokenized without special tokens, as these tokenizers add none
        out = llm.generate([r["prompt"] for r in raw], greedy(12))
        assert [o.prompt_ids for o in out] == [r["prompt_ids"] for r in raw]
        assert [o.output_ids for o in out] == [r["greedy_ids"] for r in raw]
        # one prompt as a plain string, and token-id prompts
        assert llm.generate(raw[1]["prompt"], greedy(12))[0].output_ids == raw[1]["greedy_ids"]
        assert llm.generate(raw[1]["prompt_ids"], greedy(12))[0].output_ids == raw[1]["greedy_ids"]
        ids_out = llm.generate([r["prompt_ids"] for r in raw], greedy(12))
        assert [o.output_ids for o in ids_out] == [r["greedy_ids"] for r in raw]
        # chat: one conversation, and a list of conversations
        for row in chat:
            assert llm.chat(row["prompt"], greedy(12))[0].output_ids == row["greedy_ids"]
            two = llm.chat([row["prompt"], row["prompt"]], greedy(12))
            assert [o.output_ids for o in two] == [row["greedy_ids"]] * 2
            assert two[0].prompt_ids == row["prompt_ids"]


def test_greedy_logprobs_match_log_softmax(model_name: str) -> None:
    rows = expected(model_name)["rows"]
    logits = expected_logits(model_name)
    coord = coordinator(model_name)
    responses = coord.dispatch_request([row_request(r, greedy(12, logprobs=5)) for r in rows])
    for i, (row, resp) in enumerate(zip(rows, responses)):
        ref = log_softmax(logits[f"logits_{i}"])
        n = len(row["prompt_ids"])
        assert resp.output_ids == row["greedy_ids"]
        assert resp.logprobs is not None and len(resp.logprobs) == len(row["greedy_ids"])
        for j, lp in enumerate(resp.logprobs):
            position = ref[n - 1 + j]
            assert lp.token_id == row["greedy_ids"][j]
            assert lp.logprob == pytest.approx(position[lp.token_id], abs=1e-4), (model_name, i, j)
            assert 1 <= len(lp.top) <= 5
            assert lp.top[0][0] == lp.token_id
            top_ref = np.argsort(-position)[: len(lp.top)]
            assert [t for t, _ in lp.top] == list(top_ref)
            for t, v in lp.top:
                assert v == pytest.approx(position[t], abs=1e-4)


def test_prompt_logprobs_match_log_softmax_of_transformers(model_name: str) -> None:
    """vLLM's prompt_logprobs: each prompt token's logprob given the tokens before it (None for the first), with
    its top alternatives, as transformers' logits at the position before it give them; in one prefill, in chunks
    of 5 tokens, and for a prompt the context cache already holds (computed again, not taken from the cache)."""
    rows = expected(model_name)["rows"]
    logits = expected_logits(model_name)
    for kw in ({}, {"max_prefill_tokens": 5}):
        coord = coordinator(model_name, **kw)
        for _ in range(2):  # the second round's prompts are cached, but must still be scored
            responses = coord.dispatch_request([row_request(r, greedy(2, prompt_logprobs=3)) for r in rows])
            for i, (row, resp) in enumerate(zip(rows, responses)):
                ref = log_softmax(logits[f"logits_{i}"])
                prompt = row["prompt_ids"]
                assert resp.output_ids == row["greedy_ids"][:2] and resp.cached_prompt_tokens == 0
                assert resp.prompt_logprobs is not None and len(resp.prompt_logprobs) == len(prompt)
                assert resp.prompt_logprobs[0] is None
                for p, lp in enumerate(resp.prompt_logprobs[1:]):
                    assert lp is not None and lp.token_id == prompt[p + 1]
                    assert lp.logprob == pytest.approx(ref[p][lp.token_id], abs=1e-4), (model_name, kw, i, p)
                    assert [t for t, _ in lp.top] == list(np.argsort(-ref[p], kind="stable")[:3])
                    for t, v in lp.top:
                        assert v == pytest.approx(ref[p][t], abs=1e-4)
                assert resp.logprobs is None
        # The prompts were cached all along: a request without prompt_logprobs takes them from the cache.
        longest = max(rows, key=lambda r: len(r["prompt_ids"]))
        (hit,) = coord.dispatch_request([row_request(longest, greedy(1))])
        assert hit.cached_prompt_tokens > 0
    # prompt_logprobs=0: the prompt tokens' own logprobs without alternatives; none unless asked.
    (zero,) = coordinator(model_name).dispatch_request([row_request(rows[0], greedy(1, prompt_logprobs=0))])
    assert zero.prompt_logprobs is not None and all(lp is not None and lp.top == [] for lp in zero.prompt_logprobs[1:])
    (plain,) = coordinator(model_name).dispatch_request([row_request(rows[0], greedy(1))])
    assert plain.prompt_logprobs is None


def test_no_logprobs_unless_asked() -> None:
    resp = coordinator().dispatch_request([stepllm.GenerationRequest("Hello", greedy(3))])[0]
    assert resp.logprobs is None


def test_llama3_gguf_generates_what_transformers_does() -> None:
    """The llama3 fixture converted as llama.cpp converts Llama 3.1 (rope_freqs.weight, its vocabulary in GGUF
    metadata): raw prompts tokenize and decode greedily as transformers did with the original."""
    raw = [r for r in expected("llama3")["rows"] if r["kind"] == "raw"]
    gguf = FIXTURES / "gguf" / "llama3_rope.gguf"
    with stepllm.LLM(model=str(gguf), device="cpu") as llm:
        assert llm.info()["rope"] == "per-frequency factors (rope_freqs.weight)"
        out = llm.generate([r["prompt"] for r in raw], greedy(12))
    assert [o.prompt_ids for o in out] == [r["prompt_ids"] for r in raw]
    assert [o.output_ids for o in out] == [r["greedy_ids"] for r in raw]


def test_sentencepiece_gguf_loads_and_tokenizes_as_llama_cpp() -> None:
    """A llama GGUF with a SentencePiece vocabulary (as Llama 2, Mistral and TinyLlama GGUFs have): prompts get
    llama.cpp's ids for the same file, BOS first, and generation runs."""
    gguf = FIXTURES / "gguf" / "spm_vocab.gguf"
    cases = json.loads((FIXTURES / "gguf" / "spm_vocab_expected.json").read_text())["cases"]
    plain = [c for c in cases if c["decoded"] and c["text"].strip()]
    with stepllm.LLM(model=str(gguf), device="cpu") as llm:
        out = llm.generate([c["text"] for c in plain], greedy(4))
        assert [o.prompt_ids for o in out] == [c["with_bos"] for c in plain]
        assert all(len(o.output_ids) == 4 and isinstance(o.output_text, str) for o in out)
