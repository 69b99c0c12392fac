"""Kimi-K2.5 (kimi_k25): MoonViT (2-D RoPE, interpolated learned positions) + 2x2 patch merger and MLP projector,
DeepSeek-V3 decoder (multi-head latent attention, routed + shared experts). Its image processor has a torchvision
backend only and its processor a video processor (torchvision), so a stand-in loads it here: transformers'
Kimi_K25Processor minus the video processor, on a PIL port of Kimi_K25ImageProcessor's sizing and patch layout.

Naive path only: the grouped path would scatter per-image features into the <|media_pad|> positions (default
positions, as for LLaVA) but has no equality test on this family yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="kimi-k2.5",
    model_types=("kimi_k25",),
    tiny=("kimi-k2.5",),
    fallback_reason="Kimi-K2.5 has no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin_2026:load_kimi_image_processor",
)
