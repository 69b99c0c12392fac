"""The end of a run, written once for GRPO (`vlmrl train`) and SFT (`vlmrl sft`): the final model saved safely, the
last evaluation, the trackers' summary, the report and the summary table, then the completion marker.

Kill-anywhere holds here as in the step loop. The caller runs the ending inside its `GracefulStop`, so a SIGTERM /
SIGINT during the final save only sets a flag: the save finishes (it is atomic: a SIGKILL leaves the previous state
and a `.tmp-final` that nothing reads). Once the final model is on disk the ending marker (rundir.ENDING_FILE) says
"training done, the ending is left"; a stop asked for before or during the evaluation ends it between batches with
one line and exit 0, and running the same command again finishes what was left (evaluation, report, summary) from
`final/` instead of training again (`finish_left`). The completion marker is written last, when nothing is left.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from vlmrl.config import Config
from vlmrl.evaluate import EvaluationStopped
from vlmrl.checkpoints.faults import maybe_signal
from vlmrl.run.rundir import clear_ending, write_complete, write_ending
from vlmrl.checkpoints.files import GracefulStop
from vlmrl.engine.device import resolve_device
from vlmrl.evaluate import evaluate_on
from vlmrl.rewards.scoring import load_reward_funcs
from vlmrl.run.datasets import load_datasets
from vlmrl.run.tracking import RunLogger, read_jsonl, tracker_options

if TYPE_CHECKING:
    from vlmrl.engine.distributed import Distributed


@dataclass
class Ending:
    """What the ending needs of a run (GRPO's `Run` and SFT's `SFTRun` both provide it)."""

    cfg: Config
    out: Path
    dist: Distributed
    logger: RunLogger
    log: Callable[[str], None]  # the main process's log (others: a no-op)
    kind: str  # "train" or "sft": the completion marker's kind
    title: str  # "GRPO" or "SFT": the report's and the summary table's title
    summary_keys: tuple[str, ...]  # metrics shown in the summary table (with every eval/*)
    step: int  # the last step (every step is done)


def finish(end: Ending, final: dict, stop, evaluate: Callable[[object], dict], save: Callable[[Path], None] | None) -> dict:
    """After the last step: `save(final_folder)` (None: nothing to save), then `evaluate(stop) -> metrics` (its failure
    is reported and loses nothing; a stop ends it, resumable), then trackers, report, summary and the completion
    marker. Every process calls it."""
    cfg, dist = end.cfg, end.dist
    if save is not None and cfg.training.save_final_model:
        save(end.out / "final")
    if dist.is_main:
        write_ending(end.out, end.step, end.kind)
    if dist.any(stop.requested):
        return stopped(end, final, stop, "the final model was saved" if cfg.training.save_final_model else "the last step")
    maybe_signal("final-eval")
    try:
        evaluated = evaluate(stop)
        final.update(evaluated)
        if dist.is_main:  # logged once: a rerun after a kill from here on finishes the report without evaluating again
            write_ending(end.out, end.step, end.kind, evaluated)
    except EvaluationStopped:
        return stopped(end, final, stop, "the final model was saved, during the final evaluation")
    except Exception as e:  # noqa: BLE001 - training is already on disk; say what failed and keep it
        end.logger.info(
            f"ERROR: the final evaluation failed ({type(e).__name__}: {e}); training finished and is saved in "
            f"{end.out / 'final' if cfg.training.save_final_model else end.out}. Run `vlmrl eval` on it after fixing the cause."
        )
        final["eval/failed"] = 1.0
    end.logger.close()  # trackers get the final summary; the bar ends before the report and the summary table
    if not dist.is_main:
        return final
    maybe_signal("report")
    if cfg.logging.report:
        from vlmrl.run.report import make_report

        make_report(end.out, title=f"{end.title}: {end.out.name} ({cfg.model.name_or_path})")
    if cfg.logging.progress_bar:
        from vlmrl.run.report import summary_table

        shown = {k: v for k, v in final.items() if k in end.summary_keys or k.startswith("eval/")}
        summary_table({k: f"{v:.4g}" for k, v in shown.items()}, title=f"{end.title} finished: {end.out}")
    maybe_signal("complete")
    write_complete(end.out, end.step, end.kind)
    clear_ending(end.out)
    return final


def stopped(end: Ending, final: dict, stop, after: str) -> dict:
    """A stop asked for during the ending: one line, the logger closed, no completion marker (the rerun finishes)."""
    why = stop.signal_name or "a stop request"
    end.logger.info(f"stopped by {why} after {after}; run the same command again to finish the evaluation and the report")
    end.logger.close()
    return final


def finish_left(cfg: Config, log, left, kind: str, title: str, summary_keys: tuple[str, ...]) -> dict:
    """A rerun of a run whose training is done but whose ending was stopped or killed (`left`: rundir.EndingLeft):
    the evaluation (of `final/`), report, summary and completion marker, without training again."""
    from vlmrl.models.judge import local_judge_on
    from vlmrl.models.policy import load_policy

    out, dist, step = Path(cfg.training.output_dir), left.dist, left.step
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("step") == step]
    final = {k: v for k, v in (rows[-1] if rows else {}).items() if k not in ("step", "time")}
    logger = RunLogger(out, total_steps=step, initial_step=step, **tracker_options(cfg), progress=False, desc=title, is_main_process=dist.is_main)
    end = Ending(cfg, out, dist, logger, log, kind, title, summary_keys, step)
    log(f"the training in {out} finished ({step} steps); finishing what was left: the final evaluation and the report")
    model = None
    if left.evaluated is not None:  # the final evaluation was done and logged; the report was left
        log("the final evaluation was done before the stop; writing the report")
        with GracefulStop() as stop, logger.closed_on_error():
            return finish(end, final, stop, lambda _: dict(left.evaluated), save=None)
    if (out / "final").is_dir():
        # final/ is a plain merged model: evaluated as it is, LoRA already merged.
        plain = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=str(out / "final"), use_lora=False))
        device = dist.device(resolve_device(cfg.training.device))
        model, processor = load_policy(plain, device)
        data = load_datasets(cfg, need_train=False, processor=processor)
        reward_funcs, _ = load_reward_funcs(cfg, local_judge_on(device))

    def evaluate(stop) -> dict:
        if model is None or not data.eval:
            return {}
        samples: list = []
        metrics = evaluate_on(
            dist, model, processor, data.eval, cfg, reward_funcs, device, logger.info, samples=samples if kind == "sft" else None, stop=stop
        )
        logger.log_eval(step, metrics)
        logger.log_samples(step, [{"kind": "eval", **sample} for sample in samples])
        return metrics

    with GracefulStop() as stop, logger.closed_on_error():
        return finish(end, final, stop, evaluate, save=None)
