"""Mistral 3 (Mistral-Small-3.x, Ministral 3): Pixtral tower (any aspect ratio, 2-D RoPE) + 2x2 patch merger, Mistral
decoder, no video. Its processor is import-gated on torchvision, so an image-only stand-in loads it here.

Naive path only: the tower takes a padded [images, 3, H, W] batch with `image_sizes`, and the merger's per-image
token rows (with [IMG_BREAK] / [IMG_END] between them) have no grouped or shared-prefix equality test yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="mistral3",
    model_types=("mistral3",),
    tiny=("mistral3",),
    fallback_reason="Mistral 3's Pixtral features (image_sizes, row-break tokens) have no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin:load_pixtral_image_processor",
)
