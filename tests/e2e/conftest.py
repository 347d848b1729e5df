"""The bundled SmolLM2-135M model, loaded once per session and shared by engines built
with different knobs, and the HF transformers reference on the same GGUF."""

from __future__ import annotations

import json

import pytest
import torch

from inflight.config import EngineConfig
from inflight.engine import Engine
from inflight.model.llama import LlamaForCausalLM
from inflight.model.loader import load_model
from inflight.runner import ModelRunner
from inflight.sampler import Sampler
from inflight.tokenizer import Tokenizer

from tests.conftest import require_data


@pytest.fixture(scope="session")
def bundled(bundled_model_path):
    """``(model_config, {dtype: model}, tokenizer)`` for the bundled GGUF."""
    config, state = load_model(bundled_model_path)
    models = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = LlamaForCausalLM(config, dtype=dtype)
        m.load_weights(state)
        models[dtype] = m
    return config, models, Tokenizer.from_gguf(bundled_model_path)


@pytest.fixture(scope="session")
def make_engine(bundled):
    """Build an ``Engine`` over the shared weights: ``make_engine(num_blocks=..., **knobs)``."""
    config, models, tokenizer = bundled

    def build(num_blocks=512, dtype=torch.float32, **knobs):
        cfg = EngineConfig(**knobs)
        runner = ModelRunner(models[dtype], num_blocks, cfg.block_size, dtype, Sampler())
        return Engine(cfg, runner=runner, tokenizer=tokenizer, num_blocks=num_blocks,
                      max_model_len=config.max_position_embeddings,
                      eos_token_ids=tokenizer.eos_token_ids)
    return build


@pytest.fixture(scope="session")
def hf_reference(bundled_model_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        bundled_model_path.parent, gguf_file=bundled_model_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def chat_prompts():
    """First-turn questions from MT-Bench (shared/data), one per category."""
    seen, prompts = set(), []
    with open(require_data("mt_bench_questions.jsonl")) as f:
        for line in f:
            q = json.loads(line)
            if q["category"] not in seen:
                seen.add(q["category"])
                prompts.append(q["turns"][0])
    return prompts


def run(engine, prompts, params):
    """Add every prompt (ids or text), step until idle; outputs by request id order."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    outs = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        assert steps < 20_000
        outs.update({o.request_id: o for o in engine.step()})
        engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [outs[str(i)] for i in range(len(prompts))]
