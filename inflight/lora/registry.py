"""The LoRA adapters a server knows, by name: each with a stable integer id, at most
``max_cpu_loras`` of them held in memory, the least recently used re-read from its path
when next needed (vLLM's ``LRUCacheWorkerLoRAManager`` and ``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter`` semantics)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from inflight.lora.adapter import LoRAAdapter, LoRAError, ModelShape, load_peft_adapter
from inflight.lora.lora_config import LoRAConfig, LoRAModule

__all__ = ["BASE_MODEL_ID", "LoRARegistry", "Loader"]

# The id of "no adapter": requests on the base model (scheduler, prefix-cache hashes).
BASE_MODEL_ID = 0
Loader = Callable[[str, ModelShape, int, str], LoRAAdapter]


class LoRARegistry:
    """Adapters by name, loaded lazily with LRU eviction; safe to share between threads.

    The server's event loop calls ``add`` / ``remove`` while the engine thread calls
    ``get``; one lock guards the tables, and files are read outside it, so a slow disk
    blocks neither side's table access.

    Ids start at 1 (``BASE_MODEL_ID`` 0 is the base model) and are never reused: an
    adapter removed and added again under the same name gets a new id, so KV blocks
    cached under the old one can never be taken for the new adapter's.

    Args:
        config: ``lora_modules`` are registered and loaded now, in order;
            ``max_lora_rank`` caps every adapter; ``num_cpu_loras`` adapters stay loaded.
        model_config: the base model's sizes (``model.hparams.ModelConfig``).
        loader: reads one adapter (``load_peft_adapter``'s signature); for tests.

    Raises:
        LoRAError: an adapter of ``lora_modules`` that cannot be served (the message
            names it), so a bad adapter fails start-up.
    """

    def __init__(self, config: LoRAConfig, model_config: ModelShape,
                 loader: Loader = load_peft_adapter) -> None:
        self._config = config
        self._model = model_config
        self._loader = loader
        self._lock = threading.Lock()
        self._modules: dict[str, LoRAModule] = {}  # registration order
        self._ids: dict[str, int] = {}
        self._next_id = BASE_MODEL_ID + 1
        self._loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # oldest use first
        for module in config.lora_modules:
            adapter = self._load(module)
            with self._lock:
                self._register(module, adapter)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> int:
        """Register and load the adapter at ``path`` as ``name``; its new id.

        Reads the files on the calling thread: call it off the event loop
        (``asyncio.to_thread``).

        Raises:
            LoRAError: ``name`` already registered (vLLM answers 400 "already loaded"),
                an empty name or path, or an adapter that cannot be served.
        """
        if not name or not path:
            raise LoRAError(f"LoRA adapter {name!r}: a name and a path are required")
        self._refuse_duplicate(name)
        module = LoRAModule(name, path, base_model_name)
        adapter = self._load(module)
        with self._lock:
            self._refuse_duplicate(name)  # added by another thread while we read
            return self._register(module, adapter)

    def remove(self, name: str) -> bool:
        """Forget ``name`` (its id is not reused); False if it was not registered."""
        with self._lock:
            if name not in self._modules:
                return False
            del self._modules[name], self._ids[name]
            self._loaded.pop(name, None)
            return True

    def get(self, name: str) -> LoRAAdapter:
        """The adapter ``name``, re-read from its path if it was evicted; it becomes the
        most recently used.

        Raises:
            KeyError: ``name`` is not registered (or was removed while it was re-read).
            LoRAError: its files changed since registration and can no longer be served.
        """
        with self._lock:
            adapter = self._touch(name)
            if adapter is not None:
                return adapter
            module, lora_id = self._modules[name], self._ids[name]
        adapter = self._load(module)
        with self._lock:
            if self._ids.get(name) != lora_id:
                raise KeyError(name)
            again = self._touch(name)  # another thread re-read it meanwhile
            if again is not None:
                return again
            self._keep(name, adapter)
            return adapter

    def id_of(self, name: str) -> int:
        """The adapter's id (>= 1). Raises KeyError: not registered."""
        with self._lock:
            return self._ids[name]

    def name_of(self, lora_id: int) -> str:
        """The name registered under ``lora_id``. Raises KeyError: no such id now."""
        with self._lock:
            for name, i in self._ids.items():
                if i == lora_id:
                    return name
        raise KeyError(lora_id)

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        with self._lock:
            return list(self._modules)

    def modules(self) -> list[LoRAModule]:
        """Registered adapters (name, path, base model name), in registration order."""
        with self._lock:
            return list(self._modules.values())

    def loaded_names(self) -> list[str]:
        """Names held in memory now, least recently used first."""
        with self._lock:
            return list(self._loaded)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._modules

    def __len__(self) -> int:
        with self._lock:
            return len(self._modules)

    def _load(self, module: LoRAModule) -> LoRAAdapter:
        return self._loader(module.path, self._model, self._config.max_lora_rank, module.name)

    def _refuse_duplicate(self, name: str) -> None:
        if name in self._modules:
            raise LoRAError(f"LoRA adapter {name!r} has already been loaded; unload it "
                            "first to replace it")

    def _register(self, module: LoRAModule, adapter: LoRAAdapter) -> int:
        """Under the lock: a new name, its new id, its adapter kept."""
        lora_id = self._next_id
        self._next_id += 1
        self._modules[module.name] = module
        self._ids[module.name] = lora_id
        self._keep(module.name, adapter)
        return lora_id

    def _touch(self, name: str) -> LoRAAdapter | None:
        """Under the lock: the loaded adapter made most recent, or None if evicted.
        Raises KeyError: not registered."""
        if name not in self._modules:
            raise KeyError(name)
        adapter = self._loaded.get(name)
        if adapter is not None:
            self._loaded.move_to_end(name)
        return adapter

    def _keep(self, name: str, adapter: LoRAAdapter) -> None:
        """Under the lock: hold ``adapter`` as the most recent, evicting the oldest past
        ``num_cpu_loras``."""
        self._loaded[name] = adapter
        self._loaded.move_to_end(name)
        while len(self._loaded) > self._config.num_cpu_loras:
            self._loaded.popitem(last=False)
