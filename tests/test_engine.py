"""The Engine: concurrent submits, streaming, cancellation, asyncio; and LLM.stream."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

import stepllm
from conftest import check_invariants, config, expected, greedy, long_contexts_allowed, model_dir, row_request


# Requests that must still be running when a test cancels them: the tiny fixtures decode a token in tens of
# microseconds, so these run thousands of tokens (past the fixture's 256 positions: a longer max_model_len).
LONG_TOKENS = 4000


def long_engine(**kw: Any) -> stepllm.Engine:
    with long_contexts_allowed():
        return stepllm.Engine(config("qwen2", max_model_len=LONG_TOKENS + 64, kv_cache_tokens=2 * (LONG_TOKENS + 64), **kw))


def long_request() -> stepllm.GenerationRequest:
    return stepllm.GenerationRequest("Hello", greedy(LONG_TOKENS))


@pytest.fixture
def engine():
    with long_engine(max_batch_size=4) as e:
        yield e


def wait_idle(engine: stepllm.Engine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        c = stats["counts"]
        if stats["waiting"] == 0 and stats["running"] == 0 and c["live_slots"] == 0 and c["leased_blocks"] == 0:
            check_invariants(c)
            return stats
        assert time.monotonic() < deadline, f"engine never went idle: {stats}"
        time.sleep(0.01)


def test_concurrent_submits_from_threads(engine: stepllm.Engine) -> None:
    rows = expected("qwen2")["rows"]
    results: dict[int, stepllm.GenerationResponse] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            row = rows[i % len(rows)]
            results[i] = engine.submit(row_request(row)).wait()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    assert len(results) == 12
    for i, response in results.items():
        assert response.output_ids == rows[i % len(rows)]["greedy_ids"]
    stats = wait_idle(engine)
    assert stats["finished"].get("length") == 12
    assert stats["generated_tokens"] == 12 * 12


def test_request_ids_are_distinct(engine: stepllm.Engine) -> None:
    streams = [engine.submit(stepllm.GenerationRequest("Hello", greedy(2))) for _ in range(5)]
    assert len({s.request_id for s in streams}) == 5
    for s in streams:
        s.wait()


def test_streamed_text_concatenates_to_output_text(engine: stepllm.Engine) -> None:
    for row in expected("qwen2")["rows"]:
        stream = engine.submit(row_request(row))
        assert stream.response is None
        chunks = list(stream)
        assert stream.finished
        response = stream.response
        assert response is not None
        assert "".join(c.text for c in chunks) == response.output_text
        assert [t for c in chunks for t in c.token_ids] == response.output_ids == row["greedy_ids"]
        assert list(stream) == []  # an ended stream stays ended


def test_streaming_holds_back_stop_strings(engine: stepllm.Engine) -> None:
    plain = engine.submit(stepllm.GenerationRequest("Hello", greedy(12))).wait()
    stop = plain.output_text[5:8]
    assert stop
    stream = engine.submit(stepllm.GenerationRequest("Hello", greedy(12, stop=[stop])))
    text = "".join(c.text for c in stream)
    response = stream.response
    assert response.finish_reason == stepllm.FinishReason.STOP and response.stop_reason == stop
    assert stop not in response.output_text
    assert text == response.output_text == plain.output_text[: plain.output_text.index(stop)]


def test_cancel_mid_stream(engine: stepllm.Engine) -> None:
    before = engine.counts()
    stream = engine.submit(long_request())
    first = next(iter(stream))
    assert first.token_ids
    stream.cancel()
    rest = list(stream)
    response = stream.response
    assert response.finish_reason == stepllm.FinishReason.CANCELLED
    assert len(response.output_ids) < LONG_TOKENS
    assert [t for c in [first, *rest] for t in c.token_ids] == response.output_ids
    wait_idle(engine)
    after = engine.counts()
    assert after["free_slots"] == before["free_slots"]
    assert after["free_blocks"] + after["cached_blocks"] == before["free_blocks"] + before["cached_blocks"]


def test_engine_cancel_by_id_and_of_waiting_requests() -> None:
    with long_engine(max_batch_size=1) as engine:
        running = engine.submit(long_request())
        queued = engine.submit(long_request())
        next(iter(running))
        engine.cancel(queued.request_id)
        engine.cancel(running.request_id)
        engine.cancel(987654)  # unknown ids are ignored
        assert running.wait().finish_reason == stepllm.FinishReason.CANCELLED
        queued_response = queued.wait()
        assert queued_response.finish_reason == stepllm.FinishReason.CANCELLED
        wait_idle(engine)
    # The counts are published before a cancelled waiting request's response is sent.
    with long_engine(max_batch_size=1) as engine:
        running = engine.submit(long_request())
        queued = engine.submit(long_request())
        next(iter(running))
        engine.cancel(queued.request_id)
        assert queued.wait().finish_reason == stepllm.FinishReason.CANCELLED
        stats = engine.stats()
        assert (stats["waiting"], stats["running"]) == (0, 1), stats
        running.cancel()
        wait_idle(engine)


def test_dropping_a_stream_frees_its_slot(engine: stepllm.Engine) -> None:
    stream = engine.submit(long_request())
    next(iter(stream))
    del stream
    wait_idle(engine)


def test_shutdown_ends_streams_and_refuses_new_work() -> None:
    engine = long_engine()
    stream = engine.submit(long_request())
    next(iter(stream))
    engine.shutdown()
    assert stream.wait().finish_reason == stepllm.FinishReason.CANCELLED
    assert engine.is_shut_down
    engine.shutdown()  # idempotent
    with pytest.raises(stepllm.ProtocolError):
        engine.submit(stepllm.GenerationRequest("Hello", greedy(2)))
    with pytest.raises(stepllm.ProtocolError):
        engine.stats()


def test_iteration_releases_the_gil(engine: stepllm.Engine) -> None:
    """While one thread blocks in a stream, another Python thread keeps running."""
    ticks = 0
    stop = threading.Event()

    def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    try:
        engine.submit(long_request()).wait()
    finally:
        stop.set()
        t.join()
    assert ticks > 0


def test_asyncio_streaming(engine: stepllm.Engine) -> None:
    rows = expected("qwen2")["rows"]

    async def one(row: dict) -> tuple[str, stepllm.GenerationResponse]:
        stream = engine.submit(row_request(row))
        text = ""
        async for chunk in stream:
            text += chunk.text
        assert stream.response is not None
        return text, stream.response

    async def main() -> tuple[list, int]:
        beats = 0
        done = asyncio.Event()

        async def heartbeat() -> None:
            nonlocal beats
            while not done.is_set():
                beats += 1
                await asyncio.sleep(0)

        hb = asyncio.create_task(heartbeat())
        results = await asyncio.gather(*(one(r) for r in rows * 2))
        done.set()
        await hb
        return results, beats

    results, beats = asyncio.run(main())
    assert beats > 0
    for (text, response), row in zip(results, rows * 2):
        assert response.output_ids == row["greedy_ids"]
        assert text == response.output_text


def test_asyncio_cancel(engine: stepllm.Engine) -> None:
    async def main() -> stepllm.GenerationResponse:
        stream = engine.submit(long_request())
        async for _ in stream:
            stream.cancel()
        return stream.response

    assert asyncio.run(main()).finish_reason == stepllm.FinishReason.CANCELLED
    wait_idle(engine)


def test_engine_info_and_stats(engine: stepllm.Engine) -> None:
    info = engine.info()
    assert info["architecture"] == "Qwen2ForCausalLM" and info["vocab_size"] == 400
    stats = engine.stats()
    assert set(stats) >= {"waiting", "running", "counts", "prompt_tokens", "generated_tokens", "finished", "steps"}


def test_engine_from_keywords_and_progress() -> None:
    calls = []
    with stepllm.Engine(model=model_dir("llama"), device="cpu", progress=lambda d, t: calls.append((d, t))) as e:
        assert e.submit(stepllm.GenerationRequest("Hello", greedy(3))).wait().output_ids
    assert calls[0][0] == 0 and calls[-1][0] == calls[-1][1]
    with pytest.raises(TypeError):
        stepllm.Engine(config("llama"), device="cpu")


# ------------------------------------------------------------------------------------------------ LLM

def test_llm_stream_matches_generate() -> None:
    with stepllm.LLM(model=model_dir("qwen3"), device="cpu") as llm:
        for row in expected("qwen3")["rows"]:
            prompt = row["prompt"]
            chunks = list(llm.stream(prompt, greedy(12)))
            if row["kind"] == "chat":
                full = llm.chat(prompt, greedy(12))[0]
            else:
                full = llm.generate(prompt, greedy(12))[0]
            assert "".join(chunks) == full.output_text
            assert full.output_ids == row["greedy_ids"]


def test_llm_stream_closed_early_cancels() -> None:
    with stepllm.LLM(model=model_dir("qwen2"), device="cpu") as llm:
        # close() returns once the engine has let the request go (repeated: the engine thread could otherwise
        # still hold it now and then)
        for _ in range(100):
            it = llm.stream("Hello", greedy(200))
            next(it)
            it.close()
            counts = llm.engine.counts()
            assert counts["live_slots"] == 0 and counts["leased_blocks"] == 0, counts
        wait_idle(llm.engine)


def test_llm_per_prompt_sampling_and_defaults() -> None:
    with stepllm.LLM(model=model_dir("qwen2"), device="cpu", max_batch_size=2) as llm:
        out = llm.generate(["Hello", "The capital of France is"], [greedy(3), greedy(5)])
        assert [len(o.output_ids) for o in out] == [3, 5]
        assert llm.generate([]) == []
        default = llm.generate("Hello")[0]
        assert 1 <= len(default.output_ids) <= 16
        with pytest.raises(ValueError):
            llm.generate(["a", "b"], [greedy(3)])


@pytest.mark.parametrize("budget", [1, 24, 8192])
def test_batched_prefill_gives_transformers_greedy_ids_whatever_the_token_budget(budget: int) -> None:
    # Submitted together, the rows are prefilled in groups of up to `budget` prompt tokens (one at a time at 1).
    rows = expected("qwen2")["rows"]
    with stepllm.Engine(config("qwen2", max_prefill_tokens=budget)) as e:
        streams = [e.submit(row_request(row)) for row in rows]
        results = [s.wait() for s in streams]
        stats = wait_idle(e)
    for row, r in zip(rows, results):
        assert r.output_ids == row["greedy_ids"]
    assert stats["finished"] == {"length": len(rows)}


def test_stats_count_a_request_done_once_its_wait_returns() -> None:
    """The engine updates its counts before it tells the caller: stats() right after wait() never lists the
    finished request as running (it did, at times, when the counts were published after the response)."""
    with stepllm.Engine(config(max_batch_size=2)) as engine:
        for i in range(100):
            engine.submit(stepllm.GenerationRequest([5 + i % 7, 6], greedy(1))).wait()
            stats = engine.stats()
            assert stats["running"] == 0 and stats["waiting"] == 0, (i, stats)


@pytest.mark.parametrize("stop", [None, ["zq"]])
def test_stream_chunks_carry_the_logprobs_of_their_own_tokens(stop: list[str] | None) -> None:
    """Each chunk's logprobs are one per token, for its tokens (also while a stop-string prefix holds its text
    back); together they are the response's. Without logprobs asked, chunks carry none."""
    with stepllm.Engine(config(max_batch_size=2)) as engine:
        sampling = stepllm.SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, stop=stop, ignore_eos=True)
        stream = engine.submit(stepllm.GenerationRequest([5, 6, 7], sampling))
        chunks = list(stream)
        response = stream.wait()
        assert len(chunks) > 1
        for c in chunks:
            assert c.logprobs is not None and [lp.token_id for lp in c.logprobs] == c.token_ids
        assert [lp for c in chunks for lp in (c.logprobs or [])] == response.logprobs
        plain = engine.submit(stepllm.GenerationRequest([5, 6, 7], greedy(4)))
        assert all(c.logprobs is None for c in plain)


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_a_streams_first_chunk_carries_the_prompt_logprobs(max_tokens: int) -> None:
    """The prompt's logprobs come whole with the first chunk (so a server can send an echoed prompt's logprobs
    before the tokens), also when the first token ends the request; no other chunk has them, nor any unasked."""
    with stepllm.Engine(config(max_batch_size=2)) as engine:
        sampling = stepllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
        stream = engine.submit(stepllm.GenerationRequest([5, 6, 7], sampling))
        chunks = list(stream)
        response = stream.wait()
        assert response.prompt_logprobs is not None and len(response.prompt_logprobs) == 3
        assert chunks and chunks[0].prompt_logprobs == response.prompt_logprobs
        assert all(c.prompt_logprobs is None for c in chunks[1:])
        assert all(c.prompt_logprobs is None for c in engine.submit(stepllm.GenerationRequest([5, 6, 7], greedy(max_tokens))))
