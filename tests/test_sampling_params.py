import pytest

from inflight.config import EngineConfig
from inflight.sampling_params import SamplingParams

INVALID = [
    ("n", 0), ("n", 1.5), ("temperature", -0.1), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1),
    ("min_p", 1.1), ("seed", "x"), ("seed", 2**64), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
    ("presence_penalty", -3), ("frequency_penalty", 2.1),
    ("max_tokens", -5), ("min_tokens", -1), ("stop", ""), ("stop", [1]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("logprobs", -1), ("logprobs", 21),
    ("include_stop_str_in_output", "yes"), ("ignore_eos", 1), ("skip_special_tokens", None),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21), ("prompt_logprobs", True),
    ("logit_bias", {5: 101}), ("logit_bias", {5: float("nan")}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"5": 1.0}), ("logit_bias", [5]),
]


@pytest.mark.parametrize("field,value", INVALID)
def test_invalid_field_raises_with_its_name(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_names_min_tokens():
    with pytest.raises(ValueError, match="^min_tokens:"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_valid_params_normalise_stop():
    p = SamplingParams(stop="###", stop_token_ids=[5], temperature=0)
    assert p.stop_strings == ("###",) and p.stop_token_ids == (5,) and p.is_greedy
    assert SamplingParams(stop=["a", "b"]).stop_strings == ("a", "b")
    assert SamplingParams(top_k=-1).top_k == -1
    assert p.clone(seed=3).seed == 3 and p.clone(seed=3).stop_strings == ("###",)


@pytest.mark.parametrize("field,value", [
    ("dtype", "float16"), ("block_size", 0), ("max_num_seqs", 0),
    ("max_num_batched_tokens", 0), ("batching_policy", "fifo"), ("max_queue_delay", -1),
    ("num_kv_blocks", 0), ("kv_cache_memory_bytes", 0), ("device", "tpu"),
])
def test_invalid_engine_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        EngineConfig(**{field: value})


def test_prompt_logprobs_and_logit_bias_accepted():
    p = SamplingParams(prompt_logprobs=0, logit_bias={5: -100, 7: 100.0})
    assert p.prompt_logprobs == 0 and p.logit_bias == {5: -100, 7: 100.0}


def test_max_tokens_0_is_a_prefill_only_request():
    assert SamplingParams(max_tokens=0).max_tokens == 0
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=0, min_tokens=1)
