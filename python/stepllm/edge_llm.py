"""TensorRT Edge-LLM's `llm_inference` JSON formats.

Input: top-level batch_size, temperature, top_p, top_k, max_generate_length, apply_chat_template,
add_generation_prompt, sampling_seed, and requests[], each with messages (list of {role, content}) and an
optional stop (string or list) and sampling_seed. Output: {"responses": [...]} with one entry per request:
output_text, request_idx (which batch of batch_size requests it was in), batch_idx (its place in that batch),
plus output_ids, finish_reason and token counts. Every request goes through the engine at once; batch_size
only names the groups in the output and sets how many run side by side.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _core
from .engine import Engine


@dataclass
class EdgeRequest:
    messages: list[dict[str, str]]
    stop: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class EdgeInput:
    batch_size: int
    temperature: float
    top_p: float
    top_k: int
    max_generate_length: int
    apply_chat_template: bool
    add_generation_prompt: bool
    seed: int | None
    requests: list[EdgeRequest]


class EdgeInputError(ValueError):
    """The input file is not valid Edge-LLM llm_inference JSON."""


def load_input(path: Path) -> EdgeInput:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise EdgeInputError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise EdgeInputError(f"{path}: the top level must be an object with a 'requests' list")
    return parse_input(data, str(path))


def parse_input(data: dict[str, Any], where: str = "input") -> EdgeInput:
    requests = data.get("requests")
    if not isinstance(requests, list) or not requests:
        raise EdgeInputError(f"{where}: 'requests' must be a non-empty list")
    spec = EdgeInput(
        batch_size=_number(data, "batch_size", int, 1, where, least=1),
        temperature=_number(data, "temperature", float, 1.0, where, least=0),
        top_p=_number(data, "top_p", float, 1.0, where, least=0),
        top_k=_number(data, "top_k", int, 0, where, least=0),
        max_generate_length=_number(data, "max_generate_length", int, 256, where, least=1),
        apply_chat_template=bool(data.get("apply_chat_template", True)),
        add_generation_prompt=bool(data.get("add_generation_prompt", True)),
        seed=_optional_int(data, "sampling_seed", where),
        requests=[_parse_request(r, f"{where}: requests[{i}]") for i, r in enumerate(requests)],
    )
    if spec.apply_chat_template and not spec.add_generation_prompt:
        raise EdgeInputError(
            f"{where}: 'add_generation_prompt': false is not supported (a chat prompt always ends with the assistant's "
            "header); leave it true, or set 'apply_chat_template': false to pass the messages as raw text"
        )
    return spec


def _parse_request(r: Any, where: str) -> EdgeRequest:
    if not isinstance(r, dict):
        raise EdgeInputError(f"{where} must be an object with 'messages'")
    messages = r.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EdgeInputError(f"{where}: 'messages' must be a non-empty list")
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise EdgeInputError(f"{where}: messages[{j}] must have string 'role' and 'content'")
    stop = r.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise EdgeInputError(f"{where}: 'stop' must be a string or a list of strings")
    return EdgeRequest(messages=messages, stop=stop, seed=_optional_int(r, "sampling_seed", where))


def _number(data: dict[str, Any], key: str, kind: type, default: Any, where: str, least: float | None = None) -> Any:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise EdgeInputError(f"{where}: '{key}' must be a finite number, got {value!r}")
    if kind is int and value != int(value):
        raise EdgeInputError(f"{where}: '{key}' must be an integer, got {value!r}")
    if least is not None and value < least:
        raise EdgeInputError(f"{where}: '{key}' must be at least {least}, got {value!r}")
    return kind(value)


def _optional_int(data: dict[str, Any], key: str, where: str) -> int | None:
    if data.get(key) is None:
        return None
    return _number(data, key, int, 0, where)


def _request(spec: EdgeInput, r: EdgeRequest) -> _core.GenerationRequest:
    sampling = _core.SamplingParams(
        max_tokens=spec.max_generate_length,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        seed=r.seed if r.seed is not None else spec.seed,
        stop=r.stop,
    )
    if spec.apply_chat_template:
        return _core.GenerationRequest(prompt=r.messages, sampling=sampling)
    # Without the template the messages' contents are joined as raw text, as Edge-LLM does.
    return _core.GenerationRequest(prompt="".join(m["content"] for m in r.messages), sampling=sampling)


def run_edge_llm_input(engine: Engine, spec: EdgeInput) -> dict[str, Any]:
    streams = [engine.submit(_request(spec, r)) for r in spec.requests]
    responses = []
    for i, stream in enumerate(streams):
        for _ in stream:
            pass
        resp = stream.response
        assert resp is not None
        responses.append({
            "output_text": resp.output_text,
            "request_idx": i // spec.batch_size,
            "batch_idx": i % spec.batch_size,
            "output_ids": list(resp.output_ids),
            "finish_reason": str(resp.finish_reason).split(".")[-1].lower(),
            "prompt_tokens": len(resp.prompt_ids),
            "generated_tokens": len(resp.output_ids),
        })
    return {"responses": responses}
