"""Full-state checkpoints that never lose work: atomic writes, exact resume, kill-anywhere safety.

Cut point
---------
A checkpoint is taken at the END of a training step: after the optimizer step, the scheduler step and
logging. Nothing is in flight at that moment -- no rollout half generated, no gradients half
accumulated -- so the only state that matters is the model weights, the optimizer, the LR scheduler,
the RNG streams and a small JSON of counters (step, epoch, samples consumed, sampler state, best
metric). Rollout buffers and accumulation state are never saved because they are always empty there.

Layout of `output_dir/checkpoint-<step>/`
-----------------------------------------
    model/                 written by the caller's `save_model` callback (HF format; LoRA: adapter only)
    optimizer.pt           optimizer.state_dict()          (absent in a weights-only checkpoint)
    scheduler.pt           scheduler.state_dict()          (absent in a weights-only checkpoint)
    rng_state_<rank>.pt    python / numpy / torch / CUDA RNG states (absent in a weights-only checkpoint)
    trainer_state.json     counters, best metric, config hash, library versions, weights_only flag
    config.yaml            the run's config tree
    manifest.json          written LAST: every other file's relative path, size and sha256

Atomicity
---------
Everything is written into `output_dir/.tmp-checkpoint-<step>`, each file fsync'ed, then the manifest is
written and fsync'ed, the folder fsync'ed, and only then renamed to `checkpoint-<step>` (a rename is
atomic on POSIX file systems) and `output_dir` fsync'ed. A process killed at any instant leaves either
the previous checkpoints untouched plus a `.tmp-*` folder that everyone ignores, or a complete new
checkpoint. A checkpoint counts as valid only when its manifest exists and every file matches it, so
bit rot or a half-copied folder is detected before resuming, and `resume=auto` falls back to an older
valid checkpoint.

Safety
------
All `.pt` files are read with `torch.load(weights_only=True)`: a checkpoint folder from elsewhere can
hold only tensors and plain containers, never pickled code that runs on load. Sharded (DCP) state goes
through safe_load.py, model weights through safetensors only, configs through JSON / yaml.safe_load.

This module depends only on the standard library, torch, numpy and yaml: it must stay importable
without transformers / accelerate (the model itself is written by the caller's callback).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import random
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
import yaml

from vlmrl.config import config_hash
from vlmrl.checkpoints.faults import maybe_signal
from vlmrl.checkpoints.run_manifest import is_owned, record
from vlmrl.config import resume_harmless
from importlib import metadata

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
CONFIG_FILE = "config.yaml"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
MODEL_DIR = "model"
SHARDED_DIR = "sharded"  # FSDP2 SHARDED_STATE_DICT: torch.distributed.checkpoint files (model + optimizer)
FORMAT_VERSION = 1

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
_TMP_PREFIX = ".tmp-checkpoint-"
# A valid checkpoint being replaced by a new save of the same step is parked here for a moment.
_OLD_PREFIX = ".old-checkpoint-"

Warn = Callable[[str], None]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (invalid, unsafe, weights-only, incompatible config); the message says why."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (disk full, I/O error); the previous checkpoints are intact."""


# ---------------------------------------------------------------- small file-system helpers
def rng_file(rank: int = 0) -> str:
    """File name of one rank's RNG state inside a checkpoint."""
    return f"rng_state_{rank}.pt"


def checkpoint_step(path: str | Path) -> Optional[int]:
    """The step of a `checkpoint-<step>` folder, or None when the name does not match."""
    m = _CHECKPOINT_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def _fsync_file(path: Path) -> None:
    """Flush one file's data to disk (files written by a callback included)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Persist a folder's entries (new names, renames). Some platforms cannot open folders; skip there."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        # EINVAL: the file system does not support fsync on folders; nothing more can be done.
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_text_synced(path: Path, text: str) -> None:
    """Write text and fsync it before returning."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _torch_save(obj: Any, path: Path) -> None:
    """torch.save into an open file so that it can be fsync'ed before the manifest vouches for it."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files_under(root: Path) -> list[Path]:
    """Every regular file under `root`, sorted, as paths relative to `root` (the manifest excluded)."""
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            rel = (Path(dirpath) / name).relative_to(root)
            if rel.as_posix() != MANIFEST:
                out.append(rel)
    return sorted(out)


def _rmtree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# Messages of writers that report a failed write as something other than OSError: torch's zip stream writer
# (a full disk surfaces as "unexpected pos N vs M"), and OS error texts that libraries wrap in their own types.
_STORAGE_MESSAGES = (
    "unexpected pos",
    "PytorchStreamWriter failed",
    "file write failed",
    "No space left",
    "Disk quota exceeded",
    "Read-only file system",
    "Permission denied",
    "Input/output error",
    "StorageFull",
)


def is_storage_error(e: Optional[BaseException]) -> bool:
    """Whether an exception raised while writing files comes from the storage (full disk, quota, permissions,
    read-only file system, I/O error) rather than from a bug: an OSError anywhere in its cause chain, safetensors'
    SafetensorError (its Rust writer's I/O errors), torch's stream-writer RuntimeError, or a DCP
    CheckpointException (a BaseException) whose per-rank failures are any of these."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":
            return True
        if isinstance(e, RuntimeError) and any(m in str(e) for m in _STORAGE_MESSAGES):
            return True
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint: {rank: (exception, traceback)}
        if isinstance(failures, dict) and any(is_storage_error(v[0] if isinstance(v, tuple) else v) for v in failures.values()):
            return True
        e = e.__cause__ or e.__context__
    return False


def _storage_reason(e: BaseException, folder: Path) -> str:
    """First line of the error, plus the free space left where it was written (a full disk explains itself)."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    reason = lines[0] if lines else type(e).__name__
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        reason += f" ({shutil.disk_usage(probe).free / 2**20:.1f} MiB free on that file system)"
    except OSError:
        pass
    return reason


def save_folder_atomically(folder: str | Path, write: Callable[[Path], None]) -> Path:
    """Write a folder (output_dir/final) by `write(tmp)` into `.tmp-<name>`, fsync it, then swap it in for any
    previous one (only one vlmrl wrote: run_manifest.py). A failure leaves the previous folder as it was; a storage error (is_storage_error) raises
    CheckpointSaveError naming the folder, anything else propagates."""
    folder = Path(folder)
    tmp, old = folder.parent / f".tmp-{folder.name}", folder.parent / f".old-{folder.name}"
    if folder.exists() and not is_owned(folder):
        raise CheckpointError(f"refusing to replace {folder}: vlmrl did not write it (move it out, or pick another training.output_dir)")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _rmtree(tmp)
        tmp.mkdir()
        write(tmp)
        for rel in _files_under(tmp):
            _fsync_file(tmp / rel)
        for dirpath, _dirs, _files in os.walk(tmp):
            _fsync_dir(Path(dirpath))
        maybe_signal("final-save")
        record(folder.parent, [folder.name])  # claimed before it appears: a kill after the rename leaves it ours
        if folder.exists():
            _rmtree(old)
            os.rename(folder, old)
        os.rename(tmp, folder)
        _fsync_dir(folder.parent)
        _rmtree(old)
    except BaseException as e:
        storage = isinstance(e, Exception) and is_storage_error(e)
        reason = _storage_reason(e, folder.parent) if storage else ""
        _rmtree(tmp)
        if old.exists() and not folder.exists():
            os.rename(old, folder)  # the swap failed half-way: the previous folder gets its name back
        if storage:
            raise CheckpointSaveError(f"could not write {folder}: {reason}") from e
        raise
    return folder


# ---------------------------------------------------------------- state collection
def _versions() -> dict[str, Optional[str]]:
    """Library versions for the record; metadata lookups only, so transformers is never imported."""

    out: dict[str, Optional[str]] = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "peft", "vlmrl"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def rng_state() -> dict[str, Any]:
    """All RNG streams as tensors and plain values, so that a weights_only torch.load can read them back."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        # numpy arrays are not loadable under weights_only=True; a tensor of the same keys is.
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    # Only when CUDA is already in use: initialising it just to read untouched default states is wasteful.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _plain_scheduler_state(state: dict) -> dict:
    """Keep only entries a weights_only load accepts; callables and custom objects are rebuilt by the caller anyway."""

    def plain(v: Any) -> bool:
        if v is None or isinstance(v, (bool, int, float, str, torch.Tensor)):
            return True
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        if isinstance(v, dict):
            return all(isinstance(k, (str, int)) and plain(x) for k, x in v.items())
        return False

    return {k: v for k, v in state.items() if plain(v)}


# ---------------------------------------------------------------- save
def save_checkpoint(
    output_dir: str | Path,
    step: int,
    *,
    save_model: Callable[[Path], None],
    optimizer: Any = None,
    scheduler: Any = None,
    trainer_state: dict,
    config: dict,
    rank: int = 0,
    weights_only: bool = False,
    save_total_limit: Optional[int] = None,
    warn: Warn = print,
    rng_states: Optional[dict[int, dict]] = None,
) -> Path:
    """Write `output_dir/checkpoint-<step>` atomically and return its path.

    `save_model(folder)` writes the model (HF format) into `folder`. `trainer_state` holds the loop's
    counters (epoch, samples_consumed, sampler_state, best_metric, best_step, ...) and must be JSON
    serialisable; global_step, config_hash, versions and weights_only are added here. With
    `weights_only` the optimizer, scheduler and RNG are not saved (such a checkpoint cannot resume
    exactly). `rng_states` ({rank: state}, several processes) writes one `rng_state_<rank>.pt` per process
    instead of this process's own. A storage error while writing (is_storage_error: OSError, torch's "unexpected pos",
    safetensors' SafetensorError, ...) raises CheckpointSaveError; the temporary folder is removed
    and earlier checkpoints are untouched. After a successful save, `save_total_limit` rotates old
    checkpoints (the newest and the best, `trainer_state["best_step"]`, are always kept).
    """
    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f"{_TMP_PREFIX}{step}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        _rmtree(tmp)  # a stale folder from a killed save of the same step
        tmp.mkdir()
        _write_contents(
            tmp,
            step,
            save_model=save_model,
            optimizer=optimizer,
            scheduler=scheduler,
            trainer_state=trainer_state,
            config=config,
            rank=rank,
            weights_only=weights_only,
            rng_states=rng_states,
        )
        _write_manifest(tmp, step)
        # Rotation and overwrite touch only what the run folder's manifest lists; the name is claimed before the
        # rename, so a kill right after it leaves a checkpoint the resumed run owns.
        record(output_dir, [final.name])
        _move_into_place(tmp, final)
    except BaseException as e:
        storage = isinstance(e, Exception) and is_storage_error(e)  # full disk, permissions, read-only FS, I/O: any writer's form
        reason = _storage_reason(e, output_dir) if storage else ""  # free space measured before the cleanup frees it
        _rmtree(tmp)  # never leave half a checkpoint behind, whatever went wrong (KeyboardInterrupt too)
        if storage:
            raise CheckpointSaveError(
                f"could not write checkpoint {final} (step {step}): {reason}; earlier checkpoints in {output_dir} are intact"
            ) from e
        raise
    if save_total_limit is not None:
        try:
            rotate_checkpoints(output_dir, save_total_limit, best_step=trainer_state.get("best_step"), warn=warn, check_hashes=False)
        except OSError as e:
            # The new checkpoint is safely written; failing to delete old ones must not stop the run.
            warn(f"checkpoint rotation in {output_dir} failed: {e}")
    return final


def _write_contents(
    tmp: Path,
    step: int,
    *,
    save_model,
    optimizer,
    scheduler,
    trainer_state: dict,
    config: dict,
    rank: int,
    weights_only: bool,
    rng_states: Optional[dict[int, dict]] = None,
) -> None:
    """Every file except the manifest, each fsync'ed."""
    model_dir = tmp / MODEL_DIR
    model_dir.mkdir()
    save_model(model_dir)
    for rel in _files_under(model_dir):
        _fsync_file(model_dir / rel)
    if not weights_only:
        if optimizer is not None:
            _torch_save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
        if scheduler is not None:
            _torch_save(_plain_scheduler_state(scheduler.state_dict()), tmp / SCHEDULER_FILE)
        for r, state in (rng_states or {rank: rng_state()}).items():
            _torch_save(state, tmp / rng_file(r))
    state = dict(trainer_state)
    state.update(
        global_step=step,
        weights_only=weights_only,
        config_hash=config_hash(config),
        versions=_versions(),
        format_version=FORMAT_VERSION,
        saved_at=time.time(),
        has_optimizer=optimizer is not None and not weights_only,
        has_scheduler=scheduler is not None and not weights_only,
    )
    try:
        text = json.dumps(state, indent=2, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"trainer_state for {tmp.parent / f'checkpoint-{step}'} is not JSON serialisable: {e}") from e
    write_text_synced(tmp / TRAINER_STATE, text)
    write_text_synced(tmp / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False))


def _write_manifest(tmp: Path, step: int) -> None:
    """Hash every file, then write the manifest last and persist the folder's entries."""
    files = {}
    for rel in _files_under(tmp):
        p = tmp / rel
        files[rel.as_posix()] = {"size": p.stat().st_size, "sha256": _sha256(p)}
    write_text_synced(tmp / MANIFEST, json.dumps({"format_version": FORMAT_VERSION, "step": step, "files": files}, indent=2))
    for dirpath, _dirs, _files in os.walk(tmp):
        _fsync_dir(Path(dirpath))


def _move_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished folder to its final name; an existing one is parked aside first, then deleted."""
    maybe_signal("checkpoint-save")
    parent = final.parent
    if final.exists():
        old = parent / f"{_OLD_PREFIX}{checkpoint_step(final)}"
        _rmtree(old)
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:
            os.rename(old, final)  # put the previous one back so that nothing is lost
            raise
        _fsync_dir(parent)
        _rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(parent)


# ---------------------------------------------------------------- verify / list / find
def verify_checkpoint(path: str | Path, check_hashes: bool = True) -> tuple[bool, str]:
    """(True, "ok") when the manifest exists and every file matches it; otherwise (False, reason).

    `check_hashes=False` compares sizes only (cheap; used when rotating after each save).
    """
    path = Path(path)
    manifest_path = path / MANIFEST
    if not path.is_dir():
        return False, f"{path} is not a folder"
    if not manifest_path.is_file():
        return False, f"no {MANIFEST} (the save did not finish)"
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
        entries = [(rel, int(e["size"]), str(e["sha256"])) for rel, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return False, f"unreadable {MANIFEST}: {e}"
    for rel, size, _digest in entries:
        p = path / rel
        if not p.is_file():
            return False, f"missing file {rel}"
        actual = p.stat().st_size
        if actual != size:
            return False, f"size mismatch for {rel} ({actual} bytes, manifest says {size})"
    if check_hashes:
        for rel, _size, digest in entries:
            if _sha256(path / rel) != digest:
                return False, f"sha256 mismatch for {rel} (file changed or corrupted)"
    return True, "ok"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """`checkpoint-<step>` folders in output_dir, oldest step first; temporary folders are ignored."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def find_resume_checkpoint(output_dir: str | Path, resume: str, warn: Warn = print) -> Optional[Path]:
    """The checkpoint to resume from: "never" -> None, a path -> that one (must be valid),
    "auto" -> the newest valid one in output_dir (invalid ones are reported and skipped; when there are
    checkpoints but none is valid, CheckpointError: starting over would lose them), else None."""
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not path.exists():
            raise CheckpointError(f"training.resume={resume}: {path} does not exist")
        ok, reason = verify_checkpoint(path)
        if not ok:
            hint = ""
            if list_checkpoints(path):
                hint = f"; it holds checkpoints itself: name one of them, e.g. {list_checkpoints(path)[-1]}"
            raise CheckpointError(f"training.resume={resume}: checkpoint {path} is invalid: {reason}{hint}")
        return path
    _recover_parked(Path(output_dir), warn)
    invalid = []
    for path in reversed(list_checkpoints(output_dir)):
        ok, reason = verify_checkpoint(path)
        if ok:
            return path
        warn(f"skipping invalid checkpoint {path}: {reason}; trying an older one")
        invalid.append(f"{path.name}: {reason}")
    if invalid:
        # Starting over here would train from step 0 and later rotate these away: never without being asked.
        raise CheckpointError(
            f"every checkpoint in {output_dir} is invalid ({'; '.join(invalid)}); refusing to start over from step 0. "
            f"Repair or restore a checkpoint, or set training.resume=never to start a new run in this folder (its "
            f"checkpoints then replace these), or use a new training.output_dir"
        )
    return None


def _recover_parked(output_dir: Path, warn: Warn) -> None:
    """Undo a replacement killed between its two renames: the parked checkpoint gets its name back."""
    if not output_dir.is_dir():
        return
    for old in output_dir.iterdir():
        if old.is_dir() and old.name.startswith(_OLD_PREFIX):
            final = output_dir / ("checkpoint-" + old.name[len(_OLD_PREFIX) :])
            if not final.exists() and verify_checkpoint(old, check_hashes=False)[0]:
                os.rename(old, final)
                warn(f"restored {final} from {old} (a save of the same step was interrupted)")


# ---------------------------------------------------------------- rotation
def rotate_checkpoints(
    output_dir: str | Path, save_total_limit: Optional[int], best_step: Optional[int] = None, warn: Warn = print, check_hashes: bool = True
) -> list[Path]:
    """Delete checkpoints beyond `save_total_limit` (oldest first), invalid ones and stale temporary folders.

    The newest valid checkpoint and the best one (`best_step`) are never deleted, even when that keeps
    more than the limit. Returns the deleted paths.
    """
    output_dir = Path(output_dir)
    deleted: list[Path] = []
    if not output_dir.is_dir():
        return deleted
    _recover_parked(output_dir, warn)
    # Leftovers of killed saves; rotation runs after a save finished, so none of these is in progress.
    for p in output_dir.iterdir():
        if p.is_dir() and (p.name.startswith(_TMP_PREFIX) or p.name.startswith(_OLD_PREFIX)):
            _rmtree(p)
            deleted.append(p)
    valid = []
    for p in list_checkpoints(output_dir):
        if not is_owned(p):
            continue  # e.g. a Hugging Face Trainer checkpoint-500 the user keeps there: not vlmrl's to delete
        ok, reason = verify_checkpoint(p, check_hashes=check_hashes)
        if ok:
            valid.append(p)
        else:
            warn(f"deleting invalid checkpoint {p}: {reason}")
            shutil.rmtree(p)
            deleted.append(p)
    if save_total_limit is None or not valid:
        return deleted
    keep = {valid[-1]} | {p for p in valid if best_step is not None and checkpoint_step(p) == best_step}
    for p in reversed(valid):  # fill the remaining slots with the newest
        if len(keep) >= save_total_limit:
            break
        keep.add(p)
    for p in valid:
        if p not in keep:
            shutil.rmtree(p)
            deleted.append(p)
    return deleted


# ---------------------------------------------------------------- load
def unpickling_reason(e: BaseException) -> str:
    """The line of an unpickling error that says what was refused (torch's weights_only message starts with advice
    on how to load the file anyway, which is the opposite of what an untrusted checkpoint needs)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("WeightsUnpickler error"):
            return line.split(" Please use ")[0]  # torch goes on with how to allowlist the global
    return lines[0] if lines else type(e).__name__


def safe_torch_load(path: str | Path) -> Any:
    """torch.load restricted to tensors and plain containers; anything else is a CheckpointError."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # UnpicklingError and friends: the file holds more than tensors
        raise CheckpointError(
            f"refusing to load {path}: it is not a plain tensor file (weights_only=True rejected it: {unpickling_reason(e)})"
        ) from e


def read_trainer_state(path: str | Path) -> dict:
    """trainer_state.json of a checkpoint."""
    p = Path(path) / TRAINER_STATE
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {p}: {e}") from e


def read_checkpoint_config(path: str | Path) -> dict:
    """The config tree a checkpoint was written with (for check_resume_compat)."""
    p = Path(path) / CONFIG_FILE
    try:
        return yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointError(f"cannot read {p}: {e}") from e


def is_weights_only(path: str | Path) -> bool:
    """Whether a checkpoint holds the model weights only (no optimizer, scheduler, RNG)."""
    return bool(read_trainer_state(path).get("weights_only", False))


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Model and optimizer live in `path/sharded` (torch.distributed.checkpoint), not in model/ and optimizer.pt."""
    return read_trainer_state(path).get("state_format") == "sharded"


def load_training_state(path: str | Path, optimizer: Any = None, scheduler: Any = None) -> dict:
    """Load optimizer and scheduler states (when given) and return trainer_state.

    The model is loaded by the caller from `path/model`. A weights-only checkpoint raises
    CheckpointError: it cannot continue a run exactly.
    """
    path = Path(path)
    state = read_trainer_state(path)
    if state.get("weights_only"):
        raise CheckpointError(
            f"checkpoint {path} holds model weights only (saved with training.save_only_model=true): it has no "
            f"optimizer, scheduler or RNG state, so the run cannot resume exactly. Set "
            f"training.resume_weights_only=true to start a new schedule from its weights."
        )
    if optimizer is not None:
        try:
            optimizer.load_state_dict(safe_torch_load(path / OPTIMIZER_FILE))
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{path / OPTIMIZER_FILE} does not fit this optimizer (different parameters or param groups?): {e}") from e
    if scheduler is not None:
        saved = safe_torch_load(path / SCHEDULER_FILE)
        # Entries dropped at save time (callables) stay as the freshly built scheduler has them.
        merged = {**scheduler.state_dict(), **saved}
        scheduler.load_state_dict(merged)
    return state


def restore_rng(path: str | Path, rank: int = 0, warn: Warn = print) -> None:
    """Restore python, numpy, torch and CUDA RNG streams from a checkpoint (weights_only load)."""
    path = Path(path)
    set_rng_state(safe_torch_load(path / rng_file(rank)), warn, where=str(path / rng_file(rank)))


def set_rng_state(state: dict, warn: Warn = print, where: str = "the saved RNG state") -> None:
    """Set python, numpy, torch and CUDA RNG streams to `state` (as rng_state returns it)."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda:
        if not torch.cuda.is_available():
            warn(f"{where} has CUDA RNG states but CUDA is not available; they are not restored")
            return
        count = torch.cuda.device_count()
        if count != len(cuda):
            warn(f"{where} has {len(cuda)} CUDA RNG states for {count} visible devices; restoring the first {min(count, len(cuda))}")
        for i in range(min(count, len(cuda))):
            torch.cuda.set_rng_state(cuda[i], device=i)


def _as_tuple(x: Any) -> Any:
    """random.setstate wants tuples all the way down; a loader may hand back lists."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------- config compatibility
_ABSENT = object()


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _fmt(v: Any) -> str:
    if v is _ABSENT:
        return "<absent>"
    return repr(v) if isinstance(v, str) else json.dumps(v)


def _is_harmless(key: str) -> bool:

    return resume_harmless(key)


def _same_path(old: Any, new: Any) -> bool:
    """A checkpoint written before paths were anchored at load (config.anchor_paths) recorded `data/x.jsonl` where the
    config now holds its absolute form: the same path, not a change (the inputs' fingerprints still decide)."""
    return isinstance(old, str) and isinstance(new, str) and bool(old) and not os.path.isabs(old) and os.path.abspath(old) == new


def config_diff(old: dict, new: dict, defaults: Optional[dict] = None) -> tuple[list[str], list[str]]:
    """(breaking, harmless) differences between two config trees, as lines like `algorithm.beta: 0.0 -> 0.04`.

    Harmless: logging.*, and training keys about saving, evaluation, run length, resuming and device; and a
    setting the checkpoint's config does not have (added to vlmrl after it was written) that the new config
    leaves at its default (`defaults`: the default config tree), since a new setting's default keeps the old
    behaviour. Everything else changes what the run computes, so it breaks exact resume.
    """
    a, b = _flatten(old), _flatten(new)
    d = _flatten(defaults) if defaults is not None else {}
    breaking, harmless = [], []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if va == vb or _same_path(va, vb):
            continue
        line = f"{key}: {_fmt(va)} -> {_fmt(vb)}"
        if key == "training.max_steps" and _flatten(new).get("optim.lr_scheduler_type", "constant") != "constant":
            line += " (the LR schedule follows the new length from here on)"
        added_at_default = va is _ABSENT and key in d and vb == d[key]
        if added_at_default:
            line += " (a setting newer than the checkpoint, at its default)"
        (harmless if (_is_harmless(key) or added_at_default) else breaking).append(line)
    return breaking, harmless


def check_resume_compat(old: dict, new: dict, force: bool = False, warn: Warn = print, defaults: Optional[dict] = None) -> None:
    """Refuse a resume whose config changed in a way that breaks equivalence, unless `force`."""
    breaking, harmless = config_diff(old, new, defaults)
    if breaking:
        listing = "\n  " + "\n  ".join(breaking)
        if not force:
            raise CheckpointError(
                f"the config changed since the checkpoint in ways that break an exact resume:{listing}\n"
                f"restore those values, start a fresh run (training.resume=never or a new output_dir), or set "
                f"training.resume_force=true to resume anyway"
            )
        warn(f"resuming despite config changes (training.resume_force=true):{listing}")
    if harmless:
        warn("config changes since the checkpoint (harmless for resuming):\n  " + "\n  ".join(harmless))


# ---------------------------------------------------------------- graceful stop
class GracefulStop:
    """Turn SIGTERM / SIGINT into a flag that the loop checks at the end of each step.

        with GracefulStop() as stop:
            for step in ...:
                ...  # train one step
                if stop.requested: save_checkpoint(...); break

    A second SIGINT while a stop is already requested raises KeyboardInterrupt, so Ctrl-C twice still
    quits at once. Previous handlers are restored on exit. Outside the main thread handlers cannot be
    installed; the flag then simply never gets set.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._signum: Optional[int] = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self._signum is not None

    @property
    def signum(self) -> Optional[int]:
        return self._signum

    @property
    def signal_name(self) -> Optional[str]:
        return None if self._signum is None else signal.Signals(self._signum).name

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop by hand (same effect as receiving `signum`)."""
        if self._signum is None:
            self._signum = signum

    def _handle(self, signum: int, frame: Any) -> None:
        if self._signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.request(signum)

    def __enter__(self) -> "GracefulStop":
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                break
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
