"""LLaVA-OneVision: anyres tiles, per-image features as mm_encoder_outputs; its processor needs a video processor
(torchvision), so an image-only stand-in loads it here."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="llava-onevision",
    model_types=("llava_onevision",),
    tiny=("llava-onevision",),
    grouped="onevision",
    encoder_outputs=True,
    prefix_videos=True,
    continuous=True,
    standin_processor="vlmrl.processors.standin:load_onevision_image_processor",
    video=True,
    tiling="anyres",
)
