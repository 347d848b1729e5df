"""``--enable-lora`` and its flags: which LoRA adapters a server starts with and how many it
holds. Torch-free.

Flag names, forms and defaults are vLLM's (``vllm/config/lora.py``, the ``--lora-modules``
parser in ``vllm/entrypoints/openai/cli_args.py``), so a vLLM command line starts here
unchanged:

    --enable-lora --lora-modules sql=/adapters/sql '{"name": "chat", "path": "/adapters/chat"}'
    --max-loras 4 --max-lora-rank 64 --max-cpu-loras 8
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

_MODULE_KEYS = ("name", "path", "base_model_name")


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``).

    Attributes:
        name: the model name requests use to pick the adapter (``"model": name``).
        path: the adapter's directory (Hugging Face PEFT: ``adapter_config.json`` and
            ``adapter_model.safetensors`` or ``.bin``).
        base_model_name: the model ``/v1/models`` lists as its parent; None: the served
            base model.
    """

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA settings (vLLM's ``LoRAConfig``).

    Attributes:
        max_loras: most distinct adapters in one step (the model's adapter slots).
        max_lora_rank: largest rank an adapter may have; a larger one is refused when it
            is loaded. vLLM allows only 1, 8, 16, 32, 64, 128, 256, 320, 512; any rank
            >= 1 is accepted here.
        max_cpu_loras: adapters kept loaded in host memory (the rest are re-read from
            their path on use); None: ``max_loras``. Must be >= ``max_loras``.
        lora_modules: the adapters registered at start, names unique.

    Raises:
        ValueError: a value out of range; the message starts with the field's name.
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[LoRAModule, ...] = ()

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {msg}, got {getattr(self, name)!r}")

        check(self.max_loras >= 1, "max_loras", "must be >= 1")
        check(self.max_lora_rank >= 1, "max_lora_rank", "must be >= 1")
        check(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
              "max_cpu_loras", f"must be >= max_loras ({self.max_loras})")
        names = [m.name for m in self.lora_modules]
        dup = sorted({n for n in names if names.count(n) > 1})
        check(not dup, "lora_modules", f"duplicate adapter name(s) {', '.join(dup)}")
        check(all(m.name and m.path for m in self.lora_modules), "lora_modules",
              "every adapter needs a non-empty name and path")

    @property
    def num_cpu_loras(self) -> int:
        """Adapters kept loaded in memory: ``max_cpu_loras``, or ``max_loras`` when None."""
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


def parse_lora_modules(values: list[str]) -> tuple[LoRAModule, ...]:
    """``--lora-modules`` values -> adapters, in order.

    Each value is ``name=path`` (split at the first ``=``), a JSON object
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (``base_model_name`` optional),
    or a JSON list of such objects (the forms of vLLM's ``--lora-modules``). Empty values
    are skipped, as vLLM does.

    Raises:
        ValueError: a value in neither form, bad JSON, unknown or missing keys (named),
            an empty name or path, or one name given twice.
    """
    out: list[LoRAModule] = []
    for value in values:
        text = value.strip()
        if not text:
            continue
        if text[0] in "{[":
            out.extend(_from_json(text))
        else:
            name, eq, path = text.partition("=")
            if not eq or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules: expected name=path or a JSON object, "
                                 f"got {value!r}")
            out.append(LoRAModule(name.strip(), path.strip()))
    names = [m.name for m in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"lora_modules: adapter name(s) given twice: {', '.join(dup)}")
    return tuple(out)


def _from_json(text: str) -> list[LoRAModule]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"lora_modules: invalid JSON ({e.msg}) in {text!r}") from None
    return [_module_from_dict(item, text) for item in (data if isinstance(data, list) else [data])]


def _module_from_dict(item: Any, text: str) -> LoRAModule:
    if not isinstance(item, dict):
        raise ValueError(f"lora_modules: expected a JSON object, got {text!r}")
    unknown = sorted(set(item) - set(_MODULE_KEYS))
    if unknown:
        raise ValueError(f"lora_modules: unknown key(s) {', '.join(unknown)} in {text!r}; "
                         f"known: {', '.join(_MODULE_KEYS)}")
    for key in ("name", "path"):
        if not isinstance(item.get(key), str) or not item[key].strip():
            raise ValueError(f"lora_modules: {key!r} must be a non-empty string in {text!r}")
    base = item.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"lora_modules: 'base_model_name' must be a string in {text!r}")
    return LoRAModule(item["name"].strip(), item["path"].strip(), base)


def add_lora_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add vLLM's LoRA flags to ``parser`` (a group named ``lora``)."""
    g = parser.add_argument_group("lora")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: a request names one as its model")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="MODULE",
                   help="adapters to serve from the start, each name=path or a JSON object "
                        '{"name": ..., "path": ..., "base_model_name": ...}; path is a '
                        "Hugging Face PEFT directory (needs --enable-lora)")
    g.add_argument("--max-loras", type=int, default=1,
                   help="most distinct adapters in one batch (default 1)")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="largest adapter rank accepted; a larger one is refused when "
                        "loaded (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in memory, the least recently used re-read "
                        "from disk past it (default: --max-loras; must be >= it)")


def lora_config_from_args(args: argparse.Namespace) -> LoRAConfig | None:
    """The flags of ``add_lora_cli_args`` -> a config, or None without ``--enable-lora``.

    Raises:
        ValueError: ``--lora-modules`` without ``--enable-lora`` (vLLM refuses it too),
            or as ``parse_lora_modules`` and ``LoRAConfig``.
    """
    if not args.enable_lora:
        if args.lora_modules:
            raise ValueError("lora_modules: --lora-modules needs --enable-lora; add "
                             "--enable-lora to serve LoRA adapters")
        return None
    return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras,
                      lora_modules=parse_lora_modules(args.lora_modules or []))
