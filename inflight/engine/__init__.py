from inflight.engine.engine import Engine, EngineStats

__all__ = ["Engine", "EngineStats"]
