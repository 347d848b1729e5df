"""Incremental detokenization on the bundled SmolLM2 tokenizer: UTF-8 safety and stop strings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inflight.model.bundled import find_bundled_model
from inflight.tokenizer import IncrementalDetokenizer, Tokenizer

CJK_EMOJI = "你好，世界！🌍🚀 日本語のテキスト 👍🏽🇺🇸 and café ❤️ 🧑‍🚀 한국어"
FOX = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(find_bundled_model())


@pytest.fixture(scope="module")
def prompt_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say something."}]))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feed ids one at a time; return the deltas (last one with finished=True) and the stop."""
    deltas, stop = [], None
    for i in ids:
        stop = detok.add_tokens([i])
        assert "\ufffd" not in detok.output_text
        if stop is not None:
            break
        deltas.append(detok.get_delta())
    deltas.append(detok.get_delta(finished=True))
    return deltas, stop


def test_cjk_emoji_one_by_one(tok: Tokenizer, prompt_ids: list[int]) -> None:
    ids = tok.encode(CJK_EMOJI)
    # The test only means something if some ids hold just part of a character.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas, stop = stream(detok, ids)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == CJK_EMOJI == detok.output_text
    assert deltas[-1] == ""  # nothing was left over for the final flush


def test_without_prompt_and_with_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi there<|im_end|>")
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(stream(detok, ids)[0]) == "Hi there"
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(detok, ids)[0]) == "Hi there<|im_end|>"


def test_unfinished_character_is_dropped_at_the_end(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🌍")
    cut = ids[:-1]
    assert tok.decode(cut).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, [])
    detok.add_tokens(cut)
    assert detok.get_delta() == "ok"
    rest = detok.get_delta(finished=True)
    assert "\ufffd" not in rest
    # The last id holds " " plus the emoji's first bytes: all of it waits, then is dropped.
    assert "ok" + rest == detok.output_text == "ok"
    assert tok.decode(cut).startswith(detok.output_text)


def split_across_tokens(tok: Tokenizer, text: str, stop: str) -> bool:
    return all(stop not in tok.decode([i]) for i in tok.encode(text))


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_split_across_tokens(tok: Tokenizer, prompt_ids: list[int], include: bool) -> None:
    stop = "own fo"  # spans " brown" and " fox"
    assert split_across_tokens(tok, FOX, stop)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["zzz", stop],
                                   include_stop_str_in_output=include)
    deltas, matched = stream(detok, tok.encode(FOX))
    assert matched == stop == detok.matched_stop
    expected = "The quick brown fo" if include else "The quick br"
    assert detok.output_text == expected == "".join(deltas)
    # Text past the stop string was never handed out, not even transiently.
    running = ""
    for d in deltas:
        running += d
        assert expected.startswith(running)
    # Later tokens change nothing.
    assert detok.add_tokens(tok.encode(" more")) == stop and detok.output_text == expected


def test_partial_stop_is_held_then_released(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["lazy cat"])
    seen = ""
    for i in tok.encode(FOX):
        assert detok.add_tokens([i]) is None
        seen += detok.get_delta()
        if detok.output_text.endswith("the lazy"):
            # "lazy" could still become "lazy cat": it must not be streamed yet.
            assert seen == "The quick brown fox jumps over the "
    assert seen + detok.get_delta(finished=True) == FOX


def test_batch_add_earliest_stop_wins(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=("dog", "fox", "quick brown"))
    assert detok.add_tokens(tok.encode(FOX)) == "quick brown"
    assert detok.output_text == "The "
    assert detok.get_delta() == "The "


def test_stop_in_cjk_text(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop="世界")  # a bare str is one stop string
    deltas, matched = stream(detok, tok.encode(CJK_EMOJI))
    assert matched == "世界" and "".join(deltas) == "你好，"


def test_window_stays_small(tok: Tokenizer) -> None:
    # Decoding cost per token must not grow with the output (no whole-output re-decode).
    sizes = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            sizes.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode((FOX + " " + CJK_EMOJI + "\n") * 20)
    detok = IncrementalDetokenizer(Counting(), list(range(100, 200)))
    for i in ids:
        detok.add_tokens([i])
    assert len(ids) > 400 and max(sizes) <= 12
    assert detok.output_text == tok.decode(ids)


TEXT = st.text(alphabet=st.sampled_from(list("ab cé\n你好世界🌍🚀👍🏽0123")), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, data=st.data())
def test_stream_invariants(tok: Tokenizer, text: str, data) -> None:
    ids = tok.encode(text)
    full = tok.decode(ids)
    stop = data.draw(st.sampled_from(["", "x"] + [full[i:i + n] for i in range(len(full))
                                                  for n in (1, 2, 3) if full[i:i + n].strip()]))
    include = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
    out, pos = "", 0
    while pos < len(ids):
        n = data.draw(st.integers(1, 4))
        matched = detok.add_tokens(ids[pos:pos + n])
        pos += n
        out += detok.get_delta()
        assert "\ufffd" not in out
        if matched:
            break
    out += detok.get_delta(finished=True)
    idx = full.find(stop) if stop else -1
    expected = full if idx < 0 else full[:idx + (len(stop) if include else 0)]
    assert out == expected == detok.output_text
