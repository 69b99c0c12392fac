"""Tiny offline builds of more 2026 VLM families (issue 38, second batch), registered in `tiny_families.BUILDERS`.

Same recipe as `tiny_2026.py`: the real transformers architecture at toy sizes, seeded random weights, the offline BPE
with the family's special tokens and chat template, and the image processor on its PIL backend or a stand-in from
`vlmrl.processors.standin_2026b` where transformers' needs torchvision. These families train on the naive path; docs/families.md.
"""

from __future__ import annotations

from pathlib import Path

from vlmrl.tiny_models.tiny import content_jinja, decoder_dims, family_tokenizer, finish_tiny_model, seeded_model, token_ids, vision_dims
from vlmrl.tiny_models.tiny_2026 import GLM_CHAT_TEMPLATE, GLM_SPECIAL_TOKENS, build_tiny_idefics3

# ---------------------------------------------------------------- SmolVLM / SmolVLM2


def build_tiny_smolvlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Tiny SmolVLM (SmolVLM / SmolVLM2 checkpoints, model_type smolvlm): Idefics3's layout (SigLIP ViT, pixel-shuffle
    connector, Llama decoder, Idefics3's chat format) under SmolVLM's classes, with SmolVLM's stronger pixel shuffle
    (scale 4: a 64 px image is 8x8 patches -> 4 image tokens)."""
    return build_tiny_idefics3(out_dir, seed=seed, model_type="smolvlm", scale_factor=4)


# ---------------------------------------------------------------- LFM2-VL

LFM2_VL_SPECIAL_TOKENS = [
    "<|pad|>",
    "<|startoftext|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<image>",
    "<|image_start|>",
    "<|image_end|>",
    "<|img_thumbnail|>",
]
# LFM2-VL chat format: <|startoftext|>, ChatML turns, "<image>" where an image goes (the processor expands it into
# <|image_start|> + image tokens + <|image_end|>), the assistant turn opened by "<|im_start|>assistant\n".
LFM2_VL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n" + content_jinja("<image>") + "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_lfm2_vl(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 2,
    patch_size: int = 8,
    max_image_tokens: int = 16,
) -> Path:
    """Tiny LFM2-VL: SigLIP2 NaFlex ViT (patch 8, any aspect ratio, learned positions resampled to each image's
    grid), pixel-unshuffle (factor 2) + LayerNorm + MLP projector, LFM2 hybrid decoder (short gated convolutions and
    grouped-query attention layers). A 56 px image becomes 64x64: 8x8 patches -> 16 image tokens (at most
    `max_image_tokens`, no tiles)."""
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration
    from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

    from vlmrl.processors.standin_2026b import Lfm2VlImageProcessorPil

    named = {"image_token": "<image>", "image_start_token": "<|image_start|>", "image_end_token": "<|image_end|>"}
    tokenizer = family_tokenizer(LFM2_VL_SPECIAL_TOKENS, LFM2_VL_CHAT_TEMPLATE, eos="<|im_end|>", pad="<|pad|>", bos="<|startoftext|>", named=named)
    layer_types = ["conv", "conv", "full_attention"] * (num_layers // 3) + ["full_attention"] * (num_layers % 3)
    text = decoder_dims(tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, model_type="lfm2", layer_types=layer_types)
    text.update(block_auto_adjust_ff_dim=False, conv_L_cache=3)  # MLP exactly intermediate_size wide
    vision = vision_dims(
        vision_hidden, vision_depth, vision_heads, model_type="siglip2_vision_model", patch_size=patch_size, num_patches=max_image_tokens * 4
    )
    config = Lfm2VlConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_size=hidden_size,
        downsample_factor=2,
        tie_word_embeddings=True,
    )
    model = seeded_model(Lfm2VlForConditionalGeneration, config, seed)
    model.generation_config.update(**token_ids(tokenizer))
    image_processor = Lfm2VlImageProcessorPil(
        encoder_patch_size=patch_size, downsample_factor=2, min_image_tokens=4, max_image_tokens=max_image_tokens, do_image_splitting=False
    )
    processor = Lfm2VlProcessor(image_processor, tokenizer, chat_template=LFM2_VL_CHAT_TEMPLATE)
    return finish_tiny_model(out_dir, model, tokenizer, image_processor, LFM2_VL_CHAT_TEMPLATE, processor)


# ---------------------------------------------------------------- Llama 4

LLAMA4_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|finetune_right_pad|>",
    "<|header_start|>",
    "<|header_end|>",
    "<|eom|>",
    "<|eot|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|image|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
]
# Llama 4 instruct format: <|begin_of_text|>, turns "<|header_start|>role<|header_end|>\n\n...<|eot|>", "<|image|>"
# where an image goes (the processor expands it into <|image_start|>, tile separators, <|image|> and the <|patch|>
# tokens the features take, <|image_end|>).
LLAMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|header_start|>{{ message['role'] }}<|header_end|>\n\n"
    + content_jinja("<|image|>")
    + "<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)


def build_tiny_llama4(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    num_experts: int = 4,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 2,
    tile: int = 56,
    patch_size: int = 14,
) -> Path:
    """Tiny Llama 4 (Scout / Maverick layout): ViT with 2-D RoPE on `tile` px tiles (a 56 px tile is 4x4 patches),
    pixel shuffle (ratio 0.5: 4 tokens per tile) + MLP adapter + projector, Llama 4 decoder: a dense layer then an
    MoE layer (`num_experts` routed experts, top 1, plus a shared expert), RoPE layers with chunked attention
    (chunk 16) and NoPE layers with full attention, QK norm."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration
    from transformers.models.llama4.processing_llama4 import Llama4Processor

    from vlmrl.processors.standin_2026b import Llama4ImageProcessorPil

    tokenizer = family_tokenizer(LLAMA4_SPECIAL_TOKENS, LLAMA4_CHAT_TEMPLATE, eos="<|eot|>", pad="<|finetune_right_pad|>", bos="<|begin_of_text|>")
    tid = tokenizer.convert_tokens_to_ids
    text = decoder_dims(tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, head_dim=hidden_size // num_heads)
    text.update(
        intermediate_size_mlp=intermediate_size * 2,
        num_local_experts=num_experts,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,  # dense and MoE layers alternate (Maverick)
        no_rope_layer_interval=2,
        attention_chunk_size=16,  # shorter than a prompt: the chunked mask really differs from the full one
        eos_token_id=[tid("<|end_of_text|>"), tid("<|eom|>"), tid("<|eot|>")],
    )
    vision = vision_dims(vision_hidden, vision_depth, vision_heads, image_size=tile, patch_size=patch_size, pixel_shuffle_ratio=0.5)
    # The adapter takes the pixel-shuffled patches (4x the width) through intermediate_size: both 4x the tower's width.
    vision.update(
        intermediate_size=vision_hidden * 4, projector_input_dim=hidden_size, projector_output_dim=hidden_size, vision_output_dim=hidden_size
    )
    config = Llama4Config(
        text_config=text,
        vision_config=vision,
        boi_token_index=tid("<|image_start|>"),
        eoi_token_index=tid("<|image_end|>"),
        image_token_index=tid("<|patch|>"),
        tie_word_embeddings=False,
    )
    model = seeded_model(Llama4ForConditionalGeneration, config, seed)
    model.generation_config.update(**{**token_ids(tokenizer), "eos_token_id": text["eos_token_id"]})
    image_processor = Llama4ImageProcessorPil(size={"height": tile, "width": tile}, max_patches=1)
    processor = Llama4Processor(image_processor, tokenizer, patch_size=patch_size, pixel_shuffle_ratio=0.5, chat_template=LLAMA4_CHAT_TEMPLATE)
    return finish_tiny_model(out_dir, model, tokenizer, image_processor, LLAMA4_CHAT_TEMPLATE, processor)


# ---------------------------------------------------------------- GLM-5 (glm5_next)


def build_tiny_glm5_next(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    num_experts: int = 4,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 2,
) -> Path:
    """Tiny GLM-5 (model_type glm5_next): GLM-4.xV's dynamic-resolution ViT (patch 14, 2x2 merge, 4 to 16 tokens per
    image) and a GLM-5 decoder: three Kimi-delta linear-attention layers then one MLA layer with DSA sparse attention
    (indexer top 16 in pools of 4, no RoPE), two dense MLP layers then two MoE layers (4 routed experts top 2 plus a
    shared expert), hyper-connection residual streams (2). GLM-4.xV's special tokens and chat format."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    from vlmrl.processors.standin_2026b import glm5_next_image_only_processor

    named = {"image_token": "<|image|>", "video_token": "<|video|>"}
    tokenizer = family_tokenizer(GLM_SPECIAL_TOKENS, GLM_CHAT_TEMPLATE, eos="<|user|>", pad="<|endoftext|>", named=named)
    tid = tokenizer.convert_tokens_to_ids
    head = hidden_size // num_heads
    text = decoder_dims(tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_heads)
    text.update(
        eos_token_id=[tid("<|endoftext|>"), tid("<|user|>"), tid("<|observation|>")],
        layer_types=["linear_attention"] * (num_layers - 1) + ["indexed_attention"],
        mlp_layer_types=["dense"] * (num_layers // 2) + ["sparse"] * (num_layers - num_layers // 2),
        moe_intermediate_size=intermediate_size // 4,
        n_routed_experts=num_experts,
        num_experts_per_tok=2,
        n_shared_experts=1,
        q_lora_rank=head,
        kv_lora_rank=head,
        qk_nope_head_dim=head,
        v_head_dim=head,
        qk_rope_head_dim=0,
        index_topk=16,  # fewer than a prompt's tokens: the sparse selection really drops positions
        index_kpool=4,
        index_head_dim=16,
        index_n_heads=2,
        linear_head_dim=head,
        linear_num_heads=num_heads,
        hc_mult=2,
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden,
        num_heads=vision_heads,
        intermediate_size=vision_hidden * 2,
        out_hidden_size=hidden_size,
        projection_intermediate_size=hidden_size,
        image_size=56,
        patch_size=14,
    )
    mm_ids = dict(
        image_token_id=tid("<|image|>"),
        video_token_id=tid("<|video|>"),
        image_start_token_id=tid("<|begin_of_image|>"),
        image_end_token_id=tid("<|end_of_image|>"),
        video_start_token_id=tid("<|begin_of_video|>"),
        video_end_token_id=tid("<|end_of_video|>"),
    )
    config = Glm5NextConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **mm_ids)
    model = seeded_model(Glm5NextForConditionalGeneration, config, seed)
    model.generation_config.update(**{**token_ids(tokenizer), "eos_token_id": text["eos_token_id"]})
    image_processor = Glm5NextImageProcessorPil(patch_size=14, merge_size=2, min_image_tokens=4, max_image_tokens=16)
    processor = glm5_next_image_only_processor()(image_processor, tokenizer, chat_template=GLM_CHAT_TEMPLATE)
    return finish_tiny_model(out_dir, model, tokenizer, image_processor, GLM_CHAT_TEMPLATE, processor)
