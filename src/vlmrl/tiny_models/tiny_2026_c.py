"""Tiny offline builds of the third batch of 2026 VLM families (issue 38), registered in `tiny_families.BUILDERS`
through `BUILDERS_C`.

Same recipe as `tiny_2026.py`: the real transformers architecture at toy sizes (MoE experts included where the
family has them), seeded random weights, the offline BPE tokenizer with the family's special tokens and a chat
template in its format, the image processor on its PIL backend and an image-only stand-in processor
(`vlmrl.processors.standin_2026`) where transformers' processor needs torchvision. These families train on the naive path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from vlmrl.tiny_models.tiny import finish_tiny_model, qwen35_text_config, seeded_model, tiny_mrope_section, tiny_vocab_size, train_tokenizer

# ---------------------------------------------------------------- ERNIE-4.5-VL (MoE)

ERNIE_SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "<|begin_of_sentence|>",
    "<|end_of_sentence|>",
    "<|IMAGE_START|>",
    "<|IMAGE_PLACEHOLDER|>",
    "<|IMAGE_END|>",
    "<|VIDEO_START|>",
    "<|VIDEO_PLACEHOLDER|>",
    "<|VIDEO_END|>",
]
ERNIE_MARKUP = {
    "image_token": "<|IMAGE_PLACEHOLDER|>",
    "image_start_token": "<|IMAGE_START|>",
    "image_end_token": "<|IMAGE_END|>",
    "video_token": "<|VIDEO_PLACEHOLDER|>",
    "video_start_token": "<|VIDEO_START|>",
    "video_end_token": "<|VIDEO_END|>",
}
# ERNIE-4.5-VL format: <|begin_of_sentence|> once, the system text then "\n", user turns "User: ...\n", assistant turns
# "Assistant: ...<|end_of_sentence|>"; each image "Picture N:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>" (the
# processor expands the placeholder).
ERNIE_CHAT_TEMPLATE = (
    "<|begin_of_sentence|>{% set ns = namespace(images=0) %}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}Assistant: {% elif message['role'] == 'user' %}User: {% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}{% set ns.images = ns.images + 1 %}"
    "Picture {{ ns.images }}:<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}<|end_of_sentence|>{% else %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def build_tiny_ernie45_vl(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 2,
    min_pixels: int = 28 * 28 * 4,
    max_pixels: int = 28 * 28 * 16,
) -> Path:
    """Tiny ERNIE-4.5-VL (A3B style): ViT with 2-D RoPE on dynamic-resolution patches (14 px, 2x2 merge), the
    variable-resolution resampler, ERNIE decoder with 3-D RoPE and a dense first layer then modality-isolated MoE
    (4 text experts and 4 vision experts, top 2 each, plus a shared expert). Three layers: the vision experts of the
    last layer reach no later position, those of the middle one do (their LoRA trains)."""
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration
    from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil

    from vlmrl.processors.standin_2026 import ErnieImageOnlyProcessor

    kw = dict(
        eos_token="</s>", pad_token="<unk>", bos_token="<s>", unk_token="<unk>", chat_template=ERNIE_CHAT_TEMPLATE, extra_special_tokens=ERNIE_MARKUP
    )
    tokenizer = train_tokenizer(family="custom", specials=list(ERNIE_SPECIAL_TOKENS), token_kwargs=kw)
    tid = tokenizer.convert_tokens_to_ids
    head_dim = hidden_size // num_heads
    t, h, w = tiny_mrope_section(head_dim)
    text = dict(
        vocab_size=tiny_vocab_size(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        # ERNIE orders the rotary sections (height, width, temporal); the real [22, 22, 20] of 64.
        rope_parameters={"rope_type": "default", "rope_theta": 500_000.0, "mrope_section": [h, w, t]},
        moe_intermediate_size=[intermediate_size // 4, intermediate_size // 4],
        moe_k=2,
        moe_num_experts=4,
        moe_num_shared_experts=1,
        pad_token_id=tid("<unk>"),
        bos_token_id=tid("<s>"),
        eos_token_id=tid("</s>"),
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
        num_heads=vision_heads,
        patch_size=14,
        spatial_merge_size=2,
    )
    ids = {f"{key}_id": tid(token) for key, token in ERNIE_MARKUP.items()}
    config = Ernie4_5_VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    model = seeded_model(Ernie4_5_VLMoeForConditionalGeneration, config, seed)
    eos = [tid("</s>"), tid("<|end_of_sentence|>")]
    model.generation_config.update(bos_token_id=tid("<s>"), eos_token_id=eos, pad_token_id=tid("<unk>"))
    image_processor = Ernie4_5_VLMoeImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
    processor = ErnieImageOnlyProcessor(image_processor, tokenizer, chat_template=ERNIE_CHAT_TEMPLATE)
    return finish_tiny_model(out_dir, model, tokenizer, image_processor, ERNIE_CHAT_TEMPLATE, processor)


# ---------------------------------------------------------------- MiniCPM-V 4.6

MINICPMV_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<image>",
    "</image>",
    "<slice>",
    "</slice>",
    "<image_id>",
    "</image_id>",
]
MINICPMV_MARKUP = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "image_start_token": "<image>",
    "image_end_token": "</image>",
    "slice_start_token": "<slice>",
    "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>",
    "image_id_end_token": "</image_id>",
}
# MiniCPM-V 4.6 (Qwen3.5 decoder): ChatML turns; each image one <|image_pad|>, which the processor expands into
# <image_id>N</image_id><image>...</image> plus <slice>...</slice> rows for the image's slices.
MINICPMV_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<|image_pad|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_minicpmv46(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 2,
    scale_resolution: int = 112,
) -> Path:
    """Tiny MiniCPM-V 4.6: SigLIP-style ViT (patch 14, NaViT-packed slices, nearest-interpolated positions) with the
    window-attention merger after its first layer, the 2x2 MLP merger (16x fewer tokens in all), Qwen3.5 hybrid
    decoder (one Gated DeltaNet layer, one full-attention layer). Images are sliced at `scale_resolution` px (a
    56 px image: one 112 px slice, 4 tokens; a wide one: a thumbnail plus its slices)."""
    from transformers import MiniCPMV4_6Config, MiniCPMV4_6ForConditionalGeneration
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import MiniCPMV4_6ImageProcessorPil

    from vlmrl.processors.standin_2026 import MiniCPMVImageOnlyProcessor

    kw = dict(
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=MINICPMV_CHAT_TEMPLATE,
        extra_special_tokens=MINICPMV_MARKUP,
    )
    tokenizer = train_tokenizer(family="custom", specials=list(MINICPMV_SPECIAL_TOKENS), token_kwargs=kw)
    tid = tokenizer.convert_tokens_to_ids
    layer_types = ["linear_attention", "full_attention"] * (num_layers // 2)
    text = qwen35_text_config(tokenizer, tid("<|endoftext|>"), hidden_size, layer_types, num_heads, num_kv_heads, intermediate_size)
    text["model_type"] = "qwen3_5_text"
    vision = dict(
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_depth,
        num_attention_heads=vision_heads,
        image_size=scale_resolution,
        patch_size=14,
    )
    config = MiniCPMV4_6Config(
        text_config=text,
        vision_config=vision,
        insert_layer_id=0,
        image_size=scale_resolution,
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
    )
    model = seeded_model(MiniCPMV4_6ForConditionalGeneration, config, seed)
    eos = [tid("<|im_end|>"), tid("<|endoftext|>")]
    model.generation_config.update(eos_token_id=eos, pad_token_id=tid("<|endoftext|>"))
    image_processor = MiniCPMV4_6ImageProcessorPil(scale_resolution=scale_resolution, max_slice_nums=4)
    processor = MiniCPMVImageOnlyProcessor(image_processor, tokenizer, chat_template=MINICPMV_CHAT_TEMPLATE)
    return finish_tiny_model(out_dir, model, tokenizer, image_processor, MINICPMV_CHAT_TEMPLATE, processor)


# ---------------------------------------------------------------- Kimi-K2.5

KIMI_SPECIAL_TOKENS = [
    "[BOS]",
    "[EOS]",
    "[PAD]",
    "[UNK]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_end|>",
    "<|media_pad|>",
    "<|kimi_k25_video_placeholder|>",
]
# Kimi-K2.5 format: turns "<|im_ROLE|>ROLE<|im_middle|>...<|im_end|>"; each image
# "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" (the processor expands <|media_pad|>).
KIMI_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set role = message['role'] if message['role'] in ('system', 'assistant') else 'user' %}"
    "<|im_{{ role }}|>{{ role }}<|im_middle|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def build_tiny_kimi_k25(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 2,
    max_side_patches: int = 8,
) -> Path:
    """Tiny Kimi-K2.5: MoonViT (patch 14, 2-D RoPE, learned positions interpolated to each image, at most
    `max_side_patches` patches a side), 2x2 patch merger + MLP projector, DeepSeek-V3 decoder (multi-head latent
    attention; a dense first layer, then 4 routed experts top 2 plus a shared expert). A 56 px image: 4 tokens."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from vlmrl.processors.standin_2026 import KimiImageOnlyProcessor, KimiK25ImageProcessorPil

    markup = {"image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>"}
    kw = dict(
        eos_token="[EOS]", pad_token="[PAD]", bos_token="[BOS]", unk_token="[UNK]", chat_template=KIMI_CHAT_TEMPLATE, extra_special_tokens=markup
    )
    tokenizer = train_tokenizer(family="custom", specials=list(KIMI_SPECIAL_TOKENS), token_kwargs=kw)
    tid = tokenizer.convert_tokens_to_ids
    head_dim = hidden_size // num_heads
    text = dict(
        model_type="deepseek_v3",
        vocab_size=tiny_vocab_size(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        moe_intermediate_size=intermediate_size // 4,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=hidden_size // 2,
        kv_lora_rank=hidden_size // 4,
        qk_nope_head_dim=head_dim // 2,
        qk_rope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
        pad_token_id=tid("[PAD]"),
        bos_token_id=tid("[BOS]"),
        eos_token_id=tid("[EOS]"),
    )
    vision = dict(
        patch_size=14,
        pos_emb_height=max_side_patches * 2,
        pos_emb_width=max_side_patches * 2,
        pos_emb_time=4,
        num_attention_heads=vision_heads,
        num_hidden_layers=vision_depth,
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
    )
    ids = dict(
        image_token_id=tid("<|media_pad|>"),
        video_token_id=tid("<|kimi_k25_video_placeholder|>"),
        vision_start_token_id=tid("<|media_begin|>"),
        vision_end_token_id=tid("<|media_end|>"),
    )
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=vision_hidden, tie_word_embeddings=False, **ids)
    model = seeded_model(Kimi_K25ForConditionalGeneration, config, seed)
    eos = [tid("<|im_end|>"), tid("[EOS]")]
    model.generation_config.update(bos_token_id=tid("[BOS]"), eos_token_id=eos, pad_token_id=tid("[PAD]"))
    image_processor = KimiK25ImageProcessorPil(size={"max_height": max_side_patches, "max_width": max_side_patches})
    processor = KimiImageOnlyProcessor(image_processor, tokenizer, chat_template=KIMI_CHAT_TEMPLATE)
    return finish_tiny_model(out_dir, model, tokenizer, image_processor, KIMI_CHAT_TEMPLATE, processor)


# ---------------------------------------------------------------- Molmo2

MOLMO2_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|image|>",
    "<|video|>",
    "<im_patch>",
    "<im_col>",
    "<im_start>",
    "<low_res_im_start>",
    "<frame_start>",
    "<im_end>",
    "<frame_end>",
    "<im_low>",
]
# Molmo2 (Qwen3 decoder): ChatML turns, each image one <|image|>, which the processor expands into the low-res view
# (<low_res_im_start> patch rows with <im_col> <im_end>) then the high-res crops (<im_start> ... <im_end>); the
# processor also puts the bos (<|endoftext|>) before each prompt.
MOLMO2_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<|image|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_molmo2(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vision_depth: int = 2,
    vision_hidden: int = 64,
    vision_heads: int = 2,
    crop_size: int = 112,
) -> Path:
    """Tiny Molmo2: SigLIP-style ViT on `crop_size` px crops (patch 14), features of its last two layers pooled 2x2
    by attention (the adapter) into the Qwen3-style decoder (QK norm); a low-res view of each image plus
    overlapping high-res crops (2 patch margins, 2 crops at most). A 56 px image: 2 crops, 32 patch tokens."""
    from transformers import Molmo2Config, Molmo2ForConditionalGeneration

    from vlmrl.processors.standin_2026 import Molmo2ImageOnlyProcessor, Molmo2ImageProcessorTorch

    kw = dict(
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        unk_token=None,
        chat_template=MOLMO2_CHAT_TEMPLATE,
        extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"},
    )
    tokenizer = train_tokenizer(family="custom", specials=list(MOLMO2_SPECIAL_TOKENS), token_kwargs=kw)
    tid = tokenizer.convert_tokens_to_ids
    head_dim = hidden_size // num_heads
    text = dict(
        vocab_size=tiny_vocab_size(tokenizer),
        additional_vocab_size=0,  # the checkpoints' extra rows hold special tokens the tiny tokenizer has in its vocabulary
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    )
    vision = dict(
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_depth,
        num_attention_heads=vision_heads,
        num_key_value_heads=vision_heads,
        head_dim=vision_hidden // vision_heads,
        image_size=[crop_size, crop_size],
        patch_size=14,
    )
    adapter = dict(
        vision_feature_layer=[-1, -2],
        hidden_size=vision_hidden,
        num_attention_heads=vision_heads,
        num_key_value_heads=vision_heads,
        head_dim=vision_hidden // vision_heads,
        intermediate_size=intermediate_size,
        text_hidden_size=hidden_size,
    )
    ids = dict(
        image_start_token_id=tid("<im_start>"),
        low_res_image_start_token_id=tid("<low_res_im_start>"),
        image_end_token_id=tid("<im_end>"),
        image_patch_id=tid("<im_patch>"),
        frame_start_token_id=tid("<frame_start>"),
        frame_end_token_id=tid("<frame_end>"),
    )
    config = Molmo2Config(text_config=text, vision_config=vision, adapter_config=adapter, **ids)
    model = seeded_model(Molmo2ForConditionalGeneration, config, seed)
    eos = [tid("<|im_end|>"), tid("<|endoftext|>")]
    model.generation_config.update(bos_token_id=tid("<|endoftext|>"), eos_token_id=eos, pad_token_id=tid("<|endoftext|>"))
    image_processor = Molmo2ImageProcessorTorch(size={"height": crop_size, "width": crop_size}, max_crops=2, overlap_margins=[2, 2])
    processor = Molmo2ImageOnlyProcessor(image_processor, tokenizer, chat_template=MOLMO2_CHAT_TEMPLATE)
    return finish_tiny_model(out_dir, model, tokenizer, image_processor, MOLMO2_CHAT_TEMPLATE, processor)


BUILDERS_C: dict[str, Callable[..., Path]] = {
    "ernie4.5-vl": build_tiny_ernie45_vl,
    "minicpm-v4.6": build_tiny_minicpmv46,
    "kimi-k2.5": build_tiny_kimi_k25,
    "molmo2": build_tiny_molmo2,
}
