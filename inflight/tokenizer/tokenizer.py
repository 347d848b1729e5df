"""The server's tokenizer: a ``tokenizers`` (HF fast) tokenizer plus special ids and chat template.

Loads either from GGUF metadata (:meth:`Tokenizer.from_gguf`) or from a Hugging Face model
directory holding ``tokenizer.json`` (:meth:`Tokenizer.from_pretrained`). Encoding and decoding
go straight to the Rust ``tokenizers`` backend, so results match transformers' fast tokenizers.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from inflight.tokenizer.chat import render_chat_template
from inflight.tokenizer.gguf_loader import load_gguf_tokenizer, set_special_token_template

__all__ = ["Tokenizer", "EOG_TOKEN_TEXTS"]

# Token texts llama.cpp treats as end-of-generation whenever the vocabulary has them
# (llama-vocab.cpp, special_eog_ids): GGUF files rarely list eot/eom ids explicitly.
EOG_TOKEN_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
))


class Tokenizer:
    """Wraps a HF fast tokenizer (``tokenizers`` lib) + special token ids + chat template.

    Attributes: ``vocab_size`` (tokenizer entries incl. added tokens; the model's embedding
    may be larger), ``bos_token_id`` / ``eos_token_id`` (``None`` if the model has none),
    ``eos_token_ids`` (every id that ends generation), ``chat_template`` (Jinja source or
    ``None``), ``backend`` (the underlying ``tokenizers.Tokenizer``).
    Instances are immutable after construction and safe to share between threads.
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, extra_eos_token_ids: Iterable[int] = (),
                 chat_template: str | None = None,
                 special_tokens: Mapping[str, str | None] | None = None) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        eos = set(extra_eos_token_ids)
        if eos_token_id is not None:
            eos.add(eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.chat_template = chat_template or None
        names = dict(special_tokens or {})
        names.setdefault("bos_token", self._text(bos_token_id))
        names.setdefault("eos_token", self._text(eos_token_id))
        # Templates read these names; transformers passes its whole special-tokens map.
        self.special_tokens_map: dict[str, str] = {k: v for k, v in names.items() if v is not None}

    def _text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    # ----------------------------------------------------------------------------- loading
    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Build the tokenizer described by a GGUF file's ``tokenizer.*`` metadata.

        Reads the metadata header only (no tensors). Byte-level BPE (``gpt2``) vocabularies are
        built natively; sentencepiece and others go through transformers' GGUF converter.
        ``eos_token_ids`` = eos, eot and eom ids plus the tokens llama.cpp treats as
        end-of-generation (:data:`EOG_TOKEN_TEXTS`). Raises ``FileNotFoundError`` for a missing
        file and ``ValueError`` for a file without a usable tokenizer.
        """
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        backend, meta = load_gguf_tokenizer(path)
        tokens = meta["tokenizer.ggml.tokens"]

        def token_id(key: str) -> int | None:
            tid = meta.get(f"tokenizer.ggml.{key}")
            return tid if isinstance(tid, int) and 0 <= tid < len(tokens) else None

        vocab = backend.get_vocab(with_added_tokens=True)
        extra = {t for k in ("eot_token_id", "eom_token_id") if (t := token_id(k)) is not None}
        extra |= {vocab[t] for t in EOG_TOKEN_TEXTS if t in vocab}
        special = {name: tokens[tid] if (tid := token_id(key)) is not None else None
                   for name, key in (("unk_token", "unknown_token_id"),
                                     ("pad_token", "padding_token_id"))}
        return cls(backend, bos_token_id=token_id("bos_token_id"),
                   eos_token_id=token_id("eos_token_id"), extra_eos_token_ids=extra,
                   chat_template=meta.get("tokenizer.chat_template"), special_tokens=special)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str]) -> "Tokenizer":
        """Load from a Hugging Face model directory (local only, nothing is downloaded).

        Needs ``tokenizer.json``; reads ``tokenizer_config.json`` (chat template, bos/eos/unk/pad
        tokens, ``add_bos_token``/``add_eos_token``), ``chat_template.jinja`` (which overrides the
        config's template, as in transformers), ``special_tokens_map.json`` as a fallback for
        special tokens, and ``generation_config.json``'s ``eos_token_id`` (int or list) for
        ``eos_token_ids``. Raises ``FileNotFoundError`` when ``tokenizer.json`` is missing.
        """
        root = pathlib.Path(model_dir)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found (only fast tokenizers are supported)")
        backend = BackendTokenizer.from_file(str(tok_file))
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")

        names = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            names[name] = _token_content(config.get(name)) or _token_content(special_map.get(name))

        def tid(name: str) -> int | None:
            token = names[name]
            return backend.token_to_id(token) if token else None

        if "add_bos_token" in config or "add_eos_token" in config:
            # transformers rebuilds the post-processor from these flags (update_post_processor).
            set_special_token_template(
                backend, names["bos_token"] if config.get("add_bos_token") else None,
                names["eos_token"] if config.get("add_eos_token") else None)

        gen_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        extra = [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
        return cls(backend, bos_token_id=tid("bos_token"), eos_token_id=tid("eos_token"),
                   extra_eos_token_ids=extra, chat_template=_chat_template(root, config),
                   special_tokens=names)

    # ------------------------------------------------------------------------------ usage
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token texts in ``text`` (e.g. ``<|im_start|>``) map to
        their ids. With ``add_special_tokens`` BOS/EOS are added only where the model's tokenizer
        config asks for them (SmolLM2: nothing is added).

        Raises:
            ValueError: ``text`` is not valid Unicode (a lone surrogate such as U+D800, which
                JSON's ``\\ud800`` escape can carry but UTF-8 cannot).
        """
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            if isinstance(text, str):
                bad = next((i for i, ch in enumerate(text) if 0xD800 <= ord(ch) <= 0xDFFF), None)
                if bad is not None:
                    raise ValueError(f"text is not valid Unicode: lone surrogate "
                                     f"U+{ord(text[bad]):04X} at index {bad}") from None
            raise

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that do not form complete UTF-8 characters become U+FFFD."""
        ids = ids if isinstance(ids, list) else [int(i) for i in ids]  # numpy / torch ids too
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        """Vocabulary strings (byte-level spelling, e.g. ``'Ġworld'``) of ``ids``; an id out of
        range yields ``None``, as in ``tokenizers``."""
        return [self.backend.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string, or ``None``."""
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` into a prompt string with the model's chat template.

        Same output as transformers' ``apply_chat_template(..., tokenize=False)``; the special
        token names (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``) are visible to the
        template and ``kwargs`` override them. Pass ``chat_template=`` to use another template.
        The render is bounded in time and size (:mod:`inflight.tokenizer.chat`).

        Raises:
            ValueError: malformed ``messages`` or no template; the client's fault (400).
            ConversationRejectedError: the template's ``raise_exception(...)`` refused the
                conversation; the client's fault (a ``ValueError``, 400).
            ChatTemplateError: the template failed (sandbox escape, time or size bound,
                recursion, any other error); the model's fault (not a ``ValueError``, 500).
        """
        template = kwargs.pop("chat_template", None) or self.chat_template
        context = {**self.special_tokens_map, **kwargs}
        context.setdefault("bos_token", "")
        context.setdefault("eos_token", "")
        return render_chat_template(template, messages,
                                    add_generation_prompt=add_generation_prompt, **context)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
                f"eos={sorted(self.eos_token_ids)}, chat_template={self.chat_template is not None})")


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config stores special tokens either as text or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _chat_template(root: pathlib.Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(root / "chat_template.json").get(
        "chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
