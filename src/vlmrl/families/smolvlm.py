"""SmolVLM: loads and trains on the naive path; no fast path yet (its image splitting is not equivalence-tested)."""

from vlmrl.families.base import Family

FAMILY = Family(name="smolvlm", model_types=("smolvlm",), fallback_reason="SmolVLM's image splitting is not equivalence-tested yet")
