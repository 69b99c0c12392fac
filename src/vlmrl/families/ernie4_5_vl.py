"""ERNIE-4.5-VL (ernie4_5_vl_moe): dynamic-resolution ViT (2x2 merge) + variable-resolution resampler, ERNIE decoder
with 3-D RoPE and modality-isolated MoE (text experts for text tokens, vision experts for image tokens and their
start/end markers, chosen by the processor's moe_mm_token_type_ids; so no load-balancing loss or routing replay
here). Its processor needs a video processor (torchvision), so an image-only stand-in loads it here.

Naive path only: grouped vision and the shared prefix would have to reproduce the 3-D positions (get_rope_index) and
hand each row its per-token expert choice (moe_mm_token_type_ids) on every split; no equality test yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="ernie4.5-vl",
    model_types=("ernie4_5_vl_moe",),
    tiny=("ernie4.5-vl",),
    fallback_reason="ERNIE-4.5-VL's 3-D positions and per-token vision experts have no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin_2026:load_ernie_image_processor",
    modality_experts=True,
)
