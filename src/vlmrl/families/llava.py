"""LLaVA (LLaVA-1.5 style): CLIP tower + MLP projector, features scattered by vlmrl, default positions, no video."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="llava",
    model_types=("llava",),
    tiny=("llava",),
    grouped="llava",
    continuous=True,
    multiturn=True,
)
