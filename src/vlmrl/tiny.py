"""Tiny random-weight VLMs built offline: real Hugging Face architectures with toy dimensions.

Everything here is built from scratch on this machine (no hub access): a byte-level BPE tokenizer
trained on a generated corpus, a model config whose special-token ids come from that tokenizer,
seeded random weights, and an image-processor config. Each builder writes a folder with
`save_pretrained`, so `AutoModelForImageTextToText.from_pretrained(folder)` loads it exactly as it
would load a user's checkpoint.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import torch

# ---------------------------------------------------------------- tokenizer

# Qwen2-VL's special tokens, in Qwen's own order (ids differ: ours come from the tiny tokenizer).
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
LLAVA_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]

# Qwen2-VL / Qwen2.5-VL chat template (as shipped with the instruct checkpoints).
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# LLaVA-1.5 style template: "USER: <image>\n... ASSISTANT:"; list contents with image entries.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% set ns = namespace(text='') %}"
    "{% if message['content'] is string %}{% set ns.text = message['content'] %}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set ns.text = ns.text + '<image>\\n' %}"
    "{% elif 'text' in content %}{% set ns.text = ns.text + content['text'] %}{% endif %}{% endfor %}{% endif %}"
    "{% if message['role'] == 'system' %}{{ ns.text + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'USER: ' + ns.text + ' ' }}"
    "{% else %}{{ 'ASSISTANT: ' + ns.text + '</s>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

REASONING_TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SHAPES = ["square", "circle", "triangle"]


def _corpus() -> list[str]:
    """Deterministic sentences that make the demo tasks' words cheap to tokenize.

    Word frequency decides which BPE merges are learned, so the phrases of the built-in counting
    and grounding tasks (and the reasoning tags) are repeated far more than anything else.
    """
    lines = []
    for i, colour in enumerate(COLOURS):
        for j, shape in enumerate(SHAPES):
            n = (i * 3 + j) % 10
            lines += [
                f"How many {colour} {shape}s are there in the image? Answer with a number.",
                f"How many shapes are there in the image? Answer with {n}.",
                f"<think>I see {n} {colour} {shape}s.</think><answer>{n}</answer>",
                f"Locate the {colour} {shape}. Give the bounding box as [x1, y1, x2, y2].",
                f"Output the answer in <answer></answer> tags. The {shape} is {colour}.",
            ]
    for k in range(225):
        a, b, c, d = k, (k * 7) % 225, (k * 13) % 225, (k * 29) % 225
        lines.append(f"<answer>[{a}, {b}, {c}, {d}]</answer> {k} {k},{a} [{k}]")
    lines += [" ".join(str(d) for d in range(10))] * 20
    # Chat-template words, and every key word also at the start of a line (no leading space).
    lines += ["system\nYou are a helpful assistant.\nuser\nassistant\nUSER: ASSISTANT:"] * 40
    words = [
        "How",
        "shapes",
        "Answer",
        "Locate",
        "the",
        "Give",
        "Output",
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        *COLOURS,
        *SHAPES,
        *(f"{s}s" for s in SHAPES),
    ]
    lines += [w for w in words for _ in range(30)]
    return lines * 4


def train_tokenizer(
    extra_corpus: list[str] | None = None,
    vocab_size: int = 600,
    family: str = "qwen",
    specials: list[str] | None = None,
    token_kwargs: dict | None = None,
):
    """Byte-level BPE trained on the built-in corpus (+ extra_corpus), wrapped for transformers.

    family "qwen" adds Qwen2-VL's special tokens and chat template (eos <|im_end|>, pad <|endoftext|>);
    family "llava" adds <s>/</s>/<pad>/<unk>/<image> and a LLaVA-1.5 style template. Left padding.
    family "custom" takes the special tokens from `specials` and the tokenizer's eos/pad/bos/unk, chat
    template and extra special tokens from `token_kwargs` (the other families of `tiny_families`).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if family not in ("qwen", "llava", "custom"):
        raise ValueError(f"train_tokenizer: unknown family {family!r}; expected 'qwen', 'llava' or 'custom'")
    if (family == "custom") != (specials is not None and token_kwargs is not None):
        raise ValueError("train_tokenizer: family 'custom' needs specials and token_kwargs (and only it takes them)")
    if family != "custom":
        specials = QWEN_SPECIAL_TOKENS if family == "qwen" else LLAVA_SPECIAL_TOKENS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        # Keep every byte in the vocabulary so any text (and any id) round-trips.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        show_progress=False,
    )
    tok.train_from_iterator(_corpus() + list(extra_corpus or []), trainer=trainer)
    # Byte-level pre-tokenization splits "<think>" into "<" "think" ">"; as added (not special) tokens
    # the reasoning tags cost one token each and still survive skip_special_tokens decoding.
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in REASONING_TAGS])

    if family == "custom":
        kw = dict(token_kwargs)
    elif family == "qwen":
        kw = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None, bos_token=None, chat_template=QWEN_CHAT_TEMPLATE)
    else:
        kw = dict(
            eos_token="</s>",
            pad_token="<pad>",
            unk_token="<unk>",
            bos_token="<s>",
            chat_template=LLAVA_CHAT_TEMPLATE,
            extra_special_tokens={"image_token": "<image>"},
        )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, padding_side="left", model_max_length=4096, **kw)
    return tokenizer


# ---------------------------------------------------------------- shared helpers


def _vocab_size(tokenizer) -> int:
    """Exactly len(tokenizer): every id the model can sample decodes (no dead rows to learn away)."""
    return len(tokenizer)


def _seeded_model(model_cls, config, seed: int):
    """Random init that is identical across calls (and independent of the global RNG state)."""
    fork_devices: list = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.eval()


def _finish(out_dir: str | Path, model, tokenizer, image_processor, chat_template: str, processor=None) -> Path:
    """Write model, tokenizer, image processor and chat template into out_dir (hub layout).

    `processor` (when transformers can build one here) is saved too, so processor_config.json
    carries its extra fields (e.g. LLaVA's patch_size).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    image_processor.save_pretrained(out)
    if processor is not None:
        processor.save_pretrained(out)
    # Processors read the template from chat_template.jinja (the tokenizer's copy is a fallback).
    (out / "chat_template.jinja").write_text(chat_template)
    return out


# ---------------------------------------------------------------- Qwen2-VL / Qwen2.5-VL


def _qwen_ids(tokenizer) -> dict:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    return dict(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )


def _mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (temporal, height, width) like Qwen's [16, 24, 24] of 64."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _qwen_text_config(tokenizer, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size: int | None = None) -> dict:
    if hidden_size % num_heads:
        raise ValueError(f"tiny Qwen: hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    ids = _qwen_ids(tokenizer)
    return dict(
        vocab_size=vocab_size or _vocab_size(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        max_window_layers=num_layers,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": _mrope_section(hidden_size // num_heads)},
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        tie_word_embeddings=False,
    )


def _qwen_image_processor(min_pixels: int, max_pixels: int, patch_size: int = 14, merge_size: int = 2):
    """Qwen2-VL image processor, PIL backend (needs no torchvision; configs name the same class)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=patch_size, temporal_patch_size=2, merge_size=merge_size)


def _build_qwen(
    kind: str,
    out_dir,
    seed,
    hidden_size,
    num_layers,
    num_heads,
    num_kv_heads,
    intermediate_size,
    vision_depth,
    vision_hidden,
    vision_heads,
    min_pixels,
    max_pixels,
    vocab_size=None,
) -> Path:
    """Shared builder: kind is 'qwen2_vl' or 'qwen2_5_vl'. vocab_size > len(tokenizer) pads the
    vocabulary (e.g. Qwen's 151,936 for memory benchmarks: ids past the tokenizer decode to nothing)."""
    tokenizer = train_tokenizer(family="qwen")
    ids = _qwen_ids(tokenizer)
    if vocab_size is not None and vocab_size < _vocab_size(tokenizer):
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {_vocab_size(tokenizer)} tokens")
    text = _qwen_text_config(tokenizer, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, vocab_size)
    mm_ids = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    if kind == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration as cls

        vision = dict(
            depth=vision_depth,
            hidden_size=vision_hidden,
            intermediate_size=vision_hidden * 2,
            num_heads=vision_heads,
            out_hidden_size=hidden_size,  # the merger projects into the text hidden size
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,  # 2x2 merged tokens per window: small images still exercise windowing
            fullatt_block_indexes=[vision_depth - 1],
        )
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **mm_ids)
    else:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration as cls

        vision = dict(
            depth=vision_depth,
            embed_dim=vision_hidden,
            hidden_size=hidden_size,  # hidden_size = merger output
            num_heads=vision_heads,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
        config = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **mm_ids)
    model = _seeded_model(cls, config, seed)
    model.generation_config.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    image_processor = _qwen_image_processor(min_pixels, max_pixels)
    # No processor object: Qwen2VLProcessor needs torchvision (video); AutoProcessor finds it from
    # config.json's model_type, exactly as for the hub checkpoints, which ship no processor_config.json.
    return _finish(out_dir, model, tokenizer, image_processor, QWEN_CHAT_TEMPLATE)


def build_tiny_qwen25vl(
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
    min_pixels: int = 28 * 28 * 4,
    max_pixels: int = 28 * 28 * 64,
    vocab_size: int | None = None,
) -> Path:
    """Tiny Qwen2.5-VL (window-attention ViT + 2x2 merger + Qwen2 decoder with M-RoPE) in out_dir."""
    return _build_qwen(
        "qwen2_5_vl",
        out_dir,
        seed,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        intermediate_size,
        vision_depth,
        vision_hidden,
        vision_heads,
        min_pixels,
        max_pixels,
        vocab_size,
    )


def build_tiny_qwen2vl(
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
    min_pixels: int = 28 * 28 * 4,
    max_pixels: int = 28 * 28 * 64,
) -> Path:
    """Tiny Qwen2-VL (ViT + 2x2 merger + Qwen2 decoder with M-RoPE) in out_dir."""
    return _build_qwen(
        "qwen2_vl",
        out_dir,
        seed,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        intermediate_size,
        vision_depth,
        vision_hidden,
        vision_heads,
        min_pixels,
        max_pixels,
    )


# ---------------------------------------------------------------- LLaVA


def build_tiny_llava(
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
    image_size: int = 56,
    patch_size: int = 8,
    text_model: str = "llama",
) -> Path:
    """Tiny LLaVA-1.5 (CLIP ViT + 2-layer MLP projector + Llama decoder) in out_dir; text_model="phi": a Phi decoder
    instead (LayerNorm, parallel attention/MLP, partial rotary), as MoE-LLaVA's and Bunny's Phi-2 LLaVAs.

    Images are resized to image_size x image_size: (image_size/patch_size)^2 <image> tokens each
    (49 with the defaults; the CLS token is dropped by the 'default' feature-select strategy).
    """
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, PhiConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if text_model not in ("llama", "phi"):
        raise ValueError(f"text_model must be llama or phi, got {text_model!r}")
    tokenizer = train_tokenizer(family="llava")
    tid = tokenizer.convert_tokens_to_ids
    text = (LlamaConfig if text_model == "llama" else functools.partial(PhiConfig, partial_rotary_factor=0.5))(
        vocab_size=_vocab_size(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096,
        bos_token_id=tid("<s>"),
        eos_token_id=tid("</s>"),
        pad_token_id=tid("<pad>"),
        tie_word_embeddings=False,
    )
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden,
        intermediate_size=vision_hidden * 2,
        num_hidden_layers=vision_depth,
        num_attention_heads=vision_heads,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=vision_hidden,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=tid("<image>"),
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        tie_word_embeddings=False,
    )
    model = _seeded_model(LlavaForConditionalGeneration, config, seed)
    model.generation_config.update(bos_token_id=tid("<s>"), eos_token_id=tid("</s>"), pad_token_id=tid("<pad>"))
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size},
        crop_size={"height": image_size, "width": image_size},
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        image_token="<image>",
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS token
        chat_template=LLAVA_CHAT_TEMPLATE,
    )
    return _finish(out_dir, model, tokenizer, image_processor, LLAVA_CHAT_TEMPLATE, processor)


# ---------------------------------------------------------------- embedded default

DEFAULT_NAME = "tiny-qwen2.5-vl-v2"  # v2: config.json carries the vlmrl_tiny marker (weights identical to v1)


def mark_embedded(folder: str | Path, name: str = DEFAULT_NAME) -> None:
    """Write the `vlmrl_tiny` key into folder/config.json: the embedded model's defaults (model_defaults.py) then
    apply to it and, because transformers keeps the key through save_pretrained, to every model trained from it."""
    import json

    from .model_defaults import TINY_MARKER

    path = Path(folder) / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data[TINY_MARKER] = name
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def default_model_path(cache_dir: str | Path | None = None) -> Path:
    """The embedded tiny Qwen2.5-VL, built once into $VLMRL_CACHE (or ~/.cache/vlmrl) and reused.

    The build goes to a temporary sibling folder renamed into place at the end, so a killed build
    never leaves a half-written model behind (and two concurrent builds cannot mix files).
    """
    root = Path(cache_dir or os.environ.get("VLMRL_CACHE") or Path.home() / ".cache" / "vlmrl").expanduser()
    final = root / DEFAULT_NAME
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_NAME}-", dir=root))
    try:
        build_tiny_qwen25vl(tmp)
        mark_embedded(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first: its folder is complete, keep it.
            if not (final / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
