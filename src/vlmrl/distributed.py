"""Many processes, one node or many: a thin layer over accelerate's `Accelerator` and torch.distributed.

Launch with `accelerate launch [--config_file configs/accelerate/<engine>.yaml] -m vlmrl train ...` or
`torchrun --nproc_per_node N -m vlmrl train ...` (docs/scaling_out.md). With one process none of this
does anything: `Distributed.world_size == 1`, no Accelerator is built, and the loop runs exactly the
single-process code (bit for bit).

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
- **Gradient sync once per optimizer step**: `no_sync` on every micro-batch but the last one.
- **Metrics** (`reduce_metrics`): reduced across processes (sums for the loss, max for memory peaks and
  times, mean otherwise) plus per-process memory peaks (`mem/<key>/rank<r>`); only the main process
  writes files and shows the progress bar.
- **RNG per process** (`gather_rng_states`, `restore_rng`): `rng_state_<rank>.pt` in every checkpoint.

Engines (from the accelerate config / env): DDP (accelerate's default for several processes), FSDP2
(`fully_shard` through accelerate's FSDP plugin, fsdp_version 2) and DeepSpeed. Every forward that needs
the engine goes through `PolicyCall`, a root module that runs a function of the policy inside its own
forward, so DDP's reducer and FSDP's unshard hooks see the shared-prefix and grouped log-prob paths.

accelerate enables FSDP on GPUs only; when the launcher asks for FSDP2 on CPU (accelerate launch with
configs/accelerate/fsdp2.yaml, or ACCELERATE_USE_FSDP=true FSDP_VERSION=2), vlmrl applies fully_shard itself
(`shard_fsdp2`). FSDP2 checkpoints gather full states to the main process (`full_state_dicts`), so they have
the single-process layout; the optimizer state goes back into the shards after sharding.

Tested on CPU/gloo (tests/test_distributed.py): DDP through torchrun, two nodes on loopback, FSDP2 training,
checkpoint, resume (2 processes and 1) and export. Not run: accelerate's GPU FSDP2 preparation, DeepSpeed
(no GPU, not installed). docs/scaling_out.md has the commands and the limits.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .config import ConfigError
from .runtime import env_world  # noqa: F401 - also part of this module's interface

ENGINES = ("single", "ddp", "fsdp2", "deepspeed")
# Memory keys whose per-process values are also logged (`mem/<key>/rank<r>`); the plain key is the max.
PER_RANK_MEMORY = ("mem/host_peak_rss", "mem/gpu_peak_allocated", "mem/gpu_peak_reserved")


def fsdp2_asked_on_cpu(distributed_type: str) -> bool:
    """The launcher asked for FSDP2 (accelerate config / env) but accelerate set up plain multi-CPU."""
    asked = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and os.environ.get("FSDP_VERSION", "1") == "2"
    return asked and "multi_cpu" in distributed_type


class DistributedError(ConfigError):
    """A multi-process setting cannot work (batch not divisible, unsupported engine feature); the message says why."""


# ---------------------------------------------------------------- pure helpers (unit-tested in one process)
def shard_prompts(prompts_per_step: int, num_generations: int, rows_per_opt_step: int, world_size: int, rank: int) -> list[int]:
    """Positions (in the step's global prompt order) of the prompts `rank` rolls out.

    The rollout of one step is cut into optimizer steps of `rows_per_opt_step` completions (whole
    prompts); each optimizer step's prompts are split into W equal contiguous blocks, block r to rank r.
    So every optimizer step holds the same global rows as with one process, and every rank gets whole
    prompts (its G completions stay together). One process: all positions, in order.
    """
    if world_size == 1:
        return list(range(prompts_per_step))
    G, W = num_generations, world_size
    if prompts_per_step % W:
        raise DistributedError(
            f"{prompts_per_step} prompts per step (rollout.generation_batch_size / rollout.num_generations) cannot be split "
            f"over {W} processes: make it a multiple of {W} (batch sizes in the config are global, for all processes together)")
    if rows_per_opt_step % (G * W):
        raise DistributedError(
            f"each optimizer step holds per_device_train_batch_size x gradient_accumulation_steps = {rows_per_opt_step} completions "
            f"(global); with {W} processes it must be a multiple of num_generations x processes = {G * W} so that each "
            f"process gets whole prompts of every optimizer step: raise training.gradient_accumulation_steps or "
            f"per_device_train_batch_size (the batch sizes in the config are global)")
    per_opt = rows_per_opt_step // G  # prompts per optimizer step
    share = per_opt // W
    steps = prompts_per_step // per_opt
    return [s * per_opt + rank * share + j for s in range(steps) for j in range(share)]


def rows_of(prompt_positions: list[int], num_generations: int) -> list[int]:
    """Global completion rows of the given prompt positions (prompt p owns rows p*G .. p*G+G-1)."""
    return [p * num_generations + g for p in prompt_positions for g in range(num_generations)]


def merge_rows(per_rank: list[list], rows_per_rank: list[list[int]]) -> list:
    """Put every rank's local rows back into global order (inverse of the sharding)."""
    total = sum(len(r) for r in rows_per_rank)
    out: list = [None] * total
    for values, rows in zip(per_rank, rows_per_rank):
        if len(values) != len(rows):
            raise ValueError(f"{len(values)} values for {len(rows)} rows")
        for v, i in zip(values, rows):
            out[i] = v
    return out


def prompt_seed(seed: int, step: int, position: int) -> int:
    """Seed of one prompt's sampling stream (rollout.sampling_seed=prompt): depends on the run seed, the step
    and the prompt's position in the step's global batch, never on the process that samples it."""
    return ((seed * 1_000_003 + step) * 100_003 + position) % (2**63 - 1)


def reduce_metric_dicts(per_rank: list[dict], sum_keys: tuple[str, ...] = (), max_keys: tuple[str, ...] = ()) -> dict:
    """Combine the metrics of every rank: `sum_keys` summed; `mem/*` and `time/*` the max over ranks (the
    slowest / fullest process is what matters), plus `mem/<key>/rank<r>` for the peaks in PER_RANK_MEMORY;
    a value equal on every rank kept as it is; other numbers averaged; non-numbers taken from rank 0."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    out: dict = {}
    for key, first in per_rank[0].items():
        values = [m.get(key) for m in per_rank]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if not numeric:
            out[key] = first
        elif key in sum_keys:
            out[key] = sum(values)
        elif key in max_keys or key.startswith(("mem/", "time/")):
            out[key] = max(values)
        elif all(v == first for v in values):
            out[key] = first
        else:
            out[key] = sum(values) / len(values)
        if key in PER_RANK_MEMORY:
            for r, v in enumerate(values):
                out[f"{key}/rank{r}"] = v
    return out


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
        from .models import unwrap

        self._no_split_modules = getattr(unwrap(policy), "_no_split_modules", None)

    def forward(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return fn(self.policy, *args, **kwargs)


@dataclass
class Shard:
    """This rank's part of one step: prompt positions, completion rows, and every rank's rows."""

    prompts: list[int]
    rows: list[int]
    rows_per_rank: list[list[int]]
    rows_per_opt_step: int  # local completions per optimizer step


class Distributed:
    """World size / rank / engine of this run and the collective operations the loop needs."""

    def __init__(self, accelerator=None):
        self.accelerator = accelerator
        self.model: nn.Module | None = None
        self.runner: nn.Module | None = None
        self.fsdp2_by_hand = False
        if accelerator is None:
            self.world_size, self.rank, self.local_rank, self.engine = 1, 0, 0, "single"
            return
        state = accelerator.state
        self.world_size, self.rank, self.local_rank = state.num_processes, state.process_index, state.local_process_index
        dt = str(getattr(state, "distributed_type", "")).lower()
        if "deepspeed" in dt:
            self.engine = "deepspeed"
        elif "fsdp" in dt:
            self.engine = "fsdp2"
            plugin = getattr(state, "fsdp_plugin", None)
            if plugin is not None and getattr(plugin, "fsdp_version", 1) != 2:
                raise DistributedError("the accelerate config asks for FSDP version 1; vlmrl supports FSDP2 only: set "
                                       "fsdp_version: 2 (configs/accelerate/fsdp2.yaml)")
        elif fsdp2_asked_on_cpu(dt):
            # accelerate enables FSDP on accelerators only (never for MULTI_CPU); torch's fully_shard works on CPU
            # with gloo, so vlmrl applies it itself, the way accelerate's TRANSFORMER_BASED_WRAP would (prepare).
            self.engine, self.fsdp2_by_hand = "fsdp2", True
        else:
            self.engine = "ddp"
            if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
                # accelerate enables FSDP / DeepSpeed only on accelerators (MULTI_GPU, ...), never for MULTI_CPU.
                import warnings

                warnings.warn(f"the accelerate config asks for FSDP version 1 / DeepSpeed but accelerate set up {dt or 'no engine'} "
                              "(it enables them on GPUs only): this run uses DDP, every process holds the whole model", stacklevel=2)

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
        kwargs = DistributedDataParallelKwargs(find_unused_parameters=True, broadcast_buffers=False)
        return cls(Accelerator(cpu=cpu, kwargs_handlers=[kwargs]))

    # -- identity ----------------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Parameters / optimizer states split across processes (FSDP2, DeepSpeed)."""
        return self.engine in ("fsdp2", "deepspeed")

    @property
    def planner_sharding(self) -> str:
        """This engine in the memory planner's terms (planner.Workload.sharding)."""
        if self.engine == "deepspeed":
            plugin = self.accelerator.state.deepspeed_plugin
            return {1: "zero1", 2: "zero2", 3: "zero3"}.get(plugin.zero_stage if plugin else 0, "ddp")
        return {"single": "none", "ddp": "ddp", "fsdp2": "fsdp"}[self.engine]

    def device(self, configured: torch.device) -> torch.device:
        """The configured device, made per-process: cuda -> cuda:<local rank>."""
        if self.world_size > 1 and configured.type == "cuda":
            return self.accelerator.device
        return configured

    def describe(self) -> str:
        return f"{self.world_size} processes ({self.engine}), rank {self.rank}, local rank {self.local_rank}"

    # -- sharding ----------------------------------------------------------------------------------------
    def shard(self, prompts_per_step: int, num_generations: int, rows_per_opt_step: int) -> Shard:
        W = self.world_size
        per_rank = [rows_of(shard_prompts(prompts_per_step, num_generations, rows_per_opt_step, W, r), num_generations)
                    for r in range(W)]
        prompts = shard_prompts(prompts_per_step, num_generations, rows_per_opt_step, W, self.rank)
        return Shard(prompts=prompts, rows=per_rank[self.rank], rows_per_rank=per_rank, rows_per_opt_step=rows_per_opt_step // W)

    def gather_rows(self, shard: Shard, *columns: list) -> tuple[list, ...]:
        """Every rank's per-row lists in global row order; one process: the same objects."""
        if self.world_size == 1:
            return columns
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, [list(c) for c in columns])
        return tuple(merge_rows([g[i] for g in gathered], shard.rows_per_rank) for i in range(len(columns)))

    def gather_rollout(self, shard: Shard, total: list, per_reward: dict, comp) -> tuple[list, dict, torch.Tensor, torch.Tensor]:
        """(rewards, per-reward values, completion lengths, truncated flags) of the whole step in global row order;
        one process: the local objects unchanged."""
        if self.world_size == 1:
            return total, per_reward, comp.lengths, comp.truncated
        names = list(per_reward)
        cols = self.gather_rows(shard, total, comp.lengths.tolist(), comp.truncated.tolist(), *(per_reward[n] for n in names))
        return cols[0], dict(zip(names, cols[3:])), torch.tensor(cols[1]), torch.tensor(cols[2], dtype=torch.bool)

    def local(self, shard: Shard, global_tensor: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a tensor in global row order; one process: the tensor itself."""
        if self.world_size == 1:
            return global_tensor
        return global_tensor[torch.tensor(shard.rows, device=global_tensor.device)]

    # -- reductions --------------------------------------------------------------------------------------
    def all_sum(self, values: list[float]) -> list[float]:
        if self.world_size == 1:
            return list(values)
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(t)
        return t.tolist()

    def step_normaliser(self, masks: list[torch.Tensor], max_completion_length: int):
        """One optimizer step's loss normaliser over the rows of every process (losses.step_normaliser for one)."""
        from .losses import Normaliser, step_normaliser

        if self.world_size == 1:
            return step_normaliser(masks, max_completion_length)
        seqs, toks = self.all_sum([sum(int(m.shape[0]) for m in masks), sum(int(m.sum()) for m in masks)])
        return Normaliser(num_sequences=int(seqs), num_tokens=max(1, int(toks)), max_completion_length=max_completion_length)

    def reduce_metrics(self, metrics: dict, sum_keys: tuple[str, ...] = (), max_keys: tuple[str, ...] = ()) -> dict:
        if self.world_size == 1:
            return metrics
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, metrics)
        return reduce_metric_dicts(gathered, sum_keys, max_keys)

    def broadcast(self, obj: Any) -> Any:
        """The main process's value of `obj` on every process."""
        if self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every process when `flag` is true on at least one."""
        return bool(flag) if self.world_size == 1 else self.all_sum([float(bool(flag))])[0] > 0

    @contextlib.contextmanager
    def main_first(self):
        """The main process runs the block first (e.g. writes files), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def unsupported(self, what: str) -> DistributedError:
        return DistributedError(f"{what} is not supported yet with {self.engine} ({self.world_size} processes); "
                                "see docs/scaling_out.md for what runs on which engine")

    def barrier(self) -> None:
        if self.world_size > 1:
            self.accelerator.wait_for_everyone()

    def _collective_device(self) -> torch.device:
        import torch.distributed as dist

        return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")

    # -- RNG ---------------------------------------------------------------------------------------------
    def gather_rng_states(self) -> dict[int, dict] | None:
        """{rank: RNG state} of every process on the main process (None elsewhere); one process: {0: its state}."""
        from .checkpoint import rng_state

        mine = rng_state()
        if self.world_size == 1:
            return {0: mine}
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        return dict(enumerate(gathered)) if self.is_main else None

    def restore_rng(self, path, saved_world_size: int, seed: int, warn) -> None:
        """This rank's RNG streams from `rng_state_<rank>.pt`; a rank the checkpoint has no file for (more processes
        than when it was saved) is seeded from (seed, rank) instead, with a warning."""
        from pathlib import Path

        from .checkpoint import restore_rng, rng_file
        from .runtime import seed_everything

        if (Path(path) / rng_file(self.rank)).exists():
            restore_rng(path, rank=self.rank, warn=warn)
            return
        seed_everything(seed * 1_000_003 + self.rank)
        warn(f"{path} was saved by {saved_world_size} process(es) and has no RNG state for rank {self.rank}; "
             f"rank {self.rank} starts a fresh stream (rollouts with rollout.sampling_seed=prompt do not use it)")

    # -- the engine: prepare, forward, backward, step ------------------------------------------------------
    def prepare(self, model: nn.Module, optimizer, micro_batch_size: int = 1):
        """Wrap the policy for the engine; returns the optimizer to step (prepared by accelerate when several
        processes). One process: nothing is wrapped."""
        self.model = model
        if self.world_size == 1:
            return optimizer
        root = PolicyCall(model)
        if self.fsdp2_by_hand:
            self.runner = shard_fsdp2(root, optimizer)
            return optimizer
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if self.engine == "deepspeed" and plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu"):
            # There is no dataloader for accelerate to read it from; DeepSpeed uses it for bookkeeping only.
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size
        self.runner, optimizer = self.accelerator.prepare(root, optimizer)
        return optimizer

    def call(self, fn: Callable, *args: Any, grad: bool = False, **kwargs: Any) -> Any:
        """`fn(policy, *args, **kwargs)` through the engine: one process -> directly; DDP -> through the DDP
        wrapper when gradients are needed (no-grad calls skip it: no collective there); FSDP2 / DeepSpeed
        -> always through the wrapped root, whose hooks gather the sharded parameters."""
        if self.runner is None or (self.engine == "ddp" and not grad):
            return fn(self.model, *args, **kwargs)
        return self.runner(fn, *args, **kwargs)

    def no_sync(self, last: bool):
        """Context for one micro-batch's backward: gradient sync only on the last micro-batch of an optimizer step."""
        if self.runner is None:
            return contextlib.nullcontext()
        if self.engine == "deepspeed":
            # DeepSpeed accumulates until accelerate tells it the boundary (accelerator.backward reads sync_gradients).
            self.accelerator.gradient_state._set_sync_gradients(last)
            return contextlib.nullcontext()
        if self.fsdp2_by_hand:
            self.runner.set_requires_gradient_sync(last)  # reduce-scatter only after the last micro-batch
            return contextlib.nullcontext()
        return contextlib.nullcontext() if last else self.accelerator.no_sync(self.runner)

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(); with several processes the loss is scaled by W first, because every engine averages
        gradients over processes while the loss already carries the global normaliser."""
        if self.runner is None:
            loss.backward()
            return
        self.accelerator.backward(loss * self.world_size)

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
        alike (the norm is global). DeepSpeed (experimental, never run here) clips inside its own step."""
        from .optim import StepResult, clip_and_step

        if self.engine != "deepspeed":
            model = self.runner if self.runner is not None else self.model
            params = [p for p in model.parameters() if p.requires_grad]
            return clip_and_step(params, optimizer, scheduler, max_grad_norm, self.clip_grad_norm)
        params = [p for p in self.runner.parameters() if p.requires_grad]
        norm = self.accelerator.clip_grad_norm_(params, max_grad_norm) if max_grad_norm > 0 else None
        optimizer.step()
        norm = self.runner.get_global_grad_norm() if norm is None else norm
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return StepResult(float(norm) if norm is not None else float("nan"), skipped=False)

    def check_supported(self, save_steps: int, save_final_model: bool) -> None:
        """Refuse, before any model is loaded, what this engine cannot do."""
        if self.engine == "deepspeed" and (save_steps or save_final_model):
            raise self.unsupported("writing checkpoints and the final model from DeepSpeed states (set training.save_steps=0 and "
                                   "training.save_final_model=false, or use FSDP2 / DDP)")

    def prepared_report(self) -> list[str]:
        """Lines worth logging once the model is wrapped."""
        if self.engine != "fsdp2":
            return []
        how = "fully_shard applied by vlmrl (accelerate enables FSDP on GPUs only)" if self.fsdp2_by_hand else "accelerate"
        return [f"FSDP2 via {how}: this process holds {100 * self.local_parameter_fraction():.1f}% of the parameters"]

    def local_parameter_fraction(self) -> float:
        """Share of the policy's parameter elements this process holds (1.0 unsharded, ~1/W under FSDP2)."""
        params = list((self.model or nn.Module()).parameters())
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
        return local / max(1, sum(p.numel() for p in params))

    # -- full states of sharded engines (checkpoints and the final model) -------------------------------------
    def full_state_dicts(self, optimizer) -> tuple[dict | None, dict | None]:
        """FSDP2: the whole model and optimizer states gathered to the main process's CPU, every process taking
        part; the optimizer's in torch's own layout, so the checkpoint is the one a single process writes and any
        world size resumes it. Other processes get (None, None)."""
        if self.engine != "fsdp2":
            raise self.unsupported("full state dicts of DeepSpeed engines")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        optim_state = get_optimizer_state_dict(self.model, raw_optimizer(optimizer), options=options) if optimizer is not None else None
        if not self.is_main:
            return None, None
        return model_state, optimizer_state_by_index(optim_state) if optim_state is not None else None

    @property
    def sharded_checkpoints(self) -> bool:
        """FSDP2 with `fsdp_state_dict_type: SHARDED_STATE_DICT` in the accelerate config (env FSDP_STATE_DICT_TYPE):
        checkpoints as torch.distributed.checkpoint files, each process writing its own shards."""
        if self.engine != "fsdp2":
            return False
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None) if self.accelerator is not None else None
        kind = getattr(plugin, "state_dict_type", None) or os.environ.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
        return "SHARDED" in str(kind).upper()

    def save_sharded_state(self, folder, optimizer) -> None:
        """Every process writes its shards of the model (and optimizer, when given) into `folder`
        (torch.distributed.checkpoint: one file per process plus metadata); returns when all are done."""
        import shutil

        import torch.distributed as tdist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        if self.is_main:
            shutil.rmtree(folder, ignore_errors=True)  # a stale folder of a killed save
        self.barrier()
        state = {"model": get_model_state_dict(self.model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, raw_optimizer(optimizer))
        dcp.save(state, checkpoint_id=str(folder), no_dist=not tdist.is_initialized())
        self.barrier()

    def load_full_optimizer_state(self, optimizer, state: dict | None) -> None:
        """FSDP2: a saved full optimizer state (torch's layout; read by the main process only, None elsewhere) into
        the sharded optimizer: the main process broadcasts it and every process keeps its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        opt = raw_optimizer(optimizer)
        names = {id(p): n for n, p in self.model.named_parameters()}
        by_name = (optimizer_state_by_name(state, [[names[id(p)] for p in g["params"]] for g in opt.param_groups])
                   if self.is_main else {})
        set_optimizer_state_dict(self.model, opt, by_name, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    @contextlib.contextmanager
    def gathered_for_generation(self, mode: str = "full"):
        """Parameters gathered for the rollout under a sharded engine. full: all-gather every FSDP2 unit (or every
        ZeRO-3 parameter) once, keep them for the whole rollout, release after (peak = the full model per process,
        fast); layers: leave it to the per-module hooks, one layer gathered per forward and released after it
        (peak = one layer; an all-gather per layer per generated token). A no-op for one process, DDP, ZeRO-2."""
        if self.runner is None or mode == "layers" or not self.sharded:
            yield
            return
        if self.engine == "fsdp2":
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
            return
        stage = self.accelerator.state.deepspeed_plugin.zero_stage if self.accelerator.state.deepspeed_plugin else 0
        if stage != 3:
            yield
            return
        import deepspeed  # not run in this repository's tests (no GPU); see docs/scaling_out.md

        with deepspeed.zero.GatheredParameters(list(self.runner.parameters()), modifier_rank=None):
            yield


def shard_fsdp2(root: nn.Module, optimizer) -> nn.Module:
    """fully_shard every transformer block (the model's _no_split_modules), then the root, as accelerate's FSDP2
    TRANSFORMER_BASED_WRAP does; the optimizer is pointed at the sharded (DTensor) parameters. Its state is
    loaded after this (Distributed.load_full_optimizer_state), so it must be empty here."""
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


def raw_optimizer(optimizer):
    """The torch optimizer under accelerate's AcceleratedOptimizer wrapper (or the optimizer itself)."""
    return getattr(optimizer, "optimizer", optimizer)


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
            len(names) != len(g["params"]) for names, g in zip(names_per_group, state["param_groups"])):
        raise DistributedError("the checkpoint's optimizer state has other param groups than this run's optimizer "
                               "(different trainable parameters?)")
    name_of = {i: n for names, g in zip(names_per_group, state["param_groups"]) for i, n in zip(g["params"], names)}
    return {"state": {name_of[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": names} for names, g in zip(names_per_group, state["param_groups"])]}


def cat_completions(pieces: list, pad_id: int):
    """Concatenate per-prompt rollouts (rollout.Completions) into one, right-padding ids with pad_id."""
    from .rollout import Completions

    if len(pieces) == 1:
        return pieces[0]
    width = max(p.ids.shape[1] for p in pieces)
    pad = torch.nn.functional.pad
    return Completions(ids=torch.cat([pad(p.ids, (0, width - p.ids.shape[1]), value=pad_id) for p in pieces]),
                       mask=torch.cat([pad(p.mask, (0, width - p.mask.shape[1]), value=0) for p in pieces]),
                       truncated=torch.cat([p.truncated for p in pieces]))


# Settings that decide which code runs while loading a model: never taken from the folder being exported.
