"""Stand-in of vllm.engine.protocol.EngineClient (the type AsyncLLM implements)."""

import abc


class EngineClient(abc.ABC):
    @abc.abstractmethod
    async def check_health(self) -> None:
        """Raise when the engine is dead."""
