"""Embedded images (a ``datasets.Image`` column, parquet ``{bytes, path}`` structs, raw bytes, ``data:image/`` URIs)
written once to a content-addressed cache folder, so a row holds a path as for an image file."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
from pathlib import Path
from typing import Any

from PIL import Image

from vlmrl.data.errors import DataError


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
