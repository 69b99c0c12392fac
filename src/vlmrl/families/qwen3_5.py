"""Qwen3.5 (dense and MoE): Qwen3-VL's vision with a hybrid decoder (Gated DeltaNet + gated full attention), whose
recurrent states rule out the multi-turn engine's plain KV cache."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="qwen3.5",
    model_types=("qwen3_5", "qwen3_5_moe"),
    tiny=("qwen3.5", "qwen3.5-moe"),
    grouped="qwen3",
    grouped_needs=("get_rope_index", "visual"),
    encoder_outputs=True,
    mrope=True,
    prefix_videos=True,
    continuous=True,
    dynamic_resolution=True,
    video=True,
    timestamped_video=True,
    plan_video=True,
    vision_interpolated_positions=True,
    linear_attention=True,
)
