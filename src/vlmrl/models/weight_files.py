"""A model folder's weights checked before any is loaded: their files, then the model's keys and shapes.

- `check_weight_files`: every safetensors file's header read by hand (8-byte length, then JSON), without loading a
  tensor: a header length past the file or over MAX_HEADER_BYTES, an unknown layout, a tensor whose byte range lies
  outside the file or does not hold dtype x shape bytes, and (sharded folders) a key model.safetensors.index.json
  puts in a shard whose header lacks it, are refused in one line naming the file. Milliseconds per file.
- `check_expected_weights`: the model built on the meta device from its config.json (no memory, no weights read)
  and transformers' own loading report over the folder, so its key renaming between saved names and module names
  (`model.layers.*` saved, `model.language_model.layers.*` loaded), fused experts, and tied weights that may be
  absent are transformers' decisions, not guesses here: a tensor the model needs that no file holds (it would
  train from random values) or one of another shape is refused in one line.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from vlmrl.models.loading import ModelLoadError
import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}


def read_header(path: Path) -> dict:
    """The tensors a safetensors file declares, {name: (dtype, shape)}, after checking every declared byte range
    against the file; ModelLoadError naming the file otherwise."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ModelLoadError(f"{path}: its header claims {n:,} bytes but the file holds {size:,}; the file is damaged or not safetensors")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"{path}: its header is not JSON ({e}); the file is damaged or not safetensors") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: its header is not a JSON object; the file is damaged or not safetensors")
    data_bytes = size - 8 - n
    return {name: _tensor(path, name, entry, data_bytes) for name, entry in header.items() if name != "__metadata__"}


def _tensor(path: Path, name: str, entry, data_bytes: int) -> tuple[str, tuple[int, ...]]:
    ok = isinstance(entry, dict) and isinstance(entry.get("dtype"), str)
    shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
    ok = ok and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    if not ok:
        raise ModelLoadError(f"{path}: tensor {name!r} has no valid dtype, shape and data_offsets in the header; the file is damaged")
    begin, end = offsets
    if not 0 <= begin <= end <= data_bytes:
        raise ModelLoadError(
            f"{path}: tensor {name!r} lies at bytes {begin:,}-{end:,} of a data section of {data_bytes:,} bytes (past the "
            "file's end); the file is truncated or damaged"
        )
    itemsize = DTYPE_BYTES.get(entry["dtype"])
    if itemsize is not None and end - begin != math.prod(shape) * itemsize:
        raise ModelLoadError(
            f"{path}: tensor {name!r} is declared {entry['dtype']} {shape} ({math.prod(shape) * itemsize:,} bytes) but "
            f"spans {end - begin:,} bytes; the file is damaged"
        )
    return entry["dtype"], tuple(shape)


def check_weight_files(folder: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor the folder's safetensors files declare, {name: (dtype, shape)}, each file's header checked
    (read_header) and, with model.safetensors.index.json, every key of its weight_map found in the shard it
    names. ModelLoadError in one line otherwise."""
    folder = Path(folder)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    by_file = {p.name: read_header(p) for p in sorted(folder.glob("*.safetensors"))}
    for headers in by_file.values():
        tensors.update(headers)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        except (ValueError, AttributeError):
            weight_map = {}  # check_model_folder reports an unreadable index
        for key, shard in weight_map.items():
            if shard in by_file and key not in by_file[shard]:
                raise ModelLoadError(f"{index}: names {key!r} in {shard}, whose header has no such tensor; the folder is incomplete or damaged")
    return tensors


def check_expected_weights(folder: str | Path, trust_remote_code: bool = False) -> None:
    """ModelLoadError when a tensor the model (built from config.json on the meta device) needs is in no weight file,
    or has another shape there; transformers' loading report decides, with its key renaming and tied weights."""
    from transformers import AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    folder = Path(folder)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report is turned into the one line below
    hf_logging.disable_progress_bar()  # nothing loads: no "Loading weights" bar
    try:
        _, info = AutoModelForImageTextToText.from_pretrained(
            folder,
            device_map="meta",
            dtype=torch.float32,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
            local_files_only=True,
            trust_remote_code=trust_remote_code,
        )
    except ModelLoadError:
        raise
    except Exception as e:  # the real load reports its own errors, with the same cause, when the run starts
        if isinstance(e, (OSError, ValueError, KeyError, ImportError)):
            return
        raise ModelLoadError(f"{folder}: its weights cannot be matched to config.json: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    refuse_loading_report(folder, info)


def refuse_loading_report(folder: Path, info: dict) -> None:
    """ModelLoadError from transformers' loading info when a needed tensor is missing or of another shape."""
    missing = sorted(info.get("missing_keys") or [])
    mismatched = sorted(info.get("mismatched_keys") or [], key=str)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(
            f"{folder}: its weight files lack {len(missing)} tensor(s) the model in config.json needs ({shown}); they would "
            "train from random values. The folder is incomplete: copy the missing shards, or point model.name_or_path "
            "at the complete folder"
        )
    if mismatched:
        first = mismatched[0]
        what = (
            f"{first[0]} is {tuple(first[1])} in the files, {tuple(first[2])} in the model"
            if isinstance(first, tuple) and len(first) == 3
            else str(first)
        )
        raise ModelLoadError(
            f"{folder}: {len(mismatched)} tensor(s) do not have the shape config.json gives ({what}); the weights do not belong to this config"
        )
