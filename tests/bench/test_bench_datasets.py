"""Datasets and prompt fitting: exact token counts under a toy tokenizer, reproducibility."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib

import numpy as np
import pytest
from bench_fake_openai import toy_count

from inflight.bench.datasets import DatasetConfig, build_dataset, default_data_dir, summarize_specs, trace_rows
from inflight.bench.prompts import WordCounter, fit_prompt, load_local_tokenizer
from inflight.bench.trace_files import load_trace, scale_length


class ToyCounter:
    """BOS + ceil(len(word)/4) per word, like the fake server's /tokenize; counts calls."""

    mode = "server"
    exact = True

    def __init__(self) -> None:
        self.calls = 0

    async def count(self, text: str) -> int:
        self.calls += 1
        return toy_count(text)


WORDS = ("shall I compare thee to a summer's day thou art more lovely and more temperate "
         "rough winds do shake the darling buds of May").split() * 40


@pytest.mark.parametrize("target", [1, 2, 3, 17, 64, 100, 257, 500])
def test_fit_prompt_exact(target):
    counter = ToyCounter()
    fitted = asyncio.run(fit_prompt(counter, WORDS, target))
    assert toy_count(fitted.text) == fitted.num_tokens == target
    assert fitted.exact
    # Interpolation search: a handful of counts, not one per word.
    assert counter.calls <= 20


def test_fit_prompt_with_prefix_and_impossible_targets():
    counter = ToyCounter()
    prefix = "Pick lines from these poems:\n"
    fitted = asyncio.run(fit_prompt(counter, WORDS, 80, prefix=prefix))
    assert fitted.text.startswith(prefix) and toy_count(fitted.text) == 80
    short = asyncio.run(fit_prompt(counter, WORDS, 3, prefix=prefix))
    assert not short.exact and short.num_tokens == toy_count(prefix)


def test_word_counter_is_approximate():
    fitted = asyncio.run(fit_prompt(WordCounter(), WORDS, 50))
    assert len(fitted.text.split()) == 50 and fitted.num_tokens == 50 and not fitted.exact


def test_local_tokenizer_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[UNK]": 0}
    for w in sorted(set(WORDS)):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]"}))
    counter = load_local_tokenizer(tmp_path)
    assert counter.mode == "local"
    fitted = asyncio.run(fit_prompt(counter, WORDS, 33))
    assert fitted.exact and asyncio.run(counter.count(fitted.text)) == 33


def cfg(data_dir, **kw) -> DatasetConfig:
    return DatasetConfig(data_dir=str(data_dir), **kw)


def test_default_data_dir_is_next_to_the_repo(monkeypatch):
    repo_root = pathlib.Path(__file__).resolve().parents[2]
    monkeypatch.delenv("INFLIGHT_DATA_DIR", raising=False)
    assert default_data_dir() == (repo_root / ".." / "shared" / "data").resolve()
    monkeypatch.setenv("INFLIGHT_DATA_DIR", "/elsewhere")
    assert default_data_dir() == pathlib.Path("/elsewhere")


def test_random_dataset_ranges_and_seed(data_dir):
    c = cfg(data_dir, name="random", num_prompts=30, input_len=40, output_len=10, range_ratio=0.5,
            prefix_len=8, seed=3)
    specs = asyncio.run(build_dataset(c, ToyCounter()))
    assert len(specs) == 30
    assert all(20 <= s.prompt_len <= 60 and 5 <= s.output_len <= 15 for s in specs)
    assert all(toy_count(s.prompt) == s.prompt_len and s.exact and s.ignore_eos for s in specs)
    prefix = specs[0].prompt.split("\n")[0]
    assert all(s.prompt.startswith(prefix + "\n") for s in specs)
    again = asyncio.run(build_dataset(c, ToyCounter()))
    assert [s.prompt for s in again] == [s.prompt for s in specs]
    other = asyncio.run(build_dataset(cfg(data_dir, name="random", num_prompts=30, input_len=40, seed=4),
                                      ToyCounter()))
    assert [s.prompt for s in other] != [s.prompt for s in specs]


def test_sonnet_dataset(data_dir):
    c = cfg(data_dir, name="sonnet", num_prompts=5, input_len=120, output_len=20, prefix_len=30)
    specs = asyncio.run(build_dataset(c, ToyCounter()))
    assert all(toy_count(s.prompt) == 120 and s.output_len == 20 for s in specs)
    assert all(s.prompt.startswith("FROM fairest creatures") for s in specs)
    summary = summarize_specs(specs)
    assert summary["prompt_len"]["min"] == summary["prompt_len"]["max"] == 120
    assert summary["exact_prompt_lens"]


def test_trace_dataset_scaled_capped(data_dir, tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                     "2023-11-16 18:15:46.0000000,374,44\n"
                     "2023-11-16 18:15:47.5000000,3000,10\n"
                     "2023-11-16 18:15:49.2500000,16,1000\n")
    c = cfg(data_dir, name="trace", trace_file=str(trace), num_prompts=10, length_scale=1 / 8,
            max_input_len=200, max_output_len=100)
    specs = asyncio.run(build_dataset(c, ToyCounter()))
    assert [s.prompt_len for s in specs] == [47, 200, 2]
    assert [s.output_len for s in specs] == [6, 1, 100]
    assert [s.trace_time for s in specs] == [0.0, 1.5, 3.25]
    assert all(toy_count(s.prompt) == s.prompt_len and s.ignore_eos for s in specs)
    assert scale_length(5, 0.01, 1, None) == 1


def test_mooncake_prefix_blocks_are_shared(data_dir):
    c = cfg(data_dir, name="trace", trace_file="mooncake_conversation_0-30min.jsonl", num_prompts=4,
            length_scale=1 / 64)
    rows = load_trace(data_dir / "mooncake_conversation_0-30min.jsonl")[:4]
    specs = asyncio.run(build_dataset(c, ToyCounter()))
    for row, s in zip(rows, specs):
        assert s.prompt_len == toy_count(s.prompt) == round(row.input_len / 64)
    # Rows 0..3 all start with hash id 0 (one 512-token block = 8 tokens here) and then differ.
    assert all(r.hash_ids[0] == 0 for r in rows) and rows[0].hash_ids[1] != rows[1].hash_ids[1]
    first_blocks = {s.prompt.split("\n")[0] for s in specs}
    assert len(first_blocks) == 1
    assert len({s.prompt.split("\n")[1] for s in specs}) == 4


def test_chat_dataset(data_dir):
    c = cfg(data_dir, name="chat", num_prompts=100, output_len=32, chat_file="vicuna")
    specs = asyncio.run(build_dataset(c, WordCounter()))
    assert len(specs) == 100  # 80 questions, cycled
    assert all(s.messages[0]["role"] == "user" and s.prompt_len is None for s in specs)
    assert not any(s.ignore_eos for s in specs)
    assert len({s.meta["question_id"] for s in specs}) == 80


def test_data_dir_override(tmp_path):
    (tmp_path / "vllm_sonnet.txt").write_text("alpha beta gamma\ndelta epsilon\n")
    c = DatasetConfig(name="sonnet", data_dir=str(tmp_path), num_prompts=2, input_len=10)
    specs = asyncio.run(build_dataset(c, WordCounter()))
    assert set(" ".join(s.prompt for s in specs).split()) <= {"alpha", "beta", "gamma", "delta", "epsilon",
                                                              "a", "the", "and", "of", "to", "I", "in", "it"}
    assert os.fspath(c.resolved_data_dir()) == str(tmp_path)


def test_extending_a_mix_continues_it(data_dir):
    """A window needs more requests than the first build: extensions continue the stream."""
    counter = ToyCounter()
    for cfg in (DatasetConfig(name="trace", length_scale=1 / 64, data_dir=str(data_dir)),
                DatasetConfig(name="trace", length_scale=1 / 64, shuffle=True, seed=3, data_dir=str(data_dir))):
        whole = asyncio.run(build_dataset(cfg, counter, 20))
        parts = asyncio.run(build_dataset(cfg, counter, 8)) + asyncio.run(build_dataset(cfg, counter, 12, start=8))
        assert [(s.prompt, s.output_len) for s in parts] == [(s.prompt, s.output_len) for s in whole]
    cfg = DatasetConfig(name="random", input_len=12, output_len=3, prefix_len=5, data_dir=str(data_dir))
    first = asyncio.run(build_dataset(cfg, counter, 6))
    more = asyncio.run(build_dataset(cfg, counter, 6, start=6))
    assert asyncio.run(build_dataset(cfg, counter, 6)) == first  # the first build is what it always was
    prefix = first[0].prompt.split("\n")[0]
    assert all(s.prompt.startswith(prefix + "\n") for s in first + more)  # one shared prefix
    assert {s.prompt for s in first}.isdisjoint({s.prompt for s in more})


def test_shuffled_trace_samples_the_whole_trace(data_dir):
    """Consecutive Azure rows come in runs of similar sizes; a rate-driven replay takes them
    in a seeded random order, so any stretch of the mix is a sample of the whole trace."""
    rows = load_trace(data_dir / "azure_llm_2023_conv_1815-1900.csv")
    cfg = DatasetConfig(name="trace", shuffle=True, seed=0, data_dir=str(data_dir))
    picked = trace_rows(cfg, 0, 2000)
    numbers = [n for n, _ in picked]
    assert len(set(numbers)) == 2000 and numbers != sorted(numbers)
    assert all(rows[n] == r for n, r in picked)
    assert trace_rows(cfg, 0, 2000) == picked  # seeded
    whole = np.mean([r.input_len for r in rows])
    head = np.mean([r.input_len for _, r in picked[:500]])
    # Standard error of a 500-row mean: sd / sqrt(500) ~ 5 % of the mean here.
    assert abs(head - whole) < 0.15 * whole
    assert trace_rows(DatasetConfig(name="trace", data_dir=str(data_dir)), 0, 3) == [(i, rows[i]) for i in range(3)]
