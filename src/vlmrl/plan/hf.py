"""A ModelSpec from a Hugging Face VLM config: the architecture instantiated on the meta device (no memory) to count
parameters, its dimensions read off the config (vision tower, tiling, MoE, Qwen3.5's hybrid decoder), and the bundled
presets. torch / transformers are imported lazily (the planner's arithmetic does not need them)."""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from vlmrl.families import family_of
from vlmrl.plan.spec import ModelSpec, PlanError


def _dims(obj, *names, default=None):
    for n in names:
        v = getattr(obj, n, None)
        if v is not None:
            return v
    return default


@lru_cache(maxsize=64)
def _spec_cached(config_json: str, name: str) -> ModelSpec:
    from transformers import AutoConfig

    d = json.loads(config_json)
    cfg = AutoConfig.for_model(**d)
    return _spec_from_config_object(cfg, name)


def spec_from_hf_config(config: Any, name: str = "") -> ModelSpec:
    """ModelSpec of a HF VLM config (PretrainedConfig, a dict, or a path to config.json / a model folder):
    the architecture is instantiated on the meta device (no memory) to count parameters."""
    if isinstance(config, (str, Path)):
        p = Path(config)
        p = p / "config.json" if p.is_dir() else p
        if not p.is_file():
            raise PlanError(f"{config}: no such config.json (give a preset name, a model folder or a config.json path)")
        try:
            d = json.loads(p.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlanError(f"{p}: not a JSON config ({e}); give a model's config.json") from None
        return _known_architecture(d, str(p), name or p.parent.name)
    if isinstance(config, dict):
        return _known_architecture(config, "config", name or config.get("model_type", "model"))
    return _spec_from_config_object(config, name or getattr(config, "model_type", "model"))


def _known_architecture(d: dict, where: str, name: str) -> ModelSpec:
    """The spec of a config dict; one PlanError line (not transformers' traceback) when transformers cannot
    build it as an image-text model."""
    model_type = d.get("model_type") if isinstance(d, dict) else None
    how = (
        "pass the config.json of an architecture this transformers knows as an image-text model (model_type such as "
        "qwen2_5_vl, qwen2_vl, qwen3_vl, llava, llava_onevision, internvl, idefics3), or a preset (vlmrl plan --list-models)"
    )
    if not model_type:
        raise PlanError(f"{where}: no model_type in the config; {how}")
    try:
        return _spec_cached(json.dumps(d, sort_keys=True), name)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        import transformers

        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if first.startswith("Unrecognized model identifier"):
            first = "an architecture it does not know"
        elif first.startswith("Unrecognized configuration class"):
            first = "not an image-text model"
        elif len(first) > 120:
            first = first[:117] + "..."
        raise PlanError(
            f"{where}: model_type {model_type!r} cannot be planned with transformers {transformers.__version__} ({first}); {how}"
        ) from None


def _spec_from_config_object(cfg, name: str) -> ModelSpec:
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.loading import output_head, unwrap

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    core = unwrap(model)
    counts, vt = _param_counts(model)
    emb = core.get_input_embeddings()
    head = output_head(model)
    t = cfg.get_text_config()
    heads = t.num_attention_heads
    v = getattr(cfg, "vision_config", None)
    kw = _vision_dims(cfg, v) if v is not None else {}
    moe = _decoder_dims(cfg, t, core)
    return ModelSpec(
        name=name,
        family=getattr(cfg, "model_type", ""),
        **counts,
        embed_params=emb.weight.numel(),
        lm_head_params=0 if head.weight is emb.weight else head.weight.numel(),
        hidden=t.hidden_size,
        intermediate=moe.pop("intermediate", None) or getattr(t, "intermediate_size", 0) or 0,
        layers=t.num_hidden_layers,
        heads=heads,
        kv_heads=_dims(t, "num_key_value_heads", default=heads),
        head_dim=_dims(t, "head_dim", default=None) or t.hidden_size // heads,
        vocab=t.vocab_size,
        lora_linears=_lora_linears(core, vt, head),
        **kw,
        **moe,
    )


def _param_counts(model) -> tuple[dict, Any]:
    """({total_params, vision_params, projector_params}, the vision tower or None) of a meta-device model: a
    LLaVA-style projector outside the tower counts with vision."""
    from vlmrl.models.loading import ModelLoadError, projector, vision_tower

    total = sum(p.numel() for p in model.parameters())
    try:
        vt = vision_tower(model)
        vision = sum(p.numel() for p in vt.parameters())
    except ModelLoadError:
        vt, vision = None, 0
    try:
        proj = projector(model)
        proj_n = sum(p.numel() for p in proj.parameters())
        inside = {id(p) for p in vt.parameters()} if vt is not None else set()
        if not all(id(p) in inside for p in proj.parameters()):
            vision += proj_n
    except ModelLoadError:
        proj_n = 0
    return {"total_params": total, "vision_params": vision, "projector_params": proj_n}, vt


def _lora_linears(core, vt, head) -> tuple:
    """((suffix, in_features, out_features, count), ...) of the language model's Linear layers (LoRA's targets)."""
    import torch

    linears: dict[tuple, int] = {}
    vision_ids = {id(m) for m in vt.modules()} if vt is not None else set()
    for mname, m in core.named_modules():
        if isinstance(m, torch.nn.Linear) and id(m) not in vision_ids and m is not head:
            key = (mname.rsplit(".", 1)[-1], m.in_features, m.out_features)
            linears[key] = linears.get(key, 0) + 1
    return tuple((s, i, o, c) for (s, i, o), c in sorted(linears.items()))


def _vision_dims(cfg, v) -> dict:
    """The vision tower's ModelSpec fields: widths, depth, patch / merge / temporal patch, Qwen2.5-VL's windows, and
    for fixed-resolution towers their image size and token reduction."""
    family = family_of(getattr(cfg, "model_type", ""))
    vh = _dims(v, "hidden_size", "embed_dim", default=0)
    kw: dict = {}
    if family.vision_width_key:  # Qwen2-VL: embed_dim (its hidden_size is the LLM's)
        vh = getattr(v, family.vision_width_key)
    if family.vision_mlp_gated is not None:  # Qwen2-VL: fc1 -> quick_gelu -> fc2
        kw["v_mlp_gated"] = family.vision_mlp_gated
    vi = _dims(v, "intermediate_size", default=None) or int(vh * _dims(v, "mlp_ratio", default=4))
    kw.update(
        v_hidden=vh,
        v_intermediate=vi,
        v_layers=_dims(v, "depth", "num_hidden_layers", default=0),
        v_heads=_dims(v, "num_heads", "num_attention_heads", default=1),
        patch_size=_dims(v, "patch_size", default=14),
        merge_size=_dims(v, "spatial_merge_size", default=1),
        temporal_patch=_dims(v, "temporal_patch_size", default=1),
    )
    if getattr(v, "fullatt_block_indexes", None) is not None and getattr(v, "window_size", None):
        kw["v_full_attn_blocks"] = len(v.fullatt_block_indexes)  # Qwen2.5-VL: windowed attention elsewhere
        kw["v_window_patches"] = (v.window_size // kw["patch_size"]) ** 2
    if not family.dynamic_resolution:
        kw.update(_fixed_resolution_dims(cfg, v, kw["patch_size"]))
    return kw


def _fixed_resolution_dims(cfg, v, patch) -> dict:
    """Fixed-resolution towers (CLIP / SigLIP / InternViT): image size, patch, the token reduction after the tower
    (InternVL pixel shuffle: downsample_ratio 0.5 -> 4x fewer; Idefics3 / SmolVLM scale_factor 3 -> 9x fewer; LLaVA
    keeps every patch, the CLS token dropped; Gemma 3 average-pools to a fixed token count) and tiling."""
    size = _dims(v, "image_size", default=336)
    kw: dict = {
        "image_size": size[0] if isinstance(size, (list, tuple)) else size,
        "patch_size": patch[0] if isinstance(patch, (list, tuple)) else patch,
    }
    ratio = getattr(cfg, "downsample_ratio", None)
    kw["merge_size"] = round(1 / ratio) if ratio else int(getattr(cfg, "scale_factor", 1) or 1)
    kw.update(_tiling_dims(cfg))
    if getattr(cfg, "mm_tokens_per_image", None):
        kw["merge_size"] = round(math.sqrt((kw["image_size"] // kw["patch_size"]) ** 2 / cfg.mm_tokens_per_image))
    return kw


def _decoder_dims(cfg, t, core) -> dict:
    """The decoder's ModelSpec fields beyond its widths: MoE (_moe_dims), Gemma 3's four norms per layer, Qwen3.5's
    hybrid decoder (Gated DeltaNet + gated full attention)."""
    moe = _moe_dims(t, core)
    family = family_of(getattr(cfg, "model_type", ""))
    if family.norms_per_layer:
        moe["norms_per_layer"] = family.norms_per_layer
    if family.linear_attention:
        layer_types = getattr(t, "layer_types", None) or ()
        moe.update(
            gated_attention=True,
            linear_attn_layers=sum(kind == "linear_attention" for kind in layer_types),
            linear_k_heads=t.linear_num_key_heads,
            linear_v_heads=t.linear_num_value_heads,
            linear_k_dim=t.linear_key_head_dim,
            linear_v_dim=t.linear_value_head_dim,
            linear_conv_kernel=t.linear_conv_kernel_dim,
            first_layer_linear=bool(layer_types) and layer_types[0] == "linear_attention",
        )
    return moe


def _tiling_dims(cfg) -> dict:
    """The tiled families' ModelSpec fields: LLaVA-OneVision anyres (pinpoints, anyres_max_N), InternVL dynamic tiles;
    both towers (SigLIP, InternViT: no RoPE, fc1 -> GELU -> fc2) keep 20 hv + 4 iv per patch, read off the trace
    (internvl3-1b, llava-onevision-qwen2-7b)."""
    tiling = family_of(getattr(cfg, "model_type", "")).tiling
    if tiling is None:
        return {}
    kw: dict = {"v_block_hidden": 20, "v_mlp_gated": False}
    if tiling == "dynamic":
        kw["tiling"] = "dynamic"  # tiles of image_size, up to ModelSpec.max_tiles (the processor's max_patches)
    elif tiling == "anyres" and getattr(cfg, "image_grid_pinpoints", None):
        kw["tiling"] = "anyres"
        kw["tile_pinpoints"] = tuple(tuple(p) for p in cfg.image_grid_pinpoints)
        kw["anyres_max_tiles"] = int(str(getattr(cfg, "vision_aspect_ratio", "anyres_max_9")).rsplit("_", 1)[-1])
    return kw


def _moe_dims(text_config, core) -> dict:
    """MoE decoders: routed-expert parameters, the fraction a token uses, and the MLP width one token's activations
    see (top_k routed experts + the shared expert) in place of the dense intermediate_size."""
    experts = getattr(text_config, "num_experts", 0) or 0
    top_k = getattr(text_config, "num_experts_per_tok", 0) or 0
    if not experts or not top_k:
        return {}
    routed = sum(p.numel() for n, p in core.named_parameters() if ".mlp.experts." in n)
    width = top_k * text_config.moe_intermediate_size + (getattr(text_config, "shared_expert_intermediate_size", 0) or 0)
    return {"routed_expert_params": routed, "experts_active_fraction": top_k / experts, "intermediate": width}


def model_spec(model: str) -> ModelSpec:
    """A bundled preset name, or a path to a model folder / config.json."""
    from vlmrl.plan.presets import PLANNER_PRESETS, PRESETS

    if model in PRESETS or model in PLANNER_PRESETS:
        return _preset_spec(model)
    if Path(model).exists():
        return spec_from_hf_config(model)
    names = sorted(PRESETS) + sorted(PLANNER_PRESETS)
    raise PlanError(f"unknown model {model!r}: give a preset ({', '.join(names)}) or a path to a config.json")


@lru_cache(maxsize=32)
def _preset_spec(name: str) -> ModelSpec:
    from vlmrl.plan.presets import hf_config

    return spec_from_hf_config(hf_config(name), name)


def parameter_sizes(model) -> tuple:
    """((elements, count), ...) of a model's parameters in registration order, runs of equal sizes merged (the
    order DeepSpeed ZeRO-3 meets them in: deepspeed.zero3_persistent_parameters)."""
    runs: list[list[int]] = []
    for p in model.parameters():
        if runs and runs[-1][0] == p.numel():
            runs[-1][1] += 1
        else:
            runs.append([p.numel(), 1])
    return tuple((n, c) for n, c in runs)
