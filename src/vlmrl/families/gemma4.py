"""Gemma 4: aspect-preserving ViT (2-D patch positions, pooled soft tokens per image), Gemma 4 decoder (sliding and
global layers, per-layer input embeddings). Its processor also holds an audio feature extractor and a video processor
(torchvision), so an image-only stand-in loads it here.

Naive path only: the grouped path would hand the pooled features as mm_encoder_outputs (as for Gemma 3), but the
bidirectional image mask and per-layer inputs have no grouped / shared-prefix equality test yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="gemma4",
    model_types=("gemma4",),
    tiny=("gemma4",),
    fallback_reason="Gemma 4's image mask and per-layer inputs have no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin:load_gemma4_image_processor",
)
