"""stepllm's OpenAI-compatible HTTP server (`stepllm serve`): create_app(engine) is the ASGI app; serve() runs it
with uvicorn; BackgroundServer runs it in a thread on a loopback port. Needs the `serve` extra
(pip install 'stepllm[serve]')."""

from .app import create_app
from .errors import APIError
from .runner import BackgroundServer, free_port, serve

__all__ = ["APIError", "BackgroundServer", "create_app", "free_port", "serve"]
