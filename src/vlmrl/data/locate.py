"""Where a data path's rows are: its split notation, the split files of a downloaded hub dataset, and what to say
when the path is not there.

- ``path::split`` (vlmrl) and ``path@split`` (EasyR1's ``data.train_files=hiyouga/geometry3k@train``) name a split.
  ``@`` counts only when the whole text is not an existing path, so a file name holding ``@`` still reads as a file.
- A hub-style dataset folder, as ``huggingface-cli download --repo-type dataset`` leaves it: data files named by
  their split (``data/train-00000-of-00001.parquet``, ``test.jsonl``, or ``train/*.parquet``) in the folder or its
  ``data/`` subfolder. `hub_splits` lists them; the split to read is the one named, else the caller's default
  (data.train_path reads ``train``, as EasyR1 and ``datasets.load_dataset`` do; data.eval_path must name one).
- Nothing is downloaded at run time: a path that does not exist but looks like a hub id (``owner/name``) gets the
  download line in its message.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SPLIT_SEP = "::"
EASYR1_SPLIT_SEP = "@"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
# `train-00000-of-00003.parquet`, `train-00000-of-00003-5f2c1a.parquet` (older hub shards), `train.parquet`.
SPLIT_FILE_RE = re.compile(r"^(?P<split>[A-Za-z][\w.]*?)(?:-\d{5}-of-\d{5}(?:-[0-9a-f]+)?)?\.(?:parquet|jsonl|json)$")
SPLIT_NAME_RE = re.compile(r"^[A-Za-z][\w.-]*$")
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def split_path(path: str | os.PathLike) -> tuple[Path, str | None]:
    """``"data/ds::train"`` or ``"data/ds@train"`` -> (Path("data/ds"), "train"); a path without either has no split."""
    text = os.fspath(path)
    if SPLIT_SEP in text:
        base, split = text.rsplit(SPLIT_SEP, 1)
        return Path(base), split or None
    base, sep, split = text.rpartition(EASYR1_SPLIT_SEP)
    if sep and base and SPLIT_NAME_RE.match(split) and not Path(text).expanduser().exists():
        return Path(base), split
    return Path(text), None


def is_saved_dataset(folder: Path) -> bool:
    """A ``datasets.save_to_disk`` folder (a Dataset's state.json, or a DatasetDict's dataset_dict.json)."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


def hub_splits(folder: Path) -> dict[str, list[Path]]:
    """{split: its data files in name order} of a hub-style dataset folder (see the module docstring); {} when the
    folder holds no data files named by a split. Files directly in the folder win over its ``data/`` subfolder."""
    for where in (folder, folder / "data"):
        if not where.is_dir():
            continue
        splits: dict[str, list[Path]] = {}
        for entry in sorted(where.iterdir()):
            if entry.is_file() and (m := SPLIT_FILE_RE.match(entry.name)):
                splits.setdefault(m["split"], []).append(entry)
            elif entry.is_dir() and entry.name != "data" and SPLIT_NAME_RE.match(entry.name):  # data/ is looked into next
                files = sorted(p for p in entry.iterdir() if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
                if files:
                    splits.setdefault(entry.name, []).extend(files)
        if splits:
            return splits
    return {}


def missing_path_message(path: Path, split: str | None) -> str:
    """Why `path` cannot be read (it does not exist), with the download line when it looks like a hub dataset id."""
    text = os.fspath(path)
    if HUB_ID_RE.match(text) and path.suffix.lower() not in DATA_SUFFIXES:
        name = text.rsplit("/", 1)[-1]
        return (
            f"{text}: no such file or folder. vlmrl reads local data only (nothing is downloaded at run time); for the hub "
            f"dataset {text} download it first (huggingface-cli download {text} --repo-type dataset --local-dir {name}) and "
            f"point the field to the folder: {name}{SPLIT_SEP}{split or 'train'}"
        )
    return f"{text}: no such file or folder"
