"""A GRPO run's state on disk: restore it from a checkpoint, save a checkpoint, write the final model.

Atomic checkpoint folders, manifests and safe loading are checkpoint.py; this module knows what a run's state is
(weights, optimizer, scheduler, sampler, RNG per process). What differs per engine (gathered full states or
per-process torch.distributed.checkpoint shards under FSDP2) is the engine's `save_state` / `load_state` /
`write_final` (engines.py); this module never asks which engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from vlmrl.config import Config, TrainingConfig
from vlmrl.checkpoints.files import (
    CheckpointError,
    CheckpointSaveError,
    SHARDED_DIR,
    is_sharded_checkpoint,
    is_weights_only,
    load_training_state,
    read_trainer_state,
    restore_rng,
    save_checkpoint,
)
from vlmrl.checkpoints.fingerprints import run_fingerprints
from vlmrl.checkpoints.safe_load import dcp_load, dcp_read_all
from vlmrl.config import to_dict
from vlmrl.models.loading import unwrap
import torch.distributed as tdist


def restore(path: Path, t: TrainingConfig, model, optimizer, scheduler, sampler, log, dist=None) -> dict:
    """Load weights, optimizer, scheduler, sampler and RNG from a checkpoint (`t`: cfg.training); returns the loop state.
    Every process loads the same full state (output_dir on a file system they all see); each its own RNG."""
    from safetensors.torch import load_file

    # The config compatibility check ran in rundir.prepare_run, before anything was written.
    saved_world = int(read_trainer_state(path).get("world_size", 1))
    if dist is not None and saved_world != dist.world_size:
        # Checkpoints hold full (consolidated) states and the sampler is global, so a new world size continues the
        # same run; batch sizes are global, so the math does not change either.
        log(
            f"resuming {path} (saved by {saved_world} process(es)) on {dist.world_size}: model, optimizer, scheduler "
            f"and sampler are full copies; RNG streams of processes the checkpoint has no file for start fresh"
        )
    sharded = is_sharded_checkpoint(path)  # weights and optimizer load after the engine wraps the model (restore_after_wrap)
    if not sharded:
        load_trainable_weights(model, path / "model", load_file)
    if is_weights_only(path):
        if not t.resume_weights_only:
            raise CheckpointError(
                f"{path} holds weights only (save_only_model); it cannot resume a run exactly. "
                "Set training.resume_weights_only=true to start a NEW schedule from its weights."
            )
        log(f"WARNING: starting a new schedule (step 0, fresh optimizer) from the weights of {path}")
        return {"step": 0, "best_metric": None, "best_step": None}
    # FSDP2 loads the optimizer after sharding (restore_after_wrap): its state must follow the sharded parameters.
    after_wrap = sharded or (dist is not None and dist.engine.optimizer_loads_after_wrap)
    ts = load_training_state(path, None if after_wrap else optimizer, scheduler)
    sampler.load_state_dict(ts["sampler_state"])
    if dist is None or dist.world_size == 1:
        restore_rng(path, warn=log)
    else:
        dist.restore_rng(path, saved_world, t.seed, log)
    log(f"resumed from {path} at step {ts['global_step']} (epoch {ts['epoch']}, {ts['samples_consumed']} prompts consumed)")
    out = {"step": ts["global_step"], "best_metric": ts.get("best_metric"), "best_step": ts.get("best_step")}
    if ts.get("sizes"):
        out["sizes"] = ts["sizes"]  # micro-batch sizes that OOM recovery settled on
    if ts.get("stage"):
        out["stage"] = ts["stage"]
    if isinstance(ts.get("per_prompt_seed"), bool):
        out["per_prompt_seed"] = ts["per_prompt_seed"]
    if ts.get("rollout_queue"):
        out["rollout_queue"] = ts["rollout_queue"]  # the rollout pipeline's queued steps (rollout/pipeline.py)
    return out


def resolve_sampling_seed(mode: str, world_size: int, state: dict, log=print) -> bool:
    """Whether rollouts draw one sampling stream per prompt (True) or one per step and process, recorded in
    `state` (and so in every checkpoint). `prompt` / `step` say it; `auto` picks per prompt on several processes
    and per step on one, but a resumed run keeps what its checkpoint used: a 2-process run resumed on 1 process
    keeps per-prompt streams and continues bit-exact. A per-step run (started on one process) resumed on several
    cannot: its samples depend on the world size, which is said in one line."""
    saved = state.get("per_prompt_seed")
    if mode == "auto" and isinstance(saved, bool):
        chosen = saved
    else:
        chosen = mode == "prompt" or (mode == "auto" and world_size > 1)
    if not chosen and world_size > 1 and state.get("step"):
        log(
            f"note: rollout.sampling_seed={mode} draws one stream per step and process, so this resume on {world_size} "
            "processes samples differently than the run would have on its own world size (sampling_seed=prompt is world-size invariant)"
        )
    state["per_prompt_seed"] = chosen
    return chosen


def restore_after_wrap(path: Path, optimizer, dist) -> None:
    """What loads after the engine has wrapped the model: a SHARDED checkpoint's torch.distributed.checkpoint files
    (weights and optimizer, re-sharded for any world size), or under FSDP2 the full optimizer state (read by the
    main process) scattered into the shards. Nothing otherwise (restore loaded it all)."""
    dist.engine.load_state(path, optimizer)


@dataclass
class CheckpointParts:
    """What one checkpoint holds, as save_checkpoint takes it: a function writing the weights into a folder, an
    object whose state_dict() is the optimizer state (None: no optimizer file), extra trainer_state entries."""

    save_weights: Callable[[Path], None]
    optimizer: Any
    trainer_state: dict = field(default_factory=dict)


def save(
    cfg: Config, out: Path, step: int, model, optimizer, scheduler, sampler, state: dict, log, dist=None, rows_per_step: int | None = None
) -> None:
    """One atomic checkpoint written by the main process: full model and optimizer (all processes hold the same
    ones under DDP; FSDP2 gathers them to the main process first, so the checkpoint has the single-process layout
    and resumes on any world size), the global sampler, and every process's RNG stream (rng_state_<rank>.pt).
    `rows_per_step`: dataset rows each step draws (default GRPO's prompts per step); state["stage"] (SFT) is kept."""

    t = cfg.training
    trainer_state = {
        # data files, reward sources and the rows' image files: a resume refuses when they changed
        "fingerprints": {**run_fingerprints(cfg), **({"images": state["images"]} if state.get("images") else {})},
        "epoch": sampler.epoch,
        "samples_consumed": step * (cfg.prompts_per_step if rows_per_step is None else rows_per_step),
        "sampler_state": sampler.state_dict(),
        "best_metric": state["best_metric"],
        "best_step": state["best_step"],
        "sizes": state.get("sizes"),
        **({"stage": state["stage"]} if state.get("stage") else {}),  # SFT: the stage whose optimizer this holds
        "per_prompt_seed": state.get("per_prompt_seed"),  # rollout.sampling_seed as resolved: kept on resume (resolve_sampling_seed)
        **({"rollout_queue": state["rollout_queue"]} if state.get("rollout_queue") else {}),  # rollout.max_staleness > 0
    }
    many = dist is not None and dist.world_size > 1
    parts = CheckpointParts(save_weights=lambda p: save_trainable_weights(model, p), optimizer=optimizer)
    if many:
        try:  # every process takes part (FSDP2 gathers the full states or writes its shards)
            parts = dist.engine.save_state(out, step, model, optimizer, t.save_only_model) or parts
        except CheckpointSaveError as e:  # raised on every process alike
            return on_save_error(e, t, log)
        trainer_state.update(world_size=dist.world_size, engine=dist.engine.name, **parts.trainer_state)
    rng_states = dist.gather_rng_states() if many else None  # every process takes part
    error = None
    if not many or dist.is_main:
        try:
            save_checkpoint(
                out,
                step,
                save_model=parts.save_weights,
                optimizer=parts.optimizer,
                scheduler=scheduler,
                trainer_state=trainer_state,
                config=to_dict(cfg),
                weights_only=t.save_only_model,
                save_total_limit=t.save_total_limit,
                warn=log,
                rng_states=rng_states,
            )
        except CheckpointSaveError as e:
            error = e
    if many:
        message = dist.broadcast(str(error) if error else None)  # every process stops, or none does
        error = error or (CheckpointSaveError(message) if message else None)
    if error is not None:
        on_save_error(error, t, log)


def on_save_error(error, training, log, what: str = "the previous checkpoint stays the newest") -> None:
    """training.on_save_error: stop -> raise the CheckpointSaveError (the CLI prints it, exit 2); continue -> warn."""
    if training.on_save_error == "stop":
        raise error
    log(f"WARNING: {error}; going on (training.on_save_error=continue), {what}")


def move_sharded_state(staging: Path, model_dir: Path, model) -> None:
    """Into a checkpoint being written: the processes' shards as <checkpoint>/sharded, the model config in model/."""

    staging.rename(model_dir.parent / SHARDED_DIR)
    unwrap(model).config.save_pretrained(model_dir)


class FullState:
    """A gathered optimizer state (FSDP2) where save_checkpoint expects an optimizer: state_dict() returns it."""

    def __init__(self, state: dict | None):
        self.state = state

    def state_dict(self) -> dict | None:
        return self.state


def save_final(model, processor, folder: Path, dist, save_model, cfg: Config | None = None, log=print) -> None:
    """output_dir/final as a plain HF folder, written by the main process. FSDP2: the weights are gathered to the
    main process, which loads them into an unsharded CPU copy of the policy (LoRA merged from there). Written
    under a temporary name and swapped in (a failure leaves no half folder); a storage error follows
    training.on_save_error on every process (stop: CheckpointSaveError; continue: a warning, no final model)."""

    error = None
    try:
        dist.engine.write_final(model, processor, folder, save_model, cfg)
    except CheckpointSaveError as e:
        error = e
    if dist.world_size > 1:
        message = dist.broadcast(str(error) if error else None)  # every process stops, or none does
        error = error or (CheckpointSaveError(message) if message else None)
    dist.barrier()
    if error is not None:
        if cfg is None:
            raise error
        on_save_error(
            error, cfg.training, log if dist.is_main else (lambda *_: None), "the run has no final model (the last checkpoint, if any, is intact)"
        )


def save_trainable_weights(model, folder: Path, state_dict: dict | None = None) -> None:
    """HF format: the full model for full fine-tuning, only the adapter for LoRA (peft's save_pretrained).
    `state_dict`: the model's full state gathered from sharded parameters (FSDP2) instead of its own."""
    model.save_pretrained(folder, safe_serialization=True, state_dict=state_dict)  # None: the model's own


def load_trainable_weights(model, folder: Path, load_file) -> None:
    """Inverse of save_trainable_weights, into the already-built model (so freezing / LoRA stay as configured)."""
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        return

    # safetensors only (no pickled .bin), from this folder only; the concrete class never runs code the folder ships.
    try:
        loaded = type(model).from_pretrained(folder, dtype=next(model.parameters()).dtype, use_safetensors=True, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot load the weights in {folder} (vlmrl reads model.safetensors only): {e}") from e
    with torch.no_grad():
        for (name, p), (name2, q) in zip(model.state_dict(keep_vars=True).items(), loaded.state_dict(keep_vars=True).items()):
            if name != name2:
                raise RuntimeError(f"checkpoint parameter {name2} does not match the model's {name}")
            p.copy_(q)


def load_sharded_state(model: torch.nn.Module, folder, optimizer=None) -> None:
    """A torch.distributed.checkpoint folder (save_sharded_state) into `model` (and `optimizer`): sharded (FSDP2,
    any world size: the files are re-sharded on load), replicated (DDP) or plain (one process)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict

    opt = raw_optimizer(optimizer) if optimizer is not None else None
    state = {"model": get_model_state_dict(model)}
    if opt is not None:
        state["optimizer"] = get_optimizer_state_dict(model, opt)  # builds the state tensors DCP loads into
    dcp_load(state, folder, no_dist=not tdist.is_initialized())  # metadata and bytes entries read code-free (safe_load.py)
    set_model_state_dict(model, state["model"])
    if opt is not None:
        set_optimizer_state_dict(model, opt, state["optimizer"])


def consolidated_model_state(folder) -> dict:
    """The model part of a torch.distributed.checkpoint folder as one plain state dict, on one process (read
    code-free: safe_load.py)."""

    return dcp_read_all(folder, keys={"model"})["model"]


def raw_optimizer(optimizer):
    """The torch optimizer under accelerate's AcceleratedOptimizer wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)
