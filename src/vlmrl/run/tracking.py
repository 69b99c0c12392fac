"""Run logging: JSONL files (the source of truth), TensorBoard scalars, a tqdm progress bar, and the
trackers TRL users name in ``report_to`` (Weights & Biases, MLflow; optional packages imported only when asked).

Files written under ``output_dir`` (all appended to, so a resumed run continues the same files):

- ``metrics.jsonl``: one line per training step, ``{"step", "time", **metrics}``
- ``eval.jsonl``: one line per evaluation
- ``samples.jsonl``: one line per logged completion, ``{"step", **sample}``
- ``tb/``: TensorBoard event files

``logging.report_to`` (TRL's name) picks the trackers: ``tensorboard`` (the default), ``wandb`` (the
``WANDB_MODE``, ``WANDB_PROJECT``, ``WANDB_DIR`` environment variables are honoured; ``WANDB_MODE=offline``
writes a run folder to sync later), ``mlflow`` (``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME``), ``all``
(TensorBoard and whichever of the others is installed) or ``none``. Each gets the run name and the config
at the start, the step's metrics every ``logging_steps`` with their step, the evaluations, and the final
metrics as a summary at the end.

Non-finite floats are written as ``null`` so every line is strict JSON (``json.loads`` in any language,
``jq``, pandas) rather than Python's non-standard ``NaN``. Only the main process writes anything.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable

from tqdm.auto import tqdm

from vlmrl.config import TRACKERS, report_to_names
import uuid
import dataclasses


def _jsonable(value: Any) -> Any:
    """`value` as plain JSON types: non-finite floats -> None, tensors / numpy values -> Python values,
    anything else unknown -> its str (a log line must never fail to write)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and numpy scalars
        return _jsonable(value.tolist())
    return str(value)


def _scalar(value: Any) -> float | None:
    """`value` as a float for TensorBoard, or None when it is not a number (strings, lists, None)."""
    if isinstance(value, str) or value is None:
        return None
    try:
        return float(value)  # also covers bools, numpy scalars and one-element tensors
    except (TypeError, ValueError):
        return None


def _dump(value: dict) -> str:
    # allow_nan=False is the guarantee that `_jsonable` left no NaN behind.
    return json.dumps(_jsonable(value), allow_nan=False, ensure_ascii=False)


def read_jsonl(path: str | Path) -> list[dict]:
    """All JSON objects in a ``.jsonl`` file ([] if it does not exist). Blank lines and a truncated last
    line (a run killed mid-write) are skipped rather than failing the whole read."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) and math.isfinite(value) else "nan"


def _drop_partial_last_line(path: Path) -> None:
    """A process killed mid-write leaves a line without its newline; appending after it would glue the
    next record onto it. Cut the fragment (it is an incomplete copy of a step that is re-run on resume)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        f.truncate(data.rfind(b"\n") + 1)


# ---------------------------------------------------------------------------------------------------
# Trackers (report_to)

OPTIONAL_TRACKERS = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> the package it needs


class TrackerError(RuntimeError):
    """A tracker named in logging.report_to cannot be used (package missing, or it failed to start)."""


def resolve_report_to(report_to: str | list[str] | tuple[str, ...]) -> list[str]:
    """logging.report_to as the list of trackers to use, in TRACKERS order. ``all`` = TensorBoard and every
    optional tracker whose package is installed (as TRL does); ``none`` (alone) = nothing."""
    names = report_to_names(report_to)
    if "none" in names:
        return []
    if "all" in names:
        return ["tensorboard"] + [t for t, pkg in OPTIONAL_TRACKERS.items() if _installed(pkg)]
    return [t for t in TRACKERS if t in names]


def missing_tracker_packages(trackers: list[str]) -> list[str]:
    """One line per chosen tracker whose package is not installed (checked without importing it)."""
    return [
        f"logging.report_to includes {t} but the {pkg} package is not installed: pip install {pkg}, or remove {t} from logging.report_to"
        for t, pkg in OPTIONAL_TRACKERS.items()
        if t in trackers and not _installed(pkg)
    ]


def _installed(package: str) -> bool:
    """Whether `package` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # in sys.modules without a spec (set up by hand): importable
        return True


def _import_tracker(name: str):
    package = OPTIONAL_TRACKERS[name]
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise TrackerError(
            missing_tracker_packages([name])[0]
            if not _installed(package)
            else f"logging.report_to includes {name} but importing {package} failed: {e}"
        ) from e


def _flat_config(config: dict | None, prefix: str = "") -> dict[str, Any]:
    """{"training": {"seed": 0}} -> {"training.seed": 0}: the form trackers show as a parameter table."""
    out: dict[str, Any] = {}
    for key, value in (config or {}).items():
        if isinstance(value, dict):
            out.update(_flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _numbers(metrics: dict) -> dict[str, float]:
    """The finite numeric entries of `metrics` (trackers reject strings, lists and NaN)."""
    out = {}
    for key, value in metrics.items():
        number = _scalar(value)
        if number is not None and math.isfinite(number):
            out[key] = number
    return out


class WandbTracker:
    """Weights & Biases: one run per RunLogger; WANDB_MODE (online / offline / disabled) is passed through."""

    def __init__(self, output_dir: Path, run_name: str, config: dict | None):
        wandb = _import_tracker("wandb")
        # The run id is kept in output_dir, so a resumed run continues the same W&B run instead of starting another.
        id_file = output_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = uuid.uuid4().hex[:12]
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "vlmrl"),
            name=run_name,
            config=config,
            id=run_id,
            resume="allow",
            dir=os.environ.get("WANDB_DIR", str(output_dir)),
            mode=os.environ.get("WANDB_MODE") or None,
        )

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def finish(self, summary: dict, failed: bool = False) -> None:
        self.run.summary.update(_numbers(summary))
        self.run.finish(exit_code=1 if failed else 0)


def mlflow_key(key: str) -> str:
    """`key` as a name MLflow accepts: characters other than letters, digits, ``_ - . /`` and space become ``_`` (a
    reward named by its file path, ``rewards//data/r.py:f/mean``, would be refused mid-run), and empty, ``.`` or
    ``..`` path segments go (MLflow refuses names that normalise to another one)."""
    parts = [part if part not in (".", "..") else "_" for part in re.sub(r"[^\w./\- ]", "_", key).split("/") if part]
    return "/".join(parts) or "_"


class MlflowTracker:
    """MLflow: one run in MLFLOW_EXPERIMENT_NAME (default vlmrl) at MLFLOW_TRACKING_URI (unset: MLflow's own default,
    ``sqlite:///mlflow.db`` in the current directory for MLflow 3; a ``file:`` store needs MLFLOW_ALLOW_FILE_STORE=true
    there)."""

    PARAMS_PER_CALL = 100  # MLflow's batch limit for parameters

    def __init__(self, output_dir: Path, run_name: str, config: dict | None):
        self.mlflow = _import_tracker("mlflow")
        self.mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", "vlmrl"))
        # The run id is kept in output_dir, so a resumed run continues the same MLflow run (as with W&B).
        id_file = output_dir / "mlflow_run_id"
        previous = id_file.read_text().strip() if id_file.is_file() else ""
        logged = self._params_of(previous)
        if logged is None:  # a new run (or the saved one is not in this tracking store)
            active = self.mlflow.start_run(run_name=run_name)
            run_id = getattr(getattr(active, "info", None), "run_id", None)
            if run_id:
                id_file.write_text(run_id + "\n")
            logged = {}
        else:
            self.mlflow.start_run(run_id=previous)
        # MLflow parameters cannot change once logged: a resume logs only the new ones (a changed logging.* field keeps its first value).
        params = {mlflow_key(k): str(v)[:500] for k, v in _flat_config(config).items() if mlflow_key(k) not in logged}
        items = list(params.items())
        try:
            for start in range(0, len(items), self.PARAMS_PER_CALL):
                self.mlflow.log_params(dict(items[start : start + self.PARAMS_PER_CALL]))
        except Exception:
            self.mlflow.end_run(status="FAILED")  # not left active for the next run in this process
            raise

    def _params_of(self, run_id: str) -> dict | None:
        """The parameters already logged to MLflow run `run_id`; None when there is no such run in this store."""
        if not run_id:
            return None
        try:
            return dict(self.mlflow.tracking.MlflowClient().get_run(run_id).data.params)
        except Exception:  # noqa: BLE001 - another store, a deleted run: start a new one
            return None

    def log(self, metrics: dict, step: int) -> None:
        self.mlflow.log_metrics({mlflow_key(k): v for k, v in _numbers(metrics).items()}, step=step)

    def finish(self, summary: dict, failed: bool = False) -> None:
        self.mlflow.log_metrics({mlflow_key(f"final/{k}"): v for k, v in _numbers(summary).items()})
        self.mlflow.end_run(status="FAILED" if failed else "FINISHED")


EXTERNAL_TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def tracker_options(cfg, run_name: str | None = None) -> dict:
    """RunLogger keyword arguments from a Config: ``tensorboard``, ``report_to`` (the other trackers), ``run_name``
    (default: output_dir's folder name) and ``run_config`` (the whole config, for the trackers' parameter tables)."""

    trackers = resolve_report_to(cfg.logging.report_to)
    return {
        "tensorboard": cfg.logging.tensorboard and "tensorboard" in trackers,
        "report_to": [t for t in trackers if t != "tensorboard"],
        "run_name": run_name or Path(cfg.training.output_dir).name,
        "run_config": dataclasses.asdict(cfg),
    }  # config.to_dict's tree


LOG_FILES = ("metrics.jsonl", "eval.jsonl", "samples.jsonl")


def cut_logs(output_dir: str | Path, step: int, log=print) -> dict[str, int]:
    """Remove the rows of LOG_FILES logged after `step`, the step a run continues from: a run killed after its
    last checkpoint logged steps that the resumed run logs again, and each step must appear once. `step` 0 (a
    fresh start) removes every row with a step. Rows without a step and the rest of each file stay as they are;
    a partial last line (a write cut by a kill) goes. Each file is replaced atomically. Returns {file: rows removed}."""
    removed: dict[str, int] = {}
    for name in LOG_FILES:
        path = Path(output_dir) / name
        if not path.is_file():
            continue
        keep, dropped = [], 0
        for raw in path.read_bytes().split(b"\n"):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except ValueError:
                dropped += 1
                continue
            row_step = row.get("step") if isinstance(row, dict) else None
            if isinstance(row_step, int) and not isinstance(row_step, bool) and (row_step > step or step == 0):
                dropped += 1
                continue
            keep.append(raw)
        if dropped:
            tmp = path.with_name(f".{name}.tmp")
            with tmp.open("wb") as f:
                f.write(b"".join(line + b"\n" for line in keep))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            removed[name] = dropped
            log(f"{path}: removed {dropped} row(s) logged after step {step} (the run continues from step {step}, so they are logged again)")
    return removed


def _memory_summary(metrics: dict) -> list[str]:
    """["gpu=3.1G/plan 3.0G"] on a GPU run (mem/gpu_* logged), ["host=0.43G/plan 0.40G"] on a CPU run; the
    prediction only when the planner made one for that device."""
    gpu = metrics.get("mem/gpu_peak_reserved", metrics.get("mem/gpu_peak_allocated"))
    if gpu is not None:
        label, measured, predicted = "gpu", gpu, metrics.get("plan/peak_reserved")
    elif metrics.get("mem/host_peak_rss") is not None:
        label, measured, predicted = "host", metrics["mem/host_peak_rss"], metrics.get("plan/host_peak_rss")
    else:
        return []
    return [f"{label}={_short(measured)}G" + (f"/plan {_short(predicted)}G" if predicted is not None else "")]


class RunLogger:
    """Logs a training run to JSONL, TensorBoard and a progress bar.

    Args:
        output_dir: the run folder; files are created inside it.
        total_steps: the progress bar's total.
        initial_step: where the bar starts (the step a resumed run continues from).
        logging_steps: TensorBoard scalars (and the plain progress line when ``progress`` is False) are
            written every this many steps; ``metrics.jsonl`` gets every step.
        tensorboard: write event files under ``output_dir/tb``.
        progress: show a tqdm bar; when False a plain line is printed every ``logging_steps`` instead,
            which reads better in a log file than carriage returns.
        is_main_process: when False nothing is written or printed at all (other ranks of a distributed run).
        desc: the bar's label.
        report_to: other trackers (``wandb``, ``mlflow``), started here on the main process only.
        run_name, run_config: what those trackers show the run as (default name: output_dir's folder name).
    """

    def __init__(
        self,
        output_dir: str | Path,
        *,
        total_steps: int,
        initial_step: int = 0,
        logging_steps: int = 1,
        tensorboard: bool = True,
        progress: bool = True,
        is_main_process: bool = True,
        desc: str = "GRPO",
        report_to: Iterable[str] = (),
        run_name: str | None = None,
        run_config: dict | None = None,
    ):
        self.output_dir = Path(output_dir)
        self.total_steps = total_steps
        self.logging_steps = max(1, int(logging_steps))
        self.enabled = is_main_process
        self.progress = progress
        self.desc = desc
        self._files: dict[str, Any] = {}
        self._writer = None
        self._bar = None
        self._closed = False
        self._trackers: list = []
        self._last: dict = {}  # the latest value of every metric, the trackers' final summary
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        name = run_name or self.output_dir.name
        self._start_trackers(list(report_to), name, run_config)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events at or after the resume step that a previous, interrupted run wrote
            # past its last checkpoint, so the curves don't double back on themselves.
            self._writer = SummaryWriter(str(self.output_dir / "tb"), purge_step=initial_step or None, flush_secs=30)
        if progress:
            self._bar = tqdm(total=total_steps, initial=initial_step, desc=desc, dynamic_ncols=True, unit="step")

    def _start_trackers(self, names: list[str], run_name: str, run_config: dict | None) -> None:
        """Start each tracker; one that fails to start (a refused tracking URI, a bad W&B setting) ends the ones
        already started and raises TrackerError, one line naming the tracker and the cause."""
        for tracker in names:
            if tracker not in EXTERNAL_TRACKERS:
                raise ValueError(f"report_to: unknown tracker {tracker!r} (RunLogger takes {', '.join(EXTERNAL_TRACKERS)})")
            try:
                self._trackers.append(EXTERNAL_TRACKERS[tracker](self.output_dir, run_name, run_config))
            except Exception as e:
                for started in self._trackers:
                    started.finish({}, failed=True)
                self._trackers.clear()
                if isinstance(e, TrackerError):
                    raise
                detail = " ".join(str(e).split())
                raise TrackerError(
                    f"logging.report_to includes {tracker} but it failed to start: {type(e).__name__}: {detail[:600]}"
                    " (fix the tracker's settings, or remove it from logging.report_to)"
                ) from e

    # -- files ------------------------------------------------------------------------------------------
    def _append(self, name: str, rows: Iterable[dict]) -> None:
        f = self._files.get(name)
        if f is None:  # opened on first use so runs without eval / samples leave no empty files
            _drop_partial_last_line(self.output_dir / name)
            f = self._files[name] = (self.output_dir / name).open("a", encoding="utf-8")
        for row in rows:
            f.write(_dump(row) + "\n")
        # Flushed per call so `tail -f` and a crash both see every finished step.
        f.flush()

    def _tb(self, step: int, metrics: dict, prefix: str = "") -> None:
        if self._writer is None:
            return
        for key, value in metrics.items():
            number = _scalar(value)
            if number is not None:
                tag = key if not prefix or key.startswith(prefix) else prefix + key
                self._writer.add_scalar(tag, number, step)

    # -- public API -------------------------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Record one training step: a ``metrics.jsonl`` line, TensorBoard scalars every ``logging_steps``,
        and the progress bar moved to `step` with the headline numbers as its postfix."""
        if not self.enabled:
            return
        self._append("metrics.jsonl", [{"step": step, "time": time.time(), **metrics}])
        due = step % self.logging_steps == 0 or step == self.total_steps
        self._last.update(metrics)
        if due:
            self._tb(step, metrics)
            for tracker in self._trackers:
                tracker.log(metrics, step)
        summary = self._summary(metrics)
        if self._bar is not None:
            self._bar.set_postfix_str(summary, refresh=False)
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            else:
                self._bar.refresh()
        elif due:
            tqdm.write(f"{self.desc} step {step}/{self.total_steps} {summary}")

    @staticmethod
    def _summary(metrics: dict) -> str:
        """The short postfix: reward, loss, kl, step time, and the peak memory of the device in use with the planner's
        prediction for that device: ``gpu=`` reserved GiB on a GPU run, ``host=`` peak RSS GiB on a CPU run."""
        parts = [f"{k}={_short(metrics[k])}" for k in ("reward", "loss", "kl") if k in metrics]
        if "time/step" in metrics:
            parts.append(f"step={_short(metrics['time/step'])}s")
        parts += _memory_summary(metrics)
        if metrics.get("no_signal_steps"):  # steps in a row with zero advantages (signals.py)
            parts.append(f"no-signal={metrics['no_signal_steps']}")
        return " ".join(parts)

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """Record an evaluation: an ``eval.jsonl`` line, TensorBoard scalars under ``eval/`` and a printed line."""
        if not self.enabled:
            return
        self._append("eval.jsonl", [{"step": step, "time": time.time(), **metrics}])
        self._tb(step, metrics, prefix="eval/")
        shown = {k if k.startswith("eval/") else f"eval/{k}": v for k, v in metrics.items()}
        self._last.update(shown)
        for tracker in self._trackers:
            tracker.log(shown, step)
        if self._writer is not None:
            self._writer.flush()  # evals are rare and the numbers people look for first
        shown = " ".join(f"{k.removeprefix('eval/')}={_short(_scalar(v))}" for k, v in metrics.items() if _scalar(v) is not None)
        tqdm.write(f"[eval @ step {step}] {shown}")

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Append the given completions (prompt, completion, rewards, advantage, ...) to ``samples.jsonl``."""
        if not self.enabled or not samples:
            return
        self._append("samples.jsonl", ({"step": step, **s} for s in samples))

    def info(self, msg: str) -> None:
        """Print a message above the progress bar without breaking it (main process only)."""
        if self.enabled:
            tqdm.write(str(msg))

    def close(self, failed: bool = False) -> None:
        """Flush and close everything (trackers get the final metrics, and whether the run failed); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        for tracker in self._trackers:
            tracker.finish(self._last, failed=failed)
        for f in self._files.values():
            f.close()
        self._files.clear()

    @contextlib.contextmanager
    def closed_on_error(self):
        """Closes the logger (trackers told the run failed) if the block raises; leaves it open otherwise, for what
        the caller logs after the block (GRPO's final evaluation)."""
        try:
            yield self
        except BaseException:
            self.close(failed=True)
            raise

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failed=exc_type is not None)
