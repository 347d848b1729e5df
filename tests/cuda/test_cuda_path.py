"""The CUDA path: weights, KV cache, attention and sampling on the GPU, checked against HF
transformers on the same device. Skipped without a GPU; ``benchmarks/gpu_check.sh`` runs
these with the offline benchmark on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

from inflight import LLM, SamplingParams
from tests.model.test_llama_vs_hf import _run_engine, tiny_model  # noqa: F401  (fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.03)])
def test_paged_logits_match_hf_on_cuda(tiny_model, dtype, tol):  # noqa: F811
    hf, path = tiny_model
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in (3, 13, 22)]
    # Chunked prefill beside decodes, KV in 4-token blocks, all on the GPU.
    logits, seqs = _run_engine(path, dtype, prompts, max_tokens=12, device="cuda",
                               max_num_batched_tokens=8)
    ref_model = hf.to(device="cuda", dtype=dtype)
    try:
        for rid, seq in seqs.items():
            with torch.no_grad():
                ref = ref_model(torch.tensor([seq], device="cuda")).logits[0].float()
            positions = sorted(p for r, p in logits if r == rid)
            assert len(positions) == 12
            for pos in positions:
                got = logits[(rid, pos)]
                assert got.device.type == "cuda"
                atol = tol if dtype == torch.float32 else tol * ref[pos].abs().max().item()
                torch.testing.assert_close(got, ref[pos], atol=atol, rtol=0)
    finally:
        hf.to(device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def cuda_llm():
    return LLM(device="cuda", dtype="float32", gpu_memory_utilization=0.5, max_num_seqs=64)


def test_engine_sizes_kv_from_gpu_memory_and_keeps_it_on_device(cuda_llm):
    runner = cuda_llm.engine.runner
    assert runner.device.type == "cuda"
    assert all(kv.device.type == "cuda" for kv in runner.kv_caches)
    total = torch.cuda.mem_get_info()[1]
    kv_bytes = sum(kv.numel() * kv.element_size() for kv in runner.kv_caches)
    assert 0 < kv_bytes <= 0.5 * total


def test_greedy_tokens_equal_hf_generate_on_cuda(cuda_llm, hf_reference, chat_prompts):
    tok = cuda_llm.engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                          add_special_tokens=False) for p in chat_prompts[:5]]
    outs = cuda_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    ref_model = hf_reference.to("cuda")
    try:
        for ids, out in zip(prompts, outs):
            with torch.no_grad():
                ref = ref_model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=32,
                                         attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                                   device="cuda"),
                                         do_sample=False)
            assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()
    finally:
        hf_reference.to("cpu")


def test_seeded_sampling_on_cuda_repeats_and_batches_independently(cuda_llm):
    p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = cuda_llm.generate(["Tell me about the sea."], p, use_tqdm=False)[0]
    batch = cuda_llm.generate(["Tell me about the sea.", "Count to ten.", "Name a colour."] * 4,
                              p, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(alone.outputs[0].token_ids) == 16
