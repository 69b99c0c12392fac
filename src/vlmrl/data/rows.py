"""Datasets: loading rows, validating every row before training, loading images, and sampling prompts.

Row format (JSONL / JSON / Parquet / a ``datasets.save_to_disk`` folder, one row per example)::

    {"image": "images/0001.png", "problem": "How many ...?", "solution": "3", "response": "<answer>3</answer>"}

- ``image`` (one path, or a list of paths as VLM-R1's and LLaVA's multi-image rows give it) or ``images`` (a list of
  paths). Relative paths resolve against the folder that
  holds the data file (for a ``save_to_disk`` folder: the folder that holds that folder); absolute paths
  are used as they are. A row with no image (key absent, ``null`` or ``[]``) is a text-only prompt and is
  allowed; the report counts them. Giving both ``image`` and ``images`` is an error (which one wins would
  be a guess). Embedded images are read too: a ``datasets.Image`` column (or a list of them), parquet
  ``{bytes, path}`` structs, raw bytes, and ``data:image/...;base64,`` URIs. Their bytes are written once
  to a content-addressed cache folder (`image_cache_dir`) while the file is read batch by batch, and the
  row then holds that file's path: memory stays bounded by one batch, decoding stays lazy, and validation,
  resizing and rewards see paths exactly as for image files.
- ``problem``: non-empty string, the user prompt.
- ``solution``: non-empty string. Integers and floats are accepted and converted with ``str()`` (3 -> "3",
  2.5 -> "2.5"), and a list of numbers (a box) becomes ``"[x1, y1, x2, y2]"``, because the built-in
  rewards compare text; booleans are rejected (``True`` is almost always a data bug).
- ``response`` (optional): the SFT target text; ``null`` means absent.
- Any other column is kept and passed to reward functions. Keys starting with ``_`` are internal
  (``_source`` = ``"file:line"`` for JSONL, ``"file:row N"`` otherwise; N counts from 1 like a line number).

After validation every row has ``images: list[str]`` of absolute paths (``image`` is folded into it).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import os
import random
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from PIL import Image

import vlmrl.data.strict_json as strict_json
from vlmrl.data.locate import SPLIT_SEP, hub_splits, is_saved_dataset, missing_path_message, split_path

__all__ = ["SPLIT_SEP", "split_path"]  # re-exported: callers read data paths through rows

MAX_LISTED_PROBLEMS = 20
# PIL's decompression-bomb guard, read once at import: the default of data.max_image_pixels.
DEFAULT_MAX_IMAGE_PIXELS = int(Image.MAX_IMAGE_PIXELS or 89_478_485)
# (original width, height) -> why the model's processor cannot take an image of that size, or None.
ShapeCheck = Callable[[int, int], "str | None"]


class DataError(ValueError):
    """The data cannot be used as it is; the message names the file, row and field."""


# ---------------------------------------------------------------------------------------------------
# Loading rows


class MissingData(DataError):
    """The data path does not exist (the caller adds which config field named it)."""


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
        import csv

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


# ---------------------------------------------------------------------------------------------------
# Embedded images

ARROW_BATCH_ROWS = 256
IMAGE_FIELDS = ("image", "images")
DATA_URI_PREFIX = "data:image/"


def image_cache_dir() -> Path:
    """Where embedded images are written: ``$VLMRL_CACHE/images``, default ``~/.cache/vlmrl/images``. Files are
    named by the hash of their bytes, so runs share them and reading a dataset twice writes nothing new."""
    return Path(os.environ.get("VLMRL_CACHE") or Path.home() / ".cache" / "vlmrl").expanduser() / "images"


def spill_embedded_images(row: dict, cache: Path) -> dict:
    """`row` with each embedded image in ``image`` / ``images`` replaced by the path of a cache file holding its
    bytes; a ``{bytes: None, path}`` struct becomes its path. Anything else is left for `validate_rows` to judge.
    An undecodable data: URI marks the row malformed (with its field); a failed write raises DataError."""
    out = row
    for key in IMAGE_FIELDS:
        value = row.get(key)
        try:
            if isinstance(value, (list, tuple)):
                new = [_spill_one(v, cache, row.get("_source", "?")) for v in value]
                changed = any(a is not b for a, b in zip(new, value))
            else:
                new = _spill_one(value, cache, row.get("_source", "?"))
                changed = new is not value
        except _BadEmbedded as e:
            return {**out, "_malformed": f"{key}: {e}"}
        if changed:
            out = {**out, key: new}
    return out


class _BadEmbedded(ValueError):
    pass


def _spill_one(value: Any, cache: Path, source: str) -> Any:
    if isinstance(value, dict) and set(value) <= {"bytes", "path"}:
        data = value.get("bytes")
        if data is None:  # a datasets.Image that points to a file instead of holding it
            return value["path"] if isinstance(value.get("path"), str) and value["path"] else value
    elif isinstance(value, str) and value[: len(DATA_URI_PREFIX)].lower() == DATA_URI_PREFIX:
        data = _decode_data_uri(value)
    else:
        data = value
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return value
    data = bytes(data)
    if not data:
        raise _BadEmbedded("embedded image has no bytes")
    return _write_cached(data, cache, source)


def _decode_data_uri(uri: str) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise _BadEmbedded(f"data URI {uri[:40]!r}... is not base64 (expected data:image/<type>;base64,<data>)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _BadEmbedded(f"data URI holds invalid base64 ({e})") from None


def _write_cached(data: bytes, cache: Path, source: str) -> str:
    """The cache file holding `data` (written atomically unless a file of that content is there already)."""
    target = cache / (hashlib.sha256(data).hexdigest()[:40] + _image_suffix(data))
    try:
        if target.is_file() and target.stat().st_size == len(data):
            return str(target)
        cache.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".tmp-{os.getpid()}-{target.name}")
        try:
            tmp.write_bytes(data)
            os.replace(tmp, target)  # never a half-written file under the final name
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise DataError(
            f"{source}: cannot write its embedded image to the cache {cache} ({e.strerror or e}); "
            "free space there or set VLMRL_CACHE to another folder"
        ) from None
    return str(target)


def _image_suffix(data: bytes) -> str:
    """The file suffix of the image format in the header (PIL reads the header only), '.bin' when unknown:
    the bytes are then reported by validation as an unreadable image of that row."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = (im.format or "").lower()
    except Exception:
        return ".bin"
    return {"jpeg": ".jpg", "": ".bin"}.get(fmt, "." + fmt if fmt.isalnum() else ".bin")


# ---------------------------------------------------------------------------------------------------
# Validation


@dataclass(frozen=True)
class Problem:
    """One thing wrong with one row."""

    source: str
    field: str
    reason: str
    kind: str  # malformed, missing_field, wrong_type, empty_field, missing_image, bad_image, image_too_large, image_shape

    def __str__(self) -> str:
        return f"{self.source}: {self.field}: {self.reason}"


@dataclass
class ValidationReport:
    """What validation found: counts, and every problem (kept in full, only the message is capped)."""

    total_rows: int = 0
    kept_rows: int = 0
    skipped_rows: int = 0
    problems: list[Problem] = field(default_factory=list)
    truncated_rows: int = 0  # rows with more than limit_images images
    dropped_images: int = 0  # images dropped from those rows
    text_only_rows: int = 0  # kept rows without any image or video
    num_images: int = 0  # images in kept rows (after truncation)
    num_videos: int = 0  # videos in kept rows
    format: str = ""  # the layout the rows were read in (formats.py), e.g. "vlm-r1 conversations"
    image_sizes: dict = field(default_factory=dict)  # image path -> (width, height) as decoded (EXIF orientation applied)

    @property
    def problem_counts(self) -> dict[str, int]:
        """Number of problems of each kind (a row can have several)."""
        counts: dict[str, int] = {}
        for p in self.problems:
            counts[p.kind] = counts.get(p.kind, 0) + 1
        return counts

    def skipped_sources(self) -> list[str]:
        """The ``file:line`` of each skipped row, in file order, once each."""
        return list(dict.fromkeys(p.source for p in self.problems))

    def skipped_sources_text(self, limit: int = 5) -> str:
        """'rows a.jsonl:2, 7, b.jsonl:4 and 3 more': which rows skip_bad_rows dropped, the first few named
        (a row of the same file as the one before it by its line / row number alone)."""
        sources = self.skipped_sources()
        shown, previous_file = [], None
        for source in sources[:limit]:
            file, sep, where = source.rpartition(":")
            shown.append(where if sep and file == previous_file else source)
            previous_file = file if sep else None
        more = f" and {len(sources) - limit} more" if len(sources) > limit else ""
        return "rows " + ", ".join(shown) + more

    def summary(self) -> str:
        videos = f", {self.num_videos} videos" if self.num_videos else ""
        layout = f"format {self.format}: " if self.format else ""
        parts = [f"{layout}{self.kept_rows} of {self.total_rows} rows kept, {self.num_images} images{videos}"]
        if self.skipped_rows:
            kinds = ", ".join(f"{k}: {v}" for k, v in sorted(self.problem_counts.items()))
            parts.append(f"{self.skipped_rows} bad rows skipped ({kinds}; {self.skipped_sources_text()})")
        if self.truncated_rows:
            parts.append(f"{self.truncated_rows} rows over limit_images ({self.dropped_images} images dropped)")
        if self.text_only_rows:
            parts.append(f"{self.text_only_rows} text-only rows")
        return "; ".join(parts)


def bad_rows_records(report: ValidationReport) -> list[dict]:
    """One record per problem of the skipped rows, ``{"source", "field", "kind", "reason"}``, for bad_rows.jsonl."""
    return [{"source": p.source, "field": p.field, "kind": p.kind, "reason": p.reason} for p in report.problems]


def _media_errors(checked: list, check_images: bool, max_image_pixels: int, shape_check) -> tuple[dict, dict, dict]:
    """(image path -> (kind, reason) or None, video file -> the same, image path -> its (width, height) as oriented)
    for every file the rows use, each read once; images in threads (decoding releases the GIL)."""
    paths = sorted({p for normal, *_ in checked for p in [*normal["images"], *_frame_paths(normal["videos"])]})
    workers = min(8, (os.cpu_count() or 1) + 1, max(1, len(paths)))
    with own_pixel_limit(), ThreadPoolExecutor(max_workers=workers) as pool:
        image_errors = dict(zip(paths, pool.map(lambda p: _check_image(p, check_images, max_image_pixels), paths)))
    sizes = {p: r for p, r in image_errors.items() if r is not None and not isinstance(r[0], str)}
    image_errors = _apply_shape_check(image_errors, shape_check)
    video_files = sorted({v for normal, *_ in checked for v in normal["videos"] if isinstance(v, str)})
    return image_errors, {v: _check_video_file(v, check_images) for v in video_files}, sizes


def _media_problems(normal: dict, image_field: str, image_errors: dict, video_errors: dict) -> list[Problem]:
    """A row's problems with its images (each bad one) and videos (the first bad frame or file of each)."""
    problems = [
        Problem(normal["_source"], image_field, image_errors[p][1], image_errors[p][0]) for p in normal["images"] if image_errors[p] is not None
    ]
    for v in normal["videos"]:
        errors = [video_errors[v]] if isinstance(v, str) else [image_errors[p] for p in v]
        problems += [Problem(normal["_source"], "video", e[1], e[0]) for e in errors if e is not None][:1]
    return problems


def validate_rows(
    rows: list[dict],
    base_dir: str | os.PathLike,
    *,
    limit_images: int | None,
    skip_bad_rows: bool,
    check_images: bool = True,
    name: str | None = None,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    shape_check: ShapeCheck | None = None,
    image_roots: list[str] | None = None,
) -> tuple[list[dict], ValidationReport]:
    """Check every row before training and return the good rows, normalised, with a report.

    Finds all problems in one pass: malformed rows, missing or empty ``problem``/``solution``, wrong types,
    missing image files and (with ``check_images``) images that cannot be decoded in full (truncated, not
    an image). Without ``check_images`` files are only checked to exist. Rows with more than
    ``limit_images`` images keep the first ``limit_images`` (counted, like TRL users expect); only the
    kept images are checked.

    Without ``skip_bad_rows`` any problem raises DataError listing up to 20 as ``file:line: field:
    reason`` and the totals; with it, bad rows are dropped and counted. No rows left is always an error.
    ``name`` (the data file) is used in that message. Input rows are not modified.

    Images are also checked the way training will use them: one with more than ``max_image_pixels`` pixels
    (read from the header, before decoding) is an ``image_too_large`` problem, and ``shape_check`` (see
    `processing.ImageShapeCheck`) turns sizes the model's processor rejects into ``image_shape`` problems.
    ``image_roots`` (data.image_root): relative image paths resolve against the one of these folders that holds
    the file (the first one when none does), instead of the data file's folder; a file in two of them with different
    content is refused (DataError). A prompt whose ``<image>`` /
    ``<video>`` placeholders do not match its images is a ``placeholder_mismatch`` problem.
    """
    if limit_images is not None and limit_images < 1:
        raise ValueError(f"limit_images must be >= 1 or None, got {limit_images}")
    base = Path(base_dir)
    label = name or str(base)
    if not rows:
        raise DataError(f"{label}: no rows (empty dataset)")
    report = ValidationReport(total_rows=len(rows))

    # Pass 1: structure, and the image paths each row will use.
    roots = [Path(r).expanduser() for r in image_roots] if image_roots else None
    checked = [_check_structure(row, row.get("_source") or f"{label}:row {i}", base, limit_images, roots) for i, row in enumerate(rows, start=1)]

    # Pass 2: each distinct image and video file once.
    image_errors, video_errors, report.image_sizes = _media_errors(checked, check_images, max_image_pixels, shape_check)

    good = []
    for normal, problems, image_field, dropped in checked:
        imgs = normal["images"]
        problems += _media_problems(normal, image_field, image_errors, video_errors)
        if problems:
            report.problems.extend(problems)
            report.skipped_rows += 1
            continue
        good.append(normal)
        report.num_images += len(imgs)
        report.num_videos += len(normal["videos"])
        report.text_only_rows += not imgs and not normal["videos"]
        if dropped:
            report.truncated_rows += 1
            report.dropped_images += dropped
    report.kept_rows = len(good)

    if report.problems and not skip_bad_rows:
        raise DataError(_problem_message(label, report))
    if not good:
        raise DataError(f"{label}: no usable rows: all {report.total_rows} rows are bad ({report.summary()})")
    return good, report


def _problem_message(label: str, report: ValidationReport) -> str:
    listed = "\n".join(f"  {p}" for p in report.problems[:MAX_LISTED_PROBLEMS])
    more = len(report.problems) - MAX_LISTED_PROBLEMS
    tail = f"\n  ... and {more} more" if more > 0 else ""
    return (
        f"{label}: {report.skipped_rows} of {report.total_rows} rows are bad ({len(report.problems)} problems):\n"
        f"{listed}{tail}\n"
        f"{_missing_hint(report)}Fix them, or set skip_bad_rows to drop and count them."
    )


def _missing_hint(report: ValidationReport) -> str:
    fields_missing = sorted({p.field for p in report.problems if p.kind == "missing_field"})
    if not fields_missing:
        if any(p.kind == "missing_image" for p in report.problems):
            return (
                "Relative image paths resolve against the data file's folder, or data.image_root=<folder> (VLM-R1's --image_folders; "
                "one folder per data file, in order, with data.train_path=[a.jsonl, b.jsonl]). "
            )
        return ""
    return (
        f"A prompt comes from problem, prompt, messages or conversations; name your own columns with "
        f"{', '.join(f'data.columns.{f}=<column>' for f in fields_missing)}. "
    )


def _check_structure(
    row: dict, source: str, base: Path, limit_images: int | None, roots: list[Path] | None = None
) -> tuple[dict, list[Problem], str, int]:
    """(normalised copy, problems, the image field used, images dropped by limit_images) for one row,
    without touching files. The copy's ``images`` holds absolute paths ([] when unusable)."""
    out = {**row, "_source": source}
    problems: list[Problem] = []

    def bad(field_name: str, reason: str, kind: str) -> None:
        problems.append(Problem(source, field_name, reason, kind))

    if "_malformed" in row:
        bad("row", row["_malformed"], "malformed")
        out["images"], out["videos"] = [], []
        return out, problems, "row", 0

    problem = row.get("problem")
    if problem is None:
        bad("problem", "missing", "missing_field")
    elif not isinstance(problem, str):
        bad("problem", f"expected a string, got {_type_name(problem)}", "wrong_type")
    elif not problem.strip():
        bad("problem", "empty", "empty_field")

    solution, reason = _solution_as_text(row.get("solution"))
    if reason:
        bad("solution", reason, "missing_field" if reason == "missing" else "empty_field" if reason == "empty" else "wrong_type")
    else:
        out["solution"] = solution

    response = row.get("response")
    if response is not None and not isinstance(response, str):
        bad("response", f"expected a string or null, got {_type_name(response)}", "wrong_type")

    images, image_field = _image_list(row, bad)
    out.pop("image", None)
    dropped = 0
    if images is not None:
        _check_placeholders(row, "image", len(images), bad)
        if limit_images is not None and len(images) > limit_images:
            dropped = len(images) - limit_images
            images = images[:limit_images]
        out["images"] = [_resolve(p, base, roots, source) for p in images]
    else:
        out["images"] = []
    videos = _video_list(row, bad)
    if videos is not None:
        _check_placeholders(row, "video", len(videos), bad)
    out.pop("video", None)
    out["videos"] = [[_resolve(p, base, roots, source) for p in v] if isinstance(v, list) else _resolve(v, base, roots, source) for v in videos or []]
    return out, problems, image_field, dropped


def _check_placeholders(row: dict, kind: str, given: int, bad) -> None:
    """A prompt with `<image>` (or `<video>`) placeholders must have one image per placeholder: which image goes
    where would otherwise be a guess. No placeholder at all is fine (the images go before the text)."""
    from vlmrl.data.formats import placeholder_counts

    images, videos = placeholder_counts(row)
    found = images if kind == "image" else videos
    if found and found != given:
        what = "images" if kind == "image" else "videos"
        bad("prompt", f"found {found} <{kind}> placeholders for {given} {what}", "placeholder_mismatch")


def _solution_as_text(value: Any) -> tuple[str | None, str | None]:
    """(solution text, None) or (None, reason it is unusable); see the module docstring for conversions."""
    if value is None:
        return None, "missing"
    if isinstance(value, bool):
        return None, "expected a string or number, got bool"
    if isinstance(value, str):
        return (value, None) if value.strip() else (None, "empty")
    if isinstance(value, (int, float)):
        return (str(value), None) if math.isfinite(value) else (None, f"not a finite number: {value}")
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return "[" + ", ".join(str(v) for v in value) + "]", None
    return None, f"expected a string or number, got {_type_name(value)}"


def _image_list(row: dict, bad) -> tuple[list[str] | None, str]:
    """(the row's image paths as given, the field they came from); None paths when they are unusable
    (the reason is reported via `bad`). ``image`` holds one path or, as VLM-R1's multi-image JSONL and LLaVA's data
    ship it, a list of paths; ``images`` holds a list."""
    single, many = row.get("image"), row.get("images")
    if single is not None and many is not None:
        bad("image", "both 'image' and 'images' are set; use one", "wrong_type")
        return None, "image"
    if isinstance(single, str):
        return [single], "image"
    key, value = ("image", single) if single is not None else ("images", many)
    if value is None:
        return [], "images"
    if not isinstance(value, (list, tuple)):
        expected = "a path string or a list of them" if key == "image" else "a list of path strings"
        bad(key, f"expected {expected}, got {_describe_image_value(value)}", "wrong_type")
        return None, key
    wrong = [i for i, p in enumerate(value) if not isinstance(p, str)]
    if wrong:
        bad(key, f"item {wrong[0]} is {_describe_image_value(value[wrong[0]])}, expected a path string", "wrong_type")
        return None, key
    empty = [i for i, p in enumerate(value) if not p.strip()]
    if empty:
        bad(key, f"item {empty[0]} is an empty path", "empty_field")
        return None, key
    return list(value), key


# A row's `video` given as a path with one of these suffixes is decoded with PyAV (video.py); a list of paths is its frames.
VIDEO_SUFFIXES = (".mp4", ".m4v", ".mov", ".avi", ".mkv", ".webm")


def _video_list(row: dict, bad) -> list | None:
    """The row's videos as given: each a video file path or a list of frame image paths; None when unusable.
    `video` holds one video, `videos` a list of them."""
    single, many = row.get("video"), row.get("videos")
    if single is not None and many is not None:
        bad("video", "both 'video' and 'videos' are set; use one", "wrong_type")
        return None
    field_name, videos = ("video", [single]) if single is not None else ("videos", many)
    if videos is None:
        return []
    if not isinstance(videos, (list, tuple)):
        bad(field_name, f"expected a list of videos, got {_type_name(videos)}", "wrong_type")
        return None
    for i, v in enumerate(videos):
        frames = v if isinstance(v, (list, tuple)) else [v]
        where = "" if field_name == "video" else f"item {i}: "
        if not frames or not all(isinstance(p, str) and p.strip() for p in frames):
            bad(
                field_name,
                f"{where}expected a video file path or a non-empty list of frame image paths, got {_describe_image_value(v)}",
                "wrong_type",
            )
            return None
        if isinstance(v, str) and not v.lower().endswith(VIDEO_SUFFIXES):
            bad(field_name, f"{where}{v!r} is not a video file ({', '.join(VIDEO_SUFFIXES)}); give frames as a list of image paths", "wrong_type")
            return None
    return [list(v) if isinstance(v, (list, tuple)) else v for v in videos]


def _check_video_file(path: str, decode: bool) -> tuple[str, str] | None:
    """(kind, reason) when a video file is unusable: missing, or (decode) a header PyAV cannot read or no frames."""
    from vlmrl.data.video import VideoError, video_header

    if not os.path.isfile(path):
        return "missing_video", f"file not found: {path}"
    if not decode:
        return None
    try:
        frames, _, width, height = video_header(path)
    except VideoError as e:
        return "bad_video", str(e)
    if frames < 1 or width < 1 or height < 1:
        return "bad_video", f"{path}: the video has no frames"
    return None


def _describe_image_value(value: Any) -> str:
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        return "an image struct with neither bytes nor path"
    if isinstance(value, Image.Image):
        return "a PIL image (give its file path or its encoded bytes)"
    return _type_name(value)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _resolve(path: str, base: Path, roots: list[Path] | None = None, source: str = "?") -> str:
    """An absolute path: as given, or relative to the data file's folder, or (data.image_root) to the root that holds
    it (the first root when none does, so the error names a place the user chose). A path held by two roots with
    different content raises DataError: which image the row means would be a guess (VLM-R1 pairs each data file with
    its own folder)."""
    p = Path(_file_uri_path(path)).expanduser()
    if p.is_absolute():
        return os.path.abspath(p)
    if roots:
        holders = [r / p for r in roots if (r / p).exists()]
        different = [h for h in holders[1:] if not _same_content(holders[0], h)]
        if different:
            raise DataError(
                f"{source}: image {path!r} is in two data.image_root folders with different content ({holders[0]} and {different[0]}); "
                "which one the row means would be a guess. Pair each data file with its own folder, in order: "
                "data.train_path=[a.jsonl, b.jsonl] data.image_root=[A, B] (as VLM-R1's --data_file_paths / --image_folders), "
                "or give one folder"
            )
        return os.path.abspath(holders[0] if holders else roots[0] / p)
    return os.path.abspath(base / p)


def _file_uri_path(path: str) -> str:
    """``file:///abs/a.png`` (qwen-vl-utils' and MM-EUREKA's image references) -> ``/abs/a.png``; other text unchanged."""
    if path[:7].lower() != "file://":
        return path
    from urllib.parse import unquote, urlparse

    return unquote(urlparse(path).path)


def _same_content(a: Path, b: Path) -> bool:
    """Whether two paths hold the same file or byte-equal files (then either one is the row's image)."""
    import filecmp

    try:
        return os.path.samefile(a, b) or (a.is_file() and b.is_file() and filecmp.cmp(a, b, shallow=False))
    except OSError:
        return False


def _frame_paths(videos: list) -> list[str]:
    return [p for v in videos if isinstance(v, list) for p in v]


def _check_image(path: str, decode: bool, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> tuple[str, str] | tuple[int, int] | None:
    """(kind, reason) when the image is unusable, else its (width, height) (None when not opened). Decoding
    reads every byte (``load()``), which is what finds truncated files; ``Image.open`` alone only reads the
    header, which is enough for the pixel limit. Call under `own_pixel_limit`."""
    if "://" in path:
        return "missing_image", f"URLs are not supported, download the image first: {path}"
    if not os.path.exists(path):
        return "missing_image", f"file not found: {path}"
    if not os.path.isfile(path):
        return "missing_image", f"not a file: {path}"
    if not decode:
        return None
    try:
        with Image.open(path) as im:
            too_large = _pixel_limit_problem(im.width, im.height, max_image_pixels)
            if too_large:
                return "image_too_large", f"{path}: {too_large}"
            im.load()
            if im.width < 1 or im.height < 1:
                return "bad_image", f"image has no pixels: {path}"
            from vlmrl.data.images import oriented_size, still_image_problem

            still = still_image_problem(im)
            if still:
                return "bad_image", f"{path}: {still}"
            return oriented_size(im)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError, ...
        return "bad_image", f"cannot read image {path}: {type(e).__name__}: {e}"


def _pixel_limit_problem(width: int, height: int, max_image_pixels: int) -> str | None:
    if width * height <= max_image_pixels:
        return None
    return (
        f"image is {width}x{height} = {width * height:,} pixels, over data.max_image_pixels={max_image_pixels:,} "
        "(the decompression-bomb guard); shrink the image or raise data.max_image_pixels"
    )


def _apply_shape_check(results: dict, shape_check: ShapeCheck | None) -> dict[str, tuple[str, str] | None]:
    """`_check_image` results -> path: (kind, reason) or None, with each distinct size asked once of shape_check."""
    reasons: dict[tuple[int, int], str | None] = {}
    out: dict[str, tuple[str, str] | None] = {}
    for path, result in results.items():
        if result is None or isinstance(result[0], str):
            out[path] = result
            continue
        if shape_check is None:
            out[path] = None
            continue
        if result not in reasons:
            reasons[result] = shape_check(*result)
        reason = reasons[result]
        out[path] = None if reason is None else ("image_shape", f"{path}: image is {result[0]}x{result[1]}: {reason}")
    return out


_pixel_limit_lock = threading.Lock()
_pixel_limit_depth = 0
_pixel_limit_saved: int | None = None


@contextmanager
def own_pixel_limit() -> Iterator[None]:
    """Switch PIL's global decompression-bomb check off while vlmrl opens images, because vlmrl checks the
    header size against data.max_image_pixels itself (which can then be larger than PIL's default).
    Nested and concurrent uses share one switch; the first one in saves PIL's value, the last one out restores it."""
    global _pixel_limit_depth, _pixel_limit_saved
    with _pixel_limit_lock:
        if _pixel_limit_depth == 0:
            _pixel_limit_saved = Image.MAX_IMAGE_PIXELS
            Image.MAX_IMAGE_PIXELS = None
        _pixel_limit_depth += 1
    try:
        yield
    finally:
        with _pixel_limit_lock:
            _pixel_limit_depth -= 1
            if _pixel_limit_depth == 0:
                Image.MAX_IMAGE_PIXELS = _pixel_limit_saved


# ---------------------------------------------------------------------------------------------------
# Images


def load_images(
    paths: list[str],
    min_pixels: int | None,
    max_pixels: int | None,
    *,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    cache: ImageCache | None = None,
) -> list[Image.Image]:
    """RGB images, resized (aspect ratio kept) so that min_pixels <= width * height <= max_pixels.

    Transparent images are composited onto white (as Qwen-VL's loader does) instead of turning black.
    max_pixels is a hard cap (it bounds memory); min_pixels is met where max_pixels allows. Images over
    max_image_pixels are refused before decoding. With a `cache`, an image decoded and resized before (same
    file, size and modification time, same bounds) is returned from memory: treat the images as read-only.
    """
    out = []
    for path in paths:
        key = _cache_key(path, min_pixels, max_pixels) if cache is not None else None
        image = cache.get(key) if key is not None else None
        if image is None:
            image = _decode_resized(path, min_pixels, max_pixels, max_image_pixels)
            if key is not None:
                cache.put(key, image)
        out.append(image)
    return out


def _decode_resized(path: str, min_pixels: int | None, max_pixels: int | None, max_image_pixels: int) -> Image.Image:
    try:
        with own_pixel_limit(), Image.open(path) as im:
            too_large = _pixel_limit_problem(im.width, im.height, max_image_pixels)
            if too_large:
                raise DataError(f"{path}: {too_large}")
            im.load()
            rgb = _to_rgb(im)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: cannot read image: {type(e).__name__}: {e}") from e
    size = target_size(rgb.width, rgb.height, min_pixels, max_pixels)
    return rgb if size == rgb.size else rgb.resize(size, Image.Resampling.BICUBIC)


def _cache_key(path: str, min_pixels: int | None, max_pixels: int | None) -> tuple | None:
    """The file's identity (path, size, modification time) and the resize bounds; None when it cannot be stat'ed
    (then the load reports the error)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return path, st.st_size, st.st_mtime_ns, min_pixels, max_pixels


class ImageCache:
    """Decoded, resized RGB images kept in memory up to a byte budget, least recently used evicted first.

    Without it every step decodes its images again, which for large files (tens of megapixels) costs more
    than the step. The budget counts width * height * 3 bytes per image; an image larger than the whole
    budget is not kept. Thread-safe.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = max(0, int(budget_bytes))
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._items: OrderedDict[tuple, Image.Image] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple) -> Image.Image | None:
        with self._lock:
            image = self._items.get(key)
            if image is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return image

    def put(self, key: tuple, image: Image.Image) -> None:
        size = _image_bytes(image)
        with self._lock:
            if size > self.budget_bytes or key in self._items:
                return
            while self._items and self.bytes + size > self.budget_bytes:
                _, old = self._items.popitem(last=False)
                self.bytes -= _image_bytes(old)
                self.evictions += 1
            self._items[key] = image
            self.bytes += size

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "images": len(self._items), "bytes": self.bytes}


def _image_bytes(image) -> int:
    """Bytes of a decoded image, or of a video's frames (video.Video)."""
    if hasattr(image, "frames"):
        return sum(_image_bytes(f) for f in image.frames)
    return image.width * image.height * len(image.getbands())


_shared_cache: ImageCache | None = None


def shared_image_cache(budget_mb: float) -> ImageCache | None:
    """The process's image cache for a budget in MiB (data.image_cache_mb); None when the budget is 0. A new budget
    starts a new cache."""
    global _shared_cache
    budget = int(budget_mb * 2**20)
    if budget <= 0:
        return None
    if _shared_cache is None or _shared_cache.budget_bytes != budget:
        _shared_cache = ImageCache(budget)
    return _shared_cache


def load_video(
    source: str | list[str],
    *,
    max_frames: int,
    fps: float,
    min_pixels: int | None,
    max_pixels: int | None,
    cache=None,
    exact_frames: bool = False,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> "Video":  # noqa: F821 - video.Video, imported where used (video.py needs numpy/torch)
    """A row's video: sampled frames of one size (area within [min_pixels, max_pixels]) and its sampling rate.

    source: a video file path, or a list of image paths (the frames at `fps`, sampled evenly down to max_frames).
    exact_frames: exactly max_frames frames, evenly spaced (frames repeat in a short video), whatever `fps`.
    max_image_pixels: frame files with more pixels are refused from their header (data.max_image_pixels).
    cache: ImageCache; a video decoded before with the same file(s) and settings comes from memory."""
    from vlmrl.data.video import Video, decode_frames, sample_indices, video_header

    key = _video_cache_key(source, max_frames, fps, min_pixels, max_pixels, exact_frames) if cache is not None else None
    video = cache.get(key) if key is not None else None
    if video is not None:
        return video
    if isinstance(source, (list, tuple)):
        indices = sample_indices(len(source), fps, fps, max_frames, exact=exact_frames)
        frames = [_decode_resized(source[i], None, None, max_image_pixels) for i in indices]  # each frame: the bomb guard
        duration, rate = len(source) / fps, fps
    else:
        total, rate, _, _ = video_header(source)
        indices = sample_indices(total, rate, fps, max_frames, exact=exact_frames)
        frames = decode_frames(source, indices)
        duration = total / rate if rate else len(indices) / fps
        rate = rate or fps
    size = target_size(frames[0].width, frames[0].height, min_pixels, max_pixels)
    frames = tuple(f if f.size == size else f.resize(size, Image.Resampling.BICUBIC) for f in frames)
    sampled_fps = len(frames) / duration if duration > 0 else fps
    seconds = tuple(i / rate for i in indices)
    video = Video(frames=frames, sampled_fps=sampled_fps, seconds_per_patch=2 / sampled_fps, frame_seconds=seconds)
    if key is not None:
        cache.put(key, video)
    return video


def _video_cache_key(source, max_frames, fps, min_pixels, max_pixels, exact_frames=False) -> tuple | None:
    paths = list(source) if isinstance(source, (list, tuple)) else [source]
    try:
        stats = [(p, os.stat(p)) for p in paths]
        ident = tuple((p, st.st_size, st.st_mtime_ns) for p, st in stats)
    except OSError:
        return None
    return ("video", ident, max_frames, fps, min_pixels, max_pixels, exact_frames)


def _to_rgb(im: Image.Image) -> Image.Image:
    from vlmrl.data.images import to_rgb  # EXIF orientation, 16-bit / float scaling, animated refused, alpha on white

    return to_rgb(im)


def target_size(width: int, height: int, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    """(width, height) scaled by one factor so the area lies within [min_pixels, max_pixels].

    Upscaling rounds up and downscaling rounds down, so the bounds hold after rounding; sides stay >= 1.
    For extreme aspect ratios where a 1-pixel side already breaks max_pixels, the long side is cut further.
    """
    area = width * height
    if min_pixels is not None and area < min_pixels:
        scale = math.sqrt(min_pixels / area)
        width, height = max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale))
    if max_pixels is not None and width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = max(1, math.floor(width * scale)), max(1, math.floor(height * scale))
        if width * height > max_pixels:  # only when one side was clamped to 1
            if width >= height:
                width = max(1, max_pixels // height)
            else:
                height = max(1, max_pixels // width)
    return width, height


# ---------------------------------------------------------------------------------------------------
# Convenience


def load_dataset_split(
    path: str | os.PathLike,
    *,
    limit_images: int | None,
    skip_bad_rows: bool,
    max_rows: int | None = None,
    check_images: bool = True,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    shape_check: ShapeCheck | None = None,
    image_cache: str | os.PathLike | None = None,
    layout: str = "auto",
    columns: dict[str, str] | None = None,
    image_roots: list[str] | None = None,
    prompt_template: str | None = None,
    default_split: str | None = None,
) -> tuple[list[dict], ValidationReport]:
    """`load_rows` + `formats.normalize_rows` + `validate_rows` for one file (``path::split`` for a DatasetDict folder;
    `default_split` for a hub-style folder named without one).

    ``max_rows`` keeps the first rows before validation, so a quick run does not decode a huge dataset;
    with ``skip_bad_rows`` fewer rows may remain. ``layout`` (data.format), ``columns`` (data.columns) and
    ``prompt_template`` (data.prompt_template) choose how rows are read (formats.py); the report names the layout.
    """
    from vlmrl.data.formats import FormatError, normalize_rows

    file_path, _ = split_path(path)
    rows = load_rows(path, keep_malformed=True, image_cache=image_cache, default_split=default_split)
    if max_rows is not None:
        rows = rows[:max_rows]
    try:
        rows, label = normalize_rows(rows, os.fspath(path), layout, columns, prompt_template)
    except FormatError as e:
        raise DataError(str(e)) from None
    base = file_path.resolve() if file_path.is_dir() and imagefolder_metadata(file_path) else file_path.resolve().parent
    good, report = validate_rows(
        rows,
        base,
        limit_images=limit_images,
        skip_bad_rows=skip_bad_rows,
        check_images=check_images,
        name=os.fspath(path),
        max_image_pixels=max_image_pixels,
        shape_check=shape_check,
        image_roots=image_roots,
    )
    folder = file_path if file_path.is_dir() else None
    if (folder is not None and imagefolder_metadata(folder)) or file_path.name in IMAGEFOLDER_METADATA:
        label = f"imagefolder ({label} columns)"
    report.format = label
    if label.startswith("vlm-r1"):  # VLM-R1's rewards read the resolved image paths as `image_path`
        good = [{**row, "image_path": list(row["images"])} for row in good]
    return good, report


def data_files(value: str | list[str] | tuple[str, ...]) -> list[str]:
    """data.train_path as a list of data files: one string is one file (or pattern, folder, ``path::split``)."""
    return [value] if isinstance(value, str) else list(value)


def roots_per_file(files: list[str], image_root: str | list[str] | tuple[str, ...], field: str = "data.train_path") -> list[list[str] | None]:
    """The image folders each data file's relative paths resolve against (data.image_root): one folder for every file;
    with several data files and as many folders, each file its own folder, paired by position as VLM-R1 pairs
    --data_file_paths with --image_folders; one data file and several folders: the folder that holds each image.
    DataError for several files with a different number of folders (the pairing would be a guess)."""
    roots = [image_root] if isinstance(image_root, str) else [r for r in image_root]
    roots = [r for r in roots if r]
    if not roots:
        return [None] * len(files)
    if len(roots) == 1 or len(files) == 1:
        return [roots] * len(files)
    if len(roots) != len(files):
        raise DataError(
            f"data.image_root has {len(roots)} folders for the {len(files)} data files of {field}: give one folder for all of them, "
            "or one per data file in the same order (as VLM-R1's --image_folders pairs with --data_file_paths)"
        )
    return [[r] for r in roots]


def merge_reports(reports: list[ValidationReport], names: list[str]) -> ValidationReport:
    """One report for several data files read one after the other (counts added, problems in file order)."""
    if len(reports) == 1:
        return reports[0]
    out = ValidationReport()
    for rep in reports:
        for key in ("total_rows", "kept_rows", "skipped_rows", "truncated_rows", "dropped_images", "text_only_rows", "num_images", "num_videos"):
            setattr(out, key, getattr(out, key) + getattr(rep, key))
        out.problems += rep.problems
        out.image_sizes.update(rep.image_sizes)
    labels = list(dict.fromkeys(rep.format for rep in reports))
    out.format = labels[0] if len(labels) == 1 else ", ".join(f"{rep.format} ({name})" for rep, name in zip(reports, names))
    return out


# ---------------------------------------------------------------------------------------------------
# Sampling


class PromptSampler:
    """Row indices in a seeded order that is fixed per epoch, so a resumed run continues exactly.

    Epoch e uses a permutation from ``random.Random(f"{seed}:{e}")`` (string seeds are hashed with SHA-512,
    so seeds and epochs never collide and the order does not depend on PYTHONHASHSEED). A batch that
    crosses the end of an epoch continues into the next one, so it can hold the same index twice.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if num_rows < 1:
            raise ValueError(f"PromptSampler needs at least one row, got {num_rows}")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self._epoch, self._position = 0, 0
        self._order: list[int] | None = None

    @property
    def epoch(self) -> int:
        """Completed passes over the data (the epoch the next index comes from)."""
        return self._epoch

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            order = list(range(self.num_rows))
            if self.shuffle:
                random.Random(f"vlmrl-sampler:{self.seed}:{self._epoch}").shuffle(order)
            self._order = order
        return self._order

    def next_batch(self, n: int) -> list[int]:
        """The next n indices, crossing into the next epoch when this one runs out."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            order = self._epoch_order()
            take = min(n - len(out), self.num_rows - self._position)
            out += order[self._position : self._position + take]
            self._position += take
            if self._position == self.num_rows:
                self._epoch, self._position, self._order = self._epoch + 1, 0, None
        return out

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self._epoch, "position": self._position, "num_rows": self.num_rows, "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved state; refuses (DataError, a user error) a state saved for different data or a different seed."""
        for key in ("num_rows", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise DataError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}; "
                    "the data or seed changed since the checkpoint"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_rows:
            raise ValueError(f"invalid sampler state epoch={epoch} position={position} for {self.num_rows} rows")
        self._epoch, self._position, self._order = epoch, position, None


def sft_target(row: dict) -> str:
    """The text the model learns to produce (SFT's target, the answer evaluation samples show next to the model's):
    the row's `response`, else `<answer>solution</answer>` (the solution itself when it already has answer tags, as
    VLM-R1's and ms-swift's do)."""
    if row.get("response"):
        return row["response"]
    solution = str(row["solution"])
    return solution if "<answer>" in solution else f"<answer>{solution}</answer>"
