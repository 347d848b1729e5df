"""The public API on the bundled model: LLM.generate/chat, logprobs, stop strings,
streaming deltas, n, and errors that leave nothing queued."""

from __future__ import annotations

import pytest
import torch

from inflight import LLM, SamplingParams
from tests.e2e.conftest import run


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_blocks=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def quantized_llm():
    """The GGUF's own blocks, whatever ``auto`` picks on this CPU (dense weights where the
    block kernels have no SIMD path: tests/model/test_cpu_fallbacks.py)."""
    return LLM(num_kv_blocks=64, max_num_seqs=4, quantization="gguf")


def test_prompts_read_the_blocks_unless_a_copy_is_packed_for_them(quantized_llm):
    """The bundled model's layers are all block-quantized and keep only their blocks;
    prompt rows go to a bfloat16 copy packed for the prompt GEMM only where it has AMX-BF16
    tiles for the model's dtype (``repack``, the default), else to the int8 kernel like
    generated rows. The LM head keeps no copy."""
    from inflight.model.kernels.gemm import gemm_path

    model = quantized_llm.engine.runner.model
    amx = gemm_path(model.dtype) == "AMX-BF16"
    assert model.all_quantized and model.quantized_prompts == (not amx)
    assert all(m.blocks_only and (m.gemm_packed is not None) == amx
               for m in model._layer_linears())
    assert model.lm_head.blocks_only and model.lm_head.gemm_packed is None


@pytest.mark.parametrize("repacked", [False, True])
def test_prompt_rows_take_the_path_the_rule_names(quantized_llm, monkeypatch, repacked):
    """On any CPU: with a packed copy (as ``repack`` makes on AMX-BF16 hosts) a prompt's
    rows take the prompt GEMM in the prefill step and only generated rows read the blocks;
    without one, a prompt's rows read the blocks too."""
    import inflight.model.linear as linear
    from inflight.model.kernels.gemm import gemm_pack

    model = quantized_llm.engine.runner.model
    for m in model._layer_linears():
        monkeypatch.setattr(m, "gemm_packed", gemm_pack(m.quant.dequantize().to(model.dtype))
                            if repacked else None)
    monkeypatch.setattr(model, "quantized_prompts", not repacked)
    rows = []
    real = linear.quant_linear
    monkeypatch.setattr(linear, "quant_linear", lambda x, *a, **k: (rows.append(x.shape[0]),
                                                                    real(x, *a, **k))[1])
    # 23 rows, no other step of this run has as many; a prompt of its own per case, so no
    # block of it is in the prefix cache
    prompt = list(range(2000 + 100 * repacked, 2023 + 100 * repacked))
    out = quantized_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert (23 in rows) == (not repacked)
    assert 1 in rows  # generated tokens read the blocks either way


def test_llm_default_model_generate_and_chat(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("The capital of France is")
    outs = llm.generate(["The capital of France is", ids, "1, 2, 3, 4,"],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[0].prompt == "The capital of France is" and outs[0].prompt_token_ids == ids
    assert outs[1].prompt is None and outs[1].outputs[0].token_ids == outs[0].outputs[0].token_ids
    m = outs[0].metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    # Not "What is the capital of France?": its first token is a near tie ("The" against
    # "L", 0.12-0.25 nats apart) that the prompt path's rounding decides (oneDNN's bfloat16
    # GEMM or the int8 block kernel, by CPU). This one answers alike on both, its first
    # tokens' top-2 margins 0.6 nats or more.
    chat = llm.chat([{"role": "user", "content": "Name the capital city of France."}],
                    SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert "Paris" in chat.text and chat.finish_reason == "stop"


def test_bad_prompt_raises_and_leaves_nothing_queued(llm):
    with pytest.raises(ValueError, match="max_model_len|KV cache"):
        llm.generate(["fine", [5] * 100_000], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_logprobs_equal_hf_log_softmax(make_engine, hf_reference, bundled):
    tok = bundled[2]
    ids = tok.encode("Continuous batching lets an inference server")
    out = run(make_engine(), [ids], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0]
    c = out.outputs[0]
    seq = ids + c.token_ids
    with torch.no_grad():
        ref = hf_reference(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    assert len(c.logprobs) == 6
    for i, (token, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(ids) - 1 + i]
        top = row.topk(3)
        assert set(lp) == {token} | set(top.indices.tolist())
        for tid, value in lp.items():
            assert value == pytest.approx(row[tid].item(), abs=1e-3)


def test_stop_strings_cut_text_across_tokens(make_engine, bundled):
    tok = bundled[2]
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me about Paris."}]),
                     add_special_tokens=False)
    full = run(make_engine(), [ids], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    # A stop string that straddles a token boundary: the last 3 chars of one token's text
    # plus the first 2 of the next.
    pieces = [tok.decode(full.token_ids[:i]) for i in range(1, len(full.token_ids))]
    cut = next(len(p) for p in pieces[5:] if len(p) > 20)
    stop = full.text[cut - 3:cut + 2]
    first = full.text.index(stop)
    out = run(make_engine(), [ids], SamplingParams(temperature=0, max_tokens=40, stop=[stop]))[0]
    assert out.outputs[0].text == full.text[:first]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop)
    kept = run(make_engine(), [ids], SamplingParams(temperature=0, max_tokens=40, stop=stop,
                                                    include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text == full.text[:first + len(stop)]


def test_stream_deltas_join_to_the_full_text(make_engine, bundled):
    tok = bundled[2]
    prompt = tok.encode("写一首关于月亮的诗。Emoji: 🌙✨")
    params = SamplingParams(temperature=0, max_tokens=40)
    full = run(make_engine(), [prompt], params)[0].outputs[0]
    engine = make_engine()
    engine.add_request("s", prompt, params, stream=True)
    deltas, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
            tokens += out.outputs[0].token_ids
    assert "".join(deltas) == full.text and tokens == full.token_ids
    assert all("\ufffd" not in d for d in deltas)
    assert out.finished and out.outputs[0].finish_reason == full.finish_reason


def test_n_completions_with_a_seed_differ_and_repeat(make_engine, bundled):
    tok = bundled[2]
    prompt = tok.encode("Once upon a time")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    a = run(make_engine(), [prompt], params)[0]
    b = run(make_engine(), [prompt], params)[0]
    texts = [c.token_ids for c in a.outputs]
    assert len(texts) == 3 and len({tuple(t) for t in texts}) > 1
    assert texts == [c.token_ids for c in b.outputs]


def test_step_breakdown_times_every_phase_on_the_real_model(make_engine):
    engine = make_engine(step_breakdown=True)
    run(engine, [[1, 2, 3, 4, 5], [6, 7, 8]], SamplingParams(temperature=0, max_tokens=4,
                                                             ignore_eos=True))
    recs = list(engine.step_timer.records)
    assert [(r.num_seqs, r.num_tokens) for r in recs] == [(2, 8), (2, 2), (2, 2), (2, 2)]
    for r in recs:
        assert set(r.seconds) == {"schedule", "prepare", "forward", "attention", "sample", "output"}
        assert 0 < r.seconds["attention"] < r.seconds["forward"] < r.total
