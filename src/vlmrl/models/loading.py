"""Load any local Hugging Face VLM, choose what trains (freezing, LoRA), and save plain HF folders.

Family-agnostic part finders (`vision_tower`, `projector`, `language_model`, `output_head`) work
for Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-style models (LLaVA, LLaVA-NeXT, Gemma3, Mistral3, ...)
and Idefics3/SmolVLM, with or without a peft wrapper, and with both the transformers 5 layout
(`model.model.visual`) and the older one (`model.visual`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from vlmrl.config import EMBEDDED_MODEL
from vlmrl.tiny_models.tiny import default_model_path

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
NO_DOWNLOAD = "vlmrl never downloads models unless model.allow_hub_download=true"


class ModelLoadError(Exception):
    """A model folder is missing, incomplete, or cannot be loaded as configured."""


# ---------------------------------------------------------------- loading


def _check_folder(path: str) -> None:
    """Fail early, naming the path and what is missing, before transformers tries the hub."""
    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelLoadError(f"model folder {folder} does not exist ({NO_DOWNLOAD}; point model.name_or_path at a local folder)")
    if not folder.is_dir():
        raise ModelLoadError(f"model path {folder} is not a folder ({NO_DOWNLOAD})")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"model folder {folder} has no config.json ({NO_DOWNLOAD})")
    if not any(next(folder.glob(p), None) for p in WEIGHT_PATTERNS):
        raise ModelLoadError(f"model folder {folder} has no weight files (*.safetensors or *.bin) ({NO_DOWNLOAD})")
    refuse_pickled_weights(folder)


def refuse_pickled_weights(folder: Path) -> None:
    """ModelLoadError when the folder's weights are pickled only (pytorch_model*.bin): unpickling can run code the
    file ships, so vlmrl loads safetensors only. The message carries the conversion command (for a file you trust)."""
    if next(folder.glob("*.safetensors"), None) is not None or next(folder.glob("*.bin"), None) is None:
        return
    convert = (
        f"python -c \"from transformers import AutoModelForImageTextToText as M; M.from_pretrained('{folder}', use_safetensors=False)"
        f".save_pretrained('{folder}-safetensors')\" and copy the tokenizer/processor files beside it"
    )
    raise ModelLoadError(
        f"model folder {folder} holds pickled weights only ({next(folder.glob('*.bin')).name}); vlmrl loads safetensors only "
        f"(unpickling can run code). If you trust the file, convert it: {convert}"
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model", "sentencepiece.bpe.model")


def check_model_folder(path: str | Path) -> list[str]:
    """What a local model folder lacks for vlmrl to train and prompt it, as one phrase per missing piece ([] = complete).

    Looked for: config.json; weights (*.safetensors / *.bin, and every shard an index names); the image processor
    (preprocessor_config.json, or an ``image_processor`` entry in processor_config.json); tokenizer files
    (tokenizer.json, or a vocabulary such as tokenizer.model / vocab.json with merges.txt); a chat template
    (chat_template.jinja / chat_template.json, or ``chat_template`` in tokenizer_config.json / processor_config.json).
    Without a chat template prompts cannot be built; without the image processor no image reaches the model.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return [f"the folder itself ({folder} does not exist)" if not folder.exists() else f"a folder ({folder} is a file)"]
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    missing += _missing_weights(folder)
    processor_cfg = _read_json(folder / "processor_config.json")
    if not (folder / "preprocessor_config.json").is_file() and "image_processor" not in processor_cfg:
        missing.append("image processor config (preprocessor_config.json)")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        missing.append("tokenizer files (tokenizer.json, or tokenizer.model / vocab.json)")
    elif (folder / "vocab.json").is_file() and not (folder / "tokenizer.json").is_file() and not (folder / "merges.txt").is_file():
        missing.append("merges.txt (vocab.json without tokenizer.json needs it)")
    has_template = (
        (folder / "chat_template.jinja").is_file()
        or (folder / "chat_template.json").is_file()
        or _read_json(folder / "tokenizer_config.json").get("chat_template")
        or processor_cfg.get("chat_template")
    )
    if not has_template:
        missing.append("a chat template (chat_template.jinja, or chat_template in tokenizer_config.json)")
    return missing


def _missing_weights(folder: Path) -> list[str]:
    if not any(next(folder.glob(p), None) for p in WEIGHT_PATTERNS):
        return ["weight files (*.safetensors or *.bin)"]
    out = []
    for index in sorted(folder.glob("*.index.json")):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            out.append(f"a readable {index.name} (it is not JSON with a weight_map)")
            continue
        shards = sorted(set(weight_map.values()))
        absent = [name for name in shards if not (folder / name).is_file()]
        if absent:
            out.append(f"weight shards named in {index.name}: {', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''}")
    return out


def _read_json(path: Path) -> dict:
    """A JSON object from a file; {} when absent or not an object (an unreadable file is reported by the loader)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def require_complete_model_folder(path: str | Path) -> None:
    """ModelLoadError naming everything `check_model_folder` finds missing, before any loading starts."""
    missing = check_model_folder(path)
    if not missing:
        refuse_pickled_weights(Path(path).expanduser())
    if missing:
        raise ModelLoadError(f"model folder {Path(path).expanduser()} is incomplete: missing {'; '.join(missing)} ({NO_DOWNLOAD})")


def check_attention(name: str) -> None:
    """ModelLoadError when model.attn_implementation names a kernel whose package is not installed."""
    if name == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ModelLoadError(
            "model.attn_implementation=flash_attention_2 but the flash-attn package is not installed; "
            "install it (pip install flash-attn, CUDA only) or use model.attn_implementation=sdpa"
        )


def load_model(cfg):
    """AutoModelForImageTextToText from cfg.name_or_path, then freezing, gradient checkpointing, LoRA."""
    from transformers import AutoModelForImageTextToText

    path = str(cfg.name_or_path)
    local_only = not getattr(cfg, "allow_hub_download", False)
    if local_only:
        _check_folder(path)
    check_attention(cfg.attn_implementation)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.dtype)
    if dtype is None:
        raise ModelLoadError(f"model.dtype={cfg.dtype!r} is not one of float32, bfloat16, float16")
    try:
        model = AutoModelForImageTextToText.from_pretrained(
            path,
            dtype=dtype,
            attn_implementation=cfg.attn_implementation,
            local_files_only=local_only,
            trust_remote_code=cfg.trust_remote_code,
        )
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelLoadError(f"could not load {path} with AutoModelForImageTextToText: {type(e).__name__}: {e}") from e
    return prepare_trainable(model, cfg)


def prepare_trainable(model: nn.Module, cfg) -> nn.Module:
    """Freezing, activation checkpointing and LoRA as `cfg` (a ModelConfig) says; returns the model to train."""
    apply_freezing(model, cfg)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    if cfg.use_lora:
        model = apply_lora(model, cfg)
        if cfg.gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing (works with frozen inputs and with LoRA)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def apply_freezing(model: nn.Module, cfg) -> None:
    """train_projector_only: only the projector trains; freeze_vision_tower: all but the vision encoder."""
    if cfg.train_projector_only:
        model.requires_grad_(False)
        projector(model).requires_grad_(True)
    elif cfg.freeze_vision_tower:
        vision_tower(model).requires_grad_(False)
        # Qwen-VL's merger lives inside the vision tower: re-enable it after freezing the tower.
        projector(model).requires_grad_(True)


# ---------------------------------------------------------------- part finders


def unwrap(model: nn.Module) -> nn.Module:
    """The HF *ForConditionalGeneration under a peft wrapper (LoRA layers stay injected)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _first_attr(objs: list, names: tuple[str, ...]):
    for obj in objs:
        for name in names:
            found = getattr(obj, name, None) if obj is not None else None
            if isinstance(found, nn.Module):
                return found
    return None


def _holders(model: nn.Module) -> list:
    """Modules that may hold the parts: model.model (transformers 5) and the model itself (4.x)."""
    base = unwrap(model)
    inner = getattr(base, "model", None)
    return [inner if isinstance(inner, nn.Module) else None, base]


def _unknown(model: nn.Module, part: str) -> ModelLoadError:
    return ModelLoadError(
        f"cannot find the {part} of {type(unwrap(model)).__name__}: vlmrl knows Qwen2-VL, Qwen2.5-VL, Qwen3-VL, "
        "LLaVA-style (vision_tower + multi_modal_projector), Idefics3-style (vision_model + connector) and Gemma 4 (vision_tower + "
        "embed_vision) models"
    )


def vision_tower(model: nn.Module) -> nn.Module:
    """The vision encoder (for Qwen-VL it contains the merger, see `projector`)."""
    found = _first_attr(_holders(model), ("visual", "vision_tower", "vision_model"))
    if found is None:
        raise _unknown(model, "vision tower")
    return found


def projector(model: nn.Module) -> nn.Module:
    """The vision-to-language projector: Qwen-VL's merger(s), LLaVA's multi_modal_projector, ERNIE-4.5-VL's
    resampler_model, MiniCPM-V's merger (next to its vision tower), Gemma 4's embed_vision."""
    found = _first_attr(_holders(model), ("multi_modal_projector", "mm_projector", "connector", "resampler_model", "merger", "embed_vision"))
    if found is not None:
        return found
    visual = _first_attr(_holders(model), ("visual",))
    if visual is not None and isinstance(getattr(visual, "merger", None), nn.Module):
        deepstack = getattr(visual, "deepstack_merger_list", None)  # Qwen3-VL's extra mergers
        if isinstance(deepstack, nn.ModuleList) and len(deepstack):
            return nn.ModuleList([visual.merger, *deepstack])
        return visual.merger
    raise _unknown(model, "projector")


def language_model(model: nn.Module) -> nn.Module:
    """The text decoder (embeddings, layers, norm); the LM head is `output_head`."""
    holders = _holders(model)
    found = _first_attr(holders, ("language_model", "text_model"))
    if found is None and holders[0] is not None and _first_attr([unwrap(model)], ("visual",)) is not None:
        found = holders[0]  # transformers 4.x Qwen-VL: model.model is the text decoder
    if found is None:
        raise _unknown(model, "language model")
    return found


def output_head(model: nn.Module) -> nn.Module:
    """The LM head (vocabulary projection)."""
    head = unwrap(model).get_output_embeddings()
    if head is None:
        raise _unknown(model, "LM head")
    return head


# ---------------------------------------------------------------- LoRA


def lora_target_names(model: nn.Module, targets: list[str], lora_vision: bool) -> list[str]:
    """Full names of the Linear layers that get LoRA.

    Language model: Linear layers whose last name part is in `targets` ("all-linear" = every one).
    Vision tower: every Linear layer when lora_vision, none otherwise. Never the projector or LM head,
    so disabling the adapters gives back exactly the base model (the reference policy).
    """
    vision_ids = {id(m) for m in vision_tower(model).modules()}
    skip_ids = {id(m) for m in projector(model).modules()} | {id(output_head(model))}
    all_linear = "all-linear" in targets
    names = []
    for name, module in unwrap(model).named_modules():
        if not isinstance(module, nn.Linear) or id(module) in skip_ids:
            continue
        if id(module) in vision_ids:
            if lora_vision:
                names.append(name)
        elif all_linear or name.rsplit(".", 1)[-1] in targets:
            names.append(name)
    return names


def apply_lora(model: nn.Module, cfg) -> nn.Module:
    """peft LoRA on the configured modules; every other weight is frozen."""
    from peft import LoraConfig, get_peft_model

    names = lora_target_names(model, list(cfg.lora_target_modules), cfg.lora_vision)
    if not names:
        raise ModelLoadError(
            f"model.lora_target_modules={list(cfg.lora_target_modules)} matched no Linear layer of the language model of {type(model).__name__}"
        )
    parameters = lora_target_parameter_names(model, list(getattr(cfg, "lora_target_parameters", []) or []))
    extra = {"target_parameters": parameters} if parameters else {}
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=names, bias="none", **extra)
    return get_peft_model(model, lora)


def lora_target_parameter_names(model: nn.Module, suffixes: list[str]) -> list[str]:
    """Full names of the language model's nn.Parameters (not inside an nn.Linear) that end in one of `suffixes`: the
    fused expert weights of MoE decoders, which model.lora_target_modules cannot reach. A suffix matching nothing is
    refused in one line (a typo would otherwise train no expert and say nothing)."""
    if not suffixes:
        return []
    vision_ids = {id(p) for p in vision_tower(model).parameters()}
    found = {s: [] for s in suffixes}
    for name, param in unwrap(model).named_parameters():
        if id(param) in vision_ids:
            continue
        for s in suffixes:
            if name == s or name.endswith("." + s):
                found[s].append(name)
    missing = [s for s, hits in found.items() if not hits]
    if missing:
        raise ModelLoadError(
            f"model.lora_target_parameters: {missing} matched no parameter of the language model of {type(model).__name__} "
            "(expected name suffixes such as mlp.experts.gate_up_proj)"
        )
    return sorted({n for hits in found.values() for n in hits})


def has_lora(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


@contextlib.contextmanager
def reference_disabled_adapter(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block the LoRA model computes the base (reference) policy; yields the model."""
    if not has_lora(model):
        raise ValueError("reference_disabled_adapter needs a peft LoRA model; without LoRA keep a frozen reference copy")
    with model.disable_adapter():
        yield model


# ---------------------------------------------------------------- saving and counting


def save_model(model: nn.Module, processor, out_dir: str | Path, merge_lora: bool = True) -> Path:
    """Save a folder plain transformers loads: safetensors weights, config, processor/tokenizer.

    With LoRA the adapters are merged into a copy (the training model keeps its adapters) and the
    adapter alone is also saved under out_dir/adapter/. merge_lora=False saves only the adapter.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if has_lora(model):
        model.save_pretrained(out / "adapter")
        if merge_lora:
            # deepcopy briefly doubles the model's memory; merging in place would round the live
            # weights in bf16 when unmerged again.
            merged = copy.deepcopy(model).merge_and_unload()
            merged.save_pretrained(out, safe_serialization=True)
            del merged
    else:
        unwrap(model).save_pretrained(out, safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(out)
    return out


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return trainable, total


def resolve_model_path(name_or_path: str) -> str:
    if name_or_path == EMBEDDED_MODEL:
        return str(default_model_path())
    return name_or_path
