"""Real Qwen-VL architectures with random weights, built offline (no hub access).

`PRESETS` holds the published model dimensions as transformers config dicts. `build_preset_model`
writes a folder that vlmrl loads exactly like a user's checkpoint (config, safetensors weights, our
tiny tokenizer, a Qwen2-VL image processor, the chat template), so GPU memory and step time can be
measured on the real shapes without downloading anything.

Provenance of the numbers (checked while writing this module):
- transformers 5.23 config classes: the Qwen2.5-VL vision defaults (depth 32, intermediate 3420,
  16 heads, patch 14, merge 2, temporal patch 2, window 112, fullatt_block_indexes [7, 15, 23, 31],
  silu) and the Qwen2-VL vision defaults (depth 32, embed_dim 1280, mlp_ratio 4, 16 heads,
  quick_gelu). NB the class default of Qwen2.5-VL's *vision* hidden_size is 3584, not the
  checkpoints' 1280, so it is set explicitly here.
- Module printouts of the 7B checkpoints found in public code (Qwen2.5-VL-7B and Qwen2-VL-7B:
  embed 152064 x 3584, 28 layers, k/v_proj 3584 -> 512 (4 KV heads of 128), MLP 18944, merger
  5120 -> 3584; Qwen2.5-VL vision MLP 1280 -> 3420 gated; Qwen2-VL vision MLP 1280 -> 5120).
- The Qwen2.5-VL-3B-Instruct config.json (hidden 2048, intermediate 11008, 36 layers, 16 heads,
  2 KV heads, rms_norm_eps 1e-6, rope_theta 1e6, max_position_embeddings 128000).
- Meta-device parameter counts (tests/test_presets.py): 3B ~3.75e9, 7B ~8.29e9, as published.
UNVERIFIED here (taken from the brief / memory of the hub config.json files, no hub access):
Qwen2-VL-2B's text dims (1536 / 8960 / 28 layers / 12 heads / 2 KV / tie true), vocab 151936 for
the 3B and 2B, max_window_layers, max_position_embeddings and tokens_per_second. None of these
unverified extras (window layers, max positions, tokens/s) changes parameter count or activation
memory at the sequence lengths benchmarked.

Special tokens: the configs' image/video/vision-start/end and bos/eos/pad ids come from OUR tiny
tokenizer (`vlmrl.tiny.train_tokenizer(family="qwen")`), so prompts built with our processor line
up with the model. vocab_size stays the real one (151936 / 152064) so the embedding and LM-head
shapes (and the logits memory, the largest activation in GRPO) are real; ids beyond len(tokenizer)
decode to empty strings. With random weights the next-token distribution is nearly uniform over
~152k ids, so eos (1 id) is practically never sampled and every completion runs to
max_completion_length - fine, even convenient, for measuring memory and throughput.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# Qwen's published image-processor bounds (min 4 merged tokens, max 16384 merged tokens).
QWEN_MIN_PIXELS = 56 * 56
QWEN_MAX_PIXELS = 28 * 28 * 16384

_QWEN25_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    hidden_act="silu",
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
)
_QWEN2_VISION = dict(
    depth=32,
    embed_dim=1280,
    mlp_ratio=4,
    num_heads=16,
    hidden_act="quick_gelu",
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
_MROPE = {"rope_type": "default", "rope_theta": 1_000_000.0, "mrope_section": [16, 24, 24]}


def _text(hidden, intermediate, layers, heads, kv_heads, vocab, tie, max_pos, max_window_layers) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        max_position_embeddings=max_pos,
        max_window_layers=max_window_layers,
        use_sliding_window=False,
        rope_parameters=dict(_MROPE),
        tie_word_embeddings=tie,
    )


# Each preset: {"family": "qwen2_5_vl" | "qwen2_vl", "text_config": {...}, "vision_config": {...},
# "tie_word_embeddings": bool, "params": published/expected total parameter count}.
PRESETS: dict[str, dict] = {
    "qwen2.5-vl-3b": dict(
        family="qwen2_5_vl",
        text_config=_text(2048, 11008, 36, 16, 2, 151936, True, 128000, 70),
        vision_config=dict(_QWEN25_VISION, out_hidden_size=2048),
        tie_word_embeddings=True,
        params=3.75e9,
    ),
    "qwen2.5-vl-7b": dict(
        family="qwen2_5_vl",
        text_config=_text(3584, 18944, 28, 28, 4, 152064, False, 128000, 28),
        vision_config=dict(_QWEN25_VISION, out_hidden_size=3584),
        tie_word_embeddings=False,
        params=8.29e9,
    ),
    "qwen2-vl-2b": dict(
        family="qwen2_vl",
        text_config=_text(1536, 8960, 28, 12, 2, 151936, True, 32768, 28),
        vision_config=dict(_QWEN2_VISION, hidden_size=1536),  # hidden_size = merger output = text hidden
        tie_word_embeddings=True,
        params=2.21e9,
    ),
    "qwen2-vl-7b": dict(
        family="qwen2_vl",
        text_config=_text(3584, 18944, 28, 28, 4, 152064, False, 32768, 28),
        vision_config=dict(_QWEN2_VISION, hidden_size=3584),
        tie_word_embeddings=False,
        params=8.29e9,
    ),
}


# Planner-only presets (`vlmrl plan --model NAME`): config-only, never built into a model folder. Values typed from
# the published config.json files as remembered (no hub access here, so UNVERIFIED); parameter counts always come
# from meta-device instantiation, `params` is the published total for comparison (tests/test_planner.py).
_LLAVA_CLIP_336 = dict(
    model_type="clip_vision_model",
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=336,
    patch_size=14,
    projection_dim=768,
    hidden_act="quick_gelu",
)
_INTERNVIT_300M = dict(
    model_type="internvl_vision",
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=24,
    num_attention_heads=16,
    image_size=[448, 448],
    patch_size=[14, 14],
    use_qk_norm=False,
    norm_type="layer_norm",
    layer_scale_init_value=0.1,
    hidden_act="gelu",
)
_SIGLIP_SO400M = dict(
    model_type="siglip_vision_model",
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=26,
    num_attention_heads=16,
    image_size=384,
    patch_size=14,
    hidden_act="gelu_pytorch_tanh",
)


def _qwen2_text(hidden, intermediate, layers, heads, kv, vocab, tie) -> dict:
    return dict(
        model_type="qwen2",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        vocab_size=vocab,
        tie_word_embeddings=tie,
        hidden_act="silu",
    )


def _internvl(text: dict) -> dict:
    return {
        "config": dict(
            model_type="internvl",
            vision_config=dict(_INTERNVIT_300M),
            text_config=text,
            downsample_ratio=0.5,
            projector_hidden_act="gelu",
            vision_feature_layer=-1,
            vision_feature_select_strategy="default",
            image_seq_length=256,
            tie_word_embeddings=text["tie_word_embeddings"],
        )
    }


def _gemma3(hidden: int, inter: int, layers: int, heads: int, kv: int, head_dim: int) -> dict:
    """Gemma 3 (google/gemma-3-{4b,12b,27b}-it config.json): SigLIP-So400m at 896 px (patch 14), 4x4 average pooling
    to 256 image tokens, Gemma 3 decoder (262,208 vocabulary, tied embeddings, 5 local : 1 global attention)."""
    vision = dict(
        model_type="siglip_vision_model",
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
        vision_use_head=False,
    )
    text = dict(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        vocab_size=262208,
    )
    return {"config": dict(model_type="gemma3", vision_config=vision, text_config=text, mm_tokens_per_image=256)}


def _llava(text: dict) -> dict:
    return {
        "config": dict(
            model_type="llava",
            vision_config=dict(_LLAVA_CLIP_336),
            text_config=text,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default",
            projector_hidden_act="gelu",
            image_seq_length=576,
            tie_word_embeddings=False,
        )
    }


def _qwen3_vl(text: dict, vision: dict, tie: bool, model_type: str = "qwen3_vl") -> dict:
    v = dict(
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_heads=16,
        in_channels=3,
        hidden_act="gelu_pytorch_tanh",
        num_position_embeddings=2304,
        **vision,
    )
    t = dict(
        head_dim=128,
        vocab_size=151936,
        hidden_act="silu",
        rope_theta=5_000_000.0,
        tie_word_embeddings=tie,
        rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        **text,
    )
    return {"config": dict(model_type=model_type, text_config=t, vision_config=v, tie_word_embeddings=tie)}


PLANNER_PRESETS: dict[str, dict] = {
    "qwen2-vl-72b": dict(
        family="qwen2_vl",
        text_config=_text(8192, 29568, 80, 64, 8, 152064, False, 32768, 80),
        vision_config=dict(_QWEN2_VISION, hidden_size=8192),
        tie_word_embeddings=False,
        params=73.4e9,
    ),
    "qwen2.5-vl-32b": dict(
        family="qwen2_5_vl",
        text_config=_text(5120, 27648, 64, 40, 8, 152064, False, 128000, 64),
        vision_config=dict(_QWEN25_VISION, out_hidden_size=5120),
        tie_word_embeddings=False,
        params=33.5e9,
    ),
    "qwen2.5-vl-72b": dict(
        family="qwen2_5_vl",
        text_config=_text(8192, 29568, 80, 64, 8, 152064, False, 128000, 80),
        vision_config=dict(_QWEN25_VISION, out_hidden_size=8192),
        tie_word_embeddings=False,
        params=73.4e9,
    ),
    "qwen3-vl-4b": dict(
        _qwen3_vl(
            dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8),
            dict(depth=24, hidden_size=1024, intermediate_size=4096, out_hidden_size=2560, deepstack_visual_indexes=[5, 11, 17]),
            True,
        ),
        params=4.44e9,
    ),
    "qwen3-vl-8b": dict(
        _qwen3_vl(
            dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8),
            dict(depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=4096, deepstack_visual_indexes=[8, 16, 24]),
            False,
        ),
        params=8.77e9,
    ),
    # Qwen/Qwen3-VL-30B-A3B-Instruct config.json: 48 layers, hidden 2048, 32 heads / 4 KV, 128 experts of width 768,
    # 8 routed per token (no shared expert); the vision tower of the 8B. Published: 31.1B parameters, ~3B active.
    "qwen3-vl-30b-a3b": dict(
        _qwen3_vl(
            dict(
                hidden_size=2048,
                intermediate_size=6144,
                num_hidden_layers=48,
                num_attention_heads=32,
                num_key_value_heads=4,
                num_experts=128,
                num_experts_per_tok=8,
                moe_intermediate_size=768,
                decoder_sparse_step=1,
            ),
            dict(depth=27, hidden_size=1152, intermediate_size=4304, out_hidden_size=2048, deepstack_visual_indexes=[8, 16, 24]),
            False,
            model_type="qwen3_vl_moe",
        ),
        params=31.1e9,
    ),
    # Published totals: 4.3B, 12.2B, 27.4B (model cards of google/gemma-3-*-it).
    "gemma3-4b": dict(_gemma3(2560, 10240, 34, 8, 4, 256), params=4.3e9),
    "gemma3-12b": dict(_gemma3(3840, 15360, 48, 16, 8, 256), params=12.2e9),
    "gemma3-27b": dict(_gemma3(5376, 21504, 62, 32, 16, 128), params=27.4e9),
    "internvl3-1b": dict(_internvl(_qwen2_text(896, 4864, 24, 14, 2, 151674, False)), params=0.94e9),
    "internvl3-2b": dict(_internvl(_qwen2_text(1536, 8960, 28, 12, 2, 151674, False)), params=2.09e9),
    "internvl3-8b": dict(_internvl(_qwen2_text(3584, 18944, 28, 28, 4, 151674, False)), params=7.94e9),
    "llava-1.5-7b": dict(
        _llava(
            dict(
                model_type="llama",
                hidden_size=4096,
                intermediate_size=11008,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=32,
                vocab_size=32064,
            )
        ),
        params=7.06e9,
    ),
    "llava-1.5-13b": dict(
        _llava(
            dict(
                model_type="llama",
                hidden_size=5120,
                intermediate_size=13824,
                num_hidden_layers=40,
                num_attention_heads=40,
                num_key_value_heads=40,
                vocab_size=32064,
            )
        ),
        params=13.35e9,
    ),
    "llava-phi2-clip336": dict(
        _llava(
            dict(
                model_type="phi",
                hidden_size=2560,
                intermediate_size=10240,
                num_hidden_layers=32,
                num_attention_heads=32,
                num_key_value_heads=32,
                vocab_size=51200,
                partial_rotary_factor=0.4,
            )
        ),
        params=3.09e9,
    ),
    "llava-onevision-qwen2-7b": dict(
        {
            "config": dict(
                model_type="llava_onevision",
                vision_config=dict(_SIGLIP_SO400M),
                text_config=_qwen2_text(3584, 18944, 28, 28, 4, 152128, False),
                vision_feature_layer=-1,
                vision_feature_select_strategy="full",
                tie_word_embeddings=False,
            )
        },
        params=8.03e9,
    ),
    "smolvlm-instruct": dict(
        {
            "config": dict(
                model_type="idefics3",
                scale_factor=3,
                vision_config=dict(
                    model_type="idefics3_vision",
                    hidden_size=1152,
                    intermediate_size=4304,
                    num_hidden_layers=27,
                    num_attention_heads=16,
                    image_size=384,
                    patch_size=14,
                ),
                text_config=dict(
                    model_type="llama",
                    hidden_size=2048,
                    intermediate_size=8192,
                    num_hidden_layers=24,
                    num_attention_heads=32,
                    num_key_value_heads=32,
                    vocab_size=49155,
                    tie_word_embeddings=False,
                ),
                tie_word_embeddings=False,
            )
        },
        params=2.25e9,
    ),
}


def _get(name: str) -> dict:
    if name in PLANNER_PRESETS:
        return PLANNER_PRESETS[name]
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; choose one of {', '.join(list(PRESETS) + list(PLANNER_PRESETS))}")
    return PRESETS[name]


def vision_out_size(name: str) -> int:
    """Width of the merger output (what the vision tower hands to the language model)."""
    v = _get(name)["vision_config"]
    return v["out_hidden_size"] if "out_hidden_size" in v else v["hidden_size"]


def _classes(family: str):
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    return Qwen2VLConfig, Qwen2VLForConditionalGeneration


_TOKENIZER = None


def _tokenizer():
    """Our tiny Qwen tokenizer (trained once per process; training is deterministic)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from .tiny import train_tokenizer

        _TOKENIZER = train_tokenizer(family="qwen")
    return _TOKENIZER


def preset_config(name: str, tokenizer=None):
    """The transformers config of preset `name`, special-token ids taken from our tiny tokenizer."""
    from .tiny import _qwen_ids

    spec = _get(name)
    ids = _qwen_ids(tokenizer if tokenizer is not None else _tokenizer())
    config_cls, _ = _classes(spec["family"])
    text = copy.deepcopy(spec["text_config"])
    text.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    mm_ids = {k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    return config_cls(
        text_config=text,
        vision_config=copy.deepcopy(spec["vision_config"]),
        tie_word_embeddings=spec["tie_word_embeddings"],
        **mm_ids,
    )


def hf_config(name: str):
    """The transformers config of preset `name` without our tokenizer (special-token ids left at the config
    class defaults): enough for shapes and parameter counts (the memory planner uses it)."""
    spec = _get(name)
    if "config" in spec:  # presets typed as a whole config.json (model_type + fields)
        from transformers import AutoConfig

        d = copy.deepcopy(spec["config"])
        return AutoConfig.for_model(d.pop("model_type"), **d)
    config_cls, _ = _classes(spec["family"])
    return config_cls(
        text_config=copy.deepcopy(spec["text_config"]),
        vision_config=copy.deepcopy(spec["vision_config"]),
        tie_word_embeddings=spec["tie_word_embeddings"],
    )


def count_parameters_meta(name: str) -> int:
    """Total parameters of preset `name` (tied embeddings counted once), built on the meta device."""
    _, model_cls = _classes(_get(name)["family"])
    config = preset_config(name)
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())  # parameters() already de-duplicates tied weights


@torch.no_grad()
def _fill_random(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """Finite random values without the per-module init machinery: matrices ~ N(0, std), biases 0,
    1-D weights (norms) 1. Uninitialised memory could hold NaN/inf and break sampling."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for pname, p in model.named_parameters():
        if p.ndim >= 2:
            p.normal_(0.0, std, generator=gen)
        elif pname.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)


def build_preset_model(
    name: str,
    out_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
    min_pixels: int = QWEN_MIN_PIXELS,
    max_pixels: int = QWEN_MAX_PIXELS,
) -> Path:
    """Random-weight preset model in out_dir (hub layout: config, safetensors, tokenizer, image processor,
    chat template). The model is created directly in `dtype` on `device` with transformers' weight
    init skipped (`no_init_weights`), then filled with seeded N(0, 0.02) values: seconds on a GPU."""
    from transformers.initialization import no_init_weights

    from .tiny import QWEN_CHAT_TEMPLATE, _finish, _qwen_ids, _qwen_image_processor

    spec = _get(name)
    tokenizer = _tokenizer()
    config = preset_config(name, tokenizer)
    _, model_cls = _classes(spec["family"])
    with torch.device(device), no_init_weights():
        model = model_cls._from_config(config, dtype=dtype)
    _fill_random(model, seed)
    if spec["tie_word_embeddings"]:
        model.tie_weights()
    model.eval()
    ids = _qwen_ids(tokenizer)
    model.generation_config.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    image_processor = _qwen_image_processor(min_pixels, max_pixels)
    out = _finish(out_dir, model, tokenizer, image_processor, QWEN_CHAT_TEMPLATE)
    del model
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return out
