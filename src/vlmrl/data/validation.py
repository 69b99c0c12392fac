"""Validating every row before training: structure, placeholders, image and video files (headers checked in parallel,
sizes the processor rejects), and the report of what was kept and what was skipped and why."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from PIL import Image

from vlmrl.data.errors import DataError
from vlmrl.data.media import DEFAULT_MAX_IMAGE_PIXELS, pixel_limit_problem, own_pixel_limit
from urllib.parse import unquote, urlparse
import filecmp


MAX_LISTED_PROBLEMS = 20
# (original width, height) -> why the model's processor cannot take an image of that size, or None.
ShapeCheck = Callable[[int, int], "str | None"]


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

    return unquote(urlparse(path).path)


def _same_content(a: Path, b: Path) -> bool:
    """Whether two paths hold the same file or byte-equal files (then either one is the row's image)."""

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
            too_large = pixel_limit_problem(im.width, im.height, max_image_pixels)
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
