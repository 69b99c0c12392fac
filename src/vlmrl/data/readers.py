"""Reading rows from a data file as it ships: JSONL, JSON, Parquet (also sharded, hub-style folders of splits), a
``datasets.save_to_disk`` folder, an imagefolder. Embedded images are spilled to files while reading
(embedded_images)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


import vlmrl.data.strict_json as strict_json
from vlmrl.data.locate import SPLIT_SEP, hub_splits, is_saved_dataset, missing_path_message, split_path
from vlmrl.data.embedded_images import image_cache_dir, spill_embedded_images
from vlmrl.data.errors import DataError, MissingData
import csv


def load_rows(
    path: str | os.PathLike,
    split: str | None = None,
    *,
    keep_malformed: bool = False,
    image_cache: str | os.PathLike | None = None,
    default_split: str | None = None,
) -> list[dict]:
    """All rows of a data file as dicts, each with ``_source`` for messages.

    Formats: ``.jsonl`` (one object per line; blank lines are ignored), ``.json`` (a list of objects, or
    ``{"data": [...]}``; a ``.json`` file holding JSON lines, as ``Dataset.to_json`` writes, is read as
    JSONL), ``.parquet``, or a ``datasets.save_to_disk`` folder (a DatasetDict needs a split:
    ``split=`` or ``path::split``; EasyR1's ``path@split`` too), or a hub-style dataset folder (split files in the
    folder or its ``data/``: locate.py; without a split ``default_split`` is read, else the splits are listed). A
    pattern in the file name (``data/train-*.parquet``) reads every matching file in name order. Rows are returned as
    read; `validate_rows` checks them.

    A malformed JSONL line or a row that is not an object raises DataError naming the file and line,
    unless ``keep_malformed``: then it becomes ``{"_source": ..., "_malformed": reason}`` so that
    `validate_rows` reports it together with every other bad row (and can skip it).

    Embedded images are written to ``image_cache`` (default `image_cache_dir`) and replaced by their paths
    (see `spill_embedded_images`).
    """
    cache = Path(image_cache) if image_cache is not None else image_cache_dir()
    path, inline_split = split_path(path)
    if split is not None and inline_split is not None and split != inline_split:
        raise DataError(f"{path}: split given twice ({inline_split!r} in the path, {split!r} as argument)")
    split = split or inline_split
    if any(ch in path.name for ch in "*?[") and split is None:
        return _load_shards(path, keep_malformed, cache)
    if not path.exists():
        raise MissingData(missing_path_message(path, split))
    if path.is_dir():
        metadata = imagefolder_metadata(path)
        if metadata is not None:
            if split is not None:
                raise DataError(f"{path}: an imagefolder has no splits; drop {SPLIT_SEP}{split}")
            return load_rows(metadata, keep_malformed=keep_malformed, image_cache=cache)
        splits = {} if is_saved_dataset(path) else hub_splits(path)
        if splits:
            return _load_hub_split(path, splits, split or default_split, keep_malformed, cache)
        rows = _load_from_disk(path, split, cache)
    else:
        if split is not None:
            raise DataError(f"{path}: a split ({split!r}) only applies to a dataset folder (datasets.save_to_disk, or a hub download)")
        rows = _load_file(path, cache)
    if not keep_malformed:
        for row in rows:
            if "_malformed" in row:
                raise DataError(f"{row['_source']}: {row['_malformed']}")
    return rows


def _load_file(path: Path, cache: Path) -> list[dict]:
    """The rows of one data file, by its suffix (or an imagefolder's metadata file)."""
    suffix = path.suffix.lower()
    if path.name in IMAGEFOLDER_METADATA:
        return [spill_embedded_images(row, cache) for row in _imagefolder_rows(path)]
    if suffix == ".jsonl":
        return [spill_embedded_images(row, cache) for row in _load_jsonl(path)]  # data: URIs
    if suffix == ".json":
        return [spill_embedded_images(row, cache) for row in _load_json(path)]
    if suffix == ".parquet":
        return _load_parquet(path, cache)
    raise DataError(f"{path}: unsupported format {suffix or '(no suffix)'!r}; use .jsonl, .json, .parquet or a datasets.save_to_disk folder")


# A `datasets` imagefolder: images beside a metadata file whose `file_name` column names each row's image.
IMAGEFOLDER_METADATA = ("metadata.jsonl", "metadata.csv")


def imagefolder_metadata(folder: Path) -> Path | None:
    """The metadata file of an imagefolder, None for any other folder (a save_to_disk folder has no metadata file)."""
    found = [folder / name for name in IMAGEFOLDER_METADATA if (folder / name).is_file()]
    return found[0] if found else None


def _imagefolder_rows(path: Path) -> list[dict]:
    """Rows of an imagefolder's metadata file, ``file_name`` (one image) or ``file_names`` (a list) turned into
    ``image`` / ``images`` paths relative to the metadata file's folder, as `datasets` reads them."""
    if path.suffix == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            rows = [_object_row(r, f"{path}:{i + 2}") for i, r in enumerate(csv.DictReader(f))]
    else:
        rows = _load_jsonl(path)
    out = []
    for row in rows:
        row = dict(row)
        if isinstance(row.get("file_name"), str) and row.get("image") is None:
            row["image"] = row["file_name"]
        elif isinstance(row.get("file_names"), list) and row.get("images") is None:
            row["images"] = row["file_names"]
        out.append(row)
    return out


def _load_shards(pattern: Path, keep_malformed: bool, cache: Path) -> list[dict]:
    """Every file matching a file-name pattern (``data/train-*.parquet``, how hub datasets ship their shards), in
    name order; each row keeps its own file in ``_source``."""
    files = sorted(p for p in pattern.parent.glob(pattern.name) if p.is_file())
    if not files:
        raise DataError(f"{pattern}: no file matches this pattern")
    rows: list[dict] = []
    for file in files:
        rows += load_rows(file, keep_malformed=keep_malformed, image_cache=cache)
    return rows


def _load_hub_split(path: Path, splits: dict[str, list[Path]], split: str | None, keep_malformed: bool, cache: Path) -> list[dict]:
    """The rows of one split of a hub-style dataset folder (locate.hub_splits), its files in name order."""
    listed = ", ".join(splits)
    if split is None:
        raise DataError(f"{path}: holds splits {listed}; pick one with {path}{SPLIT_SEP}<split> (EasyR1: {path}@<split>)")
    if split not in splits:
        raise DataError(f"{path}: no split {split!r}; it holds {listed}")
    rows: list[dict] = []
    for file in splits[split]:
        rows += load_rows(file, keep_malformed=True, image_cache=cache)
    if not keep_malformed:
        for row in rows:
            if "_malformed" in row:
                raise DataError(f"{row['_source']}: {row['_malformed']}")
    return rows


def _object_row(value: Any, source: str) -> dict:
    if isinstance(value, dict):
        return {**value, "_source": source}
    return {"_source": source, "_malformed": f"expected a JSON object, got {type(value).__name__}"}


def _load_jsonl(path: Path) -> list[dict]:
    rows = []
    # Read bytes and decode per line so one bad byte sequence names its line instead of failing the file.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            source = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                rows.append({"_source": source, "_malformed": f"not UTF-8 text ({e.reason} at byte {e.start})"})
                continue
            if not line.strip():
                continue
            try:
                value = strict_json.loads(line.rstrip("\r\n"))  # so error columns point into the line
            except json.JSONDecodeError as e:
                rows.append({"_source": source, "_malformed": f"invalid JSON: {e.msg} (column {e.colno})"})
                continue
            except strict_json.DuplicateKeyError as e:
                rows.append({"_source": source, "_malformed": f"invalid row: {e}"})
                continue
            rows.append(_object_row(value, source))
    return rows


def _load_json(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        value = strict_json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several top-level values: JSON lines in a .json file
            return _load_jsonl(path)
        raise DataError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    except strict_json.DuplicateKeyError as e:
        raise DataError(f"{path}: {e}") from None
    if isinstance(value, dict) and isinstance(value.get("data"), list):
        value = value["data"]
    if not isinstance(value, list):
        raise DataError(f'{path}: expected a list of rows or {{"data": [...]}}, got {type(value).__name__}')
    return [_object_row(v, f"{path}:row {i}") for i, v in enumerate(value, start=1)]  # counted from 1, like JSONL lines


def _load_parquet(path: Path, cache: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=ARROW_BATCH_ROWS)
        return _rows_from_batches(batches, str(path), cache)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: cannot read parquet: {type(e).__name__}: {e}") from e


def _rows_from_batches(batches, name: str, cache: Path) -> list[dict]:
    """Rows of arrow batches, embedded images spilled batch by batch (only one batch of image bytes in memory)."""
    rows: list[dict] = []
    for batch in batches:
        for row in batch.to_pylist():
            rows.append(spill_embedded_images({**row, "_source": f"{name}:row {len(rows) + 1}"}, cache))
    return rows


def _load_from_disk(path: Path, split: str | None, cache: Path) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: not a datasets.save_to_disk folder ({type(e).__name__}: {e})") from e
    name = str(path)
    if isinstance(ds, datasets.DatasetDict):
        if split is None:
            raise DataError(f"{path}: holds splits {', '.join(ds)}; pick one with {path}{SPLIT_SEP}<split>")
        if split not in ds:
            raise DataError(f"{path}: no split {split!r}; it holds {', '.join(ds)}")
        ds = ds[split]
        name = f"{path}{SPLIT_SEP}{split}"
    elif split is not None:
        raise DataError(f"{path}: is a single Dataset without splits; drop {SPLIT_SEP}{split}")
    # The arrow format gives raw values: an Image column stays {bytes, path} instead of being decoded.
    return _rows_from_batches(ds.with_format("arrow").iter(batch_size=ARROW_BATCH_ROWS), name, cache)


ARROW_BATCH_ROWS = 256
