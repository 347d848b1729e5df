"""``--lora-modules``: requests spread over LoRA adapters, as ``vllm bench serve`` does.

vLLM's benchmark takes ``--lora-modules NAME ...`` ("a subset of LoRA module names passed
in when launching the server; for each request, the script chooses a LoRA module at
random", ``vllm/benchmarks/serve.py``) and sends the chosen name as the request's
``model``. Here the adapters may also be given in the server's ``NAME=PATH`` form: a server
bench starts (``--serve-cmd``) then gets ``--enable-lora --lora-modules NAME=PATH ...
--max-loras N`` (vLLM's and ``inflight serve``'s flags; N, every adapter, so one batch may
mix them all), while the requests name the adapters.

The choice is part of the request mix (``datasets.build_dataset``): item ``i`` of the mix's
stream draws its adapter from a generator seeded by ``(--seed, i)``, so a run is
reproducible, a mix extended later (a window that needs more requests) keeps the adapters
it had, and the warm-ups, the mix's first items, warm the adapters up too (vLLM's warm-ups
use the base model). A multi-turn conversation keeps one adapter: its turns draw by the
conversation's number instead, since the history a follow-up carries is that adapter's.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # a type only: datasets imports this module
    from inflight.bench.datasets import RequestSpec

# Draws come in blocks of this many items, each block from its own seeded generator, so
# any item's adapter is found without drawing for the items before it.
_BLOCK = 1024
# Keeps the adapter draws apart from the dataset's own seeded streams ([seed, ...]).
_STREAM = 0x10A


@dataclass(frozen=True)
class LoraModules:
    """The adapters of ``--lora-modules``: ``names``, which requests pick from, and
    ``paths``, in step with them, where the server form ``NAME=PATH`` gave them (else
    ``()``: the server was started with its adapters by the user)."""

    names: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()

    def served(self) -> tuple[str, ...]:
        """The ``NAME=PATH`` arguments of the server's ``--lora-modules`` (``()`` without paths)."""
        return tuple(f"{n}={p}" for n, p in zip(self.names, self.paths))


def parse_lora_modules(items: Sequence[str] | None) -> LoraModules:
    """``["a", "b"]`` (vLLM bench's names) or ``["a=/ad/a", "b=/ad/b"]`` (the server's
    form) -> :class:`LoraModules`; ``None`` -> no adapters.

    Raises:
        ValueError: an empty name or path, a name given twice, or the two forms mixed.
    """
    names: list[str] = []
    paths: list[str] = []
    for item in items or ():
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not name or (sep and not path):
            raise ValueError(f"--lora-modules {item!r}: expected NAME or NAME=PATH")
        if name in names:
            raise ValueError(f"--lora-modules: {name!r} is given twice")
        names.append(name)
        if sep:
            paths.append(path)
    if paths and len(paths) != len(names):
        raise ValueError("--lora-modules: give every adapter as NAME=PATH (bench loads them into the server "
                         "it starts) or every one as a bare NAME (the server already serves them), not both")
    return LoraModules(tuple(names), tuple(paths))


def _has_flag(tokens: Sequence[str], flag: str) -> bool:
    return any(t == flag or t.startswith(flag + "=") for t in tokens)


def server_flags(modules: LoraModules, command: str) -> list[str]:
    """The flags added to the server ``command`` bench starts: ``--enable-lora`` (unless
    it has it), ``--lora-modules NAME=PATH ...`` and ``--max-loras N`` with N the number of
    adapters (unless it sets its own); ``[]`` for bare names.

    Raises:
        ValueError: ``command`` has its own ``--lora-modules`` as well.
    """
    if not modules.paths:
        return []
    tokens = shlex.split(command)
    if _has_flag(tokens, "--lora-modules"):
        raise ValueError("--serve-cmd has its own --lora-modules: give the adapters once (bare names on the "
                         "bench command pick among the server's)")
    flags = [] if _has_flag(tokens, "--enable-lora") else ["--enable-lora"]
    flags += ["--lora-modules", *modules.served()]
    if not _has_flag(tokens, "--max-loras"):
        flags += ["--max-loras", str(len(modules.names))]
    return flags


def with_server_flags(modules: LoraModules, command: str) -> str:
    """``command`` with :func:`server_flags` appended, quoted for ``shlex.split``."""
    flags = server_flags(modules, command)
    return f"{command} {shlex.join(flags)}" if flags else command


def assign_adapters(specs: Sequence[RequestSpec], names: Sequence[str], seed: int, start: int = 0) -> None:
    """Set ``spec.model`` of items ``start ..`` of a mix (``specs``, in mix order) to an
    adapter of ``names``, uniformly at random: item ``i`` draws from ``(seed, i)``, a turn
    of a multi-turn conversation (a chat's, or a trace's ``trace_session``) from ``(seed,
    its conversation)``. Nothing without names."""
    if not names:
        return
    draws: dict[tuple[int, int], np.ndarray] = {}
    for i, spec in enumerate(specs, start):
        if "turn" in spec.meta:
            kind, key = 1, int(spec.meta["conversation"])
        elif "trace_session" in spec.meta:
            kind, key = 2, int(spec.meta["trace_session"])
        else:
            kind, key = 0, i
        block, at = divmod(key, _BLOCK)
        if (kind, block) not in draws:
            rng = np.random.default_rng([seed % 2**64, _STREAM, kind, block])  # any int seed
            draws[kind, block] = rng.integers(len(names), size=_BLOCK)
        spec.model = names[int(draws[kind, block][at])]


def adapter_counts(specs: Sequence[RequestSpec]) -> dict[str, int] | None:
    """Requests per adapter in ``specs``, sorted by name; None where none names one."""
    counts: dict[str, int] = {}
    for spec in specs:
        if spec.model is not None:
            counts[spec.model] = counts.get(spec.model, 0) + 1
    return dict(sorted(counts.items())) or None
