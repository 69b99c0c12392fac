"""GLM-5 (model_type glm5_next): GLM-4.xV's dynamic-resolution ViT and merger, a GLM-5 decoder (Kimi-delta linear
attention layers, MLA layers with DSA sparse attention, MoE, hyper-connection residual streams). Its processor needs a
video processor (torchvision), so the GLM image-only stand-in loads it here.

Naive path only: the shared prefix would have to carry the linear-attention recurrent and convolution states and the
DSA indexer's key cache per row, and grouped vision its features per image; neither has its equality test yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="glm5-next",
    model_types=("glm5_next",),
    tiny=("glm5-next",),
    fallback_reason="GLM-5's linear-attention states and DSA indexer cache have no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin_2026b:load_glm5_next_processor",
)
