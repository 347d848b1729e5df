"""The engine's LoRA adapters: which a request may name, their ids, and the adapter a step
needs in a model slot (vLLM's ``LoRAModelManager`` on the engine side).

Adapters live in ``lora.registry.LoRARegistry`` (by name, an id each, LRU in memory). A
request names one in ``RequestOptions.lora_name``; it gets the adapter's id, which the
scheduler caps (``--max-loras``), the prefix cache hashes and the runner's slots load. An
adapter unloaded while requests still use it stays readable to them until they end, so an
unload never fails a request in flight; new requests for it are refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from inflight.errors import InvalidRequestError
from inflight.lora.adapter import LoRAAdapter
from inflight.lora.lora_config import LoRAConfig
from inflight.lora.registry import LoRARegistry
from inflight.request import Request


class EngineLoRA:
    """Adapters of one engine.

    Args:
        config: ``--enable-lora``'s settings; its ``lora_modules`` load now.
        runner: the ``ModelRunner`` (its model's shapes; gets ``max_loras`` slots).

    Raises:
        LoRAError: an adapter of ``lora_modules`` cannot be served (start-up fails).
        ValueError: the runner has no model to adapt (a fake runner).
    """

    def __init__(self, config: LoRAConfig, runner: Any) -> None:
        model = getattr(runner, "model", None)
        if model is None or not hasattr(runner, "enable_lora"):
            raise ValueError("enable_lora: the runner has no model to adapt")
        self.config = config
        self.registry = LoRARegistry(config, model.config)
        self._unloaded: dict[int, LoRAAdapter] = {}  # id -> adapter, for requests in flight
        self._runner = runner
        runner.enable_lora(config.max_loras, config.max_lora_rank, self.adapter)

    def id_for(self, name: str | None) -> int:
        """The id a request naming adapter ``name`` runs with (0: None, the base model).

        Raises:
            InvalidRequestError: no adapter ``name`` is loaded (the ``model`` field).
        """
        if name is None:
            return 0
        try:
            return self.registry.id_of(name)
        except KeyError:
            raise InvalidRequestError(
                f"model: no LoRA adapter named {name!r} is loaded") from None

    def adapter(self, lora_id: int) -> LoRAAdapter:
        """The adapter of ``lora_id`` for a slot (the runner's callback)."""
        if lora_id in self._unloaded:
            return self._unloaded[lora_id]
        return self.registry.get(self.registry.name_of(lora_id))

    def add(self, name: str, path: str, base_model_name: str | None = None) -> int:
        """Load the adapter at ``path`` as ``name``; its id. Raises ``LoRAError``."""
        return self.registry.add(name, path, base_model_name)

    def remove(self, name: str, in_flight: Iterable[Request]) -> bool:
        """Unload ``name`` (False: not loaded); requests in flight with it keep it."""
        if name not in self.registry:
            return False
        lora_id = self.registry.id_of(name)
        users = [r for r in in_flight if r.lora_id == lora_id and not r.is_finished]
        if users:
            self._unloaded[lora_id] = self.registry.get(name)
        self.registry.remove(name)
        if not users:
            self._runner.lora_slots.evict(lora_id)
        return True

    @property
    def holds_unloaded(self) -> bool:
        """Some unloaded adapter is still kept for requests in flight."""
        return bool(self._unloaded)

    def forget_unused(self, in_flight: Iterable[Request]) -> None:
        """Drop unloaded adapters no request in flight uses any more."""
        used = {r.lora_id for r in in_flight}
        for lora_id in [i for i in self._unloaded if i not in used]:
            del self._unloaded[lora_id]
            self._runner.lora_slots.evict(lora_id)

    def stats_fields(self, running: Iterable[Request],
                     waiting: Iterable[Request]) -> dict[str, Any]:
        """``EngineStats`` keyword arguments: the adapters of running and waiting requests
        (sorted names) and ``max_loras`` (vLLM's ``lora_requests_info``)."""
        def names(requests: Iterable[Request]) -> tuple[str, ...]:
            return tuple(sorted({r.lora_name for r in requests if r.lora_name}))
        return {"running_lora_adapters": names(running),
                "waiting_lora_adapters": names(waiting), "max_lora": self.config.max_loras}
