"""GLM-4.1V (glm4v), GLM-4.5V (glm4v_moe) and GLM-4.6V (glm46v): Qwen-VL-like dynamic-resolution ViT (2x2 merger) and
a GLM-4 decoder with M-RoPE; their processors need a video processor (torchvision), so an image-only stand-in loads
them here.

Naive path only: grouped vision and the shared prefix would need the model's own M-RoPE positions (get_rope_index
over image and video spans) reproduced per row and their equality tests; not written yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="glm4v",
    model_types=("glm4v", "glm4v_moe", "glm46v"),
    tiny=("glm4v", "glm4v-moe", "glm4.6v"),
    fallback_reason="GLM-4.xV's M-RoPE positions per row have no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin:load_glm_image_processor",
)
