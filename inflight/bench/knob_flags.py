"""A server command's flags, as ``bench tune``'s knobs set them: a knob named in any
spelling of its flag (llama-server's and vLLM's short forms are known), set in the spelling
the command already uses, or appended; and the port the command listens on."""

from __future__ import annotations

import pathlib
from urllib.parse import urlparse

BOOL_VALUES = {"on": True, "true": True, "yes": True, "off": False, "false": False, "no": False}

# Spellings of one flag, the first the one written where a command has none: llama.cpp's
# llama-server (common/arg.cpp) and vLLM's short forms. A knob named by any of them (without
# its dashes: ``parallel``, ``np``) sets the flag in whichever spelling the command uses.
FLAG_SPELLINGS: tuple[tuple[str, ...], ...] = (
    # llama-server
    ("--parallel", "-np"), ("--ctx-size", "-c"), ("--batch-size", "-b"), ("--ubatch-size", "-ub"),
    ("--threads", "-t"), ("--threads-batch", "-tb"), ("--n-gpu-layers", "--gpu-layers", "-ngl"),
    ("--flash-attn", "-fa"), ("--cache-type-k", "-ctk"), ("--cache-type-v", "-ctv"),
    ("--defrag-thold", "-dt"), ("--cache-ram", "-cram"), ("--ctx-checkpoints", "--swa-checkpoints", "-ctxcp"),
    ("--slot-prompt-similarity", "-sps"), ("--model", "-m"), ("--timeout", "-to"),
    ("--cont-batching", "-cb"), ("--no-cont-batching", "-nocb"),
    ("--kv-unified", "-kvu"), ("--no-kv-unified", "-no-kvu"),
    # vLLM
    ("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp"), ("--data-parallel-size", "-dp"),
    ("--quantization", "-q"),
)
# Flags that take on/off as a value (``-fa on``), not as a switch (``--flag`` / ``--no-flag``).
ON_OFF_VALUES = {"--flash-attn"}
# Where a server listens without --port: only llama-server differs from --base-url's 8000.
DEFAULT_PORTS = {"llama-server": 8080}


def parse_knob(text: str) -> tuple[str, list[str]]:
    """``"max-num-seqs=8,16"`` (or ``--max-num-seqs=...``) -> ``("max-num-seqs", ["8", "16"])``.
    A short name that :data:`FLAG_SPELLINGS` knows, bare or with its dash, gives its long
    name (``np=8,16`` and ``-np=8,16`` -> ``"parallel"``); another one-dash name stays a
    short flag (``-x=1,2`` -> ``"-x"``)."""
    name, sep, values = text.partition("=")
    name = name.strip()
    name = name[2:] if name.startswith("--") else name
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not sep or not name.lstrip("-") or not vals:
        raise ValueError(f"bad --knob {text!r}: expected NAME=V1,V2,... (e.g. max-num-seqs=8,16,32)")
    first = spellings(name)[0]
    return (first[2:] if first.startswith("--") else first), vals


def spellings(name: str) -> tuple[str, ...]:
    """Every spelling of the flag a knob ``name`` names, the one to write first: ``parallel``
    and ``np`` give ``("--parallel", "-np")``; an unknown ``x`` gives ``("--x",)``, ``-x``
    ``("-x",)``."""
    flag = name if name.startswith("-") else f"--{name}"
    candidates = [flag] if name.startswith("-") else [flag, f"-{name}"]
    for c in candidates:
        for group in FLAG_SPELLINGS:
            if c in group:
                return group
    return (flag,)


def _negatives(spell: tuple[str, ...]) -> tuple[str, ...]:
    """The spellings of a switch's negative form (``--no-cont-batching``, ``-nocb``)."""
    if not spell[0].startswith("--"):
        return ()
    neg = "--no-" + spell[0][2:]
    return next((g for g in FLAG_SPELLINGS if neg in g), (neg,))


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)  # a negative number is a value
    except ValueError:
        return True
    return False


def _find(tokens: list[str], spell: tuple[str, ...], neg: tuple[str, ...]) -> list[tuple[int, str, str | None, bool]]:
    """Each occurrence of the flag: (index, spelling, value written with ``=`` or None, negative)."""
    out = []
    for i, t in enumerate(tokens):
        head, eq, val = t.partition("=")
        if head in spell or head in neg:
            out.append((i, head, val if eq else None, head in neg))
    return out


def _takes_on_off(tokens: list[str], spell: tuple[str, ...], neg: tuple[str, ...]) -> bool:
    """Whether on/off is this flag's value (``-fa on``) rather than a switch."""
    if spell[0] in ON_OFF_VALUES:
        return True
    for i, head, val, negative in _find(tokens, spell, neg):
        if negative:
            continue
        nxt = val if val is not None else (tokens[i + 1] if i + 1 < len(tokens) else None)
        if nxt is not None and nxt.lower() in (*BOOL_VALUES, "auto"):
            return True
    return False


def set_flag(tokens: list[str], name: str, value: str) -> list[str]:
    """``tokens`` with the flag ``name`` (any of its :func:`spellings`) set to ``value``: an
    existing ``--name v`` / ``--name=v`` / ``-short v`` (or, for a switch set on/off,
    ``--name`` / ``--no-name`` and their short forms) replaced where it stands, in the
    spelling the command uses, later duplicates dropped; else ``--name value`` appended.
    Setting the value a command already has gives the same command, so its points are
    reused."""
    spell = spellings(name)
    neg = _negatives(spell)
    is_bool = value.lower() in BOOL_VALUES and not _takes_on_off(tokens, spell, neg)
    found = _find(tokens, spell, neg if is_bool else ())
    drop: set[int] = set()
    out = list(tokens)
    on = BOOL_VALUES.get(value.lower(), True)
    if not found:
        if is_bool:
            return out + ([spell[0]] if on else [neg[0]] if neg else [])  # no negative form: off is absent
        return out + [spell[0], value]
    for i, head, val, negative in found:
        if not is_bool and val is None and i + 1 < len(tokens) and not _is_flag(tokens[i + 1]):
            drop.add(i + 1)  # the value written after the flag
    i0, head0, _, neg0 = found[0]
    if is_bool:
        group = spell if on else neg  # in the command's spelling: -cb -> -nocb, --x -> --no-x
        k = (neg if neg0 else spell).index(head0)
        new = [group[min(k, len(group) - 1)]] if group else []
    else:
        new = [head0, value]
    drop |= {i for i, *_ in found[1:]}
    result: list[str] = []
    for i, t in enumerate(out):
        if i == i0:
            result += new
        elif i not in drop:
            result.append(t)
    return result


def flag_value(tokens: list[str], name: str) -> str | None:
    """The value ``tokens`` give the flag ``name`` (any of its :func:`spellings`; ``on``/``off``
    for a switch), or None."""
    spell = spellings(name)
    for i, head, val, negative in _find(tokens, spell, _negatives(spell)):
        if negative:
            return "off"
        if val is not None:
            return val
        nxt = tokens[i + 1] if i + 1 < len(tokens) else None
        return nxt if nxt is not None and not _is_flag(nxt) else "on"
    return None


def check_port(tokens: list[str], base_url: str) -> None:
    """The server command must listen where the client sends (ValueError otherwise): its
    ``--port``, or where it listens without one (llama-server: 8080)."""
    port = flag_value(tokens, "port")
    if port is None:
        port = next((str(DEFAULT_PORTS[pathlib.PurePath(t).name]) for t in tokens
                     if pathlib.PurePath(t).name in DEFAULT_PORTS), None)
        if port is not None and urlparse(base_url).port != int(port):
            raise ValueError(f"--serve-cmd listens on port {port} (no --port given) but --base-url is "
                             f"{base_url}; give the server --port")
        return
    want = urlparse(base_url).port
    if want is not None and int(port) != want:
        raise ValueError(f"--serve-cmd listens on port {port} but --base-url is {base_url}")
