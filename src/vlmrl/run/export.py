"""`vlmrl export`: a checkpoint as a plain Hugging Face folder, on one process.

Nothing read from the checkpoint can run code, and the settings that decide which code loads come only from the
user's command line (export_config)."""

from __future__ import annotations

import torch
from vlmrl.checkpoints.files import (
    CheckpointError,
    SHARDED_DIR,
    find_resume_checkpoint,
    is_sharded_checkpoint,
    read_checkpoint_config,
    verify_checkpoint,
)
from vlmrl.checkpoints.run_manifest import foreign_names, forget, is_run_name, owned_names, record
from vlmrl.checkpoints.state import consolidated_model_state, load_trainable_weights
from vlmrl.config import ConfigError, merge_key, build_config, parse_override
import shutil
from vlmrl.models.loading import resolve_model_path
from pathlib import Path

CODE_LOADING_KEYS = ("trust_remote_code", "allow_hub_download")


def export_config(tree: dict, overrides: list[str] | tuple[str, ...] = (), log=print):
    """The Config `vlmrl export` loads the base model with: the checkpoint's config tree, except that the
    code-loading settings (model.trust_remote_code, model.allow_hub_download) come only from the user's
    `overrides` (key=value, as on the command line; off otherwise), and with any of them on, the model path
    they load code from must come from the overrides too."""

    tree = {section: dict(values) for section, values in (tree or {}).items() if isinstance(values, dict)}
    model = tree.setdefault("model", {})
    ignored = [f"model.{k}" for k in CODE_LOADING_KEYS if model.pop(k, False)]
    if ignored:
        log(
            f"ignoring {', '.join(ignored)}=true from the checkpoint's config.yaml: code-loading settings come only from "
            f"the command line (add them there, with model.name_or_path, if you trust that code)"
        )
    given: dict = {}
    for text in overrides:
        key, value = parse_override(text)
        merge_key(given, key, value, f"argument {text!r}")
    for section, values in given.items():
        tree.setdefault(section, {}).update(values)
    tree.setdefault("training", {})["device"] = "cpu"
    user_model = given.get("model", {})
    if any(user_model.get(k) for k in CODE_LOADING_KEYS) and "name_or_path" not in user_model:
        raise ConfigError(
            "model.trust_remote_code / model.allow_hub_download load code from model.name_or_path: give "
            "model.name_or_path=<folder you trust> on the command line too (vlmrl export never takes it from "
            "the checkpoint folder when code loading is on)"
        )
    return build_config(tree)


def export_folder_entries(out) -> list:
    """The entries of `out` an export replaces (an earlier export's, from its manifest); raises ConfigError in one
    line when `out` is a file, holds anything vlmrl did not write (a user's model folder: config.json,
    model.safetensors), or is a run folder (its checkpoints, final/). Read-only."""

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file, not a folder; give vlmrl export a new or empty folder to write")
    foreign = foreign_names(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(
            f"{out} holds {shown}, which vlmrl did not write; vlmrl export writes only into a new or empty folder, or "
            "one an earlier vlmrl export wrote. Pick another folder; nothing was written"
        )
    owned = owned_names(out) if out.is_dir() else set()
    if any(is_run_name(name) for name in owned):
        raise ConfigError(f"{out} is a vlmrl run folder; export into a new or empty folder (nothing was written)")
    return sorted(out / name for name in owned if (out / name).exists() or (out / name).is_symlink())


def _clear_earlier_export(out, entries: list) -> None:
    """Remove an earlier export's entries (export_folder_entries), so `out` ends up holding this export only."""

    for path in entries:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    forget(out, [p.name for p in entries])


def _check_base_weights(cfg) -> None:
    """The base model's weight files against its config (weight_files.py), before it loads: a damaged or incomplete
    folder is one line, not a traceback or a model with random tensors."""

    from vlmrl.models.weight_files import check_expected_weights, check_weight_files

    folder = Path(resolve_model_path(cfg.model.name_or_path)).expanduser()
    if folder.is_dir():
        check_weight_files(folder)
        check_expected_weights(folder, cfg.model.trust_remote_code)


def export_checkpoint(checkpoint: str, out: str, log=print, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """`vlmrl export`: a checkpoint (or a run folder: its newest valid checkpoint) as a plain HF folder that
    transformers loads: the run's base model with the checkpoint's trainable weights (LoRA merged; the adapter
    also under out/adapter), plus the processor. Checkpoints hold full states (one process, DDP, FSDP2 with
    FULL_STATE_DICT: gathered when written) or, with SHARDED_STATE_DICT, per-process shards consolidated here.
    Nothing read from the checkpoint can run code: weights through safetensors / code-free DCP reading, configs
    as JSON / safe YAML, and code-loading settings only from `overrides` (export_config)."""

    from safetensors.torch import load_file

    from vlmrl.models.loading import save_model
    from vlmrl.models.policy import load_policy

    path = Path(checkpoint)
    export_folder_entries(out)  # refuses a user's folder before anything loads
    if not (path / "manifest.json").exists():
        found = find_resume_checkpoint(path, "auto", warn=log)
        if found is None:
            raise CheckpointError(f"{path} is neither a checkpoint nor a run folder holding a valid one")
        path = found
    ok, reason = verify_checkpoint(path)
    if not ok:
        raise CheckpointError(f"checkpoint {path} is invalid: {reason}")
    # Every engine's checkpoint (DeepSpeed's included: states gathered from the ZeRO partitions) has the single-process
    # layout, or FSDP2's torch.distributed.checkpoint shards.
    cfg = export_config(read_checkpoint_config(path), overrides, log)
    _check_base_weights(cfg)
    model, processor = load_policy(cfg, torch.device("cpu"))
    if is_sharded_checkpoint(path):  # FSDP2 SHARDED_STATE_DICT: consolidated here, on one process
        model.load_state_dict(consolidated_model_state(path / SHARDED_DIR))
    else:
        load_trainable_weights(model, path / "model", load_file)
    earlier = export_folder_entries(out)  # again, just before writing: the folder may have changed while loading
    _clear_earlier_export(Path(out), earlier)
    save_model(model, processor, out)
    record(out, [p.name for p in Path(out).iterdir()])  # the manifest: a later export may replace all of this
    log(f"exported {path} to {out}")
    return out
