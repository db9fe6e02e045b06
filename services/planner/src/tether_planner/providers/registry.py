"""The adapters by provider name, as named in an agent's ModelRef ('openai', 'anthropic')."""

from __future__ import annotations

from collections.abc import Mapping

from tether_planner.providers.port import ModelProvider, UnknownProvider


class ProviderRegistry:
    """Looks up the adapter for a run's pinned provider."""

    def __init__(self, adapters: Mapping[str, ModelProvider]) -> None:
        self._adapters = dict(adapters)

    def get(self, provider: str) -> ModelProvider:
        adapter = self._adapters.get(provider)
        if adapter is None:
            raise UnknownProvider(f"no adapter for model provider {provider!r}; known: {sorted(self._adapters)}")
        return adapter

    def close(self) -> None:
        for adapter in {id(a): a for a in self._adapters.values()}.values():
            close = getattr(adapter, "close", None)
            if close is not None:
                close()
