"""Model prices and the cost of a call, in millionths of a US dollar.

Prices are USD per million tokens, so cost in micro-dollars = tokens × price exactly. A model
is found by exact name, then as a snapshot or alias of a known name: the name followed only by
a date or `latest` (`gpt-4o-2024-08-06`, `claude-3-5-haiku-20241022`, `claude-3-7-sonnet-latest`).
Any other longer name is another model, often a pricier one (`o3-pro`, `o3-deep-research`), so
it is unknown: charged the configurable default (deliberately high, so budgets err on the safe
side) and reported as unpriced.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

PRICING_VERSION = "2025-10"

#: What may follow a table name in a snapshot or alias of that model: `-2024-08-06`,
#: `-20241022`, `-latest`, and Anthropic's `-0` aliases (`claude-sonnet-4-0`).
_SNAPSHOT_SUFFIX = re.compile(r"-(?:\d{4}-\d{2}-\d{2}|\d{8}|latest|0)")


@dataclass(frozen=True)
class Price:
    input_usd_per_mtok: float
    output_usd_per_mtok: float


#: List prices (standard tier, no caching discounts) at PRICING_VERSION.
DEFAULT_PRICES: Mapping[str, Price] = {
    # OpenAI
    "gpt-4o": Price(2.50, 10.00),
    "gpt-4o-mini": Price(0.15, 0.60),
    "gpt-4.1": Price(2.00, 8.00),
    "gpt-4.1-mini": Price(0.40, 1.60),
    "gpt-4.1-nano": Price(0.10, 0.40),
    "o3": Price(2.00, 8.00),
    "o3-mini": Price(1.10, 4.40),
    "o4-mini": Price(1.10, 4.40),
    # Anthropic
    "claude-opus-4-1": Price(15.00, 75.00),
    "claude-opus-4": Price(15.00, 75.00),
    "claude-sonnet-4-5": Price(3.00, 15.00),
    "claude-sonnet-4": Price(3.00, 15.00),
    "claude-haiku-4-5": Price(1.00, 5.00),
    "claude-3-7-sonnet": Price(3.00, 15.00),
    "claude-3-5-sonnet": Price(3.00, 15.00),
    "claude-3-5-haiku": Price(0.80, 4.00),
    "claude-3-haiku": Price(0.25, 1.25),
    # The scripted model server: priced so that cost caps can be exercised end to end.
    "tether-scripted": Price(1.00, 2.00),
}


class PricingFileError(Exception):
    """The configured pricing file cannot be read."""


@dataclass(frozen=True)
class Cost:
    usd_micros: int
    #: False when the model was not in the table and the default price was used.
    priced: bool
    version: str


@dataclass(frozen=True)
class PricingTable:
    """Prices per model, with a default for unknown models."""

    prices: Mapping[str, Price] = field(default_factory=lambda: dict(DEFAULT_PRICES))
    default: Price = Price(10.00, 30.00)
    version: str = PRICING_VERSION

    def price_of(self, model: str) -> Price | None:
        if model in self.prices:
            return self.prices[model]
        for name, price in self.prices.items():
            if model.startswith(name) and _SNAPSHOT_SUFFIX.fullmatch(model, len(name)):
                return price
        return None

    def cost(self, model: str, input_tokens: int, output_tokens: int) -> Cost:
        """Cost of one call, rounded up to a whole micro-dollar."""
        price = self.price_of(model)
        used = price or self.default
        micros = math.ceil(input_tokens * used.input_usd_per_mtok + output_tokens * used.output_usd_per_mtok - 1e-9)
        return Cost(max(0, micros), price is not None, self.version)

    def with_file(self, path: Path) -> PricingTable:
        """Prices from a JSON file `{"version": "...", "models": {"name": [in, out]}}` added over these."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            extra = {name: Price(float(p[0]), float(p[1])) for name, p in data.get("models", {}).items()}
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise PricingFileError(f"{path}: {exc}") from exc
        return PricingTable({**self.prices, **extra}, self.default, str(data.get("version", self.version)))
