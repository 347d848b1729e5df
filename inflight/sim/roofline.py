"""Step-time profiles derived, not measured: a roofline over a hardware description.

Each step costs the larger of its FLOPs over the achieved compute rate and its bytes over
the achieved memory bandwidth (Williams et al., "Roofline", CACM 2009), plus a fixed cost
per step and per row (the Python scheduler, kernel launches). FLOPs: 2 per weight per token
through the linear layers, 2 per LM-head weight per sampled row, 4 x heads x head_dim per
query-key pair of attention. Bytes: every weight once per step, the KV cache read by decode
rows and written by every token. Activations are left out (small beside the weights at the
batch sizes served here). These are estimates, and ``docs/simulator.md`` says how far the
CPU description lands from this machine's measured profile.

Hardware descriptions are JSON files in ``inflight/sim/hardware/`` (or a path):
``peak_flops`` per dtype and ``memory_bandwidth`` (datasheet or measured),
``efficiency`` (the achieved share of each), ``memory_bytes`` and what share of it the KV
cache may take, and the fixed overheads.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import asdict, dataclass
from typing import Any

from inflight.sim.profile import StepProfile
from inflight.sim.step_shape import StepShape

HARDWARE_DIR = pathlib.Path(__file__).parent / "hardware"
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """The sizes a roofline needs (a Llama-family decoder). Counts, not bytes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int

    @property
    def linear_params(self) -> int:
        """Weights of the decoder layers' projections (QKV, O, gate, up, down)."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return self.num_hidden_layers * (h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size)

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_config(cls, c: Any) -> "ModelShape":
        """From an ``inflight.model.hparams.ModelConfig`` (or anything with its fields)."""
        return cls(c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                   c.num_attention_heads, c.num_key_value_heads, c.head_dim)


@dataclass(frozen=True)
class Hardware:
    """A machine as the roofline sees it. Rates in FLOP/s and bytes/s, sizes in bytes."""

    name: str
    kind: str  # cpu | gpu
    peak_flops: dict[str, float]  # per dtype
    memory_bandwidth: float
    memory_bytes: int
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    row_overhead_s: float = 2e-5
    kv_memory_fraction: float = 0.9  # of memory_bytes, weights and activations then taken off
    kv_cache_bytes: int | None = None  # a fixed KV budget instead (inflight's CPU default)
    source: str = ""

    @classmethod
    def load(cls, name_or_path: str) -> "Hardware":
        """A shipped description by name (``inflight/sim/hardware/NAME.json``) or a path.

        Raises:
            FileNotFoundError: neither exists (the message lists the shipped names).
            ValueError: the file is not a hardware description.
        """
        path = pathlib.Path(name_or_path)
        if not path.exists():
            path = HARDWARE_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise FileNotFoundError(f"no hardware description {name_or_path!r}; shipped: "
                                    f"{', '.join(shipped_hardware())} (or give a JSON path)")
        try:
            d = json.loads(path.read_text())
            return cls(**{k: v for k, v in d.items() if not k.startswith("_")})
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: not a hardware description ({e}); see inflight/sim/hardware/*.json") from None


def shipped_hardware() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.json"))


@dataclass
class RooflineCostModel:
    """``predict(shape)``: the roofline time of a step (see the module docstring)."""

    hardware: Hardware
    model: ModelShape
    dtype: str

    def _rates(self) -> tuple[float, float]:
        hw = self.hardware
        if self.dtype not in hw.peak_flops:
            raise ValueError(f"{hw.name} lists no peak FLOP/s for {self.dtype} "
                             f"(it has {', '.join(hw.peak_flops)})")
        return hw.peak_flops[self.dtype] * hw.compute_efficiency, hw.memory_bandwidth * hw.memory_efficiency

    def flops(self, s: StepShape) -> float:
        m = self.model
        attn = 4 * m.num_hidden_layers * m.num_attention_heads * m.head_dim * (s.decode_context + s.prefill_pairs)
        return 2.0 * m.linear_params * s.tokens + 2.0 * m.head_params * s.samples + attn

    def bytes(self, s: StepShape) -> float:
        b = DTYPE_BYTES[self.dtype]
        weights = (self.model.linear_params + self.model.head_params) * b
        return weights + self.model.kv_bytes_per_token(b) * (s.decode_context + s.tokens)

    def predict(self, shape: StepShape) -> float:
        flops_rate, bw = self._rates()
        hw = self.hardware
        return (max(self.flops(shape) / flops_rate, self.bytes(shape) / bw)
                + hw.step_overhead_s + hw.row_overhead_s * shape.rows)

    def to_json(self) -> dict[str, Any]:
        return {"hardware": asdict(self.hardware), "model_shape": asdict(self.model), "dtype": self.dtype}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RooflineCostModel":
        return cls(Hardware(**d["hardware"]), ModelShape(**d["model_shape"]), d["dtype"])


def kv_blocks_for(hw: Hardware, model: ModelShape, dtype: str, block_size: int) -> int:
    """KV blocks the machine holds: ``kv_cache_bytes``, else ``kv_memory_fraction`` of its
    memory less the weights (activations are left to the fraction's slack)."""
    b = DTYPE_BYTES[dtype]
    budget = hw.kv_cache_bytes
    if budget is None:
        budget = int(hw.memory_bytes * hw.kv_memory_fraction) - (model.linear_params + 2 * model.head_params) * b
    blocks = budget // (model.kv_bytes_per_token(b) * block_size)
    if blocks < 1:
        raise ValueError(f"{hw.name}: no memory left for a KV block after the weights")
    return int(blocks)


def derive_profile(hw: Hardware, model: ModelShape, engine: dict[str, Any], model_info: dict[str, Any],
                   ) -> StepProfile:
    """A roofline :class:`StepProfile` for ``model`` on ``hw``. ``engine`` holds the engine
    settings (``dtype`` resolved to ``float32``/``bfloat16``, ``block_size``, ...);
    ``num_kv_blocks`` is filled in from the machine's memory unless set."""
    dtype = engine["dtype"]
    engine = dict(engine)
    engine.setdefault("num_kv_blocks", None)
    if engine["num_kv_blocks"] is None:
        engine["num_kv_blocks"] = kv_blocks_for(hw, model, dtype, engine["block_size"])
    cost = RooflineCostModel(hw, model, dtype)
    return StepProfile("roofline", cost, engine, {**model_info, **asdict(model)},
                       {"name": hw.name, "kind": hw.kind, "source": hw.source})
