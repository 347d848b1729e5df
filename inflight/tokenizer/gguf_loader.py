"""Build a ``tokenizers.Tokenizer`` from the ``tokenizer.ggml.*`` metadata of a GGUF file.

Only the key/value header is parsed; tensor data is never touched. ``gguf.GGUFReader`` would also
do, but it builds a numpy view per array element (about 2 s for a 49k-token vocabulary), while
the walk below reads the same header in well under a second.

Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) are assembled here with the
``tokenizers`` library, following llama.cpp's ``llama-vocab.cpp`` for the pre-tokenizer split of
each ``tokenizer.ggml.pre`` type and transformers' ``integrations/gguf`` for the vocabulary.
Other vocabulary types (sentencepiece ``llama``, ``t5``...) are delegated to transformers'
GGUF converter.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from inflight.model.gguf_file import read_gguf_metadata
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType): 3 = CONTROL, 4 = USER_DEFINED.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4



# Pre-tokenizer splits per tokenizer.ggml.pre, from llama.cpp's llama_vocab::impl::load /
# llm_tokenizer_bpe. Types not listed use the GPT-2 regex that ByteLevel applies by itself.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}
# llama.cpp isolates every digit first (regex "\p{N}"), then applies the GPT-2 regex.
_DIGIT_SPLIT_TYPES = frozenset(
    ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"))
_GPT2_REGEX_TYPES = frozenset(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"))


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable-char table (the alphabet every byte-level token uses).
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _DIGIT_SPLIT_TYPES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre is not None and pre not in _GPT2_REGEX_TYPES:
        logger.warning("GGUF pre-tokenizer %r not known; using the GPT-2 split regex", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _byte_level_backend(meta: dict[str, Any]) -> BackendTokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def respell(tok: str) -> str:
        # Some converters store added tokens with raw characters; the BPE model needs them in
        # the byte alphabet to look them up (transformers does the same).
        return tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))

    vocab = {respell(tok): i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", ())]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                          continuing_subword_prefix="", end_of_word_suffix="",
                                          fuse_unk=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    # A control token outside the byte alphabet cannot be a real vocabulary entry (llama.cpp
    # mislabel); adding it would create a second id for its text.
    backend.add_special_tokens([
        AddedToken(tok, normalized=False, special=True)
        for tok, t in zip(tokens, types) if t == TOKEN_TYPE_CONTROL and set(tok) <= alphabet])
    backend.add_tokens([
        AddedToken(tok, normalized=False, special=False)
        for tok, t in zip(tokens, types) if t == TOKEN_TYPE_USER_DEFINED and tok in vocab])
    return backend


def _transformers_backend(meta: dict[str, Any]) -> BackendTokenizer:
    try:  # transformers >= 5
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:  # transformers 4.x
        from transformers.integrations.ggml import convert_gguf_tokenizer
    renames = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens",
               "scores": "scores", "token_type": "token_type", "merges": "merges",
               "precompiled_charsmap": "precompiled_charsmap", "bos_token_id": "bos_token_id",
               "eos_token_id": "eos_token_id", "unknown_token_id": "unk_token_id",
               "padding_token_id": "pad_token_id", "add_space_prefix": "add_prefix_space"}
    tokenizer_dict = {new: meta[f"tokenizer.ggml.{old}"] for old, new in renames.items()
                      if f"tokenizer.ggml.{old}" in meta}
    backend: BackendTokenizer
    backend, _ = convert_gguf_tokenizer(meta.get("general.architecture", "llama"), tokenizer_dict)
    return backend


def set_special_token_template(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    """Make ``encode(..., add_special_tokens=True)`` add ``bos`` before / ``eos`` after the text.

    Passing ``None`` for both removes any post-processor (no special tokens are added).
    """
    # A token missing from the vocabulary cannot be added; TemplateProcessing would reject it.
    bos = bos if bos is not None and backend.token_to_id(bos) is not None else None
    eos = eos if eos is not None and backend.token_to_id(eos) is not None else None
    if bos is None and eos is None:
        backend.post_processor = None
        return
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys((bos, eos)) if t]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=specials)


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> tuple[BackendTokenizer, dict[str, Any]]:
    """Return ``(backend, metadata)`` for a GGUF file's tokenizer.

    ``metadata`` holds the ``tokenizer.*`` keys plus ``general.architecture``; the backend's
    post-processor already adds BOS/EOS as ``tokenizer.ggml.add_bos_token`` /
    ``add_eos_token`` say (defaults: BOS for sentencepiece ``llama`` vocabularies, as llama.cpp
    and transformers do; nothing otherwise). Raises ``ValueError`` if the file has no tokenizer.
    """
    meta = read_gguf_metadata(
        path, lambda k: k.startswith("tokenizer.") or k == "general.architecture")
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        raise ValueError(f"{path} carries no tokenizer (tokenizer.ggml.model/tokens missing)")
    backend = _byte_level_backend(meta) if kind == "gpt2" else _transformers_backend(meta)
    tokens = meta["tokenizer.ggml.tokens"]

    def special(key: str, flag: str, default: bool) -> str | None:
        tid = meta.get(f"tokenizer.ggml.{key}")
        wanted = meta.get(f"tokenizer.ggml.{flag}", default)
        return tokens[tid] if wanted and tid is not None and 0 <= tid < len(tokens) else None

    set_special_token_template(backend, special("bos_token_id", "add_bos_token", kind == "llama"),
                               special("eos_token_id", "add_eos_token", False))
    return backend, meta
