"""Qwen2-VL: dynamic-resolution tower (fc1 -> quick_gelu -> fc2), features scattered by vlmrl, M-RoPE."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="qwen2-vl",
    model_types=("qwen2_vl",),
    tiny=("qwen2-vl",),
    grouped="qwen",
    grouped_needs=("get_rope_index", "visual"),
    mrope=True,
    prefix_videos=True,
    continuous=True,
    multiturn=True,
    sequence_parallel=True,
    dynamic_resolution=True,
    video=True,
    plan_video=True,
    vision_width_key="embed_dim",
    vision_mlp_gated=False,
)
