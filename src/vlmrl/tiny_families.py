"""Tiny offline builds of the newer VLM families, and the registry behind `vlmrl tiny --family NAME OUT_DIR`.

Same recipe as `tiny.py` (real transformers architecture, toy dimensions, seeded random weights, the
offline BPE tokenizer with the family's own special tokens and a chat template in the family's format,
image processor on the PIL backend: no torchvision). Each builder writes a folder that
`models.load_model` and `processing.load_processor` load like a user's checkpoint. InternVL, LLaVA-OneVision
and SmolVLM are not here: their processors require a torchvision video processor (docs/families.md).

| family name   | model_type  | processor when loaded here                                        |
|---------------|-------------|-------------------------------------------------------------------|
| qwen2-vl      | qwen2_vl    | QwenImageProcessor (Qwen2VLProcessor needs torchvision for video) |
| qwen2.5-vl    | qwen2_5_vl  | QwenImageProcessor                                                |
| qwen3-vl      | qwen3_vl    | QwenImageProcessor, patch 16 (Qwen3VLProcessor needs torchvision) |
| qwen3-vl-moe  | qwen3_vl_moe| QwenImageProcessor, patch 16                                      |
| qwen3.5       | qwen3_5     | QwenImageProcessor, patch 16                                      |
| qwen3.5-moe   | qwen3_5_moe | QwenImageProcessor, patch 16                                      |
| llava         | llava       | LlavaProcessor                                                    |
| gemma3        | gemma3      | Gemma3Processor (Gemma3ImageProcessorPil)                         |
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from .tiny import (
    QWEN_SPECIAL_TOKENS,
    _finish,
    _mrope_section,
    _qwen_ids,
    _qwen_image_processor,
    _seeded_model,
    _vocab_size,
    build_tiny_llava,
    build_tiny_qwen2vl,
    build_tiny_qwen25vl,
    train_tokenizer,
)

# ---------------------------------------------------------------- Qwen3-VL

# Qwen3-VL instruct format: no default system turn; images as <|vision_start|><|image_pad|><|vision_end|>.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen3_tokenizer():
    kw = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None, chat_template=QWEN3_CHAT_TEMPLATE)
    return train_tokenizer(family="custom", specials=list(QWEN_SPECIAL_TOKENS), token_kwargs=kw)


def build_tiny_qwen3vl(
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
    min_pixels: int = 32 * 32 * 4,
    max_pixels: int = 32 * 32 * 64,
    num_experts: int = 0,
    vocab_size: int | None = None,
) -> Path:
    """Tiny Qwen3-VL: ViT (patch 16, learned + rotary positions) with DeepStack mergers after every vision
    layer, 2x2 merger, Qwen3 decoder (q/k norm, interleaved M-RoPE). DeepStack features are added to the
    image-token hidden states of the first `vision_depth` decoder layers. num_experts > 0: Qwen3-VL-MoE
    (every decoder MLP a sparse MoE block: num_experts experts, 2 active per token). vocab_size > len(tokenizer)
    pads the vocabulary (memory benchmarks with Qwen's 151,936)."""
    if num_experts:
        from transformers import Qwen3VLMoeConfig as config_cls, Qwen3VLMoeForConditionalGeneration as model_cls
    else:
        from transformers import Qwen3VLConfig as config_cls, Qwen3VLForConditionalGeneration as model_cls

    tokenizer = _qwen3_tokenizer()
    ids = _qwen_ids(tokenizer)
    head_dim = hidden_size // num_heads
    if vocab_size is not None and vocab_size < _vocab_size(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {_vocab_size(tokenizer)} tokens")
    text = dict(
        vocab_size=vocab_size or _vocab_size(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": _mrope_section(head_dim), "mrope_interleaved": True},
        pad_token_id=ids["pad_token_id"],
    )
    if num_experts:
        text.update(num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=intermediate_size // 2, decoder_sparse_step=1)
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
        num_heads=vision_heads,
        out_hidden_size=hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,  # an 8x8 learned grid, interpolated to each image's grid
        deepstack_visual_indexes=list(range(min(vision_depth, num_layers))),
    )
    mm_ids = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    config = config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False, **mm_ids)
    model = _seeded_model(model_cls, config, seed)
    model.generation_config.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    image_processor = _qwen_image_processor(min_pixels, max_pixels, patch_size=16)
    return _finish(out_dir, model, tokenizer, image_processor, QWEN3_CHAT_TEMPLATE)


def build_tiny_qwen3vl_moe(out_dir: str | Path, seed: int = 0, num_experts: int = 4, **kwargs) -> Path:
    """Tiny Qwen3-VL-MoE: `build_tiny_qwen3vl` with sparse MoE decoder MLPs (num_experts experts, top-2)."""
    return build_tiny_qwen3vl(out_dir, seed=seed, num_experts=num_experts, **kwargs)


def build_tiny_qwen35(
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
    min_pixels: int = 32 * 32 * 4,
    max_pixels: int = 32 * 32 * 64,
    num_experts: int = 0,
) -> Path:
    """Tiny Qwen3.5: Qwen3-VL-style ViT (patch 16) + hybrid decoder, three Gated DeltaNet (linear attention,
    recurrent state + causal conv) layers per full-attention layer, interleaved M-RoPE in the attention layers.
    num_experts > 0: Qwen3.5-MoE (top-2 routed experts plus a gated shared expert in every layer)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    tokenizer = _qwen3_tokenizer()
    ids = _qwen_ids(tokenizer)
    head_dim = hidden_size // num_heads
    text = dict(
        vocab_size=_vocab_size(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=num_kv_heads,
        linear_num_value_heads=num_heads,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(num_layers)],
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "mrope_section": _mrope_section(head_dim // 4),  # partial rotary: a quarter of each head rotates
            "mrope_interleaved": True,
            "partial_rotary_factor": 0.25,
        },
        pad_token_id=ids["pad_token_id"],
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
        num_heads=vision_heads,
        out_hidden_size=hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
    )
    config_class, model_class = Qwen3_5Config, Qwen3_5ForConditionalGeneration
    if num_experts:
        config_class, model_class = Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
        moe_width = text.pop("intermediate_size") // 2
        text.update(num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=moe_width, shared_expert_intermediate_size=moe_width)
    mm_ids = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **mm_ids)
    model = _seeded_model(model_class, config, seed)
    model.generation_config.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    image_processor = _qwen_image_processor(min_pixels, max_pixels, patch_size=16)
    return _finish(out_dir, model, tokenizer, image_processor, QWEN3_CHAT_TEMPLATE)


def build_tiny_qwen35_moe(out_dir: str | Path, seed: int = 0, num_experts: int = 4, **kwargs) -> Path:
    """Tiny Qwen3.5-MoE: the tiny Qwen3.5 with 4 routed experts (top 2) and a shared expert per layer."""
    return build_tiny_qwen35(out_dir, seed=seed, num_experts=num_experts, **kwargs)


# ---------------------------------------------------------------- Gemma 3

GEMMA3_SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
# Gemma 3 instruct format: <bos>, turns "<start_of_turn>user|model\n...<end_of_turn>\n", the system text
# folded into the first user turn, one <start_of_image> per image (the processor expands it).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = (message['content'] if message['content'] is string else message['content'][0]['text']) + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['role'] == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}<start_of_image>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def build_tiny_gemma3(
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
    image_size: int = 64,
    patch_size: int = 8,
    tokens_per_image: int = 16,
) -> Path:
    """Tiny Gemma 3: SigLIP ViT, average-pooled to `tokens_per_image` tokens + RMS-normed projector, Gemma 3
    decoder (sliding-window and global layers, q/k norm, bidirectional attention inside each image)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    kw = dict(
        eos_token="<eos>",
        pad_token="<pad>",
        bos_token="<bos>",
        unk_token="<unk>",
        chat_template=GEMMA3_CHAT_TEMPLATE,
        extra_special_tokens={"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"},
    )
    tokenizer = train_tokenizer(family="custom", specials=list(GEMMA3_SPECIAL_TOKENS), token_kwargs=kw)
    tid = tokenizer.convert_tokens_to_ids
    head_dim = hidden_size // num_heads
    text = dict(
        vocab_size=_vocab_size(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        query_pre_attn_scalar=head_dim,
        sliding_window=16,  # shorter than a prompt: the sliding layer's mask really differs from the global one
        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2) + ["sliding_attention"] * (num_layers % 2),
        max_position_embeddings=4096,
        pad_token_id=tid("<pad>"),
        bos_token_id=tid("<bos>"),
        eos_token_id=tid("<eos>"),
    )
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_depth,
        num_attention_heads=vision_heads,
        image_size=image_size,
        patch_size=patch_size,
        vision_use_head=False,
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=tokens_per_image,
        boi_token_index=tid("<start_of_image>"),
        eoi_token_index=tid("<end_of_image>"),
        image_token_index=tid("<image_soft_token>"),
        tie_word_embeddings=True,
    )
    model = _seeded_model(Gemma3ForConditionalGeneration, config, seed)
    # transformers initialises the projection matrix to zeros (checkpoints overwrite it): random values
    # instead, or every image feature is 0 and no gradient reaches the vision tower.
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed + 1)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, config.initializer_range)
    eos = [tid("<eos>"), tid("<end_of_turn>")]
    model.generation_config.update(bos_token_id=tid("<bos>"), eos_token_id=eos, pad_token_id=tid("<pad>"))
    image_processor = Gemma3ImageProcessorPil(size={"height": image_size, "width": image_size})
    processor = Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA3_CHAT_TEMPLATE, image_seq_length=tokens_per_image
    )
    return _finish(out_dir, model, tokenizer, image_processor, GEMMA3_CHAT_TEMPLATE, processor)


# ---------------------------------------------------------------- tiled families on a Qwen2 decoder


def _chatml_template(image_placeholder: str, video_placeholder: str = "<video>") -> str:
    """ChatML turns with `image_placeholder` (`video_placeholder`) + newline where each image (video) goes (LLaVA-OneVision,
    InternVL)."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for content in message['content'] %}"
        "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}" + image_placeholder + "\n"
        "{% elif content['type'] == 'video' or 'video' in content %}" + video_placeholder + "\n"
        "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _chatml_tokenizer(chat_template: str, image_tokens: list[str], named_tokens: dict | None = None):
    """The offline BPE with Qwen's special tokens plus the family's image tokens (named ones become tokenizer attributes)."""
    kw = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None, chat_template=chat_template)
    if named_tokens:
        kw["extra_special_tokens"] = named_tokens
    return train_tokenizer(family="custom", specials=[*QWEN_SPECIAL_TOKENS, *image_tokens], token_kwargs=kw)


def _qwen2_text(tokenizer, hidden_size: int, intermediate_size: int, num_layers: int, num_heads: int, num_kv_heads: int, vocab_size) -> dict:
    """A Qwen2 decoder config; vocab_size > len(tokenizer) gives a Qwen-size LM head for benchmarks."""
    tid = tokenizer.convert_tokens_to_ids
    return dict(
        model_type="qwen2",
        vocab_size=max(vocab_size or 0, _vocab_size(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        pad_token_id=tid("<|endoftext|>"),
        eos_token_id=tid("<|im_end|>"),
        tie_word_embeddings=False,
    )


# LLaVA-OneVision (Qwen2 decoder) chat format: ChatML turns, "<image>\n" before the text of a user turn.
ONEVISION_CHAT_TEMPLATE = _chatml_template("<image>")


def build_tiny_llava_onevision(
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
    tile: int = 28,
    patch_size: int = 14,
    vocab_size: int | None = None,
    **_ignored,  # max_pixels etc. of the Qwen builders: anyres sizes come from the tile and the pinpoints
) -> Path:
    """Tiny LLaVA-OneVision: SigLIP ViT on `tile` px tiles (a base tile plus the anyres grid of the best pinpoint,
    up to 3x3 tiles), 2-layer projector, image_newline tokens, Qwen2 decoder. Image tokens per image vary with its
    size and aspect ratio (anyres_max_9 unpadding), as in the real model. vocab_size > len(tokenizer): a
    Qwen-size LM head for benchmarks (the extra ids decode to nothing)."""
    from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    from .standin_processors import OnevisionImageProcessor

    tokenizer = _chatml_tokenizer(ONEVISION_CHAT_TEMPLATE, ["<image>", "<video>"])
    tid = tokenizer.convert_tokens_to_ids
    pinpoints = [[tile * a, tile * b] for a in (1, 2, 3) for b in (1, 2, 3)]
    text = _qwen2_text(tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, vocab_size)
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_depth,
        num_attention_heads=vision_heads,
        image_size=tile,
        patch_size=patch_size,
    )
    config = LlavaOnevisionConfig(
        text_config=text,
        vision_config=vision,
        image_token_index=tid("<image>"),
        video_token_index=tid("<video>"),
        image_grid_pinpoints=pinpoints,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
        vision_aspect_ratio="anyres_max_9",
        tie_word_embeddings=False,
    )
    model = _seeded_model(LlavaOnevisionForConditionalGeneration, config, seed)
    model.generation_config.update(eos_token_id=tid("<|im_end|>"), pad_token_id=tid("<|endoftext|>"))
    image_processor = LlavaOnevisionImageProcessorPil(size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints)
    processor = OnevisionImageProcessor(
        image_processor,
        tokenizer,
        num_image_tokens=(tile // patch_size) ** 2,
        vision_feature_select_strategy="full",
        chat_template=ONEVISION_CHAT_TEMPLATE,
        vision_aspect_ratio="anyres_max_9",
    )
    return _finish(out_dir, model, tokenizer, image_processor, ONEVISION_CHAT_TEMPLATE, processor)


# ---------------------------------------------------------------- InternVL

# InternVL (Qwen2 decoder) chat format: ChatML turns, "<IMG_CONTEXT>\n" per image (the processor expands it to
# <img><IMG_CONTEXT> x image_seq_length x tiles</img>).
INTERNVL_CHAT_TEMPLATE = _chatml_template("<IMG_CONTEXT>")


def build_tiny_internvl(
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
    tile: int = 56,
    patch_size: int = 14,
    max_tiles: int = 6,
    vocab_size: int | None = None,
    **_ignored,
) -> Path:
    """Tiny InternVL: InternViT on `tile` px tiles (dynamic tiling: 1..max_tiles tiles by aspect ratio, plus a
    thumbnail when tiled), pixel shuffle 0.5 (4 tokens per 56 px tile), MLP projector, Qwen2 decoder."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from .standin_processors import InternVLImageProcessor

    image_tokens = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
    tokenizer = _chatml_tokenizer(INTERNVL_CHAT_TEMPLATE, list(image_tokens.values()), image_tokens)
    tid = tokenizer.convert_tokens_to_ids
    text = _qwen2_text(tokenizer, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads, vocab_size)
    vision = dict(
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_depth,
        num_attention_heads=vision_heads,
        image_size=[tile, tile],
        patch_size=[patch_size, patch_size],
    )
    config = InternVLConfig(
        vision_config=vision, text_config=text, image_token_id=tid("<IMG_CONTEXT>"), downsample_ratio=0.5, tie_word_embeddings=False
    )
    model = _seeded_model(InternVLForConditionalGeneration, config, seed)
    model.generation_config.update(eos_token_id=tid("<|im_end|>"), pad_token_id=tid("<|endoftext|>"))
    image_processor = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=True, min_patches=1, max_patches=max_tiles)
    tokens_per_tile = int((tile // patch_size) ** 2 * 0.5**2)
    processor = InternVLImageProcessor(image_processor, tokenizer, image_seq_length=tokens_per_tile, chat_template=INTERNVL_CHAT_TEMPLATE)
    return _finish(out_dir, model, tokenizer, image_processor, INTERNVL_CHAT_TEMPLATE, processor)


# ---------------------------------------------------------------- registry

BUILDERS: dict[str, Callable[..., Path]] = {
    "qwen2-vl": build_tiny_qwen2vl,
    "qwen2.5-vl": build_tiny_qwen25vl,
    "qwen3-vl": build_tiny_qwen3vl,
    "qwen3-vl-moe": build_tiny_qwen3vl_moe,
    "qwen3.5": build_tiny_qwen35,
    "qwen3.5-moe": build_tiny_qwen35_moe,
    "llava": build_tiny_llava,
    "gemma3": build_tiny_gemma3,
    "llava-onevision": build_tiny_llava_onevision,
    "internvl": build_tiny_internvl,
}


def build_family(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Build the tiny model of family `name` (a key of BUILDERS) into out_dir."""
    if name not in BUILDERS:
        raise ValueError(f"unknown family {name!r}; choose one of {', '.join(BUILDERS)}")
    return BUILDERS[name](out_dir, seed=seed)


# ---------------------------------------------------------------- command line


def add_tiny_arguments(sub) -> None:
    """The `vlmrl tiny` sub-command on an argparse subparsers object."""
    t = sub.add_parser(
        "tiny",
        help="Build a tiny random-weight model of a family (offline), to smoke-test a pipeline.",
        description="Write a tiny random-weight model folder of a VLM family (real architecture, toy sizes, offline "
        "tokenizer and processor). Point model.name_or_path at it to smoke-test a config in seconds.",
        epilog="example:\n  vlmrl tiny --family qwen3-vl outputs/tiny-qwen3-vl\n"
        "  vlmrl train model.name_or_path=outputs/tiny-qwen3-vl data.task=count",
    )
    t.add_argument("--family", required=True, help=f"one of: {', '.join(BUILDERS)}")
    t.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    t.add_argument("out_dir", help="folder to write (created; must not hold a model already)")


def run_tiny(ns) -> int:
    """`vlmrl tiny`: exit 2 with one line for an unknown family or a folder that already holds a model."""
    import sys

    out = Path(ns.out_dir).expanduser()
    if ns.family not in BUILDERS:
        print(f"vlmrl tiny: unknown --family {ns.family!r}; choose one of {', '.join(BUILDERS)}", file=sys.stderr)
        return 2
    if (out / "config.json").exists() or (out.exists() and not out.is_dir()):
        print(f"vlmrl tiny: {out} already holds a model or is a file; choose a new folder", file=sys.stderr)
        return 2
    path = build_family(ns.family, out, seed=ns.seed)
    print(f"vlmrl tiny: wrote a tiny {ns.family} model to {path}", file=sys.stderr)
    return 0
