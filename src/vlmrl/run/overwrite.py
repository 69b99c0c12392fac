"""`training.overwrite_output_dir=true`: start over in a folder that holds an earlier vlmrl run, safely.

Only what vlmrl wrote into a run folder (its manifest, run_manifest.py) is ever deleted. The folder is refused,
with one line and nothing touched, when it holds anything else (it may be the user's own folder), or when the run's
own inputs (model.name_or_path, data files, training.resume) lie in what would be deleted (e.g. training again from
the same folder's final/). Kept: the lock this run holds, `data/` (the built-in task's generated files, which
the preflight may have just written for this run and which are rewritten byte for byte anyway) and `bad_rows.jsonl`
(the preflight has just written this run's list of dropped rows there, or removed the earlier one).

Deleting: every entry is first renamed into one `.vlmrl-overwritten-<pid>` folder (renames in one folder are atomic),
then that folder is removed. A kill in between leaves only that folder, which the next overwrite removes too.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable

from vlmrl.config import ConfigError
from vlmrl.checkpoints.run_manifest import LOCK_FILE, MANIFEST_FILE, data_inputs, forget, foreign_names, is_owned, owned_names

KEPT = {LOCK_FILE, MANIFEST_FILE, "data", "bad_rows.jsonl"}
TRASH_PREFIX = ".vlmrl-overwritten-"


class OverwriteRefused(ConfigError):
    """training.overwrite_output_dir=true on a folder vlmrl will not empty (user-fixable: the message says how)."""


def is_run_entry(path: Path) -> bool:
    """Whether `path` (a direct child of a run folder) is something vlmrl wrote there (run_manifest.py)."""
    return is_owned(path)


def foreign_entries(output_dir: str | Path) -> list[str]:
    """Names of the entries in output_dir that vlmrl did not write (sorted)."""
    return foreign_names(output_dir)


def entries_to_delete(output_dir: str | Path) -> list[Path]:
    """The earlier run's entries an overwrite removes: what vlmrl wrote (its manifest) and its temporary names,
    except KEPT; sorted by name."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    owned = owned_names(out)
    return sorted((p for p in out.iterdir() if p.name not in KEPT and (p.name in owned or is_owned(p))), key=lambda p: p.name)


def _inputs(cfg) -> dict[str, str]:
    """The run's own inputs that must survive the overwrite: {config key: path}."""
    items = {"model.name_or_path": cfg.model.name_or_path, **data_inputs(cfg.data), "data.eval_path": cfg.data.eval_path}
    if cfg.training.resume not in ("auto", "never"):
        items["training.resume"] = cfg.training.resume
    return {k: v for k, v in items.items() if v}


def _inside(path: str, folder: Path) -> bool:
    try:
        Path(path).expanduser().resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def plan_overwrite(cfg) -> list[Path]:
    """What training.overwrite_output_dir=true would delete in training.output_dir; raises OverwriteRefused (nothing
    touched) when the folder holds files vlmrl did not write, is not a vlmrl run folder, or holds the run's inputs."""
    out = Path(cfg.training.output_dir)
    if out.exists() and not out.is_dir():
        raise OverwriteRefused(f"training.output_dir={out} is a file, not a folder; pick another training.output_dir")
    doomed = entries_to_delete(out)
    foreign = foreign_entries(out)
    if foreign and not any(p.name in owned_names(out) for p in doomed):
        raise OverwriteRefused(
            f"training.overwrite_output_dir=true: {out} is not a vlmrl run folder (vlmrl wrote none of "
            f"{', '.join(foreign[:5])}); nothing deleted. Pick another training.output_dir"
        )
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise OverwriteRefused(
            f"training.overwrite_output_dir=true: {out} holds files no vlmrl run writes ({shown}); vlmrl deletes only its "
            "own run folders. Move them out, or pick another training.output_dir"
        )
    for key, value in _inputs(cfg).items():
        hit = next((p for p in doomed if _inside(value, p)), None)
        if hit is not None:
            raise OverwriteRefused(
                f"training.overwrite_output_dir=true would delete {hit}, which {key}={value} uses; copy it out of "
                f"{out} first, or pick another training.output_dir"
            )
    return doomed


def remove_entries(output_dir: str | Path, doomed: list[Path], log: Callable[[str], Any] = print) -> None:
    """Delete `doomed` (from plan_overwrite): renamed into one trash folder first, then removed."""
    if not doomed:
        return
    out = Path(output_dir)
    trash = out / f"{TRASH_PREFIX}{os.getpid()}"
    trash.mkdir(exist_ok=True)
    for path in doomed:
        if path != trash:
            os.rename(path, trash / path.name)
    shutil.rmtree(trash)
    forget(out, [p.name for p in doomed])
    names = [p.name for p in doomed if not p.name.startswith(TRASH_PREFIX)]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    log(f"training.overwrite_output_dir=true: deleted the earlier run in {out} ({shown}); starting over at step 0")
