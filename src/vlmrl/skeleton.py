"""One run skeleton for GRPO (train.py) and SFT (sft.py): what every run does around its steps.

    begin -> per step: [before_step] -> the step (inside kept_last_good) -> evaluate between steps -> fault point
    "step" -> preemption agreed by every process -> checkpoint when due -> [after_save] -> stop or next step
    -> the shared ending (ending.finish: final model, last evaluation, report, completion marker)

A loop gives the skeleton its `Steps` (what a step is, which phase it was in, its checkpoint, its evaluations);
the skeleton owns stop signals (SIGTERM / SIGINT finish the step, write a checkpoint and return), the last good
step (run/last_good.py), checkpoint cadence (save_due) and the ending. What every run holds is `RunBase`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from vlmrl.checkpoints.faults import maybe_signal
from vlmrl.checkpoints.files import GracefulStop
from vlmrl.checkpoints.state import save_final
from vlmrl.config import Config
from vlmrl.ending import Ending, finish
from vlmrl.run.last_good import kept_last_good, save_due

if TYPE_CHECKING:
    from transformers import ProcessorMixin

    from vlmrl.rewards.protocol import RewardFn
    from vlmrl.data.sampler import PromptSampler
    from vlmrl.engine.distributed import Distributed
    from vlmrl.models.prefix import LogprobOptions
    from vlmrl.models.router import Routing
    from vlmrl.plan.estimate import Plan
    from vlmrl.run.datasets import Datasets
    from vlmrl.run.tracking import RunLogger


@dataclass(kw_only=True)
class RunBase:
    """What every run holds for its whole length (GRPO's `Run` and SFT's `SFTRun` add their own)."""

    cfg: Config
    out: Path  # training.output_dir
    dist: Distributed  # world, rank, engine, collectives (one process: all trivial)
    device: torch.device
    model: torch.nn.Module
    processor: ProcessorMixin  # the model's transformers processor (any family's class)
    data: Datasets  # train and eval rows, reports
    reward_funcs: dict[str, RewardFn]  # name -> reward function (rewards/scoring.load_reward_funcs)
    sampler: PromptSampler  # which rows each step draws; its state is checkpointed
    logger: RunLogger
    log: Callable[[str], None]  # the caller's log function (main process; others: a no-op)
    opts: LogprobOptions  # how log-probs are computed (memory features)
    plan: Plan | None  # the planner's prediction, logged next to the measured peak
    routing: Routing | None  # an MoE model's router.Routing (its load-balancing loss), else None
    state: dict[str, Any]  # step, best_metric, best_step (and what each loop keeps in checkpoints)
    optimizer: torch.optim.Optimizer | None = None  # SFT: the current stage's, set when the stage is entered
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    saved_at: float = field(default_factory=time.monotonic)  # when the last checkpoint was written (or the run started)


class Steps(Protocol):
    """What a loop gives the skeleton. `phases` is the step's own dict of phase timings (time/<phase>)."""

    run: RunBase
    kind: str  # the completion marker's kind: "train" or "sft"
    title: str  # the report's title: "GRPO" or "SFT"
    summary_keys: tuple[str, ...]  # metrics in the summary table

    def total(self) -> int:
        """The last step of the run."""

    def begin(self) -> None:
        """Before the first step (inside the stop handler): e.g. SFT enters the stage a resumed run restores."""

    def before_step(self, step: int) -> None:
        """Before `step`'s last-good point (GRPO: peak memory reset; SFT: enter the step's stage)."""

    def step(self, step: int, phases: dict, final: dict) -> dict:
        """Run `step`; returns the run's metrics so far (what `train` / `sft` return)."""

    def where(self, phases: dict) -> str:
        """The phase a failed step was in, for its one error line."""

    def evaluate_between(self, step: int) -> dict:
        """After a step that is not the last: evaluation when due; metrics merged into the returned ones."""

    def checkpoint(self, step: int) -> None:
        """Write checkpoint-<step>."""

    def after_save(self, step: int) -> None:
        """After the checkpoint decision (GRPO: stop on a run of non-finite steps)."""

    def evaluate_final(self, stop) -> dict:
        """The last evaluation, of the final weights (stops between batches when `stop.requested`)."""


def run_steps(steps: Steps, stop_after: int | None = None, final: dict | None = None) -> dict:
    """Steps from the one after run.state["step"] to steps.total(), then the ending; returns the final metrics.
    `stop_after` simulates a stop (SIGTERM) after that step (tests, benchmarks)."""
    run = steps.run
    final = dict(final or {})
    # SIGTERM / SIGINT set stop.requested; the step in progress finishes, then a checkpoint is written. In the ending
    # the final save finishes and the evaluation stops between batches (ending.py). The logger is closed on the way
    # out (trackers told whether the run failed).
    with GracefulStop() as stop, run.logger:
        steps.begin()
        while run.state["step"] < steps.total():
            step = run.state["step"] + 1
            steps.before_step(step)
            phases: dict[str, float] = {}
            # A step that raises: the checkpoint of the step before (if it can be), one line naming step and phase.
            with kept_last_good(
                step,
                run.sampler,
                run.scheduler,
                functools.partial(steps.where, phases),
                steps.checkpoint,
                run.out,
                run.dist.world_size,
                run.logger.info,
            ):
                final = steps.step(step, phases, final)
            run.state["step"] = step
            last = step == steps.total()
            if not last:  # the last evaluation runs after the final model is safe on disk (the ending)
                final.update(steps.evaluate_between(step))
            maybe_signal("step")
            preempted = run.dist.any(stop.requested or (stop_after is not None and step >= stop_after))  # all stop together
            if save_due(run.cfg.training, step, last, preempted, run.saved_at, run.dist):
                steps.checkpoint(step)
            steps.after_save(step)
            if preempted and not last:
                why = stop.signal_name or f"stop_after={stop_after}"
                run.logger.info(f"stopped by {why} after step {step}; run the same command again to resume (training.resume=auto)")
                return final
        return end_run(steps, final, stop)


def end_run(steps: Steps, final: dict, stop) -> dict:
    """The shared ending (ending.finish): the final model saved first, then the last evaluation (whose failure is
    reported and loses nothing), trackers, report, summary and the completion marker."""
    run = steps.run
    end = Ending(run.cfg, run.out, run.dist, run.logger, run.log, steps.kind, steps.title, steps.summary_keys, run.state["step"])
    return finish(end, final, stop, steps.evaluate_final, functools.partial(save_final_model, run))


def save_final_model(run: RunBase, folder: Path) -> None:
    """`folder` (output_dir/final): the plain model (LoRA merged) and its processor, written atomically."""
    from vlmrl.models.loading import save_model

    save_final(run.model, run.processor, folder, run.dist, save_model, run.cfg, run.log)
