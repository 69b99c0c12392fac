"""One run per output_dir, and what a run folder says between runs.

- **Lock** (`RunLock`): `output_dir/.vlmrl-run.lock`, held with flock for the run's whole life and holding the
  holder's PID, host and start time. A second run on the same folder is refused with those; a lock whose holder is
  gone (flock is released by the kernel when a process dies, SIGKILL included) is taken over with a message naming
  the previous holder. Removed when the run ends.
- **Start** (`prepare_run`): every refusal comes before anything is written: all checkpoints invalid, config
  changed, a weights-only checkpoint, a finished run. Only then `config.yaml` is written and the log files are cut
  back to the step the run continues from, so each step appears once.
- **Ending** (`run_ending.json`): written once the last step is done and the final model is on disk; while it is
  there the evaluation / report of the ending are left (a stop or a kill during them), and running the same command
  again finishes those instead of training again (ending.py).
- **Finish** (`run_complete.json`): written when nothing is left (ending.finish); running the same command again then
  says the run is complete instead of training it again.

`guard_run_folder` wraps `train` and `sft` with the lock; only the main process (rank 0) holds the lock and writes
(the other processes of a multi-process run share the main process's decisions).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from vlmrl.checkpoints.files import CheckpointError
from vlmrl.config import ConfigError
from vlmrl.checkpoints.files import (
    write_text_synced,
    check_resume_compat,
    checkpoint_step,
    find_resume_checkpoint,
    is_weights_only,
    list_checkpoints,
    read_checkpoint_config,
    read_trainer_state,
)
from vlmrl.checkpoints.fingerprints import changed_inputs, run_fingerprints
from vlmrl.checkpoints.run_manifest import claim_run_names, output_dir_problem
from vlmrl.config import Config, save_config, to_dict
from vlmrl.defaults import describe
from vlmrl.engine.device import env_world
from vlmrl.run.datasets import epochs_as_steps
from vlmrl.run.overwrite import OverwriteRefused, plan_overwrite, remove_entries
from vlmrl.run.tracking import cut_logs

if TYPE_CHECKING:
    from vlmrl.engine.distributed import Distributed

LOCK_FILE = ".vlmrl-run.lock"
COMPLETE_FILE = "run_complete.json"
ENDING_FILE = "run_ending.json"


class RunLockError(ConfigError):
    """Another run holds output_dir (user-fixable: wait, stop it, or pick another folder)."""


class RunAlreadyComplete(Exception):
    """The run in output_dir already finished every step; nothing to do (not an error: the CLI exits 0)."""


# ---------------------------------------------------------------- lock
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = os.read(fd, 4096)
    try:
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime(", started %Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else ""
    return f"PID {holder.get('pid', '?')} on host {holder.get('host', '?')}{when}"


class RunLock:
    """`with RunLock(output_dir, log): ...` holds output_dir for one run (see the module docstring)."""

    def __init__(self, output_dir: str | Path, log: Callable[[str], Any] = print):
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self.log = log
        self.fd: Optional[int] = None
        self.owner = os.getpid()  # a process forked later (by a reward or a tool) never removes the lock

    def acquire(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise RunLockError(
                    f"{self.output_dir} is in use by another vlmrl run ({_describe(holder)}); wait for it to end or stop it, "
                    f"or set training.output_dir to another folder"
                ) from None
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    os.close(fd)
                    raise
                self._refuse_if_held_without_flock(fd)  # a file system without flock: the PID check alone
            # The holder may have removed the file between our open and flock: then this lock guards nothing; retry.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        previous = _read_holder(fd)
        if previous:
            self.log(f"taking over the lock of {self.output_dir} left by {_describe(previous)}: that run is no longer running")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(info).encode())
        os.fsync(fd)
        self.fd = fd
        self.owner = os.getpid()

    def _refuse_if_held_without_flock(self, fd: int) -> None:
        holder = _read_holder(fd)
        pid = holder.get("pid")
        if not holder or pid == os.getpid():
            return
        mine = holder.get("host") == socket.gethostname()
        if not mine or (isinstance(pid, int) and _pid_alive(pid)):
            os.close(fd)
            where = "" if mine else f" (another host: if that run has ended, delete {self.path})"
            raise RunLockError(
                f"{self.output_dir} is in use by another vlmrl run ({_describe(holder)}){where}; wait for it "
                f"to end or stop it, or set training.output_dir to another folder"
            )

    def release(self) -> None:
        if self.fd is None:
            return
        if os.getpid() != self.owner:  # a forked copy of the run: the lock stays the owner's
            os.close(self.fd)
            self.fd = None
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)  # unlinked while still locked, so nobody can lock this inode after us
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


# ---------------------------------------------------------------- completion marker
def read_complete(output_dir: str | Path) -> Optional[dict]:
    """The completion marker of a finished run, or None."""
    path = Path(output_dir) / COMPLETE_FILE
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("step"), int) else None


def write_complete(out: Path, step: int, kind: str) -> None:
    """The completion marker: the run (`kind` train or sft) did all its `step` steps."""

    write_text_synced(out / COMPLETE_FILE, json.dumps({"step": step, "kind": kind, "finished": time.time(), "final": (out / "final").is_dir()}))


def write_ending(out: Path, step: int, kind: str, evaluated: Optional[dict] = None) -> None:
    """The ending marker: the run (`kind` train or sft) did all its `step` steps and saved its final model; its
    evaluation and report are left until the completion marker replaces this. `evaluated`: the final evaluation's
    metrics once it is done and logged (a rerun after a kill in the report does not evaluate, nor log it, twice)."""

    marker = {"step": step, "kind": kind, "final": (out / "final").is_dir()}
    write_text_synced(out / ENDING_FILE, json.dumps({**marker, **({"evaluated": evaluated} if evaluated is not None else {})}))


def read_ending(output_dir: str | Path) -> Optional[dict]:
    """The ending marker of a run whose training is done but whose ending is not, or None."""
    try:
        marker = json.loads((Path(output_dir) / ENDING_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("step"), int) else None


def clear_ending(out: Path) -> None:
    (out / ENDING_FILE).unlink(missing_ok=True)


@dataclass(eq=False)
class EndingLeft(Exception):
    """Raised by prepare_run (and so by train.start_run / sft.start_sft) when training is done and only the ending is
    left: the caller finishes that (ending.finish_left) and trains nothing. Like RunAlreadyComplete, an outcome that
    ends the start of a run, so that the start returns one type (the run)."""

    step: int
    dist: Distributed | None = None  # the run's distributed.Distributed, set by the caller that built it
    evaluated: Optional[dict] = None  # the final evaluation's metrics when it was done before the stop


def guard_run_folder(fn: Callable) -> Callable:
    """Decorator for train(cfg, log=..., ...) and sft(...): the main process holds output_dir's lock for the call
    (the completion marker is the ending's: ending.finish)."""

    @functools.wraps(fn)
    def wrapper(cfg, *args: Any, **kwargs: Any) -> Any:
        if env_world()[1] != 0:
            return fn(cfg, *args, **kwargs)
        log = kwargs.get("log") or (args[0] if args else print)
        with RunLock(cfg.training.output_dir, log):
            cfg = epochs_as_steps(cfg, log)  # the run is complete at the max_steps its epochs give
            return fn(cfg, *args, **kwargs)

    return wrapper


# ---------------------------------------------------------------- start of a run
def check_output_dir(cfg) -> list[Path]:
    """Whether training.output_dir can hold this run, read-only; returns what training.overwrite_output_dir=true
    deletes. Raises ConfigError in one line (OverwriteRefused for the overwrite's own refusals) when the folder is
    a file or not writable, holds a user's entry under a name the run writes, or holds the run's inputs
    (run_manifest.py). `vlmrl check` and the start of train / sft call it alike."""

    doomed = plan_overwrite(cfg) if cfg.training.overwrite_output_dir else []
    problem = output_dir_problem(cfg)
    if problem is not None:
        raise ConfigError(problem)
    return doomed


def prepare_run(cfg, log: Callable[[str], Any] = print, dist=None, total_steps: Optional[int] = None, kind: str = "train") -> Optional[Path]:
    """The checkpoint this run resumes from (None: from step 0), decided by the main process and shared with all;
    raises EndingLeft on every process when training is done and only the ending is left. `total_steps`: the run's steps (default
    training.max_steps; SFT: its stages'), `kind`: train or sft.

    Everything that can refuse (all checkpoints invalid, config changed, weights-only checkpoint, finished run)
    runs before anything is written; then config.yaml is written and the log files are cut back to the step the
    run continues from. A refusal raises the same exception on every process."""
    total = cfg.training.max_steps if total_steps is None else total_steps
    if dist is None or dist.world_size == 1:
        return _prepare(cfg, log, total, kind)
    outcome: Any = None
    if dist.is_main:
        try:
            path = _prepare(cfg, log, total, kind)
            outcome = ("ok", None if path is None else str(path))
        except EndingLeft as left:
            outcome = ("ending", (left.step, left.evaluated))
        except (CheckpointError, RunAlreadyComplete, ConfigError) as e:
            answers = {RunAlreadyComplete: "complete", CheckpointError: "error", ConfigError: "config"}
            outcome = (next(k for cls, k in answers.items() if isinstance(e, cls)), str(e))
    answer, value = dist.broadcast(outcome)
    if answer in ("complete", "error", "config"):
        raise {"complete": RunAlreadyComplete, "error": CheckpointError, "config": ConfigError}[answer](value)
    if answer == "ending":
        raise EndingLeft(value[0], evaluated=value[1])  # (step, evaluated): dist is set by the caller
    return None if value is None else Path(value)


def complete_message(out: Path, done: dict) -> str:
    """What a command says when output_dir holds a finished run."""
    final = f", final model in {out / 'final'}" if (out / "final").is_dir() else ""
    kind = f"vlmrl {done['kind']} " if done.get("kind") in ("sft", "train") else ""
    return (
        f"the {kind}run in {out} is complete ({done['step']} steps{final}); nothing to do. To train again use a new "
        f"training.output_dir, or training.overwrite_output_dir=true to delete that run and start over; to train "
        f"longer raise training.max_steps (continues from the last checkpoint, so it needs one: training.save_steps)"
    )


def other_kind_message(out: Path, done: dict, kind: str) -> str:
    """Why `vlmrl <kind>` refuses a folder holding a finished run of the other kind (a GRPO run on a finished SFT run's
    folder would neither continue it nor start over)."""
    start = f"model.name_or_path={out / 'final'} and " if (out / "final").is_dir() else ""
    return (
        f"training.output_dir={out} holds a finished vlmrl {done['kind']} run ({done['step']} steps), not a vlmrl {kind} "
        f"run; to {'train GRPO' if kind == 'train' else 'fine-tune'} from it use {start}a new training.output_dir "
        f"(training.overwrite_output_dir=true deletes that run instead)"
    )


def refuse_resume(cfg, path: Path, log: Callable[[str], Any] = print) -> None:
    """Every reason resuming `path` is refused (CheckpointError, one message): the config changed in a way that
    breaks an exact resume, the data files or reward sources changed (fingerprints.py), a weights-only checkpoint
    without training.resume_weights_only; training.resume_force accepts the first two with a warning. Read-only:
    `vlmrl check` asks it too."""

    t = cfg.training
    check_resume_compat(read_checkpoint_config(path), to_dict(cfg), t.resume_force, warn=log, defaults=to_dict(Config()))
    changes = changed_inputs(read_trainer_state(path).get("fingerprints"), run_fingerprints(cfg))
    if changes:
        listing = "; ".join(changes)
        if not t.resume_force:
            raise CheckpointError(
                f"the run's inputs changed since {path}: {listing}. Restore them, start a fresh run (training.resume=never "
                f"or a new training.output_dir), or set training.resume_force=true to resume anyway"
            )
        log(f"resuming despite changed inputs (training.resume_force=true): {listing}")
    if is_weights_only(path) and not t.resume_weights_only:
        raise CheckpointError(
            f"{path} holds weights only (save_only_model); it cannot resume a run exactly. "
            "Set training.resume_weights_only=true to start a NEW schedule from its weights."
        )


def _prepare(cfg, log: Callable[[str], Any], total: int, kind: str) -> Optional[Path]:

    t = cfg.training
    out = Path(t.output_dir)
    doomed = check_output_dir(cfg)  # refuses (nothing touched): foreign files, the run's inputs inside, not writable
    # With overwrite_output_dir the earlier run's checkpoints and completion marker do not count.
    resume = "never" if t.overwrite_output_dir and t.resume == "auto" else t.resume
    path = find_resume_checkpoint(out, resume, warn=log)  # refuses when every checkpoint is invalid
    done = None if t.overwrite_output_dir else read_complete(out)
    refuse_complete(t, out, done, path, total, kind)
    ending = None if t.overwrite_output_dir or done is not None else read_ending(out)
    if ending is not None and ending["step"] == total and ending.get("kind", kind) == kind and t.resume != "never":
        log(f"the training in {out} is done ({total} steps); its final evaluation and report are left")
        evaluated = ending.get("evaluated")
        raise EndingLeft(total, evaluated=evaluated if isinstance(evaluated, dict) else None)
    start = resume_step(cfg, path, total, log)
    # Nothing refused: from here on the folder is this run's.
    log(describe(cfg))  # which defaults the fields left unset got (model.defaults), and why
    remove_entries(out, doomed, log)
    if done is not None:
        (out / COMPLETE_FILE).unlink(missing_ok=True)
    clear_ending(out)  # an ending left for fewer steps: this run trains on and ends anew
    out.mkdir(parents=True, exist_ok=True)
    claim_run_names(out)  # every run name is absent or vlmrl's here (check_output_dir): from now on they are listed
    save_config(cfg, out / "config.yaml")
    cut_logs(out, start, log)
    return path


def refuse_complete(t, out: Path, done: dict | None, path: Path | None, total: int, kind: str) -> None:
    """A completed run (`done`: its completion marker) of the other kind is refused; one of this kind continues only
    to train longer, from a checkpoint: anything else would silently train it again (RunAlreadyComplete)."""
    if done is None:
        return
    if done.get("kind") in ("train", "sft") and done["kind"] != kind:
        raise ConfigError(other_kind_message(out, done, kind))
    if not (t.resume != "never" and path is not None and total > done["step"]):
        raise RunAlreadyComplete(complete_message(out, done))


def resume_step(cfg, path: Path | None, total: int, log: Callable[[str], Any]) -> int:
    """The step a run resumes after (0: a fresh start or a weights-only checkpoint); refuses an incompatible resume."""
    if path is None:
        return 0
    refuse_resume(cfg, path, log)
    if is_weights_only(path):
        return 0
    start = int(read_trainer_state(path).get("global_step", checkpoint_step(path)))
    log(f"resuming from {path} at step {start} of {total} (training.overwrite_output_dir=true starts over instead)")
    return start


# ---------------------------------------------------------------- vlmrl check
def describe_output_dir(cfg) -> str:
    """What `vlmrl train` / `sft` would do with training.output_dir, read-only (checkpoints are verified when the run
    starts, not here: hashing a large one takes minutes)."""

    t = cfg.training
    out = Path(t.output_dir)
    head = f"output_dir {out}:"
    if t.overwrite_output_dir:
        try:
            doomed = plan_overwrite(cfg)
        except OverwriteRefused as e:
            return f"{head} {e}"
        return f"{head} new run" + (f" (training.overwrite_output_dir=true deletes the earlier run first: {len(doomed)} entries)" if doomed else "")
    done = read_complete(out)
    if done is not None:
        return f"{head} {complete_message(out, done)}"
    if t.resume not in ("auto", "never"):
        if Path(t.resume).is_dir():
            refuse_resume(cfg, Path(t.resume), lambda _: None)
        return f"{head} vlmrl train resumes from {t.resume} (training.resume)"
    ending = read_ending(out)
    if ending is not None and t.resume != "never":
        return f"{head} the training is done ({ending['step']} steps); the final evaluation and report are left: the same command finishes them"
    found = list_checkpoints(out) if t.resume == "auto" else []
    if found:
        refuse_resume(cfg, found[-1], lambda _: None)  # the refusal train would meet (config, data, rewards changed): exit 2 now
        sft_steps = "" if cfg.sft.epochs is not None else f" of {cfg.sft.projector_steps + cfg.sft.steps}"
        return (
            f"{head} resumes from {found[-1].name} (step {checkpoint_step(found[-1])}: of {t.max_steps} for vlmrl train, "
            f"of its stages' steps{sft_steps} for vlmrl sft)"
        )
    if (out / "metrics.jsonl").is_file():
        return f"{head} an unfinished run without a checkpoint: it starts over at step 0 (its logged steps are replaced)"
    return f"{head} new run"
