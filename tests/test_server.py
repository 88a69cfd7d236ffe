"""The OpenAI-compatible server through the official openai client (sync and async, streamed and not): greedy
texts equal LLM.generate / LLM.chat, per-request fields, 32 concurrent streams, the default model, `stepllm serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest

import stepllm
from conftest import model_dir
from stepllm.server import BackgroundServer
from test_server_helpers import (
    TIMEOUT,
    async_client,
    fixture_llm,
    http,
    idle_after,  # noqa: F401 - a fixture
    sync_client,
    wait_for,
    wait_idle,
)

PROMPTS = ["Hello", "The quick brown fox", "Once upon a time", "1 2 3 4", "a", "What is the capital of France?"]
CHAT: Any = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]

pytestmark = pytest.mark.usefixtures("idle_after")


@pytest.fixture(scope="module")
def llm() -> Iterator[stepllm.LLM]:
    with fixture_llm("qwen2") as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm: stepllm.LLM) -> Iterator[BackgroundServer]:
    with BackgroundServer(llm.engine) as s:
        yield s


def greedy(max_tokens: int = 12, **kw: Any) -> stepllm.SamplingParams:
    return stepllm.SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def test_models_and_health(server: BackgroundServer) -> None:
    models = sync_client(server).models.list()
    assert [m.id for m in models.data] == ["qwen2"]
    with http(server) as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/nope").status_code == 404
        assert c.get("/v1/completions").status_code == 405


def test_completions_sync_match_llm_generate(server: BackgroundServer, llm: stepllm.LLM) -> None:
    client = sync_client(server)
    for prompt in PROMPTS:
        want = llm.generate(prompt, greedy(12))[0]
        got = client.completions.create(model="qwen2", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want.output_text
        assert got.choices[0].finish_reason == "length"
        assert got.object == "text_completion" and got.model == "qwen2" and got.id.startswith("cmpl-")
        assert got.usage is not None
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_ids), 12)
        assert got.usage.total_tokens == len(want.prompt_ids) + 12

        chunks = list(client.completions.create(model="qwen2", prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want.output_text
        assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_token_id_prompt_matches(server: BackgroundServer, llm: stepllm.LLM) -> None:
    ids = [5, 17, 42, 99, 123]
    want = llm.generate(ids, greedy(8))[0]
    got = sync_client(server).completions.create(model="qwen2", prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.output_text
    assert got.usage is not None and got.usage.prompt_tokens == len(ids)


def test_chat_sync_matches_llm_chat(server: BackgroundServer, llm: stepllm.LLM) -> None:
    client = sync_client(server)
    want = llm.chat(CHAT, greedy(16))[0]
    got = client.chat.completions.create(model="qwen2", messages=CHAT, max_tokens=16, temperature=0)
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == want.output_text
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.usage is not None and got.usage.prompt_tokens == len(want.prompt_ids)

    stream = client.chat.completions.create(
        model="qwen2", messages=CHAT, max_completion_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.output_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # include_usage: every chunk has usage null except the last, which has no choices and the totals.
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == len(want.prompt_ids)


def test_async_client_streams_and_not(server: BackgroundServer, llm: stepllm.LLM) -> None:
    want_text = llm.generate("Hello", greedy(10))[0].output_text
    want_chat = llm.chat(CHAT, greedy(10))[0].output_text

    async def main() -> None:
        async with async_client(server) as client:
            c = await client.completions.create(model="qwen2", prompt="Hello", max_tokens=10, temperature=0)
            assert c.choices[0].text == want_text
            text = ""
            async for chunk in await client.completions.create(model="qwen2", prompt="Hello", max_tokens=10, temperature=0, stream=True):
                text += chunk.choices[0].text
            assert text == want_text
            r = await client.chat.completions.create(model="qwen2", messages=CHAT, max_tokens=10, temperature=0)
            assert r.choices[0].message.content == want_chat
            text = ""
            async for ch in await client.chat.completions.create(model="qwen2", messages=CHAT, max_tokens=10, temperature=0, stream=True):
                text += ch.choices[0].delta.content or ""
            assert text == want_chat

    asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def test_32_concurrent_streams_match_sequential(server: BackgroundServer) -> None:
    client = sync_client(server)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    sequential = [client.completions.create(model="qwen2", prompt=p, max_tokens=16, temperature=0).choices[0].text for p in prompts]

    async def one(aclient: Any, prompt: str) -> str:
        text = ""
        async for chunk in await aclient.completions.create(model="qwen2", prompt=prompt, max_tokens=16, temperature=0, stream=True):
            text += chunk.choices[0].text
        return text

    async def main() -> list[str]:
        async with async_client(server) as aclient:
            return list(await asyncio.gather(*(one(aclient, p) for p in prompts)))

    concurrent = asyncio.run(asyncio.wait_for(main(), 2 * TIMEOUT))
    assert concurrent == sequential
    assert len(set(sequential)) > 1


def test_sampling_fields_are_honoured(server: BackgroundServer, llm: stepllm.LLM) -> None:
    client = sync_client(server)

    def text(**kw: Any) -> str:
        return client.completions.create(model="qwen2", prompt="Hello", **kw).choices[0].text

    # Seeded sampling is reproducible and equals LLM.generate with the same values.
    fields: dict[str, Any] = dict(temperature=0.9, top_p=0.9, seed=1234, presence_penalty=0.5, frequency_penalty=0.3)
    extra: dict[str, Any] = dict(top_k=50, min_p=0.01, repetition_penalty=1.1)
    want = llm.generate("Hello", stepllm.SamplingParams(max_tokens=12, **fields, **extra))[0].output_text
    assert text(max_tokens=12, extra_body=extra, **fields) == want
    assert text(max_tokens=12, extra_body=extra, **fields) == want
    # A stop string ends the text and is trimmed, as in LLM.generate.
    plain = llm.generate("Hello", greedy(12))[0].output_text
    stop = plain[4:6]
    r = client.completions.create(model="qwen2", prompt="Hello", max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].text == plain[: plain.index(stop)] and r.choices[0].finish_reason == "stop"
    assert (r.choices[0].model_extra or {}).get("stop_reason") == stop  # vLLM's extension field
    # vLLM's include_stop_str_in_output keeps the stop; min_tokens passes over a stop met in its first tokens.
    kept = client.completions.create(model="qwen2", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == plain[: plain.index(stop) + len(stop)] and kept.choices[0].finish_reason == "stop"
    late = llm.generate("Hello", greedy(12, stop=[stop], min_tokens=12))[0]
    r = client.completions.create(model="qwen2", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"min_tokens": 12})
    assert r.choices[0].text == late.output_text and late.output_text.startswith(plain[: plain.index(stop) + len(stop)])
    with pytest.raises(openai.BadRequestError, match="min_tokens"):
        client.completions.create(model="qwen2", prompt="Hello", max_tokens=2, extra_body={"min_tokens": 3})
    # logit_bias forces a token; logprobs name the tokens.
    r = client.completions.create(model="qwen2", prompt="Hello", max_tokens=4, temperature=0, logit_bias={"77": 100}, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens == [llm.engine.decode_token(77)] * 4
    # the legacy completions shape keys alternatives by text, so two byte tokens that both render as "\ufffd" merge
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.token_logprobs is not None and all(v <= 0 for v in lp.token_logprobs)
    # max_completion_tokens bounds a chat reply; logprobs / top_logprobs in the chat shape.
    c = client.chat.completions.create(model="qwen2", messages=CHAT, max_completion_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
    assert c.usage is not None and c.usage.completion_tokens == 3
    assert c.choices[0].logprobs is not None
    content = c.choices[0].logprobs.content
    assert content is not None and len(content) == 3 and all(len(t.top_logprobs) == 3 for t in content)
    want_ids = llm.chat(CHAT, greedy(3, logprobs=3))[0].output_ids
    assert [t.token for t in content] == [llm.engine.decode_token(i) for i in want_ids]
    # Streaming with logprobs: each chunk carries its own tokens' logprobs (they came in one chunk after the text).
    chunks = list(client.chat.completions.create(model="qwen2", messages=CHAT, max_tokens=3, temperature=0, logprobs=True, stream=True))
    streamed = [t.token for ch in chunks if ch.choices and ch.choices[0].logprobs for t in (ch.choices[0].logprobs.content or [])]
    assert streamed == [llm.engine.decode_token(i) for i in want_ids]
    with_logprobs = [k for k, ch in enumerate(chunks) if ch.choices and ch.choices[0].logprobs]
    with_text = [k for k, ch in enumerate(chunks) if ch.choices and ch.choices[0].delta.content]
    assert with_logprobs[0] <= with_text[-1], (with_logprobs, with_text)
    # The legacy shape's text_offset counts from the start of the text in a stream as in a full response.
    whole = client.completions.create(model="qwen2", prompt="Hello", max_tokens=5, temperature=0, logprobs=1)
    parts = list(client.completions.create(model="qwen2", prompt="Hello", max_tokens=5, temperature=0, logprobs=1, stream=True))
    offsets = [o for p in parts if p.choices and p.choices[0].logprobs for o in (p.choices[0].logprobs.text_offset or [])]
    assert whole.choices[0].logprobs is not None and offsets == whole.choices[0].logprobs.text_offset


def test_chat_logprobs_carry_the_bytes_of_tokens_that_split_a_character(server: BackgroundServer, llm: stepllm.LLM) -> None:
    vocab = json.loads((Path(model_dir("qwen2")) / "tokenizer.json").read_text())["model"]["vocab"]
    lead_byte = vocab["\u00e2"]  # byte 0xE2 in the GPT-2 alphabet: the first byte of a three-byte character
    assert llm.engine.token_bytes(lead_byte) == b"\xe2" and llm.engine.decode_token(lead_byte) == "\ufffd"
    c = sync_client(server).chat.completions.create(
        model="qwen2", messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2, logit_bias={str(lead_byte): 100}
    )
    content = c.choices[0].logprobs.content if c.choices[0].logprobs else None
    assert content is not None and [t.bytes for t in content] == [[0xE2]] * 3
    assert [t.token for t in content] == ["\ufffd"] * 3
    for t in content:
        for alt in t.top_logprobs:
            assert alt.bytes is not None and bytes(alt.bytes).decode("utf-8", errors="replace") == alt.token
    # A greedy reply's token bytes, joined, read as its text.
    c = sync_client(server).chat.completions.create(model="qwen2", messages=CHAT, max_tokens=12, temperature=0, logprobs=True)
    content = c.choices[0].logprobs.content if c.choices[0].logprobs else None
    assert content is not None
    assert b"".join(bytes(t.bytes or []) for t in content).decode("utf-8", errors="replace") == c.choices[0].message.content


def test_n_choices_per_prompt_and_prompt_batches(server: BackgroundServer, llm: stepllm.LLM) -> None:
    client = sync_client(server)
    # n seeded samples: choice j draws with seed + j, so it equals LLM.generate with that seed.
    sampled = dict(temperature=0.9, top_p=0.95)
    r = client.completions.create(model="qwen2", prompt="Hello", max_tokens=10, n=3, seed=7, **sampled)
    want = [llm.generate("Hello", stepllm.SamplingParams(max_tokens=10, seed=7 + j, **sampled))[0] for j in range(3)]
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w.output_text for w in want]
    assert len({c.text for c in r.choices}) > 1, "seeds 7, 8 and 9 drew the same text"
    assert r.usage is not None and r.usage.prompt_tokens == len(want[0].prompt_ids)  # the prompt counts once
    assert r.usage.completion_tokens == sum(len(w.output_ids) for w in want)
    # A batch of prompts with n = 2: choice i answers prompt i // 2; echo puts each prompt before its completion.
    prompts = ["Hello", "Once upon a time", "1 2 3 4"]
    r = client.completions.create(model="qwen2", prompt=prompts, max_tokens=6, n=2, temperature=0, echo=True, extra_body={"ignore_eos": True})
    greedy_texts = [llm.generate(p, greedy(6))[0].output_text for p in prompts]
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [p + t for p, t in zip(prompts, greedy_texts) for _ in range(2)]
    assert r.usage is not None and r.usage.completion_tokens == 36
    # Token-id prompts batch too.
    ids = [[5, 6, 7], [8, 9]]
    r = client.completions.create(model="qwen2", prompt=ids, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert [c.text for c in r.choices] == [w.output_text for w in llm.generate(ids, greedy(4))]
    assert r.usage is not None and r.usage.prompt_tokens == 5


def test_streamed_choices_interleave_and_each_ends_once(server: BackgroundServer) -> None:
    client = sync_client(server)
    fields: dict[str, Any] = dict(model="qwen2", messages=CHAT, max_tokens=8, n=3, seed=11, temperature=0.8, logprobs=True)
    whole = client.chat.completions.create(**fields)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **fields))
    texts, finishes, roles, logprobs = ["", "", ""], [0, 0, 0], [0, 0, 0], [0, 0, 0]
    for ch in chunks[:-1]:
        (choice,) = ch.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += choice.delta.role == "assistant"
        finishes[choice.index] += choice.finish_reason is not None
        logprobs[choice.index] += len(choice.logprobs.content or []) if choice.logprobs else 0
    assert texts == [c.message.content for c in whole.choices]
    assert roles == [1, 1, 1] and finishes == [1, 1, 1]
    assert logprobs == [len(c.logprobs.content or []) if c.logprobs else 0 for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # Every choice's finish chunk comes after all of its text.
    last_text = {i: max(k for k, ch in enumerate(chunks[:-1]) if ch.choices[0].index == i and ch.choices[0].delta.content) for i in range(3)}
    finish_at = {ch.choices[0].index: k for k, ch in enumerate(chunks[:-1]) if ch.choices[0].finish_reason is not None}
    assert all(finish_at[i] > last_text[i] for i in range(3))


def test_chunks_that_queued_up_leave_as_one_event(llm: stepllm.LLM) -> None:
    """A server behind its streams sends what has queued up for a choice as one chunk: here every token of two
    choices has arrived before the stream is read, so each choice's text is one event, in full, before its end."""
    from stepllm.server.bridge import GenerationHandle
    from stepllm.server.responses import Context
    from stepllm.server.streaming import stream_events

    engine = llm.engine
    ctx = Context(kind="chat", id="c", model="qwen2", token_text=engine.decode_token, token_bytes=engine.token_bytes)

    async def read_after_all_arrived() -> tuple[list[dict[str, Any]], list[str]]:
        handles = [GenerationHandle.start(engine, stepllm.GenerationRequest(CHAT, greedy(10 + i))) for i in range(2)]
        while not all(h.ended for h in handles):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)  # the pumps' last hand-offs run on the loop
        events = [e async for e in stream_events(handles, ctx, want_logprobs=False)]
        assert events[-1] == "data: [DONE]\n\n"
        return [json.loads(e[6:]) for e in events[:-1]], [h.response.output_text for h in handles if h.response]

    bodies, expected = asyncio.run(read_after_all_arrived())
    texts = [[b["choices"][0]["delta"].get("content") for b in bodies if b["choices"][0]["index"] == i] for i in range(2)]
    for i in range(2):
        # role chunk, then the whole text in one event, then the finish chunk (no content)
        assert texts[i] == ["", expected[i], None], texts[i]
    assert all(len(e) > 8 for e in expected)


def test_echo_and_chat_without_max_tokens(server: BackgroundServer, llm: stepllm.LLM) -> None:
    client = sync_client(server)
    r = client.completions.create(model="qwen2", prompt="Hello", max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == "Hello" + llm.generate("Hello", greedy(5))[0].output_text
    # echo with logprobs scores the prompt too (lm-eval's loglikelihood): its first token has none, as in OpenAI.
    prompt = "The capital of France is"
    want = llm.generate(prompt, greedy(2, logprobs=2, prompt_logprobs=2))[0]
    r = client.completions.create(model="qwen2", prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert want.prompt_logprobs is not None and want.logprobs is not None and lp is not None
    n = len(want.prompt_ids)
    assert lp.tokens == [llm.engine.decode_token(t) for t in want.prompt_ids + want.output_ids]
    assert lp.token_logprobs == [None] + [p.logprob for p in want.prompt_logprobs[1:]] + [g.logprob for g in want.logprobs]
    assert lp.top_logprobs is not None and lp.top_logprobs[0] is None and all(len(t) >= 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset is not None and lp.text_offset[0] == 0 and lp.text_offset[n] == len(prompt)
    assert r.choices[0].text == prompt + want.output_text
    # Token-id prompts echo their decoded text and score the same (lm-eval sends ids).
    ids = client.completions.create(model="qwen2", prompt=want.prompt_ids, max_tokens=2, temperature=0, echo=True, logprobs=2)
    assert ids.choices[0].text == prompt + want.output_text and ids.choices[0].logprobs == lp
    # max_tokens=1 with echo, as lm-eval sends it: the prompt scored, one token generated.
    one = client.completions.create(model="qwen2", prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=0)
    assert one.choices[0].logprobs is not None and one.choices[0].logprobs.token_logprobs == lp.token_logprobs[: n + 1]
    # No limit given: the reply may run until the context is full (the fixture's is 256 tokens).
    c = client.chat.completions.create(model="qwen2", messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    # As vLLM: all that the prompt leaves of the context (earlier, up to half of it was lost to a halving search).
    assert c.usage is not None and c.usage.prompt_tokens + c.usage.completion_tokens == 256, c.usage


def test_a_streamed_echo_with_logprobs_puts_together_to_the_full_response(server: BackgroundServer, llm: stepllm.LLM) -> None:
    """As vLLM: a stream of echo with logprobs sends the echoed prompt with its logprobs (the first token's null) as
    the choice's first chunk; each choice's chunks put together are the full response's choice, text offsets
    included, for a text prompt, a token-id prompt, max_tokens 1 (whose first token ends the choice), and two
    prompts with n = 2."""
    client = sync_client(server)
    # The emoji's tokens read as three U+FFFD: the prompt's token texts are longer than the echoed text, and the
    # completion's offsets still count from the echo's end.
    prompt = "The llama \U0001f999 is"
    ids = llm.generate(prompt, greedy(1))[0].prompt_ids
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    for p, n, max_tokens in [(prompt, 1, 4), (ids, 1, 4), (prompt, 1, 1), ([prompt, "Hello"], 2, 3)]:
        echoes = [prompt, "Hello"] if n > 1 else [prompt]
        fields: dict[str, Any] = dict(model="qwen2", prompt=p, n=n, max_tokens=max_tokens, temperature=0, seed=3, echo=True, logprobs=2,
                                      extra_body={"ignore_eos": True})
        whole = client.completions.create(**fields).choices
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **fields)]
        assert len(whole) == len(echoes) * n
        for choice in whole:
            mine = [c for c in chunks if c.index == choice.index]
            first = mine[0].logprobs
            assert mine[0].text == echoes[choice.index // n] and first is not None and first.token_logprobs is not None
            assert first.token_logprobs[0] is None and all(lp is not None for lp in first.token_logprobs[1:])
            if mine[0].text == prompt:
                assert first.tokens == [llm.engine.decode_token(t) for t in ids]
            streamed: dict[str, list[Any]] = {key: [] for key in keys}
            for c in mine:
                for key in keys:
                    streamed[key] += getattr(c.logprobs, key) if c.logprobs is not None else []
            want = {key: getattr(choice.logprobs, key) for key in keys}
            if n > 1:  # choices batched differently may differ in a logprob's last bits
                assert streamed.pop("token_logprobs")[1:] == pytest.approx(want.pop("token_logprobs")[1:], abs=1e-4)
                del streamed["top_logprobs"], want["top_logprobs"]
            assert streamed == want
            assert first.tokens is not None and len(streamed["tokens"]) == len(first.tokens) + max_tokens
            assert "".join(c.text for c in mine) == choice.text
            assert (mine[-1].finish_reason, choice.finish_reason) == ("length", "length")


def test_an_echo_waiting_for_its_logprobs_comes_before_the_finish_of_a_choice_without_chunks(llm: stepllm.LLM) -> None:
    """A choice that ends without a chunk (cancelled before its first token) still echoes its prompt with the
    logprobs its response has, right before its finish chunk."""
    from stepllm.server.responses import Context
    from stepllm.server.streaming import stream_events

    prompt = "The capital of France is"
    response = llm.generate(prompt, greedy(1, prompt_logprobs=2))[0]

    class Ended:  # a GenerationHandle whose choice ended without a chunk
        def __init__(self) -> None:
            self.response = response

        async def chunks(self) -> Any:
            return
            yield

        def cancel(self) -> None:
            pass

    engine = llm.engine
    ctx = Context(kind="completion", id="c", model="qwen2", token_text=engine.decode_token, token_bytes=engine.token_bytes,
                  echoes=[prompt], echo_ids=[response.prompt_ids])

    async def events() -> list[str]:
        return [e async for e in stream_events([Ended()], ctx, want_logprobs=True)]  # type: ignore[list-item]

    bodies = [json.loads(e[6:])["choices"][0] for e in asyncio.run(events())[:-1]]
    assert [(b["text"], b["finish_reason"]) for b in bodies] == [(prompt, None), ("", "length")]
    want = ctx.prompt_logprobs(response.prompt_ids, response.prompt_logprobs or [])
    assert bodies[0]["logprobs"] == want and want["token_logprobs"][0] is None and len(want["tokens"]) == len(response.prompt_ids)


def test_a_reply_sent_back_in_the_next_turn_is_accepted(server: BackgroundServer, llm: stepllm.LLM) -> None:
    """The openai client's own message object (with refusal None and the server's empty tool_calls) goes back
    into the conversation, as multi-turn chat clients do."""
    client = sync_client(server)
    messages: list[Any] = list(CHAT)
    first = client.chat.completions.create(model="qwen2", messages=messages, max_tokens=4, temperature=0)
    messages.append(first.choices[0].message)
    messages.append({"role": "user", "content": "And then?"})
    second = client.chat.completions.create(model="qwen2", messages=messages, max_tokens=4, temperature=0)
    history = [dict(m) for m in CHAT] + [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And then?"},
    ]
    assert second.choices[0].message.content == llm.chat(history, greedy(4))[0].output_text


def test_tokenize_and_detokenize(server: BackgroundServer, llm: stepllm.LLM) -> None:
    """vLLM's /tokenize and /detokenize: the ids a completion or chat request would run, and text back from ids."""
    with http(server) as c:
        r = c.post("/tokenize", json={"model": "qwen2", "prompt": "The capital of France is"})
        assert r.status_code == 200, r.text
        body = r.json()
        want = llm.generate("The capital of France is", greedy(1))[0].prompt_ids
        assert body["tokens"] == want and body["count"] == len(want) and body["max_model_len"] == 256
        chat = c.post("/tokenize", json={"messages": CHAT}).json()
        assert chat["tokens"] == llm.chat(CHAT, greedy(1))[0].prompt_ids
        back = c.post("/detokenize", json={"model": "qwen2", "tokens": want})
        assert back.status_code == 200 and back.json() == {"prompt": "The capital of France is"}


def test_request_id_is_echoed(server: BackgroundServer) -> None:
    client = sync_client(server)
    raw = client.completions.with_raw_response.create(
        model="qwen2", prompt="Hello", max_tokens=2, extra_headers={"X-Request-Id": "my-req-42"}
    )
    assert raw.headers["x-request-id"] == "my-req-42"
    assert raw.parse().id == "cmpl-my-req-42"
    r = client.chat.completions.create(model="qwen2", messages=CHAT, max_tokens=2, extra_body={"request_id": "abc"})
    assert r.id == "chatcmpl-abc"
    chunks = list(client.chat.completions.create(model="qwen2", messages=CHAT, max_tokens=2, stream=True, extra_body={"request_id": "s1"}))
    assert {c.id for c in chunks} == {"chatcmpl-s1"}


def test_default_model_chat_end_to_end() -> None:
    """The real default model (SmolLM2-135M-Instruct): the server's greedy chat equals LLM.chat's."""
    messages: Any = [{"role": "user", "content": "What is the capital of France?"}]
    with stepllm.LLM(device="cpu", max_batch_size=2, kv_cache_tokens=2048) as llm:
        want = llm.chat(messages, greedy(24))[0]
        assert "Paris" in want.output_text
        with BackgroundServer(llm.engine) as server:
            client = sync_client(server)
            model = client.models.list().data[0].id
            got = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
            assert got.choices[0].message.content == want.output_text
            assert got.choices[0].finish_reason == ("stop" if want.finish_reason == stepllm.FinishReason.EOS else "length")
            streamed = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, stream=True)
            )
            assert streamed == want.output_text
            wait_idle(llm.engine, server)


def test_stepllm_serve_command() -> None:
    """`stepllm serve` starts, answers, and stops on SIGINT."""
    from stepllm.server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "stepllm.cli", "serve", "--model", model_dir("llama"), "--device", "cpu", "--port", str(port), "--api-key", "k1", "--max-waiting", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "exited"
            try:
                import httpx

                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except Exception:
                return False

        wait_for(up, timeout=60, what="stepllm serve to start")
        import httpx

        # ignore_eos: the default temperature samples, and the random fixture may sample EOS within 3 tokens
        body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer k1"}, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hello"}, timeout=TIMEOUT).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:  # pragma: no cover
            proc.kill()
            proc.wait(timeout=5)
    assert proc.returncode == 0, proc.stderr.read().decode() if proc.stderr else ""


def test_serve_without_server_packages_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import builtins

    from stepllm import cli

    real_import = builtins.__import__

    def fake_import(name: str, *args: Any, **kw: Any) -> Any:
        if name == "server" or name.startswith("stepllm.server") or name == "uvicorn":
            raise ImportError("No module named 'uvicorn'", name="uvicorn")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    started = time.monotonic()
    assert cli.main(["serve", "--model", model_dir("llama")]) == 1
    assert time.monotonic() - started < 5  # no model was loaded
    assert "stepllm[serve]" in capsys.readouterr().err
