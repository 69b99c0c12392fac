"""SmolVLM (SmolVLM, SmolVLM2): Idefics3's layout (SigLIP tower, pixel-shuffle connector, Llama decoder) under its own
classes; its processor needs a video processor (torchvision), so an image-only stand-in loads it here.

Naive path only: its image splitting (tiles of each image batched per row) has no grouped / shared-prefix equality
test yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="smolvlm",
    model_types=("smolvlm",),
    tiny=("smolvlm",),
    fallback_reason="SmolVLM's image splitting is not equivalence-tested yet",
    standin_processor="vlmrl.processors.standin_2026b:load_smolvlm_image_processor",
)
