from inflight.engine.engine import Engine
from inflight.engine.stats import EngineStats

__all__ = ["Engine", "EngineStats"]
