"""The memory planner's closed form: `plan(spec, workload)` sums the named device terms (terms.TERMS) into the
peaks of the step's three phases (rollout, scoring, update), adds the allocator's reserve and the CUDA context, and
puts the host terms (host) and a verdict beside them. Pure arithmetic."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vlmrl.plan.deepspeed import (
    plans_zero,
    with_zero_terms,
    zero3_prefix_gathered,
    zero3_reduces_once,
    zero_flat_at_peak,
    zero_offload_host_buffers,
)
from vlmrl.plan.geometry import MicroBatch, micro_batch, naive_fallback
from vlmrl.plan.host import host_terms, host_verdict, mmapped_at_peak, parks
from vlmrl.plan.profiles import profile_workload
from vlmrl.plan.spec import ALLOCATOR_RESERVE, CUDA_CONTEXT_BYTES, FIT_FRACTION, GiB, ModelSpec, Workload, check_workload
from vlmrl.plan.steptime import step_time
from vlmrl.plan import vllm
from vlmrl.plan.terms import (
    TERMS,
    head_gradient_temporary,
    logprob_head,
    model_states,
    pixel_inputs,
    prefix_backward_activations,
    rollout_buffers,
    scores,
    scoring_transient,
    generation_gather_bytes,
)


@dataclass
class Plan:
    terms: dict  # name -> bytes (per device)
    phases: dict  # rollout / scoring / update -> peak bytes allocated
    peak_allocated: int
    reserved: int  # peak_allocated x (1 + ALLOCATOR_RESERVE): compare with torch.cuda.max_memory_reserved
    total: int  # reserved + CUDA context: what must fit on the device
    host: dict  # host RAM terms per node (bytes)
    gpu_memory_bytes: int | None
    verdict: str
    headroom: int | None
    notes: list = field(default_factory=list)
    workload: dict = field(default_factory=dict)
    step_time_s: float = 0.0
    vllm: dict = field(default_factory=dict)  # a colocated vLLM's reservation and what it holds (plan.vllm.vllm_terms); {} without

    @property
    def fits(self) -> bool:
        """Fits on the device and, when a host size is given, in host RAM (on a CPU run: in host RAM only)."""
        host_ok = self.host_fits is not False
        if self.workload.get("device") == "cpu":
            return bool(self.host_fits)
        vllm_ok = not (self.vllm and vllm.problems(self.vllm))
        return self.gpu_memory_bytes is not None and self.total <= FIT_FRACTION * self.gpu_memory_bytes and host_ok and vllm_ok

    @property
    def host_fits(self) -> bool | None:
        size = self.workload.get("host_memory_bytes")
        return None if not size else self.host["total"] <= FIT_FRACTION * size

    def to_dict(self) -> dict:
        gib = lambda b: round(b / GiB, 3)
        return {
            "verdict": self.verdict,
            "fits": self.fits if (self.gpu_memory_bytes or self.host_fits is not None) else None,
            "host_fits": self.host_fits,
            "host_total_gib": gib(self.host["total"]),
            "total_gib": gib(self.total),
            "reserved_gib": gib(self.reserved),
            "peak_allocated_gib": gib(self.peak_allocated),
            "gpu_memory_gib": gib(self.gpu_memory_bytes) if self.gpu_memory_bytes else None,
            "headroom_gib": gib(self.headroom) if self.headroom is not None else None,
            "phases_gib": {k: gib(v) for k, v in self.phases.items()},
            "terms_gib": {k: gib(v) for k, v in self.terms.items()},
            "host_gib": {k: gib(v) for k, v in self.host.items()},
            "step_time_s": round(self.step_time_s, 3),
            "notes": list(self.notes),
            "workload": self.workload,
        } | (
            {"vllm_gib": {k: (gib(v) if k not in ("cap", "sleep_level", "tensor_parallel_size") else v) for k, v in self.vllm.items()}}
            if self.vllm
            else {}
        )


def plan(spec: ModelSpec, w: Workload) -> Plan:
    """The closed form. All figures are bytes on one device (the busiest rank). w.profile naive / trl: another
    trainer's data path for the same work (plan_profiles)."""
    check_workload(w)
    w, fallback, notes = naive_fallback(spec, profile_workload(w))
    mb = micro_batch(spec, w, fallback)
    raw = {name: term(spec, w, mb) for name, term in TERMS.items()}
    if plans_zero(w):  # a DeepSpeed run: ZeRO's own buffers from its config
        raw = with_zero_terms(spec, w, raw)
    phases, fwd_bwd = phase_peaks(spec, w, mb, raw)
    trainer_phases = phases
    v = vllm.vllm_terms(spec, w, mb) if vllm.uses_vllm(w) and w.device != "cpu" and w.gpu_memory_bytes else {}
    if vllm.uses_vllm(w) and not v:
        notes.append(vllm.UNPLANNED_ON_CPU if w.device == "cpu" else "vLLM's cap is a share of the device: give the device memory to plan it")
    if v:  # vLLM's cap is a fixed share of the device beside the trainer's allocator (no allocator reserve on it)
        phases, peak, reserved = _with_vllm(w, phases)
    else:
        peak = max(phases.values())
        reserved = int(peak * (1 + ALLOCATOR_RESERVE))
    total = reserved + CUDA_CONTEXT_BYTES
    terms = {k: int(v) for k, v in raw.items()} | {"allocator_reserve": reserved - peak, "cuda_context": CUDA_CONTEXT_BYTES}
    if v:
        terms["vllm_reservation"] = v["reservation"]
        notes += vllm.notes(v)
    st = model_states(spec, w)
    if w.offload != "none":
        notes.append(f"optimizer states ({(st['moments'] + st['master']) / GiB:.2f} GiB) live in host RAM")
    buffers = pixel_inputs(spec, w, mb) + rollout_buffers(spec, w, mb)
    mmapped = _mmapped(spec, w, mb, raw, trainer_phases, fwd_bwd)
    if plans_zero(w):
        mmapped += zero_flat_at_peak(spec, w, raw, phases, fwd_bwd)
    engine_host = zero_offload_host_buffers(spec, w, w.zero) if plans_zero(w) else 0
    host_peak = int(peak) if not v else max(trainer_phases.values())
    host = host_terms(
        spec, w, st, buffers, host_peak, raw["reference_moved_in_for_scoring"] > 0, None, mmapped, engine_host, vllm.host_bytes(spec, w)
    )
    headroom, verdict = _verdict(int(total), w, host, vllm.problems(v) if v else [])
    if v:
        verdict += f" [vLLM colocated: {v['cap']:.2f} x {w.gpu_memory_bytes / GiB:.1f} = {v['reservation'] / GiB:.1f} GiB of it]"
    return Plan(
        terms=terms,
        phases=phases,
        peak_allocated=int(peak),
        reserved=reserved,
        total=int(total),
        host=host,
        gpu_memory_bytes=w.gpu_memory_bytes if w.device != "cpu" else None,
        verdict=verdict,
        headroom=headroom,
        notes=notes,
        workload=_workload_record(w, mb),
        step_time_s=step_time(spec, w, st["trainable"]),
        vllm=v,
    )


def _with_vllm(w: Workload, phases: dict) -> tuple[dict, int, int]:
    """(phases with vLLM's resident bytes added, peak allocated, reserved) of a step beside a colocated vLLM: each
    phase is the trainer's (x the allocator's reserve) plus what vLLM holds then (plan.vllm.resident: its whole cap
    while it samples; during scoring and the update too unless it sleeps). The peak is the phase whose sum is largest."""
    both = {k: phases[k] * (1 + ALLOCATOR_RESERVE) + vllm.resident(w, k) for k in phases}
    top = max(both, key=both.get)
    with_v = {k: int(phases[k] + vllm.resident(w, k)) for k in phases}
    return with_v, with_v[top], int(both[top])


def _workload_record(w: Workload, mb: MicroBatch) -> dict:
    """The workload as planned (after the profile / fallback) with its prompt's token counts."""
    extra = {"image_tokens_per_prompt": mb.vision_tokens - mb.video_tokens, "video_tokens_per_prompt": mb.video_tokens, "prompt_tokens": mb.P}
    # fields one by one: Workload holds scalars and tuples of strings (asdict's deep copy was half of plan()'s time in search)
    record = {f.name: getattr(w, f.name) for f in dataclasses.fields(w) if f.name != "zero"}
    if w.zero is not None:  # the DeepSpeed config's ZeRO settings (absent for other engines)
        record["zero"] = dataclasses.asdict(w.zero)
    return record | extra


def persistent_bytes(spec: ModelSpec, w: Workload, mb: MicroBatch, t: dict) -> float:
    """What stays on the device through the whole step: weights, master copy and optimizer states (when on the
    device), the reference, the step's inputs and rollout buffers, the engine's buckets."""
    return (
        t["weights"]
        + t["master_weights"]
        + t["optimizer_states"]
        + t["reference_model"]
        + t["teacher_model"]
        + t["judge_model"]
        + pixel_inputs(spec, w, mb)
        + rollout_buffers(spec, w, mb)
        + t["comm_buffers"]
        + _zero_persistent(w, t)
    )


def _zero_persistent(w: Workload, t: dict) -> float:
    """DeepSpeed (with_zero_terms): its float32 master clone, the checkpoint pages a CPU run keeps, and from the
    first backward on the gradient partition (ZeRO-2 keeps it, ZeRO-3 allocates it at initialisation) and ZeRO-3's
    bucket (allocated once). 0 otherwise."""
    if not plans_zero(w):
        return 0
    return t["zero_master_copy"] + t["zero_checkpoint_pages"] + t["gradients"] + (t["zero_reduce_buckets"] if w.zero.stage == 3 else 0)


def phase_peaks(spec: ModelSpec, w: Workload, mb: MicroBatch, t: dict) -> tuple[dict, float]:
    """({rollout, scoring, update}: peak bytes allocated, the forward/backward peak) from the terms `t` (unrounded).
    With memory.offload_optimizer_during_rollout the states are parked in host RAM for rollout and scoring."""
    persistent = persistent_bytes(spec, w, mb, t)
    parked = t["master_weights"] + t["optimizer_states"] if parks(w) else 0
    generation = t["kv_cache"] + t["generation_temporaries"] + generation_gather_bytes(spec, w, mb)
    rollout = persistent - parked + max(generation, t["judge_generation"])  # the judge generates after the policy
    moved_in = t["reference_moved_in_for_scoring"] + t["teacher_moved_in_for_scoring"]
    scored = moved_in + scoring_transient(spec, w, mb) + t["gathered_parameters"] if scores(w) else 0
    scoring = persistent - parked + scored
    fwd_bwd, update = update_peaks(spec, w, mb, t, persistent)
    return {"rollout": int(rollout), "scoring": int(scoring), "update": int(update)}, fwd_bwd


def update_peaks(spec: ModelSpec, w: Workload, mb: MicroBatch, t: dict, persistent: float) -> tuple[float, float]:
    """(forward/backward peak, update peak: the largest of forward/backward, the end of backward, the optimizer step).

    Gradients are set to None after every optimizer step. With one micro-batch per optimizer step (grad_accum 1) a
    backward never finds gradients already there: each fresh gradient becomes .grad (no accumulation temporaries),
    and the decoder gradients held on the shared-prefix path are the gradients. From the second micro-batch of a
    step on (grad_accum > 1, the trace's steady state) they coexist. The shared prefix's backward peaks at one end:
    at the far end the prompt pass's activations and the vision tower's are still alive beside the held gradients."""
    steady = w.grad_accum > 1
    grads, gathered, emb = t["gradients"], t["gathered_parameters"], t["embedding_grad_temporaries"]
    held = grads if steady else 0
    buckets = at_end = 0
    end_gathered = gathered
    if plans_zero(w):  # the gradient partition is persistent (_zero_persistent); in backward ZeRO-1/2's buckets live,
        # ZeRO-3's (persistent) bucket is copied for its reduce-scatter: during backward, or once at its end when the
        # bucket holds every gradient (zero3_reduces_once)
        grads = held = 0
        buckets = at_end = t["zero_reduce_buckets"] if w.zero.stage < 3 else t["zero3_reduce_scatter_copies"]
        if zero3_reduces_once(spec, w, w.zero):  # in backward's epilogue: every module's gathered parameters released
            buckets = end_gathered = 0
    activations = t["activations_text"] + t["activations_vision"] + t["activations_other"] + t["eager_attention_scores"] + t["full_vocab_logits"]
    bwd_transient = max(t["logprob_buffers"] + head_gradient_temporary(spec, w, mb), t["checkpoint_recompute"])
    fwd_bwd = persistent + held + activations + bwd_transient + gathered + buckets
    fwd_end = persistent + held + activations + t["naive_row_pixel_copies"] + gathered
    fwd_bwd = max(fwd_bwd, fwd_end)
    bwd_end = persistent + grads + (emb if steady else 0) + end_gathered + at_end
    if t["prefix_held_gradients"]:
        prefix_act = prefix_backward_activations(spec, w, mb)
        if plans_zero(w) and w.zero.stage == 3:  # the decoder gathered, ZeRO-3's copies (measured: zero3_prefix_gathered)
            prefix_end = persistent + emb * steady + zero3_prefix_gathered(spec, w, w.zero) + prefix_act + at_end
        else:
            prefix_end = persistent + held + emb * steady + t["prefix_held_gradients"] + prefix_act + gathered + buckets
        bwd_end = max(bwd_end, prefix_end)
    # the step's float32 gradient partition and temporaries, then (released) ZeRO-1/2's all-gather staging on the CPU
    opt_step = persistent + grads + max(t["optimizer_step_temporary"] + t.get("zero_fp32_grad_partition", 0), t.get("zero_allgather_staging", 0))
    return fwd_bwd, max(fwd_bwd, bwd_end, opt_step)


def _mmapped(spec: ModelSpec, w: Workload, mb: MicroBatch, t: dict, phases: dict, fwd_bwd: float) -> int:
    """mmapped_at_peak of this step's log-prob head."""
    head = logprob_head(spec, w, mb)
    head_bwd = t["logprob_buffers"] + head_gradient_temporary(spec, w, mb)
    return mmapped_at_peak(
        phases, head["unit"], head["kept"], head_bwd, fwd_bwd, t["checkpoint_recompute"], head["no_grad"], scoring_transient(spec, w, mb)
    )


def _verdict(total: int, w: Workload, host: dict, vllm_problems: list | tuple = ()) -> tuple[int | None, str]:
    """(device headroom, the verdict line): the device's, and the host's when a host size is given (on CPU: only it);
    a colocated vLLM that cannot start does not fit whatever the total."""
    gpu = w.gpu_memory_bytes
    if w.device == "cpu":
        return None, "CPU run: no device memory; " + host_verdict(host, w.host_memory_bytes)
    if gpu and vllm_problems:
        headroom, verdict = int(gpu - total), "does NOT fit: " + "; ".join(vllm_problems)
    elif gpu:
        headroom = int(gpu - total)
        verdict = (
            f"fits: {total / GiB:.1f} of {gpu / GiB:.1f} GiB, {headroom / GiB:.1f} GiB headroom"
            if total <= FIT_FRACTION * gpu
            else f"does NOT fit: {total / GiB:.1f} GiB needed on a {gpu / GiB:.1f} GiB device"
            + (f" ({-headroom / GiB:.1f} GiB over)" if headroom < 0 else f" (within {(1 - FIT_FRACTION):.0%} margin)")
        )
    else:
        headroom, verdict = None, f"needs {total / GiB:.1f} GiB per device (no device size given)"
    if w.host_memory_bytes:
        verdict += "; " + host_verdict(host, w.host_memory_bytes)
    return headroom, verdict
