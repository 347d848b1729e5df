"""Request mixes: what each benchmark request asks for, independent of when it is sent.

Datasets (all reproducible from ``seed``):

- ``random``: prompts of ``input_len`` tokens and ``max_tokens = output_len``, each drawn
  uniformly from ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (vLLM's
  ``--random-range-ratio``); text is random words from the sonnet vocabulary, after an
  optional shared prefix of ``prefix_len`` tokens.
- ``sonnet``: vLLM's sonnet dataset: a shared prefix cut from the start of
  ``vllm_sonnet.txt`` (``prefix_len`` tokens) followed by randomly sampled lines, to
  ``input_len`` tokens.
- ``trace``: the Azure LLM trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``) or the
  Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``):
  lengths from the trace (times ``length_scale``, clipped to the caps), arrival times kept
  for ``--arrival trace``; with ``shuffle`` (the default under a rate) rows in a seeded
  random order. Mooncake's ``hash_ids`` become shared text blocks, so requests
  that share prefix blocks in the trace share prompt prefixes here. With ``sessions``
  (users), rows come as the conversations their blocks chain into, each turn's prompt
  holding its history (the earlier turns' blocks) as the trace recorded it.
- ``chat``: the first turn of the MT-Bench or Vicuna-Bench questions, or the ``prompt`` of
  each line of a JSONL file (vLLM's ``custom`` dataset). With ``conversation_turns`` > 1, a
  multi-turn chat replay: each conversation is a question's turns (MT-Bench has two; later
  turns are other questions' first turns), and each follow-up is sent with the whole
  history, the server's own earlier answers included (``inflight.bench.conversations``).

Prompt lengths are in tokens as counted by a :class:`~inflight.bench.prompts.TokenCounter`;
exact only when that counter is (server ``/tokenize`` or a local tokenizer).
"""

from __future__ import annotations

import asyncio
import os
import pathlib
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from inflight.bench.chat_files import ChatLine, load_chat_file
from inflight.bench.lora_modules import assign_adapters
from inflight.bench.prompts import FittedPrompt, TokenCounter, fit_prompt
from inflight.bench.trace_files import BLOCK_TOKENS, TraceRow, load_trace, scale_length, trace_sessions

SONNET_FILE = "vllm_sonnet.txt"
AZURE_CONV_FILE = "azure_llm_2023_conv_1815-1900.csv"
CHAT_FILES = {"mt_bench": "mt_bench_questions.jsonl", "vicuna": "vicuna_bench_questions.jsonl"}


def default_data_dir() -> pathlib.Path:
    """``$INFLIGHT_DATA_DIR``, else ``<repo root>/../shared/data`` (next to the checkout)."""
    env = os.environ.get("INFLIGHT_DATA_DIR")
    if env:
        return pathlib.Path(env)
    repo_root = pathlib.Path(__file__).resolve().parents[2]
    return (repo_root / ".." / "shared" / "data").resolve()


@dataclass
class RequestSpec:
    """One request of the mix. Lengths in tokens."""

    prompt: str | None  # text for /v1/completions (None for chat-only specs)
    messages: list[dict[str, Any]] | None  # messages for /v1/chat/completions
    prompt_len: int | None  # tokens as counted by the dataset's counter; None if unknown
    output_len: int  # max_tokens
    ignore_eos: bool
    trace_time: float | None = None  # seconds since the first trace row, unscaled
    exact: bool = False  # prompt_len is the server's exact count
    meta: dict[str, Any] = field(default_factory=dict)
    model: str | None = None  # the LoRA adapter it names (--lora-modules); None: the session's model

    def as_messages(self) -> list[dict[str, Any]]:
        return self.messages or [{"role": "user", "content": self.prompt or ""}]

    def as_text(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return "\n".join(m["content"] for m in self.messages or [])


@dataclass
class DatasetConfig:
    """Everything that defines a request mix; saved verbatim with every result."""

    name: str = "random"  # random | sonnet | trace | chat
    num_prompts: int = 100
    seed: int = 0
    data_dir: str | None = None
    input_len: int = 256  # random / sonnet
    output_len: int = 64  # random / sonnet / chat max_tokens
    range_ratio: float = 0.0  # random
    prefix_len: int = 0  # random / sonnet shared prefix, tokens
    trace_file: str | None = None
    trace_format: str = "auto"  # auto | azure | mooncake
    trace_skip: int = 0  # rows skipped at the start of the trace
    length_scale: float = 1.0  # multiplies trace prompt and output lengths
    min_input_len: int = 1
    max_input_len: int | None = None
    min_output_len: int = 1
    max_output_len: int | None = None
    prefix_blocks: bool = True  # Mooncake hash_ids -> shared prefix text
    chat_file: str = "mt_bench"  # mt_bench | vicuna | a JSONL path ({"turns": [...]} or {"prompt": ...})
    conversation_turns: int = 1  # chat: user turns per conversation (1: independent questions)
    active_conversations: int = 16  # chat, multi-turn: conversations interleaved in the mix
    sonnet_file: str | None = None  # sonnet: the text file (default vllm_sonnet.txt in the data dir)
    ignore_eos: bool | None = None  # None: True except for chat
    shuffle: bool = False  # trace: rows in a seeded random order (a rate replays lengths, not times)
    sessions: bool = False  # trace: rows in conversation order, by hash_ids chains (``--users``)
    lora_modules: tuple[str, ...] = ()  # adapters the requests pick from, seeded (lora_modules.assign_adapters)

    def resolved_data_dir(self) -> pathlib.Path:
        return pathlib.Path(self.data_dir) if self.data_dir else default_data_dir()

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["data_dir"] = str(self.resolved_data_dir())
        d["ignore_eos"] = self.effective_ignore_eos()
        d["lora_modules"] = list(self.lora_modules)
        if self.name == "trace":
            d["trace_file"] = str(self.trace_path())
        return d

    def effective_ignore_eos(self) -> bool:
        return self.ignore_eos if self.ignore_eos is not None else self.name != "chat"

    def trace_path(self) -> pathlib.Path:
        return _resolve(self.trace_file or AZURE_CONV_FILE, self.resolved_data_dir())


def _resolve(name: str, data_dir: pathlib.Path) -> pathlib.Path:
    p = pathlib.Path(name)
    return p if p.is_absolute() or p.exists() else data_dir / p


# ---------------------------------------------------------------- text sources

_FALLBACK_WORDS = ("time beauty love summer rose heart eyes world night day truth youth age "
                   "sweet fair light gold face mind praise verse spring winter").split()


def _sonnet_lines(data_dir: pathlib.Path, name: str | None = None) -> list[str]:
    p = _resolve(name, data_dir) if name else data_dir / SONNET_FILE
    if not p.exists() and name:
        raise FileNotFoundError(2, "no such sonnet file", str(p))
    if not p.exists():
        # The random dataset must not depend on the data folder; any English-ish text will do.
        return [" ".join(_FALLBACK_WORDS[i:] + _FALLBACK_WORDS[:i]) for i in range(len(_FALLBACK_WORDS))]
    return [ln.strip() for ln in p.read_text(encoding="utf-8").splitlines() if ln.strip()]


def _random_line_words(lines: Sequence[str], rng: np.random.Generator, n_words: int) -> list[str]:
    words: list[str] = []
    while len(words) < n_words:
        words.extend(lines[int(rng.integers(len(lines)))].split())
    return words


def _random_words(vocab: Sequence[str], rng: np.random.Generator, n_words: int) -> list[str]:
    return [vocab[i] for i in rng.integers(len(vocab), size=n_words)]


# ---------------------------------------------------------------- builders

async def _fit_all(counter: TokenCounter, jobs: list[tuple[list[str], int, str]]) -> list[FittedPrompt]:
    return await asyncio.gather(*(fit_prompt(counter, w, t, prefix=p) for w, t, p in jobs))


async def _shared_prefix(counter: TokenCounter, words: list[str], n_tokens: int) -> str:
    if n_tokens <= 0:
        return ""
    base = await counter.count("")  # special tokens the server adds; the prefix excludes them
    fitted = await fit_prompt(counter, words, n_tokens + base)
    return fitted.text + "\n"


def _ranged(rng: np.random.Generator, n: int, center: int, ratio: float) -> np.ndarray:
    lo, hi = max(1, int(center * (1 - ratio))), max(1, int(center * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def _continuation(rng: np.random.Generator, seed: int, start: int) -> np.random.Generator:
    # Requests from ``start`` on: the first build continues the prefix's stream (so a mix of
    # n requests is what it always was); an extension gets its own stream, same prefix.
    return rng if start == 0 else np.random.default_rng([seed, start])


async def build_random(cfg: DatasetConfig, counter: TokenCounter, n: int, start: int = 0) -> list[RequestSpec]:
    rng = np.random.default_rng(cfg.seed)
    vocab = sorted({w for ln in _sonnet_lines(cfg.resolved_data_dir()) for w in ln.split()})
    prefix = await _shared_prefix(counter, _random_words(vocab, rng, cfg.prefix_len + 16), cfg.prefix_len)
    rng = _continuation(rng, cfg.seed, start)
    in_lens = _ranged(rng, n, cfg.input_len, cfg.range_ratio)
    out_lens = _ranged(rng, n, cfg.output_len, cfg.range_ratio)
    jobs = [(_random_words(vocab, rng, int(t) + 16), int(t), prefix) for t in in_lens]
    fitted = await _fit_all(counter, jobs)
    return [RequestSpec(f.text, None, f.num_tokens, int(o), cfg.effective_ignore_eos(), exact=f.exact)
            for f, o in zip(fitted, out_lens)]


async def build_sonnet(cfg: DatasetConfig, counter: TokenCounter, n: int, start: int = 0) -> list[RequestSpec]:
    rng = _continuation(np.random.default_rng(cfg.seed), cfg.seed, start)
    lines = _sonnet_lines(cfg.resolved_data_dir(), cfg.sonnet_file)
    prefix_words = " ".join(lines).split()
    prefix = await _shared_prefix(counter, prefix_words, cfg.prefix_len)
    jobs = [(_random_line_words(lines, rng, cfg.input_len + 16), cfg.input_len, prefix) for _ in range(n)]
    fitted = await _fit_all(counter, jobs)
    return [RequestSpec(f.text, None, f.num_tokens, cfg.output_len, cfg.effective_ignore_eos(), exact=f.exact)
            for f in fitted]


class _BlockTexts:
    """Mooncake hash id -> a fixed block of about ``block_tokens`` tokens of sonnet lines.

    Blocks are not fitted one by one (a 30-minute slice has tens of thousands of distinct
    ids); the words-per-token ratio measured once sizes them, and the request's last part
    is fitted so the whole prompt is exact.
    """

    def __init__(self, lines: list[str], seed: int, block_tokens: int, tokens_per_word: float):
        self._lines, self._seed = lines, seed
        self._n_words = max(1, int(round(block_tokens / max(tokens_per_word, 1e-6))))
        self._cache: dict[int, list[str]] = {}

    def words(self, h: int, n_words: int | None = None) -> list[str]:
        if h not in self._cache:
            rng = np.random.default_rng([self._seed, h])
            self._cache[h] = _random_line_words(self._lines, rng, self._n_words)[: self._n_words]
        w = self._cache[h]
        return w if n_words is None else (w * (n_words // max(1, len(w)) + 1))[:n_words]


async def _tokens_per_word(counter: TokenCounter, lines: list[str]) -> float:
    sample = " ".join(lines[:64])
    return max(1e-6, (await counter.count(sample) - await counter.count("")) / max(1, len(sample.split())))


def trace_rows(cfg: DatasetConfig, start: int, n: int) -> list[tuple[int, TraceRow]]:
    """Rows ``start .. start + n - 1`` of the mix as (row number, row): the trace's own order
    from ``trace_skip`` on, or, with ``shuffle``, a seeded permutation of those rows, so
    the lengths of any stretch of the mix are a sample of the whole trace's (consecutive
    rows of a real trace come in runs of similar requests). With ``sessions``, whole
    conversations (``trace_files.trace_sessions``) one after the other, each in turn order;
    ``shuffle`` then permutes conversations, not rows."""
    return [(number, row) for number, row, _ in _ordered_rows(cfg)[start: start + n]]


def _ordered_rows(cfg: DatasetConfig) -> list[tuple[int, TraceRow, dict[str, int]]]:
    """The mix's rows in order: (row number, row, its conversation's meta or {})."""
    rows = load_trace(cfg.trace_path(), cfg.trace_format)[cfg.trace_skip:]
    rng = np.random.default_rng([cfg.seed, 7])
    if not cfg.sessions:
        idx = rng.permutation(len(rows)) if cfg.shuffle else np.arange(len(rows))
        return [(cfg.trace_skip + int(i), rows[int(i)], {}) for i in idx]
    sessions = trace_sessions(rows)
    order = rng.permutation(len(sessions)) if cfg.shuffle else range(len(sessions))
    return [(cfg.trace_skip + i, rows[i], {"trace_session": int(k), "trace_turn": t,
                                            "trace_turns": len(sessions[k])})
            for k in order for t, i in enumerate(sessions[k])]


async def build_trace(cfg: DatasetConfig, counter: TokenCounter, n: int, start: int = 0) -> list[RequestSpec]:
    numbered = _ordered_rows(cfg)[start: start + n]
    lines = _sonnet_lines(cfg.resolved_data_dir())
    block_tokens = max(1, int(round(BLOCK_TOKENS * cfg.length_scale)))
    blocks = _BlockTexts(lines, cfg.seed, block_tokens, await _tokens_per_word(counter, lines))
    jobs = []
    for number, row, _ in numbered:
        in_len = scale_length(row.input_len, cfg.length_scale, cfg.min_input_len, cfg.max_input_len)
        rng = np.random.default_rng([cfg.seed, number])
        if row.hash_ids and cfg.prefix_blocks:
            jobs.append(_block_prompt(counter, blocks, row.hash_ids, in_len, block_tokens,
                                      row.input_len // BLOCK_TOKENS))
        else:
            jobs.append(fit_prompt(counter, _random_line_words(lines, rng, in_len + 16), in_len))
    fitted = await asyncio.gather(*jobs)
    specs = []
    for (number, row, session), f in zip(numbered, fitted):
        out_len = scale_length(row.output_len, cfg.length_scale, cfg.min_output_len, cfg.max_output_len)
        meta = {"trace_input_len": row.input_len, "trace_output_len": row.output_len}
        if cfg.shuffle:
            meta["trace_row"] = number
        if row.hash_ids is not None:
            meta["num_hash_blocks"] = len(row.hash_ids)
        meta.update(session)
        specs.append(RequestSpec(f.text, None, f.num_tokens, out_len, cfg.effective_ignore_eos(),
                                 trace_time=row.time, exact=f.exact, meta=meta))
    return specs


async def _block_prompt(counter: TokenCounter, blocks: _BlockTexts, hash_ids: list[int],
                        in_len: int, block_tokens: int, complete: int) -> FittedPrompt:
    # Only the trace's complete blocks are shared text: the last, partial one is this
    # prompt's own (scaled lengths round, so ``in_len // block_tokens`` alone can count it).
    full = min(complete, len(hash_ids), in_len // block_tokens)
    while True:
        prefix = "\n".join(" ".join(blocks.words(h)) for h in hash_ids[:full])
        # A block boundary is a newline: requests sharing the first j ids share j blocks of text.
        prefix = prefix + "\n" if prefix else ""
        if full == 0 or await counter.count(prefix) <= in_len:
            break
        full -= 1
    tail_id = hash_ids[full] if full < len(hash_ids) else hash_ids[-1] + 1_000_003
    return await fit_prompt(counter, blocks.words(tail_id, in_len + 16), in_len, prefix=prefix)


def _load_chat(cfg: DatasetConfig) -> list[ChatLine]:
    return load_chat_file(_resolve(CHAT_FILES.get(cfg.chat_file, cfg.chat_file), cfg.resolved_data_dir()))


async def build_chat(cfg: DatasetConfig, counter: TokenCounter, n: int, start: int = 0) -> list[RequestSpec]:
    questions = _load_chat(cfg)
    order = np.random.default_rng(cfg.seed).permutation(len(questions))
    specs = []
    for i in range(start, start + n):
        if cfg.conversation_turns > 1:
            conv, turn = conversation_slot(i, cfg.conversation_turns, cfg.active_conversations, cfg.seed)
            q = questions[int(order[conv % len(order)])]
            if turn < len(q.turns):
                text = q.turns[turn]
            else:  # a follow-up the file does not have: another question's first turn
                other = questions[int(np.random.default_rng([cfg.seed, conv, turn]).integers(len(questions)))]
                text = other.turns[0]
            meta = {"question_id": q.question_id, "category": q.category, "conversation": conv, "turn": turn}
        else:
            q = questions[int(order[i % len(order)])]
            text = q.turns[0]
            meta = {"question_id": q.question_id, "category": q.category}
        specs.append(RequestSpec(text, [{"role": "user", "content": text}], None, cfg.output_len,
                                 cfg.effective_ignore_eos(), meta=meta))
    return specs


def conversation_slot(index: int, turns: int, active: int, seed: int = 0) -> tuple[int, int]:
    """(conversation, turn) of item ``index`` of a multi-turn mix.

    Conversations come in groups of ``active``: a group's first turns come first, then its
    second turns, and so on, each wave in its own seeded order. So a conversation's next
    turn comes between 1 and ``2 * active - 1`` requests (``active`` on average) after its
    previous one: at ``r`` requests/s a user reads and types for about ``active / r``
    seconds, and never before the previous answer ended (``conversations.ConversationLog``).
    Every item's previous turn comes earlier in the mix.
    """
    group, within = divmod(index, turns * active)
    turn, pos = divmod(within, active)
    member = int(np.random.default_rng([seed, group, turn]).permutation(active)[pos])
    return group * active + member, turn


BUILDERS = {"random": build_random, "sonnet": build_sonnet, "trace": build_trace, "chat": build_chat}


async def build_dataset(cfg: DatasetConfig, counter: TokenCounter, n: int | None = None,
                        start: int = 0) -> list[RequestSpec]:
    """``n`` (default ``cfg.num_prompts``) request specs of the configured dataset: items
    ``start .. start + n - 1`` of its stream, so a mix can be extended without rebuilding it
    (trace rows continue; random and sonnet draw the extension from their own seeded stream
    behind the same shared prefix; chat keeps cycling its questions), each naming one of
    ``cfg.lora_modules`` where there are some."""
    if cfg.name not in BUILDERS:
        raise ValueError(f"unknown dataset {cfg.name!r} ({', '.join(BUILDERS)})")
    specs = await BUILDERS[cfg.name](cfg, counter, cfg.num_prompts if n is None else n, start)
    assign_adapters(specs, cfg.lora_modules, cfg.seed, start)
    return specs


def trace_length(cfg: DatasetConfig) -> int | None:
    """Rows a trace dataset can still give after ``trace_skip`` (None for other datasets)."""
    if cfg.name != "trace":
        return None
    return max(0, len(load_trace(cfg.trace_path(), cfg.trace_format)) - cfg.trace_skip)


def summarize_specs(specs: Sequence[RequestSpec]) -> dict[str, Any]:
    """Prompt and output length statistics (tokens) of a mix, for the result's fixed part."""
    def stats(vals: Sequence[float]) -> dict[str, float] | None:
        if not vals:
            return None
        a = np.asarray(vals, dtype=float)
        return {"mean": float(a.mean()), "min": int(a.min()), "median": float(np.median(a)), "max": int(a.max())}
    return {
        "num_requests": len(specs),
        "prompt_len": stats([s.prompt_len for s in specs if s.prompt_len is not None]),
        "output_len": stats([s.output_len for s in specs]),
        "exact_prompt_lens": all(s.exact for s in specs) if specs else False,
    }

