"""Reading torch.distributed.checkpoint (DCP) folders without running code from them.

A sharded checkpoint (FSDP2 with SHARDED_STATE_DICT) is a DCP folder: `.metadata` plus one `.distcp` file
per process. Stock DCP (torch 2.13, filesystem.py / default_planner.py) reads `.metadata` with a plain
`pickle.load`, and every non-tensor entry of the state (optimizer param groups, or any entry the metadata
*says* is bytes) with `torch.load(weights_only=False)`: a folder from elsewhere could run code on load.
Tensor entries already go through `torch.load(weights_only=True)`.

Here instead:
- `.metadata` is unpickled by `MetadataUnpickler`, which resolves only the handful of globals DCP's
  metadata consists of (its dataclasses, torch.Size, dtypes, layouts, pathlib paths); any other global
  (os.system, builtins.exec, a class with a __reduce__ payload) is refused before it is called;
- every storage entry must name a file inside the folder (no absolute path, no `..`);
- bytes entries are read with `torch.load(weights_only=True)` (tensors and plain containers only).

Anything refused raises UnsafeCheckpointError (a CheckpointError) naming the file and what was refused.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from vlmrl.checkpoints.files import CheckpointError, unpickling_reason

METADATA_FILE = ".metadata"

# Module -> names the unpickler resolves. Everything DCP's Metadata pickles to (checked with pickletools on
# single-process and FSDP2 saves of torch 2.13); torch dtypes are added below.
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # layout from its name ("torch.strided")
    "torch._utils": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
}


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file asked for something a code-free load refuses (a foreign global, a path outside the folder)."""


class MetadataUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only DCP metadata classes, torch.Size, dtypes and layouts."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of torch.distributed.checkpoint metadata")


def read_dcp_metadata(folder: str | Path) -> Any:
    """`folder/.metadata` as DCP's Metadata object, through MetadataUnpickler; checks every storage path."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(folder) / METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (not a torch.distributed.checkpoint folder)") from None
    except Exception as e:  # UnpicklingError, and whatever an allowed class raises on odd arguments
        raise UnsafeCheckpointError(
            f"refusing to load {path}: {unpickling_reason(e)} (only torch.distributed.checkpoint metadata classes are unpickled)"
        ) from e
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"refusing to load {path}: it holds a {type(metadata).__name__}, not DCP Metadata")
    for info in (metadata.storage_data or {}).values():
        _check_relative(getattr(info, "relative_path", None), path)
    return metadata


def _check_relative(rel: Any, metadata_path: Path) -> None:
    """A storage entry must name a plain file inside the checkpoint folder."""
    ok = isinstance(rel, str) and rel and not PurePosixPath(rel).is_absolute() and ".." not in PurePosixPath(rel).parts and "\\" not in rel
    if not ok:
        raise UnsafeCheckpointError(f"refusing to load {metadata_path}: it points at {rel!r}, outside the checkpoint folder")


def _safe_reader(folder: str | Path):
    """A FileSystemReader for `folder` whose metadata is read here, first, through MetadataUnpickler (so a refusal is
    raised as itself instead of being swallowed by DCP's fallbacks); read_data's tensors are weights_only already."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = read_dcp_metadata(folder)

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self) -> Any:  # no **kwargs: DCP then never looks for per-rank metadata files
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeFileSystemReader(str(folder))


def _safe_planner_class(base):
    from torch.distributed.checkpoint._traverse import set_element

    class SafeBytesPlanner(base):
        """A DCP load planner whose non-tensor entries are read with torch.load(weights_only=True); otherwise it
        stores them exactly as DefaultLoadPlanner.load_bytes does (torch 2.13)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                loaded = torch.load(value, weights_only=True)
            except Exception as e:
                raise UnsafeCheckpointError(
                    f"refusing to load entry {fqn!r} of a sharded checkpoint: it is not plain data "
                    f"(weights_only=True rejected it: {unpickling_reason(e)})"
                ) from e
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafeBytesPlanner


def dcp_load(state: dict, folder: str | Path, no_dist: bool) -> None:
    """`torch.distributed.checkpoint.load(state, folder)` (in place, re-sharded for the running world size), with
    the metadata and bytes entries read code-free. Refusals raise UnsafeCheckpointError on every process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    reader = _safe_reader(folder)
    planner = _safe_planner_class(DefaultLoadPlanner)()
    _checkpoint_errors_unwrapped(lambda: dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist))


def dcp_read_all(folder: str | Path, keys: set[str] | None = None) -> dict:
    """Every entry of a DCP folder (only the top-level `keys`, e.g. {"model"}, when given) as one plain nested
    state dict, on one process; code-free as dcp_load."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader = _safe_reader(folder)
    planner = _safe_planner_class(_EmptyStateDictLoadPlanner)(keys=keys)
    state: dict = {}
    _checkpoint_errors_unwrapped(lambda: _load_state_dict(state, storage_reader=reader, planner=planner, no_dist=True))
    return state


def _failures(e: Exception) -> list:
    """The exceptions each rank raised inside a DCP CheckpointException (torch 2.13: rank -> (exception, traceback))."""
    failures = getattr(e, "failures", {}) or {}
    return [v[0] if isinstance(v, tuple) else v for v in failures.values()]


def _checkpoint_errors_unwrapped(run):
    """Run a DCP load; a CheckpointError raised inside it (wrapped by DCP per rank) comes out as itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return run()
    except CheckpointException as e:
        ours = [err for err in _failures(e) if isinstance(err, CheckpointError)]
        if ours:
            raise ours[0] from e
        raise
