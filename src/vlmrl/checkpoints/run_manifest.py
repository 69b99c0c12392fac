"""What vlmrl wrote in a run folder: `output_dir/.vlmrl-run.json`, so it deletes or replaces nothing else.

The manifest lists the top-level names (files and folders) of training.output_dir that vlmrl wrote. Rotation,
training.overwrite_output_dir and the replacement of `final/` act only on listed names; anything else in the folder
(a base model kept in `final/`, a Hugging Face Trainer `checkpoint-500/`, a hand-written `config.yaml`, notes) is the
user's. When a run starts (and in `vlmrl check`, which calls the same `check_output_dir`) a user's entry under a name
the run would write is refused in one line before anything is written, and so are the run's own inputs (model,
data, reward files) inside the folder: the run would replace or delete them.

Names are recorded when a run claims them (after those refusals, so every claimed name is absent or vlmrl's) and
when a checkpoint is written. A folder written by a vlmrl version before the manifest ("legacy") is recognised by
files only a run writes (metrics.jsonl, run_complete.json, or a checkpoint whose trainer_state.json carries
vlmrl's config_hash); then its run-named entries count as vlmrl's, except checkpoints that are not vlmrl's.

Standard library only (checkpoint.py imports it and must stay free of transformers).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

if TYPE_CHECKING:
    from vlmrl.config import DataConfig

MANIFEST_FILE = ".vlmrl-run.json"
LOCK_FILE = ".vlmrl-run.lock"
COMPLETE_FILE = "run_complete.json"
# What a run writes at the top of output_dir (tracking.py, rundir.py, report.py, runtime.py: the built-in task's data).
ENDING_FILE = "run_ending.json"  # the ending's progress marker (ending.py)
RUN_FILES = frozenset(
    {"config.yaml", "metrics.jsonl", "eval.jsonl", "eval.json", "samples.jsonl", "report.png", "bad_rows.jsonl", COMPLETE_FILE, ENDING_FILE}
)
RUN_DIRS = frozenset({"tb", "final", "wandb", "data"})
CHECKPOINT_RE = re.compile(r"^checkpoint-\d+$")
# vlmrl's own bookkeeping and the temporary / parked names of its atomic writes (checkpoint.py, tracking.py, overwrite.py).
INTERNAL_PATTERNS = (
    re.compile(rf"^{re.escape(MANIFEST_FILE)}$"),
    re.compile(rf"^{re.escape(LOCK_FILE)}$"),
    re.compile(r"^\.(tmp|old)-.+$"),
    re.compile(r"^\..+\.tmp$"),
    re.compile(r"^\.vlmrl-overwritten-.+$"),
)


def is_internal(name: str) -> bool:
    """vlmrl's bookkeeping files and temporary names: never the user's, never listed."""
    return any(p.match(name) for p in INTERNAL_PATTERNS)


def is_run_name(name: str) -> bool:
    """A name a run writes (so a user's entry under it would be replaced or deleted)."""
    return name in RUN_FILES or name in RUN_DIRS or bool(CHECKPOINT_RE.match(name))


def read_manifest(output_dir: str | Path) -> Optional[set[str]]:
    """The names listed in output_dir's manifest; None when there is none (or it is unreadable)."""
    try:
        data = json.loads((Path(output_dir) / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    names = data.get("entries") if isinstance(data, dict) else None
    return {n for n in names if isinstance(n, str)} if isinstance(names, list) else None


def _write(output_dir: Path, names: set[str]) -> None:
    """Atomically (temporary file, fsync, rename): a kill leaves the old or the new list, never half of one."""
    path = output_dir / MANIFEST_FILE
    tmp = output_dir / f".{MANIFEST_FILE}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"written_by": "vlmrl", "entries": sorted(names)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def record(output_dir: str | Path, names: Iterable[str]) -> None:
    """Add `names` (top-level entries vlmrl wrote or claims) to the manifest, creating it (and the folder)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    current = owned_names(out)
    new = current | {n for n in names if not is_internal(n)}
    if new != current or read_manifest(out) is None:
        _write(out, new)


def forget(output_dir: str | Path, names: Iterable[str]) -> None:
    """Drop `names` (deleted by vlmrl) from the manifest."""
    out = Path(output_dir)
    current = read_manifest(out)
    if current is not None:
        _write(out, current - set(names))


def _is_vlmrl_checkpoint(path: Path) -> bool:
    try:
        state = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and "config_hash" in state


def _legacy_names(out: Path) -> set[str]:
    """The run entries of a folder written before the manifest existed (see the module docstring)."""
    present = [p for p in out.iterdir() if is_run_name(p.name)]
    ours_ckpt = {p.name for p in present if CHECKPOINT_RE.match(p.name) and p.is_dir() and _is_vlmrl_checkpoint(p)}
    if not ((out / "metrics.jsonl").is_file() or (out / COMPLETE_FILE).is_file() or ours_ckpt):
        return set()
    return {p.name for p in present if not CHECKPOINT_RE.match(p.name) and not p.is_symlink()} | ours_ckpt


def owned_names(output_dir: str | Path) -> set[str]:
    """Top-level names of output_dir that vlmrl wrote: the manifest's, or for a legacy folder its run entries."""
    out = Path(output_dir)
    listed = read_manifest(out)
    if listed is not None:
        return listed
    return _legacy_names(out) if out.is_dir() else set()


def is_owned(path: str | Path) -> bool:
    """Whether `path` (a direct child of a run folder) is vlmrl's to delete or replace."""
    path = Path(path)
    return is_internal(path.name) or path.name in owned_names(path.parent)


def foreign_names(output_dir: str | Path) -> list[str]:
    """Entries of output_dir vlmrl did not write (sorted)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    owned = owned_names(out)
    return sorted(p.name for p in out.iterdir() if not is_internal(p.name) and p.name not in owned)


def _inside(path: str, folder: Path) -> bool:
    try:
        Path(path).expanduser().resolve().relative_to(folder.resolve())
    except (ValueError, OSError):
        return False
    return True


def reward_files(specs: Iterable[str]) -> list[str]:
    """The .py files named by reward specs (path/to/file.py:function, ...:factory(...))."""
    files = []
    for spec in specs:
        target = spec.split("(", 1)[0].rsplit(":", 1)[0] if ":" in spec else ""
        if target.endswith(".py"):
            files.append(target)
    return files


def data_inputs(d: DataConfig) -> dict[str, str]:
    """{config key: path} of data.train_path (`d`: cfg.data): one key, or one per file of a list (data.train_path[i])."""
    value = d.train_path
    if isinstance(value, str):
        return {"data.train_path": value}
    return {f"data.train_path[{i}]": v for i, v in enumerate(value)}


def run_inputs(cfg) -> dict[str, str]:
    """The run's inputs a run folder must not hold: {config key: path}."""
    items = {"model.name_or_path": cfg.model.name_or_path, **data_inputs(cfg.data), "data.eval_path": cfg.data.eval_path}
    for i, f in enumerate(reward_files(cfg.algorithm.reward_funcs)):
        items[f"algorithm.reward_funcs[{i}]"] = f
    return {k: v for k, v in items.items() if v}


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)  # root passes os.access even there
    except (OSError, AttributeError):
        return False


def output_dir_problem(cfg) -> Optional[str]:
    """Why training.output_dir cannot hold this run (one line), or None. Read-only: `vlmrl check` and the start of
    `train` / `sft` ask the same question before anything is written."""
    out = Path(cfg.training.output_dir).expanduser()
    if out.exists() and not out.is_dir():
        return f"training.output_dir={out} is a file, not a folder; pick another training.output_dir"
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"training.output_dir={out}: {probe} is a file, not a folder; pick another training.output_dir"
    if not os.access(probe, os.W_OK | os.X_OK) or _read_only_mount(probe):
        return f"training.output_dir={out}: {probe} is not writable; pick a folder you can write to"
    owned = owned_names(out) if out.is_dir() else set()
    for key, value in run_inputs(cfg).items():
        if _inside(value, out) and not any(_inside(value, out / n) for n in owned if n == "data"):
            return (
                f"{key}={value} lies inside training.output_dir={out}, which the run writes into (its final/, "
                f"checkpoints, config.yaml); move it out of {out} or pick another training.output_dir"
            )
    clash = [n for n in foreign_names(out) if is_run_name(n)]
    if clash:
        shown = ", ".join(clash[:5]) + (f" and {len(clash) - 5} more" if len(clash) > 5 else "")
        return (
            f"training.output_dir={out} holds {shown}, which vlmrl did not write but a run would replace or delete; "
            f"move {'them' if len(clash) > 1 else 'it'} out of {out} or pick another training.output_dir"
        )
    return None


def claim_run_names(output_dir: str | Path) -> None:
    """After output_dir_problem found nothing: the names this run writes are vlmrl's from now on."""
    record(output_dir, RUN_FILES | RUN_DIRS)
