"""Optimizer states parked in host memory while the rollout and scoring run (memory.offload_optimizer_during_rollout).

AdamW's two moments are twice the trainable weights (fp32 moments of a 3B full fine-tune: 24 GB) and nothing between
one optimizer step and the next reads them. Parking them in host memory for the rollout and scoring phases frees that
much device memory for larger generation batches and KV caches, at the cost of one device->host and one host->device
copy per step. No second engine, no weight copy: the optimizer keeps its own tensors, only their storage comes and goes.

How: each state tensor on the training device keeps its identity (the optimizer, accelerate's wrapper and FSDP2's
DTensor states keep referring to it); its bytes are copied into a host buffer (pinned on CUDA, allocated once and
reused every step) and the tensor is pointed at an empty storage (`set_`), which hands its memory back to the
allocator (a storage loaded from a checkpoint may not be resizable in place, so no `resize_`). Restoring points it
at a fresh device copy of the same bytes: the update sees bitwise the states it would have seen without parking.
On a CPU device the host buffer is a second host tensor: the mechanism is the same and the tests observe it (the
training device holds no state bytes while parked), though nothing is gained there.

Scalars (AdamW's `step`, a 0-d tensor, on the host unless capturable/fused) are left alone.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vlmrl.config import MemoryConfig


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this process's bytes (a DTensor's local shard; the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()  # a DTensor's to_local() is then its own local tensor, not an autograd view of it
def state_tensors(optimizer) -> list[torch.Tensor]:
    """Every non-scalar state tensor of the optimizer (under accelerate's wrapper too), in a stable order."""
    inner = getattr(optimizer, "optimizer", optimizer)
    out = []
    for group in inner.param_groups:
        for p in group["params"]:
            for value in inner.state.get(p, {}).values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    out.append(_local(value))
    return out


def device_state_bytes(optimizer) -> int:
    """Bytes the optimizer's state tensors hold in their storages now (0 while parked)."""
    return sum(t.untyped_storage().nbytes() for t in state_tensors(optimizer))


class OptimizerParking:
    """Parks an optimizer's states in host memory and brings them back; a no-op when disabled."""

    def __init__(self, optimizer, enabled: bool):
        self.optimizer = optimizer
        self.enabled = enabled
        self.host: list[torch.Tensor] = []  # host buffers, one per state tensor, reused every step
        self.parked = False

    def park(self) -> int:
        """Copy every state tensor to its host buffer and free its device storage. Returns the bytes freed."""
        if not self.enabled or self.parked:
            return 0
        tensors = state_tensors(self.optimizer)
        pin = torch.cuda.is_available() and any(t.is_cuda for t in tensors)
        if [h.shape for h in self.host] != [t.shape for t in tensors] or [h.dtype for h in self.host] != [t.dtype for t in tensors]:
            self.host = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in tensors]
        freed = 0
        for t, h in zip(tensors, self.host):
            h.copy_(t, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()  # the copies must have read the bytes before their storage is released
        with torch.no_grad():
            for t in tensors:
                freed += t.untyped_storage().nbytes()
                t.set_(torch.empty(0, dtype=t.dtype, device=t.device))
        self.parked = True
        return freed

    def restore(self) -> None:
        """Point every state tensor at a device copy of its parked bytes (before the update reads them)."""
        if not self.parked:
            return
        tensors = state_tensors(self.optimizer)
        with torch.no_grad():
            for t, h in zip(tensors, self.host):
                t.set_(h.to(t.device, non_blocking=h.is_pinned(), copy=True))
        self.parked = False

    @contextlib.contextmanager
    def parked_states(self):
        """States in host memory inside the block; back on the device when it ends, also when it raises (a rollout that
        fails must not leave the optimizer without its moments for the checkpoint or the next step)."""
        self.park()
        try:
            yield
        finally:
            self.restore()


def parking_enabled(memory: MemoryConfig, dist, log) -> bool:
    """memory.offload_optimizer_during_rollout, unless the engine keeps the states where parking cannot reach them."""
    if not memory.offload_optimizer_during_rollout:
        return False
    if getattr(getattr(dist, "engine", None), "name", "") == "deepspeed":
        log(
            "memory.offload_optimizer_during_rollout: off under DeepSpeed, which keeps the optimizer states in its own "
            "partitions (use its offload_optimizer)"
        )
        return False
    return True
