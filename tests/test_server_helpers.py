"""Shared pieces of the server tests (no tests here): engines, in-process servers, clients, idle checks and a
fault-injecting engine wrapper."""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import pytest

import stepllm
from conftest import check_invariants, long_contexts_allowed, model_dir

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import openai  # noqa: E402

from stepllm.server import BackgroundServer  # noqa: E402

TIMEOUT = 30.0  # every client call is bounded by this
# Long enough that a request still runs when a test disconnects (tens of seconds on the tiny fixtures).
LONG_TOKENS = 30000
LONG_CONTEXT = LONG_TOKENS + 256


def fixture_llm(name: str = "qwen2", *, long: bool = False, **kw: Any) -> stepllm.LLM:
    kw.setdefault("max_batch_size", 4)
    if long:
        kw.setdefault("max_model_len", LONG_CONTEXT)
        kw.setdefault("kv_cache_tokens", 5 * LONG_CONTEXT)
    else:
        kw.setdefault("kv_cache_tokens", 4096)
    if long:
        with long_contexts_allowed():
            return stepllm.LLM(model=model_dir(name), device="cpu", **kw)
    return stepllm.LLM(model=model_dir(name), device="cpu", **kw)


def sync_client(server: BackgroundServer, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT)


def async_client(server: BackgroundServer, api_key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=TIMEOUT)


def http(server: BackgroundServer, **kw: Any) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=TIMEOUT, **kw)


def wait_idle(engine: Any, server: BackgroundServer | None = None, timeout: float = 10.0) -> dict[str, Any]:
    """Wait (bounded) until the engine has no waiting or running request, no live slot and no leased block, and
    the server has no request in flight; returns the engine's stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        c = stats["counts"]
        inflight = server.app.state.stepllm.inflight if server is not None else 0
        if stats["waiting"] == stats["running"] == c["live_slots"] == c["leased_blocks"] == inflight == 0:
            check_invariants(c)
            return stats
        assert time.monotonic() < deadline, f"engine never went idle: {stats}, server in flight {inflight}"
        time.sleep(0.01)


def wait_for(predicate: Any, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_serving(server: BackgroundServer) -> None:
    """The server still answers: health, and a one-token completion."""
    with http(server, headers=auth_headers(server)) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1


def auth_headers(server: BackgroundServer) -> dict[str, str]:
    key = server.app.state.stepllm.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def assert_error_body(response: httpx.Response, status: int, type: str = "invalid_request_error") -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type, err
    return err


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a Prometheus text page (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    key = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture
def idle_after(server: BackgroundServer) -> Iterator[None]:
    """Needs a `server` fixture: after the test the engine is idle and the server still answers."""
    yield
    wait_idle(server.app.state.stepllm.engine, server)
    assert_serving(server)
    wait_idle(server.app.state.stepllm.engine, server)


class FailingStream:
    """A real request's stream that fails after its first chunk, as a step failure would fail it: the engine
    request is cancelled (its resources go back) and the response says ERROR."""

    def __init__(self, inner: stepllm.RequestStream) -> None:
        self.inner = inner
        self._response: stepllm.GenerationResponse | None = None

    @property
    def request_id(self) -> int:
        return self.inner.request_id

    @property
    def finished(self) -> bool:
        return self._response is not None

    @property
    def response(self) -> stepllm.GenerationResponse | None:
        return self._response

    def cancel(self) -> None:
        self.inner.cancel()

    def __iter__(self) -> Iterator[stepllm.StreamChunk]:
        for chunk in self.inner:
            yield chunk
            break
        self.inner.cancel()
        real = self.inner.wait()
        self._response = stepllm.GenerationResponse(
            real.request_id, real.original_index, real.prompt_ids, real.output_ids, real.output_text,
            stepllm.FinishReason.ERROR, error="injected device failure",
        )


class FaultyEngine:
    """Wraps an engine; requests whose prompt contains FAIL fail in flight."""

    def __init__(self, engine: stepllm.Engine) -> None:
        self.engine = engine

    def submit(self, request: stepllm.GenerationRequest) -> Any:
        stream = self.engine.submit(request)
        return FailingStream(stream) if "FAIL" in str(request.prompt) else stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)
