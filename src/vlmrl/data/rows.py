"""Reading one data split for training: read the rows (readers), normalize the layout (formats), validate every row
(validation); and which data files and image folders data.train_path names.

Row format (JSONL / JSON / Parquet / a ``datasets.save_to_disk`` folder, one row per example)::

    {"image": "images/0001.png", "problem": "How many ...?", "solution": "3", "response": "<answer>3</answer>"}

- ``image`` (one path, or a list of paths as VLM-R1's and LLaVA's multi-image rows give it) or ``images`` (a list of
  paths). Relative paths resolve against the folder that
  holds the data file (for a ``save_to_disk`` folder: the folder that holds that folder); absolute paths
  are used as they are. A row with no image (key absent, ``null`` or ``[]``) is a text-only prompt and is
  allowed; the report counts them. Giving both ``image`` and ``images`` is an error (which one wins would
  be a guess). Embedded images are read too: a ``datasets.Image`` column (or a list of them), parquet
  ``{bytes, path}`` structs, raw bytes, and ``data:image/...;base64,`` URIs. Their bytes are written once
  to a content-addressed cache folder (`embedded_images.image_cache_dir`) while the file is read batch by batch, and the
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

import os


from vlmrl.data.locate import split_path
from vlmrl.data.errors import DataError
from vlmrl.data.media import DEFAULT_MAX_IMAGE_PIXELS
from vlmrl.data.readers import IMAGEFOLDER_METADATA, imagefolder_metadata, load_rows
from vlmrl.data.validation import ShapeCheck, ValidationReport, validate_rows


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
