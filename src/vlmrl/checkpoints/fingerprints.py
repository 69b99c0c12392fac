"""What a run's inputs were, cheaply, so a resume notices when they changed at the same paths.

Config values alone miss a data file shuffled, its solutions edited, rows appended, or a reward file edited: each is
the same path in the config. Every checkpoint stores `fingerprints` in trainer_state.json: per data file its size
and a sha256 (of the whole file up to FULL_HASH_BYTES, beyond that of SAMPLED_BLOCKS blocks spread over it, plus
the size), per reward given by a file or module the sha256 of that module's source. A folder of data files (a
saved dataset) hashes each file's fingerprint in name order. Built-in rewards are vlmrl's code: their name is
enough. Every image file the rows name is fingerprinted too, more cheaply (there can be many): its size and a
sha256 of IMAGE_BLOCKS blocks of IMAGE_BLOCK_BYTES spread over it (the whole file when smaller), stored per path
(`fingerprints["images"]`), so a replaced image is named; a resume fingerprints the checkpoint's images again.
Embedded images (written by vlmrl into its image cache, named by their bytes) are covered by their data file's.

Standard library only.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Optional

FULL_HASH_BYTES = 64 * 2**20
SAMPLED_BLOCKS = 64
BLOCK_BYTES = 2**20


def file_fingerprint(path: str | Path) -> str:
    """`<size>:<sha256>`: of the whole file when small, else of SAMPLED_BLOCKS evenly spread blocks and the size.
    Cached per (path, size, mtime): each checkpoint asks again."""
    path = Path(path)
    st = path.stat()
    return _fingerprint(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _fingerprint(path: str, size: int, _mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= FULL_HASH_BYTES:
            for chunk in iter(lambda: f.read(BLOCK_BYTES), b""):
                h.update(chunk)
        else:
            step = (size - BLOCK_BYTES) // (SAMPLED_BLOCKS - 1)
            for i in range(SAMPLED_BLOCKS):
                f.seek(i * step)
                h.update(f.read(BLOCK_BYTES))
    return f"{size}:{h.hexdigest()}"


IMAGE_BLOCKS = 4
IMAGE_BLOCK_BYTES = 16 * 2**10


def image_fingerprint(path: str | Path) -> Optional[str]:
    """`<size>:<sha256 prefix>` of an image file from IMAGE_BLOCKS sampled blocks (the whole file when small); None when
    it is gone. Cached per (path, size, mtime)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _image_fingerprint(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=None)
def _image_fingerprint(path: str, size: int, _mtime_ns: int) -> Optional[str]:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            if size <= IMAGE_BLOCKS * IMAGE_BLOCK_BYTES:
                h.update(f.read())
            else:
                step = (size - IMAGE_BLOCK_BYTES) // (IMAGE_BLOCKS - 1)
                for i in range(IMAGE_BLOCKS):
                    f.seek(i * step)
                    h.update(f.read(IMAGE_BLOCK_BYTES))
    except OSError:
        return None
    return f"{size}:{h.hexdigest()[:24]}"


def image_fingerprints(rows: list[dict], embedded_cache: Optional[Path] = None) -> dict[str, str]:
    """{path: image_fingerprint} for every image file the rows name (not those under `embedded_cache`)."""
    skip = str(embedded_cache.resolve()) + os.sep if embedded_cache is not None else None
    paths = sorted({p for r in rows for p in (r.get("images") or []) if isinstance(p, str)})
    out = {}
    for p in paths:
        if skip and os.path.abspath(p).startswith(skip):
            continue
        fp = image_fingerprint(p)
        if fp is not None:
            out[p] = fp
    return out


def changed_images(saved: Optional[dict], limit: int = 3) -> list[str]:
    """The checkpoint's images whose file is gone or changed now, as phrases (the first `limit` named, then a count)."""
    if not isinstance(saved, dict):
        return []
    changed = []
    for path, fp in sorted(saved.items()):
        now = image_fingerprint(path)
        if now != fp:
            changed.append(f"image {path}: {'is gone' if now is None else 'replaced (its content changed)'}")
    if len(changed) > limit:
        changed = changed[:limit] + [f"and {len(changed) - limit} more images changed"]
    return changed


def path_fingerprint(path: str | Path) -> Optional[str]:
    """A file's fingerprint, a folder's (its files' in name order), or None when the path is gone."""
    path = Path(path).expanduser()
    if path.is_file():
        return file_fingerprint(path)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(f"{p.relative_to(path).as_posix()}={file_fingerprint(p)}\n".encode())
    return f"dir:{h.hexdigest()}"


def reward_source_file(spec: str) -> Optional[Path]:
    """The source file a reward spec's function lives in (None: a built-in reward, or not found)."""
    target = spec.split("(", 1)[0]
    if ":" not in target:
        return None  # a built-in name
    module = target.rsplit(":", 1)[0]
    if module.endswith(".py"):
        return Path(module).expanduser()
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(found.origin) if found is not None and found.origin and os.path.isfile(found.origin) else None


def run_fingerprints(cfg) -> dict[str, str]:
    """{what: fingerprint} for the run's data files and reward sources (keys name the config field)."""
    out: dict[str, str] = {}
    for key in ("train_path", "eval_path"):
        value = getattr(cfg.data, key)
        if isinstance(value, str):
            fp = path_fingerprint(value) if value else None
        else:  # a list of data files: one fingerprint of them all
            prints = [path_fingerprint(f) for f in value]
            fp = "list:" + ",".join(p or "-" for p in prints) if any(prints) else None
        if fp is not None:
            out[f"data.{key}"] = fp
    for spec in cfg.algorithm.reward_funcs:
        source = reward_source_file(spec)
        if source is not None and source.is_file():
            out[f"reward {spec}"] = file_fingerprint(source)
    return out


def changed_inputs(saved: Optional[dict], current: dict[str, str]) -> list[str]:
    """What differs between a checkpoint's fingerprints and now, as phrases; [] when the checkpoint has none."""
    if not isinstance(saved, dict):
        return []  # a checkpoint from before fingerprints: nothing to compare
    changes = []
    for key in sorted(set(saved) & set(current) - {"images"}):
        if saved[key] != current[key]:
            what = "its source changed" if key.startswith("reward ") else "its content changed (rows edited, added, removed or reordered)"
            changes.append(f"{key}: {what}")
    return changes + changed_images(saved.get("images"))
