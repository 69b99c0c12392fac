"""Qwen2.5-VL: as Qwen2-VL, with windowed vision attention and seconds per temporal patch for videos."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="qwen2.5-vl",
    model_types=("qwen2_5_vl",),
    tiny=("qwen2.5-vl",),
    grouped="qwen",
    grouped_needs=("get_rope_index", "visual"),
    mrope=True,
    prefix_videos=True,
    continuous=True,
    multiturn=True,
    sequence_parallel=True,
    dynamic_resolution=True,
    video=True,
    video_seconds_per_patch=True,
    plan_video=True,
    vision_windows=True,
)
