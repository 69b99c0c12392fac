"""InternVL: dynamic tiles, per-tile features as mm_encoder_outputs (image_num_patches tiles per image); its processor
needs a video processor (torchvision), so an image-only stand-in loads it here; videos are taken as frames."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="internvl",
    model_types=("internvl",),
    tiny=("internvl",),
    grouped="internvl",
    encoder_outputs=True,
    continuous=True,
    standin_processor="vlmrl.processors.standin:load_internvl_image_processor",
    video=True,
    tiling="dynamic",
)
