"""Running the app: `serve` (blocking, for `stepllm serve`) and `BackgroundServer` (uvicorn on a loopback port in
a thread, for tests and benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from types import FrameType, TracebackType
from typing import Any

import uvicorn
from starlette.applications import Starlette

from .app import create_app
from .bridge import EngineLike


class _Server(uvicorn.Server):
    """uvicorn's server, cancelling the requests in flight as soon as shutdown begins (Ctrl-C, SIGTERM), so open
    streams end at once instead of holding the shutdown until they finish."""

    def __init__(self, app: Starlette, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.app.state.stepllm.cancel_all()
        super().handle_exit(sig, frame)


def serve(engine: EngineLike, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None, max_waiting: int = 256, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM end it gracefully)."""
    app = create_app(engine, api_key=api_key, max_waiting=max_waiting)
    server = _Server(app, uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled; the shutdown was clean
        pass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class BackgroundServer:
    """`with BackgroundServer(engine) as server:` serves on 127.0.0.1:<free port> until the block ends.
    `server.url` is the base URL ("http://127.0.0.1:PORT"); `server.app` the ASGI app."""

    def __init__(self, engine: EngineLike, *, host: str = "127.0.0.1", port: int | None = None, start_timeout: float = 30.0, **app_kwargs: Any) -> None:
        self.app = create_app(engine, **app_kwargs)
        self.host = host
        self.port = port or free_port(host)
        self.start_timeout = start_timeout
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"stepllm-serve-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server on {self.url} failed to start")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the server on {self.url} did not start within {self.start_timeout} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.app.state.stepllm.cancel_all()
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
