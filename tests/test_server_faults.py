"""The server under trouble: clients that disconnect, malformed bodies, oversize prompts, bad auth, a full waiting
queue, engine errors. After every test the engine is idle (no residents, no leased blocks) and the server answers."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import openai
import pytest

import stepllm
from stepllm.server import BackgroundServer
from test_server_helpers import (
    LONG_CONTEXT,
    LONG_TOKENS,
    FaultyEngine,
    assert_error_body,
    assert_serving,
    fixture_llm,
    http,
    idle_after,  # noqa: F401 - a fixture
    metric,
    sync_client,
    wait_for,
    wait_idle,
)

pytestmark = pytest.mark.usefixtures("idle_after")

LONG = {"prompt": "Hello", "max_tokens": LONG_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm() -> Iterator[stepllm.LLM]:
    with fixture_llm("qwen2", long=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def engine(llm: stepllm.LLM) -> stepllm.Engine:
    return llm.engine


@pytest.fixture(scope="module")
def server(engine: stepllm.Engine) -> Iterator[BackgroundServer]:
    with BackgroundServer(engine, max_waiting=2) as s:
        yield s


def cancelled(engine: stepllm.Engine) -> int:
    return engine.stats()["finished"].get("cancelled", 0)


def metrics_text(server: BackgroundServer) -> str:
    with http(server) as c:
        r = c.get("/metrics")
        assert r.status_code == 200
        return r.text


# ------------------------------------------------------------------------------------------------ disconnects


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_cancels_the_request(server: BackgroundServer, engine: stepllm.Engine, endpoint: str, n: int) -> None:
    before = cancelled(engine)
    body = dict(LONG, stream=True, n=n)
    if endpoint.endswith("chat/completions"):
        body = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": "Hi"}]}
    started = time.monotonic()
    with http(server) as c, c.stream("POST", endpoint, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [next(lines) for _ in range(6)]
        assert any(e.startswith("data: {") for e in events)
        wait_for(lambda: engine.stats()["running"] == n, what=f"{n} running choices")
    # The connection is closed: the server cancels every choice, the engine frees the slots and blocks well
    # before the request could have finished by itself.
    wait_idle(engine, server, timeout=5)
    assert cancelled(engine) == before + n
    assert time.monotonic() - started < 10
    label = "chat" if "chat" in endpoint else "completions"
    assert metric(metrics_text(server), "stepllm_requests_total", endpoint=label, outcome="cancelled") >= 1


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_of_a_non_streamed_request_cancels_it(server: BackgroundServer, engine: stepllm.Engine, n: int) -> None:
    before = cancelled(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=dict(LONG, n=n), timeout=httpx.Timeout(10, read=0.5))
    wait_idle(engine, server, timeout=5)
    assert cancelled(engine) == before + n


def test_disconnect_while_waiting_in_the_queue(server: BackgroundServer, engine: stepllm.Engine) -> None:
    """Four long streams fill the engine's four slots; a fifth waits in the queue and its client leaves."""
    before = cancelled(engine)
    with http(server) as c:
        streams = [c.stream("POST", "/v1/completions", json=dict(LONG, stream=True)) for _ in range(4)]
        responses = [s.__enter__() for s in streams]
        try:
            lines = [r.iter_lines() for r in responses]  # kept: a dropped iterator closes its connection
            for r, it in zip(responses, lines):
                assert r.status_code == 200
                next(it)
            wait_for(lambda: engine.stats()["running"] == 4, what="four running requests")
            with httpx.Client(base_url=server.url, timeout=10) as other:
                with other.stream("POST", "/v1/completions", json=dict(LONG, stream=True)) as waiting:
                    assert waiting.status_code == 200
                    wait_for(lambda: engine.stats()["waiting"] == 1, what="a waiting request")
            wait_for(lambda: cancelled(engine) == before + 1, timeout=5, what="the waiting request to be cancelled")
            assert engine.stats()["running"] == 4
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    wait_idle(engine, server, timeout=5)
    assert cancelled(engine) == before + 5


# ------------------------------------------------------------------------------------------------ bad input

BAD_BODIES: list[tuple[str, bytes | dict[str, Any], str | None]] = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "3"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -3}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "min_p": 1.5}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 100_000}, "n"),
    ("/v1/completions", {"prompt": ["hi"] * 300, "n": 2}, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, None),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": [999999]}, None),
    ("/v1/completions", {"prompt": ""}, None),
    ("/v1/completions", {"prompt": ["a", [1]]}, "prompt"),
    ("/v1/completions", {"prompt": [[5, 6], [999999]]}, None),
    ("/v1/completions", {"prompt": [[5, 6], []]}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]}, None),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, None),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, None),
    ("/tokenize", {"prompt": "hi", "extra": 1}, "extra"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}, None),
    ("/detokenize", {"tokens": [999999]}, None),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "hi"}, "tokens"),
]


@pytest.mark.parametrize("endpoint, body, param", BAD_BODIES)
def test_bad_bodies_answer_400(server: BackgroundServer, endpoint: str, body: bytes | dict[str, Any], param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with http(server) as c:
        r = c.post(endpoint, content=content, headers={"Content-Type": "application/json"})
    err = assert_error_body(r, 400)
    if param is not None:
        assert err["param"] == param, err


def test_oversize_prompts_answer_400(server: BackgroundServer) -> None:
    client = sync_client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="qwen2", prompt=[7] * (LONG_CONTEXT + 10), max_tokens=1)
    assert "prompt" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="qwen2", prompt="Hello " * (LONG_CONTEXT + 10), max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:  # fits alone, but not with the tokens asked for
        client.chat.completions.create(model="qwen2", messages=[{"role": "user", "content": "hi"}], max_tokens=LONG_CONTEXT)
    assert e.value.body is not None and e.value.status_code == 400


def test_max_tokens_beyond_the_kv_cache_is_400_not_500() -> None:
    with fixture_llm("qwen2", kv_cache_tokens=64) as small, BackgroundServer(small.engine) as server:
        with pytest.raises(openai.BadRequestError) as e:
            sync_client(server).completions.create(model="qwen2", prompt="Hello", max_tokens=100)
        assert e.value.param == "max_tokens"
        # Chat without a limit: the default is clipped to what the KV cache holds.
        r = sync_client(server).chat.completions.create(model="qwen2", messages=[{"role": "user", "content": "hi"}], extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.total_tokens <= 64
        wait_idle(small.engine, server)


def test_oversize_body_is_413(server: BackgroundServer) -> None:
    with http(server) as c:
        r = c.post("/v1/completions", content=b'{"prompt": "' + b"x" * (33 << 20) + b'"}', headers={"Content-Type": "application/json"})
    assert_error_body(r, 413)


def test_unknown_model_is_404(server: BackgroundServer) -> None:
    with pytest.raises(openai.NotFoundError):
        sync_client(server).completions.create(model="gpt-9", prompt="hi", max_tokens=1)


def test_bad_values_raise_in_the_openai_client(server: BackgroundServer) -> None:
    client = sync_client(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="qwen2", messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert e.value.code == "invalid_value" and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="qwen2", prompt="hi", n=100_000)
    assert e.value.param == "n"


# ------------------------------------------------------------------------------------------------ auth


def test_api_key_is_required_when_set(engine: stepllm.Engine, server: BackgroundServer) -> None:
    with BackgroundServer(engine, api_key="sekret") as keyed:
        body = {"prompt": "Hello", "max_tokens": 2}
        with http(keyed) as c:
            assert_error_body(c.post("/v1/completions", json=body), 401)
            assert_error_body(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
            assert_error_body(c.post("/v1/chat/completions", json={}, headers={"Authorization": "Basic sekret"}), 401)
            assert_error_body(c.get("/v1/models"), 401)
            assert c.get("/health").status_code == 200  # health and metrics stay open
            assert c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            sync_client(keyed, api_key="wrong").completions.create(model="qwen2", prompt="hi", max_tokens=1)
        r = sync_client(keyed, api_key="sekret").completions.create(model="qwen2", prompt="hi", max_tokens=1)
        assert r.usage is not None and r.usage.completion_tokens == 1
        assert_serving(keyed)
        assert metric(metrics_text(keyed), "stepllm_requests_total", endpoint="completions", outcome="unauthorized") == 3


# ------------------------------------------------------------------------------------------------ backpressure


@contextmanager
def long_streams(c: httpx.Client, count: int) -> Iterator[None]:
    """`count` long streamed completions in flight (each answered 200) until the block ends."""
    streams = [c.stream("POST", "/v1/completions", json=dict(LONG, stream=True)) for _ in range(count)]
    try:
        for s in streams:
            assert s.__enter__().status_code == 200
        yield
    finally:
        for s in streams:
            s.__exit__(None, None, None)


def test_full_waiting_queue_answers_429(server: BackgroundServer, engine: stepllm.Engine) -> None:
    """max_waiting=2 over 4 slots: 6 requests in flight fill it; the 7th gets 429 with Retry-After."""
    with http(server) as c, long_streams(c, 6):
        wait_for(lambda: engine.stats()["running"] == 4 and engine.stats()["waiting"] == 2, what="4 running, 2 waiting")
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1})
        assert_error_body(r, 429, type="rate_limit_error")
        assert int(r.headers["retry-after"]) >= 1
        with pytest.raises(openai.RateLimitError):
            sync_client(server).chat.completions.create(model="qwen2", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert metric(metrics_text(server), "stepllm_requests_waiting") == 2
    wait_idle(engine, server, timeout=5)
    assert metric(metrics_text(server), "stepllm_requests_total", endpoint="completions", outcome="overloaded") >= 1


def test_a_request_whose_choices_do_not_fit_the_queue_answers_429(server: BackgroundServer, engine: stepllm.Engine) -> None:
    """4 requests in flight leave room for 2 (max_waiting=2 over 4 slots): n = 3 gets 429, n = 2 waits."""
    with http(server) as c, long_streams(c, 4):
        wait_for(lambda: engine.stats()["running"] == 4, what="4 running")
        assert_error_body(c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "n": 3}), 429, type="rate_limit_error")
        with c.stream("POST", "/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "n": 2, "stream": True}) as waiting:
            assert waiting.status_code == 200
            wait_for(lambda: engine.stats()["waiting"] == 2, what="both choices waiting")
    wait_idle(engine, server, timeout=5)


# ------------------------------------------------------------------------------------------------ engine errors


def test_engine_errors_answer_500_and_serving_goes_on(engine: stepllm.Engine, server: BackgroundServer) -> None:
    with BackgroundServer(FaultyEngine(engine)) as faulty:
        client = sync_client(faulty)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="qwen2", prompt="FAIL now", max_tokens=50)
        assert "injected device failure" in str(e.value)
        with http(faulty) as c:
            assert_error_body(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "FAIL"}], "max_tokens": 9}), 500, "server_error")
        # Streamed: the headers went out, so the failure is an error event, which the client raises.
        with pytest.raises(openai.APIError) as se:
            for _ in client.chat.completions.create(model="qwen2", messages=[{"role": "user", "content": "FAIL"}], max_tokens=50, stream=True):
                pass
        assert "injected device failure" in str(se.value)
        # Other requests are served, before and after.
        ok = client.completions.create(model="qwen2", prompt="Hello", max_tokens=5, temperature=0)
        assert ok.choices[0].finish_reason == "length"
        wait_idle(engine, faulty)
        assert_serving(faulty)
        assert metric(metrics_text(faulty), "stepllm_requests_total", endpoint="chat", outcome="error") == 2


# ------------------------------------------------------------------------------------------------ metrics


def test_metrics_page(server: BackgroundServer, engine: stepllm.Engine) -> None:
    client = sync_client(server)
    client.completions.create(model="qwen2", prompt="The same long prompt " * 4, max_tokens=4, temperature=0)
    client.completions.create(model="qwen2", prompt="The same long prompt " * 4, max_tokens=4, temperature=0)
    wait_idle(engine, server)
    text = metrics_text(server)
    assert metric(text, "stepllm_requests_total", endpoint="completions", outcome="success") >= 2
    assert metric(text, "stepllm_request_finish_total", reason="length") >= 2
    assert metric(text, "stepllm_generation_tokens_total") >= 8
    assert metric(text, "stepllm_prompt_tokens_total") > 0
    assert metric(text, "stepllm_time_to_first_token_seconds_count") >= 2
    assert metric(text, "stepllm_time_per_output_token_seconds_count") >= 2
    assert metric(text, "stepllm_requests_running") == 0 and metric(text, "stepllm_requests_waiting") == 0
    counts = engine.counts()
    assert metric(text, "stepllm_kv_blocks_total") == counts["total_blocks"]
    assert metric(text, "stepllm_kv_blocks_used") == 0
    assert metric(text, "stepllm_kv_blocks_cached") == counts["cached_blocks"] > 0
    assert 0 < metric(text, "stepllm_prefix_cache_hit_rate") <= 1  # the second prompt reused the first's blocks
    assert "# TYPE stepllm_time_to_first_token_seconds histogram" in text
