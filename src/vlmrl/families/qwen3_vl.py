"""Qwen3-VL (dense and MoE): features and DeepStack features handed to the model as mm_encoder_outputs, M-RoPE,
video timestamps, learned vision positions resampled to each grid."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="qwen3-vl",
    model_types=("qwen3_vl", "qwen3_vl_moe"),
    tiny=("qwen3-vl", "qwen3-vl-moe"),
    grouped="qwen3",
    grouped_needs=("get_rope_index", "visual"),
    encoder_outputs=True,
    mrope=True,
    prefix_videos=True,
    continuous=True,
    multiturn=True,
    sequence_parallel=True,
    dynamic_resolution=True,
    video=True,
    timestamped_video=True,
    plan_video=True,
    vision_interpolated_positions=True,
)
