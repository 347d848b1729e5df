"""Multi-LoRA through the engine, exact against HF transformers + PEFT: on a tiny random
Llama in float32 with dense weights, a request for an adapter generates PEFT's greedy
tokens, alone, in one batch mixing three adapters and the base model, and chunked; the
``--max-loras`` cap, the prefix cache's adapter separation and unloading."""

from __future__ import annotations

import copy

import peft
import pytest
import torch

from inflight.config import EngineConfig
from inflight.engine.engine import Engine
from inflight.lora.lora_config import LoRAConfig, LoRAModule
from inflight.request import RequestOptions
from inflight.sampling_params import SamplingParams
from tests.e2e.tiny_hf import save_tiny_llama

PROMPTS = ["The quick brown fox jumps over", "Paged attention keeps the KV cache in blocks",
           "One shared model, many users at once: continuous batching admits requests"]
# name -> (targets, rank, alpha, rsLoRA)
ADAPTERS = {
    "all": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            8, 16, False),
    "qv": (["q_proj", "v_proj"], 4, 8, False),
    "mlp": (["o_proj", "gate_proj", "down_proj"], 8, 16, True),
}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory, bundled):
    tok = bundled[2]
    base_dir = tmp_path_factory.mktemp("base")
    hf = save_tiny_llama(base_dir, tok)
    refs: dict[str | None, list[list[int]]] = {None: _greedy(hf, tok)}
    modules = []
    for k, (name, (targets, r, alpha, rs)) in enumerate(ADAPTERS.items()):
        model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(
            r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rs))
        gen = torch.Generator().manual_seed(100 + k)
        with torch.no_grad():  # PEFT starts B at zero: an adapter that changes nothing
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        refs[name] = _greedy(model.eval(), tok)
        modules.append(LoRAModule(name, str(path)))
    for name in ADAPTERS:  # each adapter changes the answer, or the test proves nothing
        assert refs[name] != refs[None]
    return str(base_dir), tuple(modules), refs


def _greedy(model, tok) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)
        out.append(seq[0, ids.shape[1]:].tolist())
    return out


def _engine(setup, **knobs) -> Engine:
    base, modules, _ = setup
    lora = knobs.pop("lora", None) or LoRAConfig(max_loras=3, max_lora_rank=8,
                                                 lora_modules=modules)
    return Engine(EngineConfig(model=base, dtype="float32", quantization="none",
                               num_kv_blocks=128, lora_config=lora, **knobs))


def _run(engine: Engine, jobs: list[tuple[str | None, int]]) -> list[list[int]]:
    """Generate greedily for (adapter, prompt index) jobs at once; tokens in job order."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, (name, p) in enumerate(jobs):
        engine.add_request(str(i), PROMPTS[p], params, options=RequestOptions(lora_name=name))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
        engine.kv_cache.check_integrity()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return [outs[str(i)].outputs[0].token_ids for i in range(len(jobs))]


def test_adapters_alone_mixed_and_chunked_equal_peft(setup):
    refs = setup[2]
    names: list[str | None] = [None, *ADAPTERS]
    engine = _engine(setup)
    for name in names:  # alone
        for p in range(len(PROMPTS)):
            assert _run(engine, [(name, p)]) == [refs[name][p]], (name, p)
    jobs = [(name, p) for p in range(len(PROMPTS)) for name in names]
    assert _run(engine, jobs) == [refs[n][p] for n, p in jobs]  # one batch, 3 adapters + base
    chunked = _engine(setup, max_num_batched_tokens=8)  # prompts cut into chunks of <= 8
    assert _run(chunked, jobs) == [refs[n][p] for n, p in jobs]


def test_max_loras_caps_the_running_adapters_without_starving_one(setup):
    base, modules, refs = setup
    engine = _engine(setup, lora=LoRAConfig(max_loras=1, max_lora_rank=8, lora_modules=modules))
    seen = []
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    jobs = [("all", 0), ("qv", 0), ("all", 1), (None, 2), ("all", 2)]
    for i, (name, p) in enumerate(jobs):
        engine.add_request(str(i), PROMPTS[p], params, options=RequestOptions(lora_name=name))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
        seen.append({r.lora_name for r in engine.scheduler.running if r.lora_name})
        assert len(seen[-1]) <= 1
    # "qv" was refused behind "all", so the later "all" requests waited for it: they ran
    # after it, not beside the first one, while the base request joined at once.
    first = {o: min(i for i, s in enumerate(seen) if o in s) for o in ("all", "qv")}
    assert first["all"] < first["qv"]
    assert outs["1"].metrics.first_scheduled_time <= outs["2"].metrics.first_scheduled_time
    assert outs["3"].metrics.first_scheduled_time <= outs["1"].metrics.first_scheduled_time
    assert [outs[str(i)].outputs[0].token_ids for i in range(5)] == [refs[n][p] for n, p in jobs]


def test_prefix_cache_never_shares_blocks_across_adapters(setup):
    engine = _engine(setup, block_size=4)
    refs = setup[2]
    assert _run(engine, [(None, 2)]) == [refs[None][2]]
    assert _run(engine, [("qv", 2)]) == [refs["qv"][2]]
    params = SamplingParams(temperature=0, max_tokens=1)
    engine.add_request("again", PROMPTS[2], params, options=RequestOptions(lora_name="qv"))
    engine.add_request("other", PROMPTS[2], params, options=RequestOptions(lora_name="all"))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs["again"].num_cached_tokens > 0  # same adapter: its own blocks
    assert outs["other"].num_cached_tokens == 0  # another adapter: nothing shared


def test_unknown_adapter_refused_and_unload_keeps_requests_in_flight(setup):
    engine = _engine(setup)
    refs = setup[2]
    with pytest.raises(ValueError, match="model: no LoRA adapter named 'nope'"):
        engine.add_request("x", "hi", SamplingParams(), options=RequestOptions(lora_name="nope"))
    assert not engine.has_unfinished_requests()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params, options=RequestOptions(lora_name="mlp"))
    engine.step()
    assert engine.remove_lora("mlp") and not engine.remove_lora("mlp")
    with pytest.raises(ValueError, match="mlp"):
        engine.add_request("b", "hi", SamplingParams(), options=RequestOptions(lora_name="mlp"))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    assert outs["a"].outputs[0].token_ids == refs["mlp"][0]
    assert engine.lora is not None and not engine.lora._unloaded
    # loaded again under the same name: a new id, the same answers
    engine.add_lora("mlp", setup[1][2].path)
    assert _run(engine, [("mlp", 1)]) == [refs["mlp"][1]]


def test_an_adapter_requests_logprobs_are_the_same_bits_alone_batched_and_chunked(setup):
    """Alone a request decodes through the one-call path (1 row), in a batch of 12 rows
    through the modules, chunked with prompts beside it: the adapter's rows are computed
    by the same row kernel every time, so every sampled logprob is identical."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)

    def logprobs(engine: Engine, jobs: list[tuple[str | None, int]]) -> list:
        for i, (name, p) in enumerate(jobs):
            engine.add_request(str(i), PROMPTS[p], params, options=RequestOptions(lora_name=name))
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o for o in engine.step()})
        return [outs[str(i)].outputs[0].logprobs for i in range(len(jobs))]

    engine = _engine(setup)
    alone = logprobs(engine, [("all", 1)])[0]
    mixed = [(n, p) for n in (None, "all", "qv", "mlp") for p in range(len(PROMPTS))]
    batched = logprobs(engine, mixed)
    assert batched[mixed.index(("all", 1))] == alone
    chunked = logprobs(_engine(setup, max_num_batched_tokens=8), mixed)
    assert chunked[mixed.index(("all", 1))] == alone


def test_adapters_over_block_quantized_weights(setup):
    """Over Q8_0 blocks (the int8 row kernel and the one-call path for every decode step)
    the adapter's product is added the same way: close to PEFT's tokens, and identical
    alone and in a mixed batch."""
    base, modules, refs = setup
    engine = Engine(EngineConfig(model=base, dtype="float32", quantization="q8_0",
                                 num_kv_blocks=128, lora_config=LoRAConfig(
                                     max_loras=3, max_lora_rank=8, lora_modules=modules)))
    assert engine.runner.model.all_quantized
    alone = _run(engine, [("all", 0)])[0]
    mixed = [(n, p) for n in (None, "all", "qv", "mlp") for p in range(len(PROMPTS))]
    batched = _run(engine, mixed)
    assert batched[mixed.index(("all", 0))] == alone
    base_tokens = batched[mixed.index((None, 0))]
    assert alone != base_tokens  # the adapter acts on quantized weights too
    same = sum(a == b for a, b in zip(alone, refs["all"][0]))
    assert same >= NEW_TOKENS // 2, (alone, refs["all"][0])
