"""Many processes, one node or many: a thin layer over accelerate's `Accelerator` and torch.distributed.

Launch with `accelerate launch [--config_file configs/accelerate/<engine>.yaml] -m vlmrl train ...` or
`torchrun --nproc_per_node N -m vlmrl train ...` (docs/scaling_out.md). With one process none of this
does anything: `Distributed.world_size == 1`, no Accelerator is built, and the loop runs exactly the
single-process code (bit for bit).

Two parts behind one object (`Distributed`, what the loop holds as `run.dist`): the processes and their
collective operations (collectives.py: `Collectives`, inherited) and the engine (engines.py: one class per
backend, `SingleProcessEngine`, `DDPEngine`, `FSDP2Engine`, `DeepSpeedEngine`, picked once by `engine_for`
and reached as `dist.engine`). Neither the loop nor the checkpoint code branches on the engine's name.

What the loop gets from here
----------------------------
- **The batch sizes in the config are global.** `prompts_per_step` prompts per step in total and
  `per_device_train_batch_size x gradient_accumulation_steps` completions per optimizer step in total,
  whatever the number of processes W; W only changes how that work is split (each process runs 1/W of
  every optimizer step in micro-batches of at most per_device_train_batch_size rows). So a W-process run
  computes what one process computes with the same config, and the LR schedule does not depend on W.
- **Group-aware sharding** (`shard_prompts`): every process gets different whole prompts (all G
  completions of a prompt live on one process) and each optimizer step's prompts are split evenly.
- **Whole-group advantages**: `gather_rows` collects every process's rewards in global order, so the
  advantages (and the logged reward statistics) are those of the whole batch.
- **Loss normalisation** (`step_normaliser`): sequence and token counts of an optimizer step are summed
  over processes, and the loss is multiplied by W before backward because DDP / FSDP / DeepSpeed average
  gradients: the gradient equals the one-process gradient of the same global batch.
- **Gradient sync once per optimizer step**: `no_sync` on every micro-batch but the last one; with OOM recovery
  (memory.oom_recovery, the default) DDP runs every micro-batch under `no_sync` and averages the gradients
  (`sync_gradients`, bit-identical to DDP's reducer) only after all processes agreed that none ran out of memory.
- **Out of memory on some processes** (`oom_peers`, oom.py): each attempt is settled by one all-reduce, so every
  process halves to the same size and redoes (one process, DDP); FSDP2 / DeepSpeed, whose forward and backward hold
  collectives, stop every process with one message instead (abort.py: the rendezvous store, exit code 2).
- **Metrics** (`reduce_metrics`): reduced across processes (sums for the loss, max for memory peaks and
  times, mean otherwise) plus per-process memory peaks (`mem/<key>/rank<r>`); only the main process
  writes files and shows the progress bar.
- **RNG per process** (`gather_rng_states`, `restore_rng`): `rng_state_<rank>.pt` in every checkpoint.

Engines (from the accelerate config / env): DDP (accelerate's default for several processes), FSDP2
(`fully_shard` through accelerate's FSDP plugin, fsdp_version 2) and DeepSpeed ZeRO-1/2/3 (accelerate's DeepSpeed
plugin; on CPU the Accelerator is built with cpu=False and a gloo process group, since accelerate ignores DeepSpeed
with cpu=True; a launch asking for DeepSpeed gets it or a DistributedError, never another engine). Every forward that needs
the engine goes through `PolicyCall`, a root module that runs a function of the policy inside its own
forward, so DDP's reducer and FSDP's unshard hooks see the shared-prefix and grouped log-prob paths.

accelerate enables FSDP on GPUs only; when the launcher asks for FSDP2 on CPU (accelerate launch with
configs/accelerate/fsdp2.yaml, or ACCELERATE_USE_FSDP=true FSDP_VERSION=2), vlmrl applies fully_shard itself
(`shard_fsdp2`). FSDP2 checkpoints gather full states to the main process (`FSDP2Engine.full_state_dicts`), so they have
the single-process layout; the optimizer state goes back into the shards after sharding.

Tested on CPU/gloo (tests/test_distributed.py, tests/test_deepspeed.py): DDP through torchrun, two nodes on loopback,
FSDP2 and DeepSpeed ZeRO-2/3 training, checkpoint, resume and export. Not run: accelerate's GPU FSDP2 preparation,
DeepSpeed on GPUs. docs/scaling_out.md has the commands and the limits.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from vlmrl.engine.collectives import (
    PER_RANK_MEMORY,
    Collectives,
    DistributedError,
    Shard,
    merge_rows,
    prompt_seed,
    reduce_metric_dicts,
    rows_of,
    shard_prompts,
)
from vlmrl.engine.engines import (
    ENGINES,
    DDPEngine,
    DeepSpeedEngine,
    Engine,
    FSDP2Engine,
    PolicyCall,
    SingleProcessEngine,
    deepspeed_asked,
    engine_for,
    optimizer_state_by_index,
    require_deepspeed,
    optimizer_state_by_name,
    shard_fsdp2,
)
from vlmrl.checkpoints.state import raw_optimizer
from vlmrl.engine.device import env_world
from vlmrl.engine.abort import abort_everyone, watch_for_abort
from vlmrl.engine.oom import ALONE, OutOfMemoryAbort, Peers

# Re-exported: the collectives, the engines and their helpers are imported from here by callers and tests.
__all__ = [
    "PER_RANK_MEMORY",
    "Collectives",
    "DistributedError",
    "Shard",
    "merge_rows",
    "prompt_seed",
    "reduce_metric_dicts",
    "rows_of",
    "shard_prompts",
    "ENGINES",
    "DDPEngine",
    "DeepSpeedEngine",
    "Engine",
    "FSDP2Engine",
    "PolicyCall",
    "SingleProcessEngine",
    "engine_for",
    "optimizer_state_by_index",
    "optimizer_state_by_name",
    "shard_fsdp2",
    "raw_optimizer",
    "env_world",
    "Distributed",
]


class Distributed(Collectives):
    """This run's processes (the collectives, inherited) and its engine (`engine`: one class per backend, picked once
    by `engine_for`). The loop's engine calls go through the one-line forwards below; nothing here asks which
    engine runs."""

    def __init__(self, accelerator=None):
        super().__init__(accelerator)
        self.engine: Engine = engine_for(self, accelerator)
        if self.world_size > 1 and not self.engine.can_redo_oom:
            watch_for_abort(self.rank)  # another process's abort_everyone ends this one (oom_peers)

    @classmethod
    def from_env(cls, cpu: bool = False) -> "Distributed":
        """One process -> no Accelerator at all. Several (WORLD_SIZE > 1) -> an Accelerator that joins the process
        group the launcher set up (gloo on CPU, nccl on CUDA), with DDP kwargs the loop needs."""
        world, _, _ = env_world()
        if world == 1:
            return cls(None)
        from accelerate import Accelerator
        from accelerate.utils import DistributedDataParallelKwargs

        # find_unused_parameters: frozen / adapter-disabled parts and text-only micro-batches leave some trainable
        # parameters without a gradient. broadcast_buffers=False: ranks may run different numbers of forwards
        # (token packing, OOM redo); buffers (rotary tables) are constants here anyway.
        handlers = [DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)]
        if deepspeed_asked():
            # accelerate turns DeepSpeed on only when built with cpu=False (with cpu=True it silently runs DDP); on a
            # machine without an accelerator DeepSpeed's CPU accelerator then joins a gloo process group.
            require_deepspeed()
            if cpu:
                from accelerate.utils import InitProcessGroupKwargs

                handlers.append(InitProcessGroupKwargs(backend="gloo"))
            cpu = False
        try:
            accelerator = Accelerator(cpu=cpu, kwargs_handlers=handlers)
        except ValueError as e:
            if not deepspeed_asked():
                raise
            # accelerate's checks of the DeepSpeed config (e.g. keys it ignores next to a deepspeed_config_file)
            raise DistributedError(f"accelerate refused the DeepSpeed setup: {' '.join(str(e).split())}") from e
        if deepspeed_asked():
            # accelerate's ZeRO-3 plugin registers its config with transformers, whose from_config / from_pretrained then
            # build every model inside deepspeed.zero.Init (the planner's meta-device trace fails there, and the
            # reference and the final model's plain copy would come out partitioned). vlmrl builds models whole on
            # each process; deepspeed.initialize partitions the policy.
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        return cls(accelerator)

    # -- sequence parallelism (engine/ulysses.py) --------------------------------------------------------------
    def use_sequence_parallel(self, sp: int) -> None:
        """training.sequence_parallel_size: sp processes split each row's sequence in scoring and the update. Only
        sp = the number of processes on the DDP engine runs yet (preflight refused the other settings); a process
        group of its own carries the all-to-alls, apart from the engine's gradient all-reduces."""
        if sp == 1:
            return
        field = f"training.sequence_parallel_size={sp}"
        if sp != self.world_size:
            raise DistributedError(
                f"{field} with {self.world_size} processes: set it to the number of processes or 1 (SP inside data parallelism is not done yet)"
            )
        if self.engine.name != "ddp":
            raise DistributedError(
                f"{field}: not yet with the {self.engine.name} engine (Ulysses runs under DDP only); launch with DDP, or set it to 1"
            )
        import torch.distributed as dist

        self.sp, self.sp_group = sp, dist.new_group(list(range(self.world_size)))

    def sequence_split(self, model):
        """Context in which `model`'s decoder runs Ulysses over the SP group (forward and backward alike: checkpointed
        layers recompute attention in backward); a no-op without sequence parallelism."""
        if self.sp == 1:
            return contextlib.nullcontext()
        from vlmrl.engine.ulysses import sequence_parallel

        return sequence_parallel(model, self.sp_group)

    def sequence_metrics(self) -> dict[str, int]:
        """The step's longest split sequence and this process's share of it (engine/ulysses.take_split_metrics);
        nothing without sequence parallelism."""
        if self.sp == 1:
            return {}
        from vlmrl.engine.ulysses import take_split_metrics

        return take_split_metrics()

    # -- the engine's part, forwarded ----------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Parameters / optimizer states split across processes (FSDP2, DeepSpeed)."""
        return self.engine.sharded

    @property
    def planner_sharding(self) -> str:
        return self.engine.planner_sharding

    @property
    def planner_deepspeed(self) -> dict | None:
        return self.engine.planner_deepspeed

    @property
    def pins_host_allocator(self) -> str | None:
        return self.engine.pins_host_allocator

    def describe(self) -> str:
        return self.engine.describe()

    def check_supported(self, save_steps: int, save_final_model: bool) -> None:
        self.engine.check_supported(save_steps, save_final_model)

    def check_config(self, cfg) -> None:
        """The engine's own settings (a DeepSpeed config) against the vlmrl config: DistributedError when they contradict."""
        self.engine.check_config(cfg)

    def prepare(self, model, optimizer, micro_batch_size: int = 1, oom_recovery: bool = False):
        """The engine's wrap. Several processes with OOM recovery on an engine that can redo (DDP): gradients synced
        after every process's accumulation (Engine.defer_gradient_sync), so that the processes can agree on an OOM first."""
        self.engine.defer_gradient_sync = oom_recovery and self.world_size > 1 and self.engine.can_redo_oom
        return self.engine.prepare(model, optimizer, micro_batch_size)

    def sync_gradients(self) -> None:
        self.engine.sync_gradients()

    @property
    def oom_peers(self):
        """How an out-of-memory is settled with the other processes (oom.Peers): agreed by one all-reduce and redone
        by all (one process, DDP), or every process stopped with one message (FSDP2, DeepSpeed)."""

        if self.world_size == 1:
            return ALONE

        def abort(message: str):
            abort_everyone(message, self.world_size, OutOfMemoryAbort)

        def note(message: str) -> None:
            print(f"[process {self.rank}] {message}", file=sys.stderr, flush=True)

        return Peers(
            who=self.ranks_where,
            can_redo=self.engine.can_redo_oom,
            abort=abort,
            note=None if self.is_main else note,
            rank=self.rank,
            world_size=self.world_size,
        )

    def prepared_report(self) -> list[str]:
        return self.engine.prepared_report()

    def call(self, fn, *args, grad: bool = False, **kwargs):
        return self.engine.call(fn, *args, grad=grad, **kwargs)

    def no_sync(self, last: bool):
        return self.engine.no_sync(last)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optimizer_step(self, optimizer, scheduler, max_grad_norm: float):
        return self.engine.optimizer_step(optimizer, scheduler, max_grad_norm)

    def gathered_for_generation(self, mode: str = "full"):
        return self.engine.gathered_for_generation(mode)

    def decode_agreement(self, mode: str = "full"):
        return self.engine.decode_agreement(mode)
