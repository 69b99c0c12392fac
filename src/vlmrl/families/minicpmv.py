"""MiniCPM-V 4.6 (minicpmv4_6): ViT on NaViT-packed image slices (a thumbnail plus up to max_slice_nums slices per
image) with a window-attention merger inside the tower and an MLP merger after it, Qwen3.5 hybrid decoder. Its
processor needs a video processor (torchvision), so an image-only stand-in loads it here; it also returns the slices
of each image (image_num_patches), with which `select_rows` cuts the packed pixel columns per image.

Naive path only: the grouped path would hand per-image slice features as mm_encoder_outputs, and the shared prefix
would carry the Gated DeltaNet states (as for Qwen3.5); neither has an equality test on this family yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="minicpm-v",
    model_types=("minicpmv4_6",),
    tiny=("minicpm-v4.6",),
    fallback_reason="MiniCPM-V's packed slices and hybrid decoder have no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin_2026:load_minicpmv_image_processor",
)
