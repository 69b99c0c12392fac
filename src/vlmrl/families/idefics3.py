"""Idefics3: loads and trains on the naive path; no fast path yet (its image splitting is not equivalence-tested)."""

from vlmrl.families.base import Family

FAMILY = Family(name="idefics3", model_types=("idefics3",), fallback_reason="Idefics3's image splitting is not equivalence-tested yet")
