"""Gemma 3: features as mm_encoder_outputs (the model builds its bidirectional image-block mask), no video input,
four norms per decoder layer; sliding-window layers rule out the multi-turn engine's plain KV cache."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="gemma3",
    model_types=("gemma3",),
    tiny=("gemma3",),
    grouped="gemma3",
    encoder_outputs=True,
    continuous=True,
    norms_per_layer=4,
)
