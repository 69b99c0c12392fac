"""One run per output_dir, and what a run folder says between runs.

- **Lock** (`RunLock`): `output_dir/.vlmrl-run.lock`, held with flock for the run's whole life and holding the
  holder's PID, host and start time. A second run on the same folder is refused with those; a lock whose holder is
  gone (flock is released by the kernel when a process dies, SIGKILL included) is taken over with a message naming
  the previous holder. Removed when the run ends.
- **Start** (`prepare_run`): every refusal comes before anything is written: all checkpoints invalid, config
  changed, a weights-only checkpoint, a finished run. Only then `config.yaml` is written and the log files are cut
  back to the step the run continues from, so each step appears once.
- **Finish** (`run_complete.json`): written when the last step is done; running the same command again then says
  the run is complete instead of training it again.

`guard_run_folder` wraps `train` with the lock and the completion marker; only the main process (rank 0) holds the
lock and writes (the other processes of a multi-process run share the main process's decisions).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional

from vlmrl.checkpoints.files import CheckpointError
from vlmrl.config import ConfigError

LOCK_FILE = ".vlmrl-run.lock"
COMPLETE_FILE = "run_complete.json"


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


def mark_complete_if_finished(cfg) -> None:
    """After train() returned: when metrics.jsonl ends at training.max_steps every step is done (a preempted run
    stops earlier, and the log is cut back to the resumed step at each start), so write the completion marker."""
    from vlmrl.run.tracking import read_jsonl

    out = Path(cfg.training.output_dir)
    steps = [r.get("step") for r in read_jsonl(out / "metrics.jsonl") if isinstance(r.get("step"), int)]
    if steps and steps[-1] == cfg.training.max_steps:
        write_complete(out, cfg.training.max_steps, "train")


def write_complete(out: Path, step: int, kind: str) -> None:
    """The completion marker: the run (`kind` train or sft) did all its `step` steps."""
    from vlmrl.checkpoints.files import _write_text

    _write_text(out / COMPLETE_FILE, json.dumps({"step": step, "kind": kind, "finished": time.time(), "final": (out / "final").is_dir()}))


def guard_run_folder(fn: Callable) -> Callable:
    """Decorator for train(cfg, log=..., ...): the main process holds output_dir's lock for the call and marks the
    run complete when it reached training.max_steps."""

    @functools.wraps(fn)
    def wrapper(cfg, *args: Any, **kwargs: Any) -> Any:
        from vlmrl.engine.device import env_world

        if env_world()[1] != 0:
            return fn(cfg, *args, **kwargs)
        log = kwargs.get("log") or (args[0] if args else print)
        with RunLock(cfg.training.output_dir, log):
            result = fn(cfg, *args, **kwargs)
            mark_complete_if_finished(cfg)
            return result

    return wrapper


# ---------------------------------------------------------------- start of a run
def prepare_run(cfg, log: Callable[[str], Any] = print, dist=None) -> Optional[Path]:
    """The checkpoint this run resumes from (None: from step 0), decided by the main process and shared with all.

    Everything that can refuse (all checkpoints invalid, config changed, weights-only checkpoint, finished run)
    runs before anything is written; then config.yaml is written and the log files are cut back to the step the
    run continues from. A refusal raises the same exception on every process."""
    if dist is None or dist.world_size == 1:
        return _prepare(cfg, log)
    outcome: Any = None
    if dist.is_main:
        try:
            path = _prepare(cfg, log)
            outcome = ("ok", None if path is None else str(path))
        except (CheckpointError, RunAlreadyComplete, ConfigError) as e:
            kinds = {RunAlreadyComplete: "complete", CheckpointError: "error", ConfigError: "config"}
            outcome = (next(k for cls, k in kinds.items() if isinstance(e, cls)), str(e))
    kind, value = dist.broadcast(outcome)
    if kind in ("complete", "error", "config"):
        raise {"complete": RunAlreadyComplete, "error": CheckpointError, "config": ConfigError}[kind](value)
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


def _prepare(cfg, log: Callable[[str], Any]) -> Optional[Path]:
    from vlmrl.checkpoints.files import (
        check_resume_compat,
        checkpoint_step,
        find_resume_checkpoint,
        is_weights_only,
        read_checkpoint_config,
        read_trainer_state,
    )
    from vlmrl.config import Config, save_config, to_dict
    from vlmrl.defaults import describe
    from vlmrl.run.overwrite import plan_overwrite, remove_entries
    from vlmrl.run.tracking import cut_logs

    t = cfg.training
    out = Path(t.output_dir)
    doomed = plan_overwrite(cfg) if t.overwrite_output_dir else []  # refuses (nothing touched) on foreign files
    # With overwrite_output_dir the earlier run's checkpoints and completion marker do not count.
    resume = "never" if t.overwrite_output_dir and t.resume == "auto" else t.resume
    path = find_resume_checkpoint(out, resume, warn=log)  # refuses when every checkpoint is invalid
    done = None if t.overwrite_output_dir else read_complete(out)
    # A finished run continues only to train longer, from a checkpoint; anything else would silently train it again.
    if done is not None and not (t.resume != "never" and path is not None and t.max_steps > done["step"]):
        raise RunAlreadyComplete(complete_message(out, done))
    start = 0
    if path is not None:
        check_resume_compat(read_checkpoint_config(path), to_dict(cfg), t.resume_force, warn=log, defaults=to_dict(Config()))
        if is_weights_only(path):
            if not t.resume_weights_only:
                raise CheckpointError(
                    f"{path} holds weights only (save_only_model); it cannot resume a run exactly. "
                    "Set training.resume_weights_only=true to start a NEW schedule from its weights."
                )
        else:
            start = int(read_trainer_state(path).get("global_step", checkpoint_step(path)))
            log(f"resuming from {path} at step {start} of {t.max_steps} (training.overwrite_output_dir=true starts over instead)")
    # Nothing refused: from here on the folder is this run's.
    log(describe(cfg))  # which defaults the fields left unset got (model.defaults), and why
    remove_entries(out, doomed, log)
    if done is not None:
        (out / COMPLETE_FILE).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    cut_logs(out, start, log)
    return path


# ---------------------------------------------------------------- vlmrl sft
def guard_sft_folder(fn: Callable) -> Callable:
    """Decorator for sft(cfg, log=...): the rules of `vlmrl train` for output_dir, without resume (SFT has no
    checkpoints): a complete SFT run is reported complete (RunAlreadyComplete) unless
    training.overwrite_output_dir=true deletes it first; an unfinished one starts over with its logs cut back;
    the lock is held for the call, and the completion marker written when it returns."""

    @functools.wraps(fn)
    def wrapper(cfg, *args: Any, **kwargs: Any) -> Any:
        from vlmrl.engine.device import env_world

        if env_world()[0] > 1:
            return fn(cfg, *args, **kwargs)  # sft refuses several processes itself, before touching the folder
        log = kwargs.get("log") or (args[0] if args else print)
        out = Path(cfg.training.output_dir)
        with RunLock(out, log):
            prepare_sft_run(cfg, log)
            result = fn(cfg, *args, **kwargs)
            write_complete(out, cfg.sft.projector_steps + cfg.sft.steps, "sft")
            return result

    return wrapper


def prepare_sft_run(cfg, log: Callable[[str], Any] = print) -> None:
    """Refusals first (a complete run, an overwrite vlmrl will not do), then the folder is this run's."""
    from vlmrl.config import save_config
    from vlmrl.defaults import describe
    from vlmrl.run.overwrite import plan_overwrite, remove_entries
    from vlmrl.run.tracking import cut_logs

    out = Path(cfg.training.output_dir)
    doomed = plan_overwrite(cfg) if cfg.training.overwrite_output_dir else []
    done = None if cfg.training.overwrite_output_dir else read_complete(out)
    if done is not None:
        raise RunAlreadyComplete(complete_message(out, done))
    log(describe(cfg))
    remove_entries(out, doomed, log)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    cut_logs(out, 0, log)  # an unfinished earlier SFT run: SFT does not resume, its logged steps are replaced


# ---------------------------------------------------------------- vlmrl check
def describe_output_dir(cfg) -> str:
    """What `vlmrl train` / `sft` would do with training.output_dir, read-only (checkpoints are verified when the run
    starts, not here: hashing a large one takes minutes)."""
    from vlmrl.checkpoints.files import checkpoint_step, list_checkpoints
    from vlmrl.run.overwrite import OverwriteRefused, plan_overwrite

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
        return f"{head} vlmrl train resumes from {t.resume} (training.resume)"
    found = list_checkpoints(out) if t.resume == "auto" else []
    if found:
        return f"{head} vlmrl train resumes from {found[-1].name} (step {checkpoint_step(found[-1])} of {t.max_steps}); vlmrl sft would start over"
    if (out / "metrics.jsonl").is_file():
        return f"{head} an unfinished run without a checkpoint: it starts over at step 0 (its logged steps are replaced)"
    return f"{head} new run"
