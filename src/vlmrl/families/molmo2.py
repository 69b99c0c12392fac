"""Molmo2 (molmo2): SigLIP-style ViT on a low-res view plus overlapping high-res crops of each image, attention
pooling (2x2) of two of its layers' features into a Qwen3-style decoder; image tokens attend bidirectionally within
their block (mm_token_type_ids). Its processor needs a video processor and its image processor calls torchvision for
resize and normalize, so a stand-in loads it here (transformers' classes, those calls done in torch). `select_rows`
rebases image_token_pooling (indices into the batch's patches) per image.

Naive path only: the grouped path would hand pooled per-image features as mm_encoder_outputs and the shared prefix
would carry the bidirectional image blocks; no equality test on this family yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="molmo2",
    model_types=("molmo2",),
    tiny=("molmo2",),
    fallback_reason="Molmo2's pooled crops and bidirectional image blocks have no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin_2026:load_molmo2_image_processor",
)
