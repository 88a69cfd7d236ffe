"""Bad input raises the right exception and changes nothing; operations in the wrong order are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

import stepllm
from conftest import FIXTURES, check_invariants, config, coordinator, greedy, same_except_cache

# ------------------------------------------------------------------------------------------------ sampling values

BAD_SAMPLING: list[dict[str, Any]] = [
    {"max_tokens": 0},
    {"max_tokens": -1},
    {"temperature": -0.5},
    {"temperature": float("nan")},
    {"temperature": float("inf")},
    {"top_k": -1},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"min_p": -0.1},
    {"min_p": 1.5},
    {"seed": -1},
    {"repetition_penalty": 0.0},
    {"repetition_penalty": -1.0},
    {"presence_penalty": 2.5},
    {"frequency_penalty": -2.5},
    {"logit_bias": {1: 101.0}},
    {"logit_bias": {-1: 1.0}},
    {"logprobs": 21},
    {"logprobs": -1},
    {"stop": [""]},
    {"stop": ""},
    {"stop_token_ids": [-3]},
]


@pytest.mark.parametrize("kw", BAD_SAMPLING, ids=lambda kw: ",".join(f"{k}={v!r}" for k, v in kw.items()))
def test_out_of_range_sampling_values_raise_invalid_request(kw: dict[str, Any]) -> None:
    (field,) = kw
    with pytest.raises(stepllm.InvalidRequestError, match=field):
        stepllm.SamplingParams(**kw)


def test_a_negative_temperature_is_refused_with_the_allowed_range_in_words() -> None:
    with pytest.raises(stepllm.InvalidRequestError) as e:
        stepllm.SamplingParams(temperature=-0.5)
    assert str(e.value).endswith("temperature must be a finite number >= 0 (0 means greedy), got -0.5")


def test_invalid_request_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        stepllm.SamplingParams(max_tokens=0)
    assert issubclass(stepllm.InvalidRequestError, stepllm.StepllmError)
    assert issubclass(stepllm.ProtocolError, RuntimeError)
    assert issubclass(stepllm.StaleRefError, stepllm.ProtocolError)
    assert issubclass(stepllm.ModelLoadError, stepllm.StepllmError)
    assert issubclass(stepllm.DeviceError, stepllm.StepllmError)


@pytest.mark.parametrize(
    "kw",
    [{"max_batch_size": 0}, {"block_size": 0}, {"kv_cache_tokens": 8, "block_size": 16}, {"parallel": stepllm.ParallelConfig(tensor_parallel_size=0)},
     {"parallel": stepllm.ParallelConfig(tensor_parallel_size=2, devices=[0])}, {"gpu_memory_utilization": 0.0},
     {"gpu_memory_utilization": 1.5}],
)
def test_bad_config_raises_invalid_request(kw: dict[str, Any]) -> None:
    with pytest.raises(stepllm.InvalidRequestError):
        stepllm.Config(model=str(FIXTURES / "llama"), **kw)


def test_max_model_len_past_the_trained_positions_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STEPLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    trained = json.loads((FIXTURES / "llama" / "config.json").read_text())["max_position_embeddings"]
    assert coordinator("llama", max_model_len=trained).info()["max_model_len"] == trained
    with pytest.raises(stepllm.InvalidRequestError, match=f"max_model_len {trained + 1} .* max_position_embeddings \\({trained}\\)"):
        coordinator("llama", max_model_len=trained + 1)
    monkeypatch.setenv("STEPLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert coordinator("llama", max_model_len=trained + 1).info()["max_model_len"] == trained + 1


@pytest.mark.parametrize("kw", [{"lookup": "maybe"}, {"commit": "sometimes"}])
def test_bad_context_cache_config(kw: dict[str, Any]) -> None:
    with pytest.raises(stepllm.InvalidRequestError):
        stepllm.ContextCacheConfig(**kw)


@pytest.mark.parametrize("prompt", [3.5, None, {"role": "user"}, [1, "a"], [{"role": "user"}], [{"content": "x"}], [1.5]])
def test_malformed_prompt_raises_invalid_request(prompt: Any) -> None:
    with pytest.raises(stepllm.InvalidRequestError):
        stepllm.GenerationRequest(prompt=prompt)


def test_bad_device_name() -> None:
    with pytest.raises(stepllm.InvalidRequestError):
        stepllm.RuntimeCoordinator(config(device="tpu"))


# ------------------------------------------------------------------------------------------------ requests a model refuses

def long_prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 300 + 10 for i in range(n)]


BAD_REQUESTS: dict[str, Callable[[], stepllm.GenerationRequest]] = {
    "empty text": lambda: stepllm.GenerationRequest(""),
    "empty token list": lambda: stepllm.GenerationRequest([]),
    "prompt longer than the KV capacity": lambda: stepllm.GenerationRequest(long_prompt(200), greedy(4)),
    "max_tokens above the limit": lambda: stepllm.GenerationRequest("Hello", stepllm.SamplingParams(max_tokens=100_000)),
    "prompt token outside the vocabulary": lambda: stepllm.GenerationRequest([5, 400], greedy(2)),
    "huge prompt token": lambda: stepllm.GenerationRequest([2**32 - 1], greedy(2)),
    "logit bias outside the vocabulary": lambda: stepllm.GenerationRequest("Hello", stepllm.SamplingParams(logit_bias={400: 1.0})),
    "stop token outside the vocabulary": lambda: stepllm.GenerationRequest("Hello", stepllm.SamplingParams(stop_token_ids=[1000])),
}


def small_coordinator() -> stepllm.RuntimeCoordinator:
    # 128 KV tokens: a 200-token prompt can never fit
    return coordinator("llama", kv_cache_tokens=128, block_size=16)


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_raises_and_changes_nothing(name: str) -> None:
    coord = small_coordinator()
    request = BAD_REQUESTS[name]()
    before = coord.counts()
    with pytest.raises(stepllm.InvalidRequestError):
        coord.begin_stepped(request)
    assert coord.counts() == before
    with pytest.raises(stepllm.InvalidRequestError):
        coord.dispatch_request([stepllm.GenerationRequest("Hello", greedy(2)), request])
    assert coord.counts() == before
    # inside a running session: admit raises, the session is untouched and still works
    stepped = coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(4)))
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    during, residents = stepped.counts(), stepped.residents()
    with pytest.raises(stepllm.InvalidRequestError):
        stepped.admit(request, original_index=1, request_id=2)
    with pytest.raises(stepllm.InvalidRequestError):
        stepped.build_intent(request, original_index=1, request_id=2)
    assert stepped.counts() == during and stepped.residents() == residents
    while stepped.residents():
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    assert stepped.finish().output_ids
    same_except_cache(before, coord.counts())


def test_bad_request_through_engine_and_llm_raises() -> None:
    with stepllm.LLM(model=str(FIXTURES / "llama"), device="cpu", kv_cache_tokens=128) as llm:
        before = llm.engine.counts()
        for make in BAD_REQUESTS.values():
            with pytest.raises(stepllm.InvalidRequestError):
                llm.engine.submit(make())
        # "Hello" is queued before "" raises; it is cancelled and let go before generate raises (checked many
        # times: the engine thread could otherwise still hold it now and then).
        for _ in range(200):
            with pytest.raises(stepllm.InvalidRequestError):
                llm.generate(["Hello", ""], greedy(8))
            assert llm.engine.counts() == before
        assert llm.generate("Hello", greedy(2))[0].output_ids


def test_request_id_zero_is_refused() -> None:
    coord = coordinator()
    with pytest.raises(stepllm.InvalidRequestError):
        coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(2)), request_id=0)


# ------------------------------------------------------------------------------------------------ model files

def copy_fixture(tmp_path: Path, name: str = "qwen2") -> Path:
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    return d


def edit_config(d: Path, **changes: Any) -> None:
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))


MUTATIONS: dict[str, Callable[[Path], None]] = {
    "unknown architecture": lambda d: edit_config(d, architectures=["FooForCausalLM"], model_type="foo"),
    "config disagrees with weights": lambda d: edit_config(d, vocab_size=10),
    "no config.json": lambda d: (d / "config.json").unlink(),
    "config.json not JSON": lambda d: (d / "config.json").write_text("{not json"),
    "no weights": lambda d: (d / "model.safetensors").unlink(),
    "truncated weights": lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:5000]),
    "garbage weights": lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64),
    "no tokenizer.json": lambda d: (d / "tokenizer.json").unlink(),
    "corrupt tokenizer.json": lambda d: (d / "tokenizer.json").write_text("garbage"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_broken_model_directory_raises_model_load_error(tmp_path: Path, name: str) -> None:
    d = copy_fixture(tmp_path)
    MUTATIONS[name](d)
    with pytest.raises(stepllm.ModelLoadError):
        stepllm.RuntimeCoordinator(stepllm.Config(model=str(d), device="cpu"))
    with pytest.raises(stepllm.ModelLoadError):
        stepllm.LLM(model=d, device="cpu")


def test_missing_shard_raises_model_load_error(tmp_path: Path) -> None:
    d = copy_fixture(tmp_path, "llama")
    (d / "model-00003-of-00008.safetensors").unlink()
    with pytest.raises(stepllm.ModelLoadError):
        stepllm.RuntimeCoordinator(stepllm.Config(model=str(d), device="cpu"))


@pytest.mark.parametrize("path", ["/nonexistent/model", str(FIXTURES / "make_fixtures.py"), str(FIXTURES)])
def test_missing_model_raises_model_load_error(path: str) -> None:
    with pytest.raises(stepllm.ModelLoadError):
        stepllm.RuntimeCoordinator(stepllm.Config(model=path, device="cpu"))


# ------------------------------------------------------------------------------------------------ stale refs and order

def begun(coord: stepllm.RuntimeCoordinator, max_tokens: int = 6) -> stepllm.SteppedRequest:
    stepped = coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(max_tokens)))
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=stepped.founder()))
    return stepped


def unchanged(stepped: stepllm.SteppedRequest, call: Callable[[], Any], exc: type[BaseException]) -> None:
    counts, residents = stepped.counts(), stepped.residents()
    with pytest.raises(exc):
        call()
    assert stepped.counts() == counts
    assert stepped.residents() == residents
    check_invariants(counts)


def test_stale_refs_are_refused_everywhere() -> None:
    coord = coordinator()
    stepped = begun(coord, max_tokens=2)
    founder = stepped.founder()
    step = stepped.decode(stepllm.ImmutableDecodeBatch(residents=[founder]))
    assert [r for r, _ in step.finished] == [founder]
    adm = stepped.admit(stepllm.GenerationRequest("Hello", greedy(6)), original_index=1, request_id=2)
    assert adm.ref.slot == founder.slot and adm.ref.epoch != founder.epoch  # the slot came back, a new epoch
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
    never = stepllm.ResidentRef(slot=99, epoch=0)
    for stale in (founder, never):
        unchanged(stepped, lambda: stepped.decode(stepllm.ImmutableDecodeBatch(residents=[stale])), stepllm.StaleRefError)
        unchanged(stepped, lambda: stepped.decode(stepllm.ImmutableDecodeBatch(residents=[adm.ref, stale])), stepllm.StaleRefError)
        unchanged(stepped, lambda: stepped.cancel(stale), stepllm.StaleRefError)
    unchanged(stepped, lambda: stepped.prefill(stepllm.ImmutablePrefillBatch(target=never)), stepllm.StaleRefError)
    # the live one still runs to the end
    while stepped.residents():
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    stepped.finish()


def test_operations_in_the_wrong_order_are_refused() -> None:
    coord = coordinator()
    before = coord.counts()
    stepped = coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(6)))
    founder = stepped.founder()
    # decode before the founder's first token is reported
    unchanged(stepped, lambda: stepped.decode(stepllm.ImmutableDecodeBatch(residents=[founder])), stepllm.ProtocolError)
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder))
    # prefill of a ref that is not seated (the founder is running)
    unchanged(stepped, lambda: stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder)), stepllm.ProtocolError)
    # an empty decode batch, a duplicate one
    unchanged(stepped, lambda: stepped.decode(stepllm.ImmutableDecodeBatch(residents=[])), stepllm.ProtocolError)
    unchanged(stepped, lambda: stepped.decode(stepllm.ImmutableDecodeBatch(residents=[founder, founder])), stepllm.ProtocolError)
    adm = stepped.admit(stepllm.GenerationRequest("The capital", greedy(6)), original_index=1, request_id=2)
    assert adm.status == stepllm.AdmissionStatus.ADMITTED
    # while a seated prefill is pending: decode, another admit, another prefill target are refused
    unchanged(stepped, lambda: stepped.decode(stepllm.ImmutableDecodeBatch(residents=[founder])), stepllm.ProtocolError)
    unchanged(stepped, lambda: stepped.admit(stepllm.GenerationRequest("Hi", greedy(2)), 2, 3), stepllm.ProtocolError)
    unchanged(stepped, lambda: stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder)), stepllm.ProtocolError)
    # decode of a seated, not yet prefilled ref is refused too
    stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
    # finish() while residents live
    unchanged(stepped, stepped.finish, stepllm.ProtocolError)
    # a second session on the same coordinator
    with pytest.raises(stepllm.ProtocolError):
        coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(2)))
    with pytest.raises(stepllm.ProtocolError):
        coord.dispatch_request([stepllm.GenerationRequest("Hello", greedy(2))])
    stepped.abort()
    same_except_cache(before, coord.counts())
    # everything after abort is refused (abort itself is idempotent)
    stepped.abort()
    assert stepped.closed and stepped.residents() == []
    for call in (
        lambda: stepped.decode(stepllm.ImmutableDecodeBatch(residents=[founder])),
        lambda: stepped.prefill(stepllm.ImmutablePrefillBatch(target=founder)),
        lambda: stepped.admit(stepllm.GenerationRequest("Hi", greedy(2)), 1, 2),
        lambda: stepped.cancel(founder),
        stepped.finish,
    ):
        with pytest.raises(stepllm.ProtocolError):
            call()
    same_except_cache(before, coord.counts())
    # the coordinator is free again
    assert coord.dispatch_request([stepllm.GenerationRequest("Hello", greedy(3))])[0].output_ids


def test_abort_is_idempotent_and_releases_everything() -> None:
    coord = coordinator()
    before = coord.counts()
    stepped = begun(coord, max_tokens=20)
    for i in range(1, 4):
        adm = stepped.admit(stepllm.GenerationRequest([10 + i] * (5 + 9 * i), greedy(20)), original_index=i, request_id=i + 1)
        assert adm.status == stepllm.AdmissionStatus.ADMITTED
        if i < 3:
            stepped.prefill(stepllm.ImmutablePrefillBatch(target=adm.ref))
    # the last one is left seated, not prefilled
    assert coord.counts()["live_slots"] == 4
    stepped.abort()
    same_except_cache(before, coord.counts())
    stepped.abort()
    same_except_cache(before, coord.counts())
    with stepped:  # leaving a with block aborts again: still fine
        pass
    same_except_cache(before, coord.counts())


def test_dropped_session_releases_everything() -> None:
    coord = coordinator()
    before = coord.counts()
    stepped = begun(coord)
    del stepped
    import gc

    gc.collect()
    same_except_cache(before, coord.counts())
    coord.begin_stepped(stepllm.GenerationRequest("Hello", greedy(2))).abort()


def test_finish_closes_the_session() -> None:
    coord = coordinator()
    stepped = begun(coord, max_tokens=3)
    while stepped.residents():
        stepped.decode(stepllm.ImmutableDecodeBatch(residents=stepped.residents()))
    response = stepped.finish()
    assert response.finish_reason == stepllm.FinishReason.LENGTH and len(response.output_ids) == 3
    with pytest.raises(stepllm.ProtocolError):
        stepped.finish()
    stepped.abort()  # a no-op now
    assert stepped.closed


def test_no_capacity_changes_nothing() -> None:
    coord = coordinator(max_batch_size=1)
    stepped = begun(coord)
    counts, residents = stepped.counts(), stepped.residents()
    adm = stepped.admit(stepllm.GenerationRequest("Hello", greedy(4)), original_index=1, request_id=2)
    assert adm.status == stepllm.AdmissionStatus.NO_CAPACITY and adm.ref is None and adm.reason
    assert stepped.counts() == counts and stepped.residents() == residents
    stepped.abort()


def test_cuda_config_without_a_gpu_is_a_clear_device_error() -> None:
    try:
        stepllm.Config(device="cuda")
    except stepllm.DeviceError as e:
        assert 'device="cpu"' in str(e)
    else:
        pytest.skip("a CUDA GPU is usable here")
    with pytest.raises(stepllm.InvalidRequestError, match="unknown device"):
        stepllm.Config(device="tpu")


# ------------------------------------------------------------------------------ sizes near the integer limits


@pytest.mark.parametrize("kw,field", [
    ({"kv_cache_tokens": 2**64 - 1}, "kv_cache_tokens"),
    ({"kv_cache_tokens": 2**40}, "kv_cache_tokens"),
    ({"max_batch_size": 2**62}, "max_batch_size"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_model_len": 1}, "max_model_len"),
])
def test_sizes_out_of_range_are_refused_by_the_config(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(stepllm.InvalidRequestError, match=field):
        stepllm.Config(model=str(FIXTURES / "llama"), device="cpu", **kw)


@pytest.mark.parametrize("max_tokens", [2**64 - 1, 2**64 - 17, 2**63])
def test_a_max_tokens_near_the_integer_limit_is_refused_and_leaves_the_coordinator_usable(max_tokens: int) -> None:
    coord = coordinator(max_batch_size=2, kv_cache_tokens=256, block_size=4)
    huge = stepllm.GenerationRequest([5] * 20, stepllm.SamplingParams(max_tokens=max_tokens))
    with pytest.raises(stepllm.InvalidRequestError, match="max_tokens"):
        coord.begin_stepped(huge)
    with pytest.raises(stepllm.InvalidRequestError, match="max_tokens"):
        coord.dispatch_request([stepllm.GenerationRequest([5, 6], greedy(3)), huge])
    assert coord.counts()["live_slots"] == 0 and coord.counts()["leased_blocks"] == 0
    (ok,) = coord.dispatch_request([stepllm.GenerationRequest([5, 6, 7], greedy(3))])
    assert len(ok.output_ids) == 3


# ------------------------------------------------------------------------------------ pinned system prompts


def test_pinned_system_prompts_count_against_what_can_ever_fit() -> None:
    """16 blocks of 4, 10 pinned by a system prompt: a request needing 8 can never run (REJECTED in a session, an
    ERROR response from dispatch_request, which still answers the others), one that extends the system prompt can."""
    coord = coordinator(max_batch_size=2, kv_cache_tokens=64, block_size=4)
    system = list(range(100, 140))
    assert coord.gen_and_save_system_prompt_kv_cache(system) == 40
    assert coord.counts()["pinned_blocks"] == 10
    big = stepllm.GenerationRequest(list(range(3, 23)), stepllm.SamplingParams(max_tokens=12, ignore_eos=True))
    small = stepllm.GenerationRequest([5, 6, 7], greedy(4))
    alone = coordinator(max_batch_size=2, kv_cache_tokens=64, block_size=4).dispatch_request([small])[0]
    small_out, big_out = coord.dispatch_request([small, big])
    assert small_out.output_ids == alone.output_ids
    assert big_out.finish_reason == stepllm.FinishReason.ERROR and "pinned" in (big_out.error or ""), big_out.error
    with coord.begin_stepped(small) as stepped:
        stepped.prefill(stepllm.ImmutablePrefillBatch(stepped.founder()))
        result = stepped.admit(big, 1, 2)
        assert result.status == stepllm.AdmissionStatus.REJECTED and "pinned" in result.reason, result.reason
        stepped.abort()
    extends = stepllm.GenerationRequest(system + [7, 8, 9], greedy(8))
    (hit,) = coord.dispatch_request([extends])
    assert hit.cached_prompt_tokens == 40 and len(hit.output_ids) == 8
    check_invariants(coord.counts())


def test_a_request_that_can_never_fit_is_rejected_even_while_the_slots_are_full() -> None:
    coord = coordinator(max_batch_size=1, kv_cache_tokens=64, block_size=4)
    with coord.begin_stepped(stepllm.GenerationRequest([5, 6, 7], greedy(8))) as stepped:
        stepped.prefill(stepllm.ImmutablePrefillBatch(stepped.founder()))
        never = stepllm.GenerationRequest(list(range(3, 53)), stepllm.SamplingParams(max_tokens=30))
        assert stepped.admit(never, 1, 2).status == stepllm.AdmissionStatus.REJECTED
        fits = stepllm.GenerationRequest([8, 9], greedy(2))
        assert stepped.admit(fits, 2, 3).status == stepllm.AdmissionStatus.NO_CAPACITY
        stepped.abort()


@pytest.mark.parametrize("case", ["longer than max_model_len", "the whole cache", "cache disabled"])
def test_system_prompts_that_could_never_serve_a_request_are_refused(case: str) -> None:
    if case == "longer than max_model_len":
        coord = coordinator(kv_cache_tokens=1024, block_size=4, max_model_len=32)
        prompt, match = list(range(100, 164)), "max_model_len"
    elif case == "the whole cache":
        coord = coordinator(kv_cache_tokens=64, block_size=4)
        prompt, match = list(range(100, 164)), "no block"
    else:
        coord = coordinator(kv_cache_tokens=256, block_size=4, context_cache=stepllm.ContextCacheConfig(enabled=False))
        prompt, match = list(range(100, 140)), "disabled"
    before = coord.counts()
    with pytest.raises(stepllm.InvalidRequestError, match=match):
        coord.gen_and_save_system_prompt_kv_cache(prompt)
    assert coord.counts() == before


def test_saving_a_system_prompt_reports_the_tokens_the_cache_kept() -> None:
    coord = coordinator(kv_cache_tokens=256, block_size=4, context_cache=stepllm.ContextCacheConfig(max_records=2))
    assert coord.gen_and_save_system_prompt_kv_cache(list(range(100, 140))) == 8
    assert coord.counts()["pinned_blocks"] == 2


def test_a_system_prompt_over_an_earlier_requests_cached_blocks_pins_them_too() -> None:
    coord = coordinator(kv_cache_tokens=256, block_size=4)
    system = list(range(100, 120))
    coord.dispatch_request([stepllm.GenerationRequest(system + [7], greedy(2))])
    assert coord.gen_and_save_system_prompt_kv_cache(system) == 20
    assert coord.counts()["pinned_blocks"] == 5


# -------------------------------------------------------------------------------------- intents and LoRA names


def test_an_intent_built_by_another_coordinator_is_checked_against_this_one() -> None:
    wide = coordinator(kv_cache_tokens=1024, block_size=4)
    narrow = coordinator(kv_cache_tokens=1024, block_size=4, max_model_len=32)
    with wide.begin_stepped(stepllm.GenerationRequest([5, 6], greedy(2))) as a:
        intent = a.build_intent(stepllm.GenerationRequest(list(range(3, 63)), greedy(8)), 0, 7)
        a.abort()
    with narrow.begin_stepped(stepllm.GenerationRequest([5, 6], greedy(2))) as b:
        b.prefill(stepllm.ImmutablePrefillBatch(b.founder()))
        with pytest.raises(stepllm.InvalidRequestError, match="max_model_len|context length"):
            b.admit_intent(intent)
        assert b.seated() == []
        b.abort()


def test_a_lora_name_is_refused_since_no_adapter_can_be_loaded() -> None:
    coord = coordinator()
    with pytest.raises(stepllm.InvalidRequestError, match="lora_name"):
        coord.dispatch_request([stepllm.GenerationRequest([5, 6], greedy(2), lora_name="my-adapter")])


# ------------------------------------------------------------------------------------------------ LLM prompts


def test_llm_generate_refuses_a_dict_and_takes_integer_arrays_as_token_ids() -> None:
    np = pytest.importorskip("numpy")
    llm = stepllm.LLM(str(FIXTURES / "llama"), device="cpu", max_batch_size=2, kv_cache_tokens=512)
    try:
        with pytest.raises(stepllm.InvalidRequestError, match="LLM.chat"):
            llm.generate({"role": "user", "content": "x"}, greedy(2))  # type: ignore[arg-type]
        (expected,) = llm.generate([5, 6, 7], greedy(3))
        (array,) = llm.generate(np.array([5, 6, 7]), greedy(3))  # type: ignore[arg-type]
        (ints,) = llm.generate([[np.int64(5), np.int64(6), np.int64(7)]], greedy(3))
        assert array.output_ids == expected.output_ids == ints.output_ids
    finally:
        llm.close()


def test_a_model_path_under_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(FIXTURES / "llama", tmp_path / "llama")
    monkeypatch.setenv("HOME", str(tmp_path))
    coord = stepllm.RuntimeCoordinator(stepllm.Config(model="~/llama", device="cpu", kv_cache_tokens=256))
    (out,) = coord.dispatch_request([stepllm.GenerationRequest([5, 6, 7], greedy(2))])
    assert len(out.output_ids) == 2
