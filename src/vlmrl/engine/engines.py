"""One class per engine: how the policy is wrapped, run, stepped and saved with one process, DDP, FSDP2 or DeepSpeed.

Every engine has the same methods (`prepare`, `call`, `no_sync`, `backward`, `optimizer_step`,
`gathered_for_generation`, `save_state`, `load_state`, `write_final`) and the loop and the checkpoint code never ask
which engine runs: `engine_for` picks the class once, from the accelerate state the launcher set up.

- `SingleProcessEngine`: nothing is wrapped; the loop runs the plain single-process code (bit for bit).
- `DDPEngine`: accelerate's DDP around `PolicyCall(policy)`; every process holds the whole model and optimizer.
- `FSDP2Engine`: `fully_shard` through accelerate's FSDP plugin (fsdp_version 2), or applied by vlmrl itself on CPU
  (`shard_fsdp2`, accelerate enables FSDP on GPUs only). Checkpoints hold gathered full states (the single-process
  layout) or, with `fsdp_state_dict_type: SHARDED_STATE_DICT`, torch.distributed.checkpoint shards.
- `DeepSpeedEngine`: ZeRO-1/2/3 through accelerate's DeepSpeed plugin (GPU/NCCL; CPU/gloo with DeepSpeed's CPU
  accelerator); checkpoints and the final model hold full states gathered from the ZeRO partitions (single-process layout).

Every forward that needs the engine goes through `PolicyCall`, a root module that runs a function of the policy
inside its own forward, so DDP's reducer and FSDP's unshard hooks see the shared-prefix and grouped log-prob paths.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from vlmrl.engine.collectives import Collectives, DistributedError
from vlmrl.checkpoints.state import raw_optimizer
from vlmrl.checkpoints.state import CheckpointParts, FullState, load_sharded_state, move_sharded_state, save_trainable_weights
from vlmrl.checkpoints.files import (
    CheckpointSaveError,
    OPTIMIZER_FILE,
    SHARDED_DIR,
    is_sharded_checkpoint,
    is_storage_error,
    is_weights_only,
    safe_torch_load,
    save_folder_atomically,
)
from vlmrl.engine.collectives import average_gradients
from vlmrl.engine.deepspeed_config import check_config, describe, fill_config, precision
from vlmrl.engine.optim import StepResult, allocate_optimizer_state, clip_and_step
from vlmrl.models.loading import unwrap
import importlib.util
import warnings
import torch.distributed as tdist
import shutil
import dataclasses

ENGINES = ("single", "ddp", "fsdp2", "deepspeed")


def fsdp2_asked_on_cpu(distributed_type: str) -> bool:
    """The launcher asked for FSDP2 (accelerate config / env) but accelerate set up plain multi-CPU."""
    asked = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and os.environ.get("FSDP_VERSION", "1") == "2"
    return asked and "multi_cpu" in distributed_type


def deepspeed_asked() -> bool:
    """The launcher asked for DeepSpeed: `accelerate launch` with a DeepSpeed config (or `--use_deepspeed`) exports
    ACCELERATE_USE_DEEPSPEED=true."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "").strip().lower() == "true"


def require_deepspeed() -> None:
    """DistributedError (exit 2, one line) when DeepSpeed is asked for but the package cannot be imported."""

    if importlib.util.find_spec("deepspeed") is None:
        raise DistributedError(
            "the launcher asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true: an accelerate config with distributed_type: DEEPSPEED) "
            "but the deepspeed package is not installed: pip install 'vlmrl[deepspeed]', or launch with another accelerate config"
        )


def engine_for(collectives: Collectives, accelerator=None) -> "Engine":
    """The engine the launcher set up: none (one process) -> single; accelerate's distributed type otherwise."""
    if accelerator is None:
        return SingleProcessEngine(collectives)
    state = accelerator.state
    dt = str(getattr(state, "distributed_type", "")).lower()
    if "deepspeed" in dt:
        return DeepSpeedEngine(collectives, accelerator)
    if deepspeed_asked():
        raise DistributedError(
            f"the launcher asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) but accelerate set up {dt or 'no engine'}; "
            "vlmrl never runs another engine in its place: check the accelerate config (use_cpu: false)"
        )
    if "fsdp" in dt:
        plugin = getattr(state, "fsdp_plugin", None)
        if plugin is not None and getattr(plugin, "fsdp_version", 1) != 2:
            raise DistributedError(
                "the accelerate config asks for FSDP version 1; vlmrl supports FSDP2 only: set fsdp_version: 2 (configs/accelerate/fsdp2.yaml)"
            )
        return FSDP2Engine(collectives, accelerator)
    if fsdp2_asked_on_cpu(dt):
        # accelerate enables FSDP on accelerators only (never for MULTI_CPU); torch's fully_shard works on CPU
        # with gloo, so vlmrl applies it itself, the way accelerate's TRANSFORMER_BASED_WRAP would (prepare).
        return FSDP2Engine(collectives, accelerator, by_hand=True)
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        # accelerate enables FSDP only on accelerators (MULTI_GPU, ...), never for MULTI_CPU.

        warnings.warn(
            f"the accelerate config asks for FSDP version 1 but accelerate set up {dt or 'no engine'} "
            "(it enables FSDP on GPUs only): this run uses DDP, every process holds the whole model",
            stacklevel=3,
        )
    return DDPEngine(collectives, accelerator)


# ---------------------------------------------------------------- the root module every engine wraps
class PolicyCall(nn.Module):
    """`PolicyCall(model)(fn, *args)` runs `fn(model, *args)` inside this module's forward.

    The loop's forwards call submodules of the policy directly (shared-prefix prefill, then the text
    model on the cache; the grouped vision path), which would bypass the hooks DDP and FSDP put on the
    module they wrap. Wrapping this root instead makes every such call one forward of the wrapped module.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        # accelerate's FSDP auto-wrap reads the transformer block classes from here.

        self._no_split_modules = getattr(unwrap(policy), "_no_split_modules", None)

    def forward(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return fn(self.policy, *args, **kwargs)


# ---------------------------------------------------------------- the engines
class Engine:
    """What every engine shares: the policy wrapped by accelerate in a `PolicyCall` root (`runner`), a backward
    scaled by W, accelerate's global gradient norm, full states held by every process (DDP's layout)."""

    name = "?"
    sharded = False  # parameters / optimizer states split across processes
    optimizer_loads_after_wrap = False  # the checkpoint's optimizer state goes in after prepare (load_state)
    # Every micro-batch's backward under no_sync and the gradients averaged by `sync_gradients` only once every process
    # has finished its accumulation (OOM agreement, oom.retry_on_oom): set by Distributed.prepare for DDP with OOM recovery.
    defer_gradient_sync = False

    @property
    def can_redo_oom(self) -> bool:
        """Whether one process's out-of-memory can be settled by every process redoing its piece (oom.Peers): only
        when no forward or backward holds a collective (one process, DDP with deferred gradient sync)."""
        return not self.sharded

    def __init__(self, collectives: Collectives, accelerator=None):
        self.collectives, self.accelerator = collectives, accelerator
        self.model: nn.Module | None = None
        self.runner: nn.Module | None = None

    # -- identity ----------------------------------------------------------------------------------------
    @property
    def planner_sharding(self) -> str:
        """This engine in the memory planner's terms (planner.Workload.sharding)."""
        return "ddp"

    @property
    def planner_deepspeed(self) -> dict | None:
        """The DeepSpeed config this engine runs (the planner sizes ZeRO's buffers from it); None: not DeepSpeed."""
        return None

    @property
    def pins_host_allocator(self) -> str | None:
        """Why this engine's processes need glibc's mmap threshold pinned (engine/host_alloc.py), or None."""
        return None

    def describe(self) -> str:
        c = self.collectives
        return f"{c.world_size} processes ({self.name}), rank {c.rank}, local rank {c.local_rank}"

    def unsupported(self, what: str) -> DistributedError:
        return DistributedError(
            f"{what} is not supported yet with {self.name} ({self.collectives.world_size} processes); "
            "see docs/scaling_out.md for what runs on which engine"
        )

    def check_supported(self, save_steps: int, save_final_model: bool) -> None:
        """Refuse, before any model is loaded, what this engine cannot do."""

    def check_config(self, cfg) -> None:
        """Refuse (DistributedError) an engine setting that contradicts the vlmrl config `cfg`; nothing by default."""

    def prepared_report(self) -> list[str]:
        """Lines worth logging once the model is wrapped."""
        return []

    def local_parameter_fraction(self) -> float:
        """Share of the policy's parameter elements this process holds (1.0 unsharded, ~1/W under FSDP2)."""
        params = list((self.model or nn.Module()).parameters())
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
        return local / max(1, sum(p.numel() for p in params))

    # -- prepare, forward, backward, step ------------------------------------------------------------------
    def wrap_reference(self, reference: nn.Module):
        """A frozen reference copy wrapped so that `runner(fn, *args)` runs `fn(reference, *args)` inside the engine,
        or None: the reference is called directly (every engine but ZeRO-3 keeps it whole on every process)."""
        return None

    def prepare(self, model: nn.Module, optimizer, micro_batch_size: int = 1):
        """Wrap the policy for the engine; returns the optimizer to step (prepared by accelerate)."""
        self.model = model
        self.runner, optimizer = self.accelerator.prepare(PolicyCall(model), optimizer)
        return optimizer

    def call(self, fn: Callable, *args: Any, grad: bool = False, **kwargs: Any) -> Any:
        """`fn(policy, *args, **kwargs)` through the wrapped root, whose hooks gather sharded parameters."""
        if self.runner is None:
            return fn(self.model, *args, **kwargs)
        return self.runner(fn, *args, **kwargs)

    def no_sync(self, last: bool):
        """Context for one micro-batch's backward: gradient sync only on the last micro-batch of an optimizer step
        (never, with defer_gradient_sync: `sync_gradients` does it after the OOM agreement)."""
        if self.runner is None or (last and not self.defer_gradient_sync):
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.runner)

    def sync_gradients(self) -> None:
        """With defer_gradient_sync: the locally accumulated gradients averaged over processes, as DDP's reducer would
        (collectives.average_gradients). Otherwise nothing: the engine synced them in the last backward."""
        if self.defer_gradient_sync and self.runner is not None:
            average_gradients([p for p in self.runner.parameters() if p.requires_grad], self.collectives.world_size)

    def backward(self, loss: torch.Tensor) -> None:
        """The loss scaled by the data-parallel ranks first, because every engine averages gradients over processes
        while the loss already carries the global normaliser. (Under sequence parallelism the mean over an SP group's
        processes of their gradients is that group's whole gradient: engine/ulysses.py.)"""
        if self.runner is None:
            loss.backward()
            return
        self.accelerator.backward(loss * self.collectives.data_world)

    def clip_grad_norm(self, params: list, max_norm: float) -> float:
        """The global gradient norm over every process (DTensor gradients included), clipped to max_norm."""
        if self.runner is None:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        norm = self.accelerator.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    def optimizer_step(self, optimizer, scheduler, max_grad_norm: float):
        """optim.clip_and_step with this engine's global norm: a non-finite norm skips the step on every process
        alike (the norm is global)."""

        model = self.runner if self.runner is not None else self.model
        params = [p for p in model.parameters() if p.requires_grad]
        return clip_and_step(params, optimizer, scheduler, max_grad_norm, self.clip_grad_norm)

    @contextlib.contextmanager
    def gathered_for_generation(self, mode: str = "full"):
        """Parameters gathered for the rollout where the engine shards them (a no-op otherwise). full: gathered once
        for the whole rollout (_gathered_whole: peak = the full model per process, fast); layers: each module's
        gathered by the engine's hooks for its forward (peak = one layer; an all-gather per layer per generated
        token), the processes decoding in step (`decode_agreement`, passed to the decoder)."""
        if self._shards_parameters() and mode != "layers":
            with self._gathered_whole():
                yield
        else:
            yield

    def decode_agreement(self, mode: str = "full") -> Callable[[bool], bool] | None:
        """How the processes agree that some row, on some process, is unfinished, where every decode forward holds
        collectives (sharded parameters gathered layer by layer: every process must run as many forwards); None:
        each process decides alone. The rollout backend passes it to the decoder (models/rollout.generate)."""
        return self.collectives.any if self._shards_parameters() and mode == "layers" else None

    def _shards_parameters(self) -> bool:
        """Whether each process holds only part of the parameters (FSDP2, ZeRO-3)."""
        return False

    def _gathered_whole(self) -> contextlib.AbstractContextManager:
        """Every parameter gathered until the context ends (gathered_for_generation's full mode)."""
        return contextlib.nullcontext()

    # -- state on disk ---------------------------------------------------------------------------------------
    def save_state(self, out: Path, step: int, model, optimizer, weights_only: bool) -> CheckpointParts | None:
        """What checkpoint `step` in `out` holds when it is not this process's own model and optimizer (those are
        what run_checkpoint.save writes when this returns None: one process, DDP). Every process calls it."""
        return None

    def load_state(self, path: Path, optimizer) -> None:
        """What loads from checkpoint `path` after prepare: a SHARDED checkpoint's torch.distributed.checkpoint files
        (weights and optimizer, re-sharded for any world size). Nothing otherwise (run_checkpoint.restore loaded it)."""

        if is_sharded_checkpoint(path):
            load_sharded_state(self.model, path / SHARDED_DIR, None if is_weights_only(path) else optimizer)

    def write_final(self, model, processor, folder: Path, save_model, cfg) -> None:
        """output_dir/final written by the main process from its own (full) model, atomically."""

        if self.collectives.is_main:
            save_folder_atomically(folder, lambda tmp: save_model(model, processor, tmp))


class SingleProcessEngine(Engine):
    """One process: nothing is wrapped, the policy is called directly, gradients are not synced."""

    name = "single"

    @property
    def planner_sharding(self) -> str:
        return "none"

    def prepare(self, model: nn.Module, optimizer, micro_batch_size: int = 1):
        self.model = model
        return optimizer


class DDPEngine(Engine):
    """accelerate's DDP around the PolicyCall root; every process holds the whole model and optimizer."""

    name = "ddp"

    def call(self, fn: Callable, *args: Any, grad: bool = False, **kwargs: Any) -> Any:
        """Through the DDP wrapper when gradients are needed; no-grad calls skip it (no collective there)."""
        if not grad:
            return fn(self.model, *args, **kwargs)
        return super().call(fn, *args, **kwargs)


class FSDP2Engine(Engine):
    """fully_shard by accelerate (GPU) or by vlmrl itself (`by_hand`, CPU); full states gathered for checkpoints."""

    name = "fsdp2"
    sharded = True
    optimizer_loads_after_wrap = True  # its state must follow the sharded parameters

    def __init__(self, collectives: Collectives, accelerator=None, by_hand: bool = False):
        super().__init__(collectives, accelerator)
        self.by_hand = by_hand

    @property
    def planner_sharding(self) -> str:
        return "fsdp"

    def prepared_report(self) -> list[str]:
        how = "fully_shard applied by vlmrl (accelerate enables FSDP on GPUs only)" if self.by_hand else "accelerate"
        return [f"FSDP2 via {how}: this process holds {100 * self.local_parameter_fraction():.1f}% of the parameters"]

    def prepare(self, model: nn.Module, optimizer, micro_batch_size: int = 1):
        if not self.by_hand:
            return super().prepare(model, optimizer, micro_batch_size)
        self.model = model
        self.runner = shard_fsdp2(PolicyCall(model), optimizer)
        return optimizer

    def no_sync(self, last: bool):
        if self.by_hand and self.runner is not None:
            self.runner.set_requires_gradient_sync(last)  # reduce-scatter only after the last micro-batch
            return contextlib.nullcontext()
        return super().no_sync(last)

    def _shards_parameters(self) -> bool:
        return self.runner is not None

    @contextlib.contextmanager
    def _gathered_whole(self):
        """Every FSDP2 unit all-gathered once and kept until the context ends, then released."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in self.runner.modules() if isinstance(m, FSDPModule)]
        for m in units:
            m.set_reshard_after_forward(False, recurse=False)
            m.unshard()
        try:
            yield
        finally:
            for m in units:
                m.reshard()
                m.set_reshard_after_forward(True, recurse=False)

    # -- full and sharded states (checkpoints and the final model) ---------------------------------------------
    @property
    def sharded_checkpoints(self) -> bool:
        """`fsdp_state_dict_type: SHARDED_STATE_DICT` in the accelerate config (env FSDP_STATE_DICT_TYPE): checkpoints
        as torch.distributed.checkpoint files, each process writing its own shards."""
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None) if self.accelerator is not None else None
        kind = getattr(plugin, "state_dict_type", None) or os.environ.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
        return "SHARDED" in str(kind).upper()

    def full_state_dicts(self, optimizer) -> tuple[dict | None, dict | None]:
        """The whole model and optimizer states gathered to the main process's CPU, every process taking part; the
        optimizer's in torch's own layout, so the checkpoint is the one a single process writes and any world size
        resumes it. Other processes get (None, None)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        optim_state = get_optimizer_state_dict(self.model, raw_optimizer(optimizer), options=options) if optimizer is not None else None
        if not self.collectives.is_main:
            return None, None
        return model_state, optimizer_state_by_index(optim_state) if optim_state is not None else None

    def save_sharded_state(self, folder, optimizer) -> None:
        """Every process writes its shards of the model (and optimizer, when given) into `folder`
        (torch.distributed.checkpoint: one file per process plus metadata); returns when all are done."""

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self.collectives.is_main:
            shutil.rmtree(folder, ignore_errors=True)  # a stale folder of a killed save
        self.collectives.barrier()
        state = {"model": get_model_state_dict(self.model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, raw_optimizer(optimizer))
        dcp.save(state, checkpoint_id=str(folder), no_dist=not tdist.is_initialized())
        self.collectives.barrier()

    def load_full_optimizer_state(self, optimizer, state: dict | None) -> None:
        """A saved full optimizer state (torch's layout; read by the main process only, None elsewhere) into the
        sharded optimizer: the main process broadcasts it and every process keeps its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        opt = raw_optimizer(optimizer)
        names = {id(p): n for n, p in self.model.named_parameters()}
        by_name = optimizer_state_by_name(state, [[names[id(p)] for p in g["params"]] for g in opt.param_groups]) if self.collectives.is_main else {}
        set_optimizer_state_dict(self.model, opt, by_name, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def save_state(self, out: Path, step: int, model, optimizer, weights_only: bool) -> CheckpointParts:
        """SHARDED_STATE_DICT: every process writes its shards into a staging folder, which then moves into the
        checkpoint (a storage error: CheckpointSaveError on every process, as DCP raises on every process). Otherwise
        the full states gathered to the main process (every process takes part), in the single-process layout."""

        if self.sharded_checkpoints:
            staging = out / f".tmp-sharded-{step}"
            try:
                self.save_sharded_state(staging, None if weights_only else optimizer)
            except BaseException as e:  # DCP raises the same CheckpointException (a BaseException) on every process
                if not is_storage_error(e):
                    raise
                if self.collectives.is_main:
                    shutil.rmtree(staging, ignore_errors=True)
                raise CheckpointSaveError(
                    f"could not write the sharded state of checkpoint {step} to {staging}: "
                    f"{str(e).splitlines()[0]}; earlier checkpoints in {out} are intact"
                ) from e
            return CheckpointParts(
                save_weights=lambda p: move_sharded_state(staging, p, model), optimizer=None, trainer_state={"state_format": "sharded"}
            )
        model_state, optim_state = self.full_state_dicts(None if weights_only else optimizer)
        return CheckpointParts(save_weights=lambda p: save_trainable_weights(model, p, model_state), optimizer=FullState(optim_state))

    def load_state(self, path: Path, optimizer) -> None:
        """A SHARDED checkpoint's files (Engine.load_state), or the full optimizer state (read by the main process)
        scattered into the shards."""

        if is_sharded_checkpoint(path):
            super().load_state(path, optimizer)
        elif not is_weights_only(path):
            self.load_full_optimizer_state(optimizer, safe_torch_load(path / OPTIMIZER_FILE) if self.collectives.is_main else None)

    def write_final(self, model, processor, folder: Path, save_model, cfg) -> None:
        """The weights gathered to the main process, which loads them into an unsharded CPU copy of the policy (LoRA
        merged from there) and writes that."""
        from vlmrl.models.policy import load_policy

        state, _ = self.full_state_dicts(None)
        if self.collectives.is_main:
            plain, _ = load_policy(cfg, torch.device("cpu"))
            plain.load_state_dict(state)
            save_folder_atomically(folder, lambda tmp: save_model(plain, processor, tmp))


class DeepSpeedEngine(Engine):
    """DeepSpeed ZeRO-1/2/3 through accelerate's DeepSpeed plugin (GPU/NCCL, or CPU/gloo with DeepSpeed's CPU
    accelerator). Checkpoints and the final model hold full states in the single-process layout (vlmrl's own safe
    format, never DeepSpeed's pickled files): the fp32 master weights and AdamW moments are gathered from the ZeRO
    partitions through DeepSpeed's tensor-fragment API (deepspeed.utils.safe_get_full_*) and scattered back on resume."""

    name = "deepspeed"
    sharded = True
    optimizer_loads_after_wrap = True  # the moments go into DeepSpeed's flat partitions after deepspeed.initialize

    def __init__(self, collectives: Collectives, accelerator=None):
        super().__init__(collectives, accelerator)
        self.trainable: list[tuple[str, nn.Parameter]] = []  # the optimizer's parameters, in its order (torch's layout)
        self.dtypes: dict[str, torch.dtype] = {}  # the policy's state dict dtypes before DeepSpeed cast it (bf16 / fp16)
        self.gathered = False  # inside gathered_for_generation("full") under ZeRO-3: call the policy directly

    @property
    def plugin(self):
        return getattr(self.accelerator.state, "deepspeed_plugin", None) if self.accelerator is not None else None

    def _zero_stage(self) -> int:
        return self.plugin.zero_stage if self.plugin else 0

    @property
    def planner_sharding(self) -> str:
        return {1: "zero1", 2: "zero2", 3: "zero3"}.get(self._zero_stage(), "ddp")

    @property
    def planner_deepspeed(self) -> dict | None:
        return self.plugin.deepspeed_config if self.plugin else None

    @property
    def pins_host_allocator(self) -> str | None:
        # ZeRO-3 gathers every parameter into fresh tensors around each module's forward and backward and frees them;
        # glibc's heap kept those freed blocks (peak RSS +1.2-1.5 GiB over the live tensors in the 2-process CPU runs,
        # benchmarks/results/planner_deepspeed_cpu_*.md)
        # On a GPU the gathers are device memory, and the pin's cost (each gathered block mapped and faulted in afresh)
        # would buy nothing: CPU processes only.
        device = getattr(self.accelerator, "device", None)
        on_host = device is None or torch.device(device).type == "cpu"
        return "DeepSpeed ZeRO-3 (its parameter gathers)" if self._zero_stage() == 3 and on_host else None

    def check_config(self, cfg) -> None:

        check_config(self.plugin.deepspeed_config, cfg.optim.max_grad_norm)

    def prepared_report(self) -> list[str]:

        return [f"{describe(self.plugin.deepspeed_config)}: this process holds {100 * self.local_parameter_fraction():.1f}% of the parameters"]

    def local_parameter_fraction(self) -> float:
        params = list((self.model or nn.Module()).parameters())
        local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params)
        return local / max(1, sum(getattr(p, "ds_numel", p.numel()) for p in params))

    def prepare(self, model: nn.Module, optimizer, micro_batch_size: int = 1):

        config = getattr(unwrap(model), "config", None)
        text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
        fill_config(self.plugin.deepspeed_config, micro_batch_size, getattr(text, "hidden_size", None))
        names = {id(p): n for n, p in model.named_parameters()}
        self.trainable = [(names[id(p)], p) for g in optimizer.param_groups for p in g["params"]]
        # bf16 / fp16 weights: DeepSpeed would build its fp32 masters from the rounded copies; the loaded fp32 weights
        # go into them instead (a resume then continues from the saved masters exactly; test_zero2_bf16_*).
        self.dtypes = {k: v.dtype for k, v in model.state_dict(keep_vars=True).items()}
        keep = None
        if precision(self.plugin.deepspeed_config) != "fp32":
            keep = [p.detach().to("cpu", copy=True) for _, p in self.trainable]
        optimizer = super().prepare(model, optimizer, micro_batch_size)
        if keep is not None:
            from deepspeed.utils import safe_set_full_fp32_param

            for (_, p), value in zip(self.trainable, keep):
                safe_set_full_fp32_param(p, value.to(p.device, torch.float32))
        allocate_zero_moments(raw_optimizer(optimizer))
        return optimizer

    def wrap_reference(self, reference: nn.Module):
        """ZeRO-3: the frozen reference partitioned like the policy (deepspeed.initialize without an optimizer, the
        user's ZeRO-3 parameter settings), so no process holds it whole; its hooks gather each module for its forward.
        ZeRO-1/2 with bf16 / fp16 weights: the reference cast to the policy's dtype (DeepSpeed casts the policy), so
        that the KL term compares like with like."""
        if self._zero_stage() != 3:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision(self.plugin.deepspeed_config))
            if dtype is not None:
                reference.to(dtype)
            return None
        import deepspeed

        user = self.plugin.deepspeed_config
        zero = {k: v for k, v in (user.get("zero_optimization") or {}).items() if k.startswith("stage3_") or k == "offload_param"}
        config = {
            "zero_optimization": {"stage": 3, **{k: v for k, v in zero.items() if v != "auto"}},
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "bf16": user.get("bf16", {"enabled": False}),
            "steps_per_print": 2**31,
        }
        engine, *_ = deepspeed.initialize(model=PolicyCall(reference), config=config)
        engine.eval()
        return engine

    def call(self, fn: Callable, *args: Any, grad: bool = False, **kwargs: Any) -> Any:
        """Through the DeepSpeed engine, whose ZeRO-3 hooks look for tensors in the output: a dataclass result
        (Completions) travels as a tuple of its fields and is rebuilt here."""
        if self.runner is None or self.gathered:
            return fn(self.model, *args, **kwargs)

        kind: dict = {}

        def flat(policy, *a, **k):
            out = fn(policy, *a, **k)
            if dataclasses.is_dataclass(out) and not isinstance(out, type):
                kind["type"] = type(out)
                return tuple(getattr(out, f.name) for f in dataclasses.fields(out))
            return out

        out = self.runner(flat, *args, **kwargs)
        return kind["type"](*out) if kind else out

    def no_sync(self, last: bool):
        if self.runner is None:
            return contextlib.nullcontext()
        # DeepSpeed accumulates until accelerate tells it the boundary (accelerator.backward reads sync_gradients).
        self.accelerator.gradient_state._set_sync_gradients(last)
        return contextlib.nullcontext()

    def optimizer_step(self, optimizer, scheduler, max_grad_norm: float):
        """DeepSpeed clipped (gradient_clipping = optim.max_grad_norm) and stepped inside the last backward; here the
        schedule advances and the norm is read. DeepSpeed does not skip a step on a non-finite norm in fp32/bf16."""

        optimizer.step()  # accelerate's DeepSpeed wrapper: a no-op, the engine stepped in backward
        norm = self.runner.get_global_grad_norm()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return StepResult(float(norm) if norm is not None else float("nan"), skipped=False)

    def _shards_parameters(self) -> bool:
        return self.runner is not None and self._zero_stage() == 3  # ZeRO-1/2 hold the parameters whole already

    @contextlib.contextmanager
    def _gathered_whole(self):
        """ZeRO-3: every parameter gathered and the engine's hooks removed (DeepSpeed's own
        unwrap_model_for_generation); the policy is called directly meanwhile (self.gathered)."""
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(self.runner):
            self.gathered = True
            try:
                yield
            finally:
                self.gathered = False

    # -- full states (checkpoints and the final model) ------------------------------------------------------------
    def full_model_state(self) -> dict | None:
        """The policy's state dict on the main process's CPU (None elsewhere; every process takes part): trainable
        parameters from DeepSpeed's fp32 masters, the rest (frozen parameters, buffers) gathered under ZeRO-3, in the
        dtype the policy had before DeepSpeed cast it (bf16 / fp16 weights: the rounded values the run used)."""
        from deepspeed.utils import safe_get_full_fp32_param

        masters = {}
        for _, p in self.trainable:
            full = safe_get_full_fp32_param(p)
            if full is not None and self.collectives.is_main:
                masters[id(p)] = full.detach().to("cpu", copy=True)
        with self._gathered_parameters():
            if not self.collectives.is_main:
                return None
            state = self.model.state_dict(keep_vars=True).items()
            return {k: masters.get(id(v), v.detach().to("cpu", self.dtypes.get(k, v.dtype), copy=True)) for k, v in state}

    def _gathered_parameters(self):
        if self._zero_stage() != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)

    def full_optimizer_state(self, optimizer) -> dict | None:
        """AdamW's state in torch's own layout (integer ids in the optimizer's order), gathered from the ZeRO
        partitions to the main process (None elsewhere; every process takes part)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        # accelerate's wrapper -> DeepSpeed's ZeRO optimizer -> torch's AdamW (DeepSpeedCPUAdam with offload_optimizer)
        base = raw_optimizer(optimizer).optimizer
        steps = [s["step"] for s in base.state.values() if "step" in s]
        state = {}
        for i, (_, p) in enumerate(self.trainable):
            moments = {key: safe_get_full_optimizer_state(p, key) for key in ("exp_avg", "exp_avg_sq")}
            if self.collectives.is_main and all(v is not None for v in moments.values()):
                # torch's layout: a float32 scalar tensor (DeepSpeedCPUAdam counts in a Python int)
                step = torch.tensor(float(steps[0]), dtype=torch.float32)
                state[i] = {"step": step, **{k: v.detach().to("cpu", copy=True) for k, v in moments.items()}}
        if not self.collectives.is_main:
            return None
        group = {k: v for k, v in base.param_groups[0].items() if k != "params"}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.trainable)))}]}

    def load_full_optimizer_state(self, optimizer, saved: dict) -> None:
        """A full AdamW state (torch's layout, as full_optimizer_state writes it) into DeepSpeed's partitions; every
        process calls it with the same state."""
        from deepspeed.utils import safe_set_full_optimizer_state

        base = raw_optimizer(optimizer).optimizer
        if len(saved["param_groups"]) != 1 or len(saved["param_groups"][0]["params"]) != len(self.trainable):
            raise DistributedError(
                "the checkpoint's optimizer state has other param groups than this run's optimizer (different trainable parameters?)"
            )
        step = None
        for i, (_, p) in enumerate(self.trainable):
            entry = saved["state"].get(i)
            if entry is None:
                continue
            step = entry["step"]
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, entry[key].to(p.device), key)
        hyper = {k: v for k, v in saved["param_groups"][0].items() if k != "params"}
        for group in base.param_groups:
            group.update(hyper)
        if step is not None:
            for s in base.state.values():
                s["step"] = int(step) if isinstance(s["step"], int) else step.clone()  # DeepSpeedCPUAdam: an int
            _catch_up_cpu_adam(base, int(step))

    def save_state(self, out: Path, step: int, model, optimizer, weights_only: bool) -> CheckpointParts:
        """Full states gathered to the main process (every process takes part), in the single-process layout: any
        world size and any engine resumes them, `vlmrl export` reads them."""
        model_state = self.full_model_state()
        optim_state = None if weights_only else self.full_optimizer_state(optimizer)
        return CheckpointParts(save_weights=lambda p: save_trainable_weights(model, p, model_state), optimizer=FullState(optim_state))

    def load_state(self, path: Path, optimizer) -> None:
        """The checkpoint's full optimizer state (read code-free by every process) scattered into the partitions. The
        weights loaded before deepspeed.initialize (run_checkpoint.restore), which partitioned them."""

        if is_sharded_checkpoint(path):
            raise DistributedError(
                f"{path} holds torch.distributed.checkpoint shards (FSDP2 SHARDED_STATE_DICT); DeepSpeed resumes full checkpoints only"
            )
        if not is_weights_only(path):
            self.load_full_optimizer_state(optimizer, safe_torch_load(path / OPTIMIZER_FILE))

    def write_final(self, model, processor, folder: Path, save_model, cfg) -> None:
        """The full weights gathered to the main process, which loads them into an unpartitioned CPU copy of the
        policy (LoRA merged from there) and writes that as a plain HF folder."""
        from vlmrl.models.policy import load_policy

        state = self.full_model_state()
        if self.collectives.is_main:
            plain, _ = load_policy(cfg, torch.device("cpu"))
            plain.load_state_dict(state)
            save_folder_atomically(folder, lambda tmp: save_model(plain, processor, tmp))


def allocate_zero_moments(zero) -> None:
    """AdamW's moments for DeepSpeed's flat fp32 partitions created now (zeros, as its first step would), so that an
    OOM happens at start and a resume has partitions to scatter the saved moments into; ZeRO-1/2 then link their
    per-parameter views of them (what the tensor-fragment API reads and writes)."""

    flats = getattr(zero, "fp32_partitioned_groups_flat", None)
    if flats:  # ZeRO-3: torch's param groups are empty between steps; each sub-group's partition joins its group per step
        for i, flat in enumerate(flats):
            group = zero.optimizer.param_groups[zero.sub_group_to_group_id[i]]
            group["params"] = [flat]
            _allocate_moments(zero.optimizer)
            group["params"] = []
    else:
        _allocate_moments(zero.optimizer)
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2
        zero._lazy_init_hp_params_optimizer_state()


def _allocate_moments(optimizer) -> None:
    """torch's AdamW: allocate_optimizer_state. DeepSpeedCPUAdam (what accelerate puts in its place with
    offload_optimizer: its fused C++ step works on the host partitions) as its own first step would: step 0 (a Python
    int), float32 zeros."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam):
        allocate_optimizer_state(optimizer)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state[p]:
                zeros = [torch.zeros_like(p, dtype=torch.float32) for _ in range(2)]
                optimizer.state[p].update(step=0, exp_avg=zeros[0], exp_avg_sq=zeros[1])


def _catch_up_cpu_adam(optimizer, step: int) -> None:
    """DeepSpeedCPUAdam's C++ side keeps beta^t as a running product (one float multiplication a step) and computes it
    with pow() instead when a step number comes out of sequence, as a resumed run's first one does: an ulp apart,
    which the bias correction passes on to every weight (measured: a resumed ZeRO-2 offload run ended off the
    uninterrupted one). The fresh C++ optimizer is brought to `step` the way the uninterrupted run got there: its
    update called for steps 1..step on one-element scratch tensors (the parameters and moments are not touched)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not isinstance(optimizer, DeepSpeedCPUAdam):
        return
    group = optimizer.param_groups[0]
    scratch = [torch.zeros(1) for _ in range(4)]  # parameter, gradient, exp_avg, exp_avg_sq
    for s in range(1, step + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, s, 0.0, *group["betas"], group["eps"], 0.0, True, *scratch)


# ---------------------------------------------------------------- FSDP2 sharding and optimizer-state layouts
def shard_fsdp2(root: nn.Module, optimizer) -> nn.Module:
    """fully_shard every transformer block (the model's _no_split_modules), then the root, as accelerate's FSDP2
    TRANSFORMER_BASED_WRAP does; the optimizer is pointed at the sharded (DTensor) parameters. Its state is
    loaded after this (FSDP2Engine.load_full_optimizer_state), so it must be empty here."""
    from torch.distributed.fsdp import fully_shard

    if optimizer.state:
        raise DistributedError("internal: FSDP2 sharding needs an optimizer without state (it is restored after sharding)")
    names = {id(p): n for n, p in root.named_parameters()}
    blocks = set(getattr(root, "_no_split_modules", None) or ())
    # fsdp_reshard_after_forward of the accelerate config (exported as FSDP_RESHARD_AFTER_FORWARD): false keeps
    # each block gathered from forward to backward (ZeRO-2-like), true (default) frees it after the forward.
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").strip().lower() not in ("false", "0", "no")
    for module in root.policy.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, reshard_after_forward=reshard)
    fully_shard(root, reshard_after_forward=reshard)
    params = dict(root.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [params[names[id(p)]] for p in group["params"]]
    return root


def optimizer_state_by_index(state: dict) -> dict:
    """A parameter-name-keyed optimizer state dict (torch.distributed.checkpoint's full layout) in torch's own
    layout: integer ids numbered in param-group order, as `optimizer.state_dict()` numbers them."""
    index: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        ids = []
        for name in group["params"]:
            index[name] = len(index)
            ids.append(index[name])
        groups.append({**group, "params": ids})
    return {"state": {index[name]: v for name, v in state["state"].items()}, "param_groups": groups}


def optimizer_state_by_name(state: dict, names_per_group: list[list[str]]) -> dict:
    """Inverse of optimizer_state_by_index for an optimizer whose param groups hold the parameters `names_per_group`."""
    if len(names_per_group) != len(state["param_groups"]) or any(
        len(names) != len(g["params"]) for names, g in zip(names_per_group, state["param_groups"])
    ):
        raise DistributedError("the checkpoint's optimizer state has other param groups than this run's optimizer (different trainable parameters?)")
    name_of = {i: n for names, g in zip(names_per_group, state["param_groups"]) for i, n in zip(g["params"], names)}
    return {
        "state": {name_of[i]: v for i, v in state["state"].items()},
        "param_groups": [{**g, "params": names} for names, g in zip(names_per_group, state["param_groups"])],
    }
