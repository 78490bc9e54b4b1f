"""radixserve: an LLM serving engine built around RadixAttention."""

__version__ = "0.1.0"

__all__ = ["Engine", "EngineConfig"]


def __getattr__(name: str):
    # The engine pulls in torch; importing radixserve.cache or radixserve.sched must not.
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    if name == "EngineConfig":
        from radixserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
