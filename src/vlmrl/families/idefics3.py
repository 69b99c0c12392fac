"""Idefics3: SigLIP tower, pixel-shuffle connector, Llama decoder; its processor (PIL backend, no video) loads here
as is. Naive path only: its image splitting (tiles of each image batched per row) has no grouped / shared-prefix
equality test yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="idefics3", model_types=("idefics3",), tiny=("idefics3",), fallback_reason="Idefics3's image splitting is not equivalence-tested yet"
)
