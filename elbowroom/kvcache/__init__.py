"""The tiered KV prefix cache (RAM tier -> disk tier) used inside the LLM runner.

See docs/kvcache.md. The engine talks to ``PrefixCache`` only; the parts (block hash
index, tiers, cost model, file format) are pure and tested without a model.
"""

from elbowroom.kvcache.cache import CacheKey, Hit, PrefixCache, budget_for_level
from elbowroom.kvcache.cost import CostModel, Tier

__all__ = ["CacheKey", "CostModel", "Hit", "PrefixCache", "Tier", "budget_for_level"]
