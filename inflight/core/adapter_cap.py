"""``--max-loras``: the most LoRA adapters running at once, without starving one. Torch-free.

Every running request is scheduled each step, so capping the adapters among running
requests caps the adapters of any step (the model runner's slots, ``model.lora``). A
waiting request for an adapter that is not running, while ``max_loras`` others are, must
wait; vLLM then skips it and admits later requests, so an adapter behind busy ones may wait
forever. Here, once a request is refused for the cap, no later adapter request joins in
that step: the running adapters drain and the refused one gets a slot. Base-model requests
take no slot and are never held back.
"""

from __future__ import annotations

from collections.abc import Iterable

from inflight.request import Request


class AdapterCap:
    """One step's admission rule for ``max_loras`` (0: no LoRA, everything admitted).

    Args:
        max_loras: the most distinct adapters (``Request.lora_id`` > 0) running at once.
        running: the requests running before admission.
    """

    def __init__(self, max_loras: int, running: Iterable[Request]) -> None:
        self.max_loras = max_loras
        self.active = {r.lora_id for r in running if r.lora_id}
        self.blocked = False

    def admits(self, req: Request) -> bool:
        """May ``req`` join the running requests now? Counts its adapter as running if so
        (the caller admits it or stops admitting for this step)."""
        if not req.lora_id or self.max_loras <= 0:
            return True
        if self.blocked:
            return False
        if req.lora_id in self.active or len(self.active) < self.max_loras:
            self.active.add(req.lora_id)
            return True
        self.blocked = True  # later adapter requests wait behind this one
        return False
