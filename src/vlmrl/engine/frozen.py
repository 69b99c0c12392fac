"""The frozen policies the GRPO loss scores against: the reference (KL, algorithm.beta) and the distillation teacher
(algorithm.teacher_path). Each is held by a `FrozenPolicy`: the adapter-disabled model (LoRA) or a frozen copy, parked on
the CPU between scorings with memory.ref_placement=cpu and wrapped by the engine when it shards references (ZeRO-3).
In the engine layer because it frees device memory (engine.oom) and is wrapped by the training engine.
"""

from __future__ import annotations

import copy


from vlmrl.config import Config
from vlmrl.models.policy import load_policy
from vlmrl.engine.oom import free_memory
from vlmrl.models.loading import reference_disabled_adapter


class FrozenPolicy:
    """Context manager yielding the reference policy: the adapter-disabled model (LoRA) or a frozen copy.
    A copy placed on the CPU (memory.ref_placement=cpu) is moved to the device only while it scores."""

    def __init__(self, model, frozen_copy=None, device=None, offload: bool = False, runner=None, processor=None):
        self.model, self._copy, self._ctx = model, frozen_copy, None
        self.processor = processor  # the teacher's own processor (distillation), else None
        self.device, self.offload = device, offload
        self.runner = runner  # the copy wrapped by the engine (ZeRO-3: partitioned): scoring calls go through it
        if self._copy is not None and offload and runner is None:
            self._copy.to("cpu")

    def __enter__(self):
        if self._copy is not None:
            return self._copy.to(self.device) if self.offload and self.runner is None else self._copy

        self._ctx = reference_disabled_adapter(self.model)
        self._ctx.__enter__()
        return self.model

    def __exit__(self, *exc):
        if self._copy is not None and self.offload and self.runner is None:
            self._copy.to("cpu")

            free_memory()
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
            self._ctx = None


def make_reference(model, cfg: Config, device, fresh: bool = False, engine=None):
    """None when beta == 0 (no reference is loaded at all). With LoRA the reference is the same model with
    its adapter disabled. Otherwise a frozen copy of the initial policy: a deep copy at the start, or a
    fresh load from model.name_or_path when resuming (the policy then holds trained weights), wrapped by the
    engine when it shards references too (`engine.wrap_reference`: ZeRO-3 partitions it)."""
    if cfg.algorithm.beta == 0:
        return None
    if cfg.model.use_lora:
        return FrozenPolicy(model)
    if fresh:
        initial = load_policy(cfg, device)[0]
        # Loaded weights can sit at unaligned addresses (safetensors), where CPU matmul kernels round differently
        # than on a deep copy's fresh allocations; copied one tensor at a time, resume stays bit-exact.
        for tensor in [*initial.parameters(), *initial.buffers()]:
            tensor.data = tensor.data.clone()
    else:
        initial = copy.deepcopy(model)
    initial = initial.eval().requires_grad_(False)
    runner = engine.wrap_reference(initial) if engine is not None else None
    return FrozenPolicy(model, initial, device, offload=cfg.memory.ref_placement == "cpu", runner=runner)


def make_teacher(model, processor, cfg: Config, device, engine=None):
    """None without algorithm.teacher_path; else the frozen teacher (models/teacher.load_teacher: refused unless it
    has the policy's tokenizer) held like a reference copy: memory.ref_placement=cpu keeps it in host RAM between
    scorings, and an engine that shards references (ZeRO-3) shards it too."""
    from vlmrl.models.teacher import load_teacher

    loaded = load_teacher(cfg, device, model, processor)
    if loaded is None:
        return None
    teacher, teacher_processor = loaded
    runner = engine.wrap_reference(teacher) if engine is not None else None
    return FrozenPolicy(None, teacher, device, offload=cfg.memory.ref_placement == "cpu", runner=runner, processor=teacher_processor)
