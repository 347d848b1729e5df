"""``kernels/lora.c`` (``model.lora.add_lora``): each row's adapter product against
PyTorch, each row the same bits alone or in any batch, base rows untouched, and the
PyTorch (mask) path equal to it to rounding."""

from __future__ import annotations

import pytest
import torch

from inflight.model import lora as lora_mod
from inflight.model.lora import LoRAStep, add_lora

S, R, PARTS, K, N = 3, 4, 2, 96, 80


def _slots(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Slot tensors holding three adapters of ranks 4, 2 and 3 x PARTS (zeros past them)."""
    g = torch.Generator().manual_seed(0)
    w = PARTS * R
    at, b, adapters = torch.zeros(K, S * w), torch.zeros(S * w, N), []
    for s, r in enumerate((PARTS * 4, PARTS * 2, PARTS * 3)):
        a_s, b_s = torch.randn(r, K, generator=g), torch.randn(N, r, generator=g) * 0.1
        at[:, s * w:s * w + r] = a_s.t()
        b[s * w:s * w + r] = b_s.t()
        adapters.append((a_s, b_s))
    return at.to(dtype), b.to(dtype), adapters


def _step(slots: list[int], dtype: torch.dtype) -> LoRAStep:
    return LoRAStep(torch.tensor(slots), S, R, max(slots) + 1, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_get_their_own_adapter(dtype):
    at, b, adapters = _slots(dtype)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, K, generator=g).to(dtype)
    y0 = torch.randn(7, N, generator=g).to(dtype)
    slots = [0, -1, 2, 1, 0, -1, 2]
    got = add_lora(x, y0.clone(), at, b, _step(slots, dtype))
    for m, s in enumerate(slots):
        if s < 0:
            assert torch.equal(got[m], y0[m])  # a base row: not touched
            continue
        a_s, b_s = adapters[s]
        want = y0[m].double() + (x[m].double() @ a_s.double().t()) @ b_s.double().t()
        tol = 1e-4 if dtype == torch.float32 else 0.05 * want.abs().max().item()
        assert (got[m].double() - want).abs().max().item() < tol, (m, s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_is_the_same_bits_in_any_batch_and_thread_count(dtype):
    at, b, _ = _slots(dtype)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(33, K, generator=g).to(dtype)
    y0 = torch.randn(33, N, generator=g).to(dtype)
    slots = [(i * 7) % 4 - 1 for i in range(33)]
    batch = add_lora(x, y0.clone(), at, b, _step(slots, dtype))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for m in (0, 5, 17, 32):
            if slots[m] < 0:
                continue
            alone = add_lora(x[m:m + 1], y0[m:m + 1].clone(), at, b, _step([slots[m]], dtype))
            assert torch.equal(alone[0], batch[m])
    finally:
        torch.set_num_threads(threads)


def test_pytorch_path_matches_the_kernel(monkeypatch):
    at, b, _ = _slots(torch.float32)
    g = torch.Generator().manual_seed(3)
    x, y0 = torch.randn(9, K, generator=g), torch.randn(9, N, generator=g)
    slots = [1, 0, -1, 2, 2, 1, -1, 0, 1]
    native = add_lora(x, y0.clone(), at, b, _step(slots, torch.float32))
    monkeypatch.setattr(lora_mod, "native_for", lambda *t: None)
    torch_path = add_lora(x, y0.clone(), at, b, _step(slots, torch.float32))
    assert torch.allclose(native, torch_path, atol=1e-5)
    assert not torch.equal(native, y0)
