"""``--speculative-config``: vLLM's JSON accepted, every bad input refused with its name,
both through ``SpeculativeConfig.parse`` and the CLI flag."""

from __future__ import annotations

import argparse
import json

import pytest

from inflight.config import EngineConfig
from inflight.core.spec_config import SpeculativeConfig


def test_vllm_ngram_json_is_accepted_verbatim():
    text = ('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, '
            '"prompt_lookup_min": 2}')
    cfg = SpeculativeConfig.parse(text)
    assert cfg == SpeculativeConfig(method="ngram", num_speculative_tokens=5,
                                    prompt_lookup_max=3, prompt_lookup_min=2)
    assert (cfg.model, cfg.disable_by_batch_size) == (None, None)


def test_draft_model_json_with_every_key():
    data = {"method": "draft_model", "model": "/m/small.gguf", "num_speculative_tokens": 3,
            "disable_by_batch_size": 8, "min_acceptance_rate": 0.2, "acceptance_window": 16}
    cfg = SpeculativeConfig.parse(json.dumps(data))
    assert cfg.method == "draft_model" and cfg.model == "/m/small.gguf"
    assert (cfg.num_speculative_tokens, cfg.disable_by_batch_size) == (3, 8)
    assert (cfg.min_acceptance_rate, cfg.acceptance_window) == (0.2, 16)


def test_unknown_key_is_named():
    with pytest.raises(ValueError, match="unknown key.*draft_tensor_parallel_size"):
        SpeculativeConfig.parse('{"method": "ngram", "draft_tensor_parallel_size": 1}')


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match=r"method.*'eagle'"):
        SpeculativeConfig.parse('{"method": "eagle", "num_speculative_tokens": 2}')


def test_missing_method_is_an_error():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.parse('{"num_speculative_tokens": 2}')


def test_draft_model_without_model_is_an_error():
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig.parse('{"method": "draft_model", "num_speculative_tokens": 2}')


def test_ngram_with_a_model_is_an_error():
    with pytest.raises(ValueError, match=r"speculative_config\.model"):
        SpeculativeConfig.parse('{"method": "ngram", "model": "x.gguf"}')


@pytest.mark.parametrize("text", ["{method: ngram}", "", '{"method": "ngram"',
                                  "[1, 2]", '"ngram"', "4"])
def test_bad_json_or_not_an_object_is_an_error(text):
    with pytest.raises(ValueError, match="^speculative_config"):
        SpeculativeConfig.parse(text)


@pytest.mark.parametrize("key,value", [("num_speculative_tokens", 0),
                                       ("num_speculative_tokens", 17),
                                       ("prompt_lookup_min", 0),
                                       ("prompt_lookup_max", 1),  # below the default min 2
                                       ("disable_by_batch_size", 0),
                                       ("min_acceptance_rate", 1.0),
                                       ("acceptance_window", 0)])
def test_out_of_range_values_are_named(key, value):
    with pytest.raises(ValueError, match=rf"speculative_config\.{key}"):
        SpeculativeConfig.parse(json.dumps({"method": "ngram", key: value}))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", exit_on_error=True)
    EngineConfig.add_cli_args(parser)
    return parser


def test_cli_flag_parses_to_a_config():
    args = _parser().parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert EngineConfig.from_cli_args(args).speculative_config == args.speculative_config


def test_cli_flag_is_off_by_default():
    args = _parser().parse_args([])
    assert args.speculative_config is None
    assert EngineConfig.from_cli_args(args).speculative_config is None


@pytest.mark.parametrize("text,message", [
    ('{"method": "medusa"}', "medusa"),
    ('{"method": "ngram", "bogus": 1}', "bogus"),
    ("not json", "not JSON"),
    ('{"method": "draft_model"}', "speculative_config.model"),
])
def test_cli_flag_refuses_bad_input_with_the_message(capsys, text, message):
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(["--speculative-config", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err
