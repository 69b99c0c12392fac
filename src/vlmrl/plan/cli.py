"""`vlmrl plan`: predict the per-device GPU peak of a GRPO step before launch (and search configs that fit).

vlmrl plan --model qwen2.5-vl-7b --gpus 8 --gpu-memory 80GiB --num-generations 8 --max-pixels 1003520
vlmrl plan --config run.yaml training.per_device_train_batch_size=8 --gpu-memory 80GiB --search
vlmrl plan --model path/to/config.json --gpu-memory 24GiB --lora --json
vlmrl plan --model qwen2.5-vl-3b --trace            # exact mode: one traced update step on the meta device
vlmrl plan --model qwen2.5-vl-7b --profile naive     # a TRL-style trainer's step: does it fit, and which vlmrl config does
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from vlmrl.plan.profiles import PROFILES
from vlmrl.plan.planner import ATTENTIONS, GPU_MEMORY_GIB, MASTER_WEIGHTS, OFFLOADS, SHARDINGS, GiB, PlanError, parse_memory
from vlmrl.plan.planner import Workload, workload_from_config
from vlmrl.plan.deepspeed import zero_config, zero_offload
from vlmrl.plan.planner import sft_workload
from vlmrl.plan.planner import model_spec, plan, search, spec_for_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    _model_arguments(p)
    _workload_arguments(p)
    _engine_arguments(p)
    _output_arguments(p)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    """What to plan: a config or a model, and the machine."""
    p.add_argument("overrides", nargs="*", help="key=value config overrides (with --config), e.g. rollout.num_generations=8")
    p.add_argument("--config", help="a vlmrl YAML config to plan (model, batch, pixels, switches all come from it)")
    p.add_argument("--model", help="a preset name (see --list-models) or a path to a model folder / config.json")
    p.add_argument("--list-models", action="store_true", help="print the bundled presets and exit")
    p.add_argument("--gpus", type=int, default=None, help="GPUs (world size); default 1")
    p.add_argument(
        "--gpu-memory",
        "--gpu",
        dest="gpu_memory",
        default=None,
        help="memory per GPU as PyTorch sees it: a GPU name (" + ", ".join(GPU_MEMORY_GIB) + ") or a size. "
        "Sizes: 80GiB = 80 x 2^30 bytes; 80GB = 80 x 10^9 bytes (74.5 GiB); a bare number is GiB. A card sold "
        "as '80GB' is neither: an H100 80GB gives PyTorch 79.18 GiB (nvidia-smi: 81559 MiB = 79.6 GiB), so "
        "prefer the name (--gpu h100-80gb). Default with --model: h100-80gb",
    )


def _workload_arguments(p: argparse.ArgumentParser) -> None:
    """What one step does: batch, pixels, video, lengths, what trains."""
    p.add_argument("--num-generations", type=int, help="completions per prompt (G)")
    p.add_argument("--prompts", type=int, help="prompts per rollout step per GPU")
    p.add_argument("--micro-batch", type=int, help="rows per forward/backward (per_device_train_batch_size)")
    p.add_argument("--grad-accum", type=int, help="gradient accumulation steps")
    p.add_argument("--prompts-per-call", type=int, help="prompts per generate() call (memory.generation_prompts_per_call)")
    p.add_argument("--max-pixels", type=int, help="pixel cap per image (data.max_pixels)")
    p.add_argument("--images-per-prompt", type=int, help="images per prompt (default 1)")
    p.add_argument(
        "--video-frames",
        type=int,
        help="frames of one video per prompt (data.max_frames; the Qwen-VL families); 0 = no video. A video-only prompt: --images-per-prompt 0",
    )
    p.add_argument("--video-max-pixels", type=int, help="pixel cap per video frame (data.video_max_pixels, default 128*28*28)")
    p.add_argument("--prompt-tokens", type=int, help="text tokens per prompt besides image tokens (default 64)")
    p.add_argument("--completion-length", type=int, help="max completion tokens (rollout.max_completion_length)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), help="weights dtype (default bfloat16 with --model)")
    p.add_argument("--lora", action="store_true", default=None, help="LoRA instead of full fine-tuning")
    p.add_argument("--lora-r", type=int)
    p.add_argument("--gradient-checkpointing", action="store_true", default=None)
    p.add_argument("--freeze-vision", action="store_true", default=None, help="freeze the vision tower")
    p.add_argument("--beta", type=float, help="KL weight (> 0 adds a reference model for full fine-tuning)")
    p.add_argument("--ref-placement", choices=("device", "cpu"))


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine, precision, attention, offload and the step's mode / profile."""
    p.add_argument("--sharding", choices=SHARDINGS, help="engine of the accelerate config: ddp, zero1/2/3 (DeepSpeed), fsdp (FSDP2)")
    p.add_argument(
        "--deepspeed-config",
        metavar="JSON",
        help="the DeepSpeed JSON of the run: ZeRO's own buffers (buckets, gather window, flat-partition step) are planned "
        "from its zero_optimization section, DeepSpeed's defaults where a key is unset; sets --sharding zero<stage>",
    )
    p.add_argument(
        "--generation-gather",
        choices=("full", "layers"),
        help="memory.generation_gather under zero3/fsdp: full = whole model gathered for the rollout, layers = one block",
    )
    p.add_argument(
        "--attn-implementation",
        choices=ATTENTIONS,
        help="model.attn_implementation: sdpa (default) and flash_attention_2 keep no score matrix; eager keeps "
        "[rows, heads, S, S] float32 softmax + cast probabilities per layer (--trace runs the family's eager code)",
    )
    p.add_argument(
        "--master-weights",
        choices=MASTER_WEIGHTS,
        help="precision scheme of the optimizer: none = AdamW on the weights, moments in their dtype (bf16 weights: "
        "4 bytes/parameter of states); fp32 = a float32 master copy + float32 moments (12 bytes/parameter; "
        "DeepSpeed, verl/EasyR1 FSDP). Sharded by the same rule under every engine. auto (default) = what vlmrl "
        "runs: none without DeepSpeed and under fsdp, fp32 under zero1/2/3",
    )
    p.add_argument("--offload", choices=OFFLOADS, help="CPU offload with a ZeRO/FSDP stage (planning only)")
    p.add_argument(
        "--offload-during-rollout",
        action="store_true",
        default=None,
        help="memory.offload_optimizer_during_rollout: optimizer states in host RAM for rollout and scoring",
    )
    _vllm_arguments(p)
    p.add_argument("--logprob-chunk", type=int, help="memory.logprob_chunk_tokens (0 = off)")
    p.add_argument(
        "--mode",
        choices=("grpo", "sft"),
        default="grpo",
        help="sft: plan `vlmrl sft` (rows = --micro-batch or sft.batch_size, each with its own prompt and image; "
        "--completion-length = target tokens; no rollout). With --config every stage the config runs is planned",
    )
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="vlmrl",
        help="whose step: vlmrl (default); naive = a plain TRL-style trainer (G copies of each prompt and image, HF generate "
        "prefill of the copies, full-vocabulary float32 logits, reference scored the same way); trl = naive with TRL 1.x's "
        "fused LM head (tiles of 4096 tokens x 32768 vocabulary). Also prints vlmrl's plan of the same work, and a vlmrl "
        "config that fits when that does not",
    )
    p.add_argument(
        "--logits-positions",
        choices=("completion", "sequence"),
        help="with --profile naive: completion (default: logits_to_keep, TRL >= 0.15) or sequence (the LM head projects "
        "every prompt + completion position before the completion slice: VLM trainers that call the model without logits_to_keep)",
    )


def _vllm_arguments(p: argparse.ArgumentParser) -> None:
    """A colocated vLLM engine (rollout.backend=vllm): its cap, sleep level, tensor parallelism, image limit, length."""
    p.add_argument(
        "--vllm-gpu-memory-utilization",
        type=float,
        help="a colocated vLLM samples the rollouts and reserves this share of the device (TRL / ms-swift: "
        "vllm_gpu_memory_utilization); its weights, encoder cache, profiling peak and KV blocks live inside it",
    )
    p.add_argument(
        "--vllm-sleep-level",
        type=int,
        choices=(0, 1, 2),
        help="0 = vLLM stays on the device; 1 = weights to host RAM + KV freed during training; 2 = both discarded",
    )
    p.add_argument("--vllm-tensor-parallel-size", type=int, help="ranks one vLLM engine splits its weights and KV heads over")
    p.add_argument("--vllm-limit-images", type=int, help="images per prompt vLLM is profiled for (limit_mm_per_prompt; default --images-per-prompt)")
    p.add_argument("--vllm-max-model-len", type=int, help="vLLM's max_model_len (default prompt + completion tokens)")


def _output_arguments(p: argparse.ArgumentParser) -> None:
    """SFT stages, host / CPU runs, search, trace and output."""
    p.add_argument("--sft-stage", type=int, choices=(1, 2), help="with --mode sft and --model: 1 = projector only, 2 = language model (default)")
    p.add_argument("--train-vision-tower", action="store_true", help="with --mode sft: stage 2 also trains the vision tower")
    p.add_argument(
        "--host-memory",
        help="host RAM per node (same forms as --gpu-memory, e.g. 256GB): adds a host verdict; --search keeps only configurations that fit it",
    )
    p.add_argument(
        "--cpu", action="store_true", help="plan a CPU run (training.device=cpu): every tensor in host RAM, the host verdict is the verdict"
    )
    p.add_argument("--search", action="store_true", help="print the fastest few configurations predicted to fit")
    p.add_argument("--allow", default="", help="with --search: comma list of num_generations,max_pixels,effective_batch that may change")
    p.add_argument("--top", type=int, default=5, help="with --search: how many to print")
    p.add_argument("--trace", action="store_true", help="exact mode: trace one update step on the meta device and compare")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _workload(ns, spec):

    gpu = parse_memory(ns.gpu_memory) if ns.gpu_memory else None
    world = ns.gpus or 1
    if ns.config:
        from vlmrl.config import load_config

        cfg = load_config(ns.config, ns.overrides)
        if gpu is None and cfg.training.auto_fit_gpu_memory_gib:
            gpu = int(cfg.training.auto_fit_gpu_memory_gib * GiB)
        base = workload_from_config(cfg, world, gpu)
        if cfg.training.device == "cpu":  # a config that trains on the CPU is planned as a CPU run
            base = dataclasses.replace(base, device="cpu")
    else:
        if ns.overrides:
            raise PlanError(f"key=value overrides {ns.overrides} need --config (with --model use the flags)")
        base = Workload(world_size=world, gpu_memory_bytes=gpu if gpu is not None else parse_memory("h100-80gb"))
    mapping = {
        "num_generations": ns.num_generations,
        "prompts_per_step": ns.prompts,
        "micro_batch": ns.micro_batch,
        "grad_accum": ns.grad_accum,
        "prompts_per_call": ns.prompts_per_call,
        "max_pixels": ns.max_pixels,
        "images_per_prompt": ns.images_per_prompt,
        "video_frames": ns.video_frames,
        "video_max_pixels": ns.video_max_pixels,
        "prompt_text_tokens": ns.prompt_tokens,
        "completion_tokens": ns.completion_length,
        "dtype": ns.dtype,
        "use_lora": ns.lora,
        "lora_r": ns.lora_r,
        "gradient_checkpointing": ns.gradient_checkpointing,
        "freeze_vision": ns.freeze_vision,
        "beta": ns.beta,
        "ref_placement": ns.ref_placement,
        "sharding": ns.sharding,
        "offload": ns.offload,
        "offload_during_rollout": ns.offload_during_rollout,
        "logprob_chunk_tokens": ns.logprob_chunk,
        "generation_gather": ns.generation_gather,
        "master_weights": ns.master_weights,
        "attn_implementation": ns.attn_implementation,
        "logits_positions": ns.logits_positions,
        "vllm_gpu_memory_utilization": ns.vllm_gpu_memory_utilization,
        "vllm_sleep_level": ns.vllm_sleep_level,
        "vllm_tensor_parallel_size": ns.vllm_tensor_parallel_size,
        "vllm_limit_images": ns.vllm_limit_images,
        "vllm_max_model_len": ns.vllm_max_model_len,
    }
    changes = {k: v for k, v in mapping.items() if v is not None}
    if ns.host_memory:
        changes["host_memory_bytes"] = parse_memory(ns.host_memory)
    if ns.cpu:
        changes["device"] = "cpu"
    if ns.profile != "vlmrl":
        changes["profile"] = ns.profile
    w = dataclasses.replace(base, **changes)
    if ns.deepspeed_config:
        w = _with_deepspeed(w, ns.deepspeed_config, ns.sharding, ns.offload, spec.hidden)
    if w.sharding == "none" and world > 1 and ns.sharding is None:
        w = dataclasses.replace(w, sharding="ddp")
    if ns.micro_batch is not None and ns.grad_accum is None:
        w = dataclasses.replace(w, grad_accum=max(1, w.rows_per_step // w.micro_batch))
    return w


def _with_deepspeed(w, path: str, sharding: str | None, offload: str | None, hidden: int):
    """w planned under the DeepSpeed JSON at `path` (Workload.zero; sharding zero<stage> unless --sharding says, the
    JSON's offload unless --offload says: a contradiction is refused by the planner's checks)."""

    try:
        ds = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"--deepspeed-config {path}: cannot read it as JSON ({e})") from None
    if not isinstance(ds, dict):
        raise PlanError(f"--deepspeed-config {path}: expected a JSON object (a DeepSpeed config)")
    z = zero_config(ds, hidden)
    if z.stage == 0:
        raise PlanError(f"--deepspeed-config {path}: zero_optimization.stage is 0 (no ZeRO): plan it with --sharding ddp")
    return dataclasses.replace(w, zero=z, sharding=sharding or f"zero{z.stage}", offload=offload or zero_offload(z))


def _sft_stages(ns, w) -> dict:
    """{stage: Workload} of `vlmrl sft`: with --config the stages it runs (sft.*), else --sft-stage (default 2)."""

    if ns.config:
        from vlmrl.config import load_config

        cfg = load_config(ns.config, ns.overrides)
        s = cfg.sft
        base = dataclasses.replace(w, micro_batch=ns.micro_batch or s.batch_size)
        stages = [k for k, steps in ((1, s.projector_steps), (2, s.steps)) if steps > 0] or [2]
        return {k: sft_workload(base, k, s.train_vision_tower or bool(ns.train_vision_tower)) for k in stages}
    return {ns.sft_stage or 2: sft_workload(w, ns.sft_stage or 2, bool(ns.train_vision_tower))}


def _table(spec, p) -> str:
    d = p.to_dict()
    head = (
        f"model {spec.name} ({spec.family}): {spec.total_params / 1e9:.2f} B parameters "
        f"(vision {spec.vision_params / 1e9:.2f} B), {d['workload']['image_tokens_per_prompt']} image tokens per prompt, "
        + (f"{d['workload']['video_tokens_per_prompt']} video tokens per prompt, " if d["workload"].get("video_tokens_per_prompt") else "")
        + f"{d['workload']['prompt_tokens']} prompt tokens"
    )
    lines = [head, "", f"{'term':<34} {'GiB':>9}", "-" * 44]
    for k, v in d["terms_gib"].items():
        if v:
            lines.append(f"{k:<34} {v:>9.3f}")
    lines += ["-" * 44, f"{'peak per phase (allocated)':<34}"]
    for k, v in d["phases_gib"].items():
        lines.append(f"  {k:<32} {v:>9.3f}")
    lines += [
        f"{'peak allocated':<34} {d['peak_allocated_gib']:>9.3f}",
        f"{'reserved (allocator)':<34} {d['reserved_gib']:>9.3f}",
        f"{'total on the device':<34} {d['total_gib']:>9.3f}",
        *_vllm_lines(p),
        "",
        f"{'host RAM per node':<34}",
    ]
    for k, v in d["host_gib"].items():
        if v and not k.startswith("peak_") and k not in ("total", "process_peak"):
            lines.append(f"  {k:<32} {v:>9.3f}")
    lines += [
        f"  {'peak (loading / training / saving)':<32} {d['host_gib']['total']:>9.3f}",
        "",
        f"verdict: {p.verdict}",
        f"step-time model: {p.step_time_s:.2f} s per step",
    ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


# What a colocated vLLM's reservation holds, by name (plan.vllm.vllm_terms), in the order it is filled.
VLLM_LINES = (
    ("weights", "its weight copy (1/tp)"),
    ("encoder_cache", "encoder cache (limit_mm_per_prompt images)"),
    ("profile_peak", "profiling peak"),
    ("kv_cache", "KV blocks (what the cap leaves)"),
    ("kv_needed", "KV the rollout's rows take at once"),
    ("freed_by_sleep", "freed while asleep (scoring, update)"),
)


def _vllm_lines(p) -> list[str]:
    """The vLLM section of the table: the cap and what lives inside it, term by term."""
    v = p.vllm
    if not v:
        return []
    head = f"cap {v['cap']:.2f} x the device, sleep level {v['sleep_level']}, tensor parallel {v['tensor_parallel_size']}"
    lines = ["", f"{'vllm_reservation':<34} {v['reservation'] / GiB:>9.3f}  {head}"]
    lines += [f"  vllm_{k:<27} {v[k] / GiB:>9.3f}  {why}" for k, why in VLLM_LINES]
    return lines


def _check_flags(ns) -> None:
    """Flag combinations that cannot be planned: one PlanError line each, before any model is read."""
    if not ns.config and not ns.model:
        raise PlanError("give --model <preset or config.json> or --config <file.yaml> (see vlmrl plan --help)")
    if ns.config and ns.model:
        raise PlanError("give either --model or --config, not both (the config names its model)")
    if ns.gpu_memory:
        parse_memory(ns.gpu_memory)  # fail early on a bad size
    if ns.mode == "sft" and ns.search:
        raise PlanError(
            "--search tunes GRPO's knobs (micro-batch with accumulation, generation calls); vlmrl sft has one micro-batch "
            "per step: compare sft.batch_size values (--micro-batch) or add --gradient-checkpointing / --lora yourself"
        )
    if ns.trace and ns.profile != "vlmrl":
        raise PlanError(f"--trace runs vlmrl's own step; --profile {ns.profile} is closed form only (drop --trace, or plan --profile vlmrl)")
    if ns.mode == "sft" and ns.profile != "vlmrl":
        raise PlanError(f"--profile {ns.profile} plans another trainer's GRPO step; --mode sft plans vlmrl sft only (drop one)")


def run(ns) -> int:

    if ns.list_models:
        from vlmrl.plan.presets import PLANNER_PRESETS, PRESETS

        print("\n".join(sorted(PRESETS) + sorted(PLANNER_PRESETS)))
        return 0
    _check_flags(ns)
    if ns.config:
        from vlmrl.config import load_config

        source = load_config(ns.config, ns.overrides).model.name_or_path
        spec = spec_for_config(load_config(ns.config, ns.overrides))
    else:
        source = ns.model
        spec = model_spec(ns.model)
    w = _workload(ns, spec)
    stages: dict = {}
    if ns.mode == "sft":
        stages = _sft_stages(ns, w)
        w = max(stages.values(), key=lambda x: plan(spec, x).total)
    p = plan(spec, w)
    out: dict = {"model": spec.name, "parameters": spec.total_params, **p.to_dict()}
    if stages:
        out["sft_stages"] = {f"stage{k}": plan(spec, x).to_dict() for k, x in stages.items()}
    if ns.search:
        allow = tuple(a.strip() for a in ns.allow.split(",") if a.strip())
        bad = [a for a in allow if a not in ("num_generations", "max_pixels", "effective_batch")]
        if bad:
            raise PlanError(f"--allow {','.join(bad)}: use num_generations, max_pixels, effective_batch")
        found = search(spec, w, allow=allow, top=ns.top)
        out["search"] = [c.to_dict() for c in found]
    if ns.profile != "vlmrl":
        out["vlmrl_profile"] = _vlmrl_alternative(spec, w)
    if ns.trace:
        out["trace"] = _trace(spec, w, source)
    if ns.json:
        print(json.dumps(out, indent=1))
        return 0
    _print(spec, p, out, ns)
    return 0


def _vlmrl_alternative(spec, w) -> dict:
    """vlmrl's plan of the same work as a plain trainer's workload `w`, and (when that does not fit either) the
    fastest vlmrl configuration predicted to fit, G / pixels / effective batch kept."""

    v = dataclasses.replace(w, profile="vlmrl")  # the profile is applied inside plan(): w keeps vlmrl's own memory settings
    p = plan(spec, v)
    out = {"plan": p.to_dict(), "fits": p.fits, "verdict": p.verdict}
    if not p.fits and (v.gpu_memory_bytes or v.host_memory_bytes):
        try:
            found = search(spec, v, top=1)
        except PlanError:
            found = []
        out["fitting_config"] = found[0].to_dict() if found else None
    return out


def _print_profile(out: dict, ns) -> None:
    alt = out["vlmrl_profile"]
    print(f"\n--profile {ns.profile}: {out['verdict']}")
    m = alt["plan"]["workload"]
    how = f"group_vision {m['group_vision']}, shared_prefix {m['shared_prefix']}, log-prob chunks {m['logprob_chunk_tokens']}"
    print(f"vlmrl, same work ({how}): {alt['verdict']}")
    if "fitting_config" in alt:
        c = alt["fitting_config"]
        print(
            f"vlmrl config that fits: {c['total_gib']:.1f} GiB: " + ("; ".join(c["changes"]) or "as given")
            if c
            else "no vlmrl config fits with G, pixels and the effective batch kept (vlmrl plan --search --allow ...)"
        )


def _print(spec, p, out: dict, ns) -> None:
    print(_table(spec, p))
    if "vlmrl_profile" in out:
        _print_profile(out, ns)
    for stage, d in out.get("sft_stages", {}).items():
        print(f"SFT {stage}: {d['total_gib']:.1f} GiB on the device, {d['host_total_gib']:.1f} GiB host RAM: {d['verdict']}")
    if ns.search:
        print(
            f"\nfastest configurations predicted to fit ({len(out['search'])} shown):"
            if out["search"]
            else "\nno configuration fits: allow num_generations / max_pixels / effective_batch (--allow), add GPUs (--gpus) or use --lora"
        )
        for i, c in enumerate(out["search"], 1):
            print(f"{i}. {c['total_gib']:.1f} GiB, ~{c['step_time_s']:.2f} s/step: " + ("; ".join(c["changes"]) or "as given"))
    if ns.trace:
        t = out["trace"]
        print(
            f"\ntrace (meta device, {t['seconds']} s): update peak {t['peak_gib']:.3f} GiB; closed form {t['closed_form_gib']:.3f} GiB "
            f"({t['difference_pct']:+.1f}%)"
        )
        for k, v in t["peak_breakdown_gib"].items():
            print(f"  {k:<30} {v:>9.3f}")


def _trace(spec, w, source: str) -> dict:
    """Trace the update micro-batch of `w` (unsharded, one device) and compare with the closed form's update
    peak under the trace's semantics (no autocast; weights dtype)."""

    from vlmrl.plan.trace import setup_for, trace_update
    from vlmrl.plan.presets import PLANNER_PRESETS, PRESETS, hf_config

    if w.sharding not in ("none", "ddp") or w.offload != "none":
        raise PlanError("--trace traces one unsharded device; drop --sharding/--offload")
    config = hf_config(source) if (source in PRESETS or source in PLANNER_PRESETS) else _config_from_path(source)
    setup = setup_for(spec, w)
    r = trace_update(config, setup)
    # The trace is the steady state of an accumulating optimizer step (gradients already there): compare like with like.
    # The trace runs torch AdamW on the weights (no master copy) and, for flash_attention_2, the sdpa-like stand-in.
    attn = "eager" if w.attn_implementation == "eager" else "sdpa"
    cf = plan(
        spec,
        dataclasses.replace(
            w,
            autocast=False,
            beta=0.0,
            num_iterations=1,
            grad_accum=max(2, w.grad_accum),
            device="cuda",
            master_weights="none",
            attn_implementation=attn,
        ),
    ).phases["update"]
    return {
        "peak_gib": r.peak_bytes / GiB,
        "closed_form_gib": cf / GiB,
        "difference_pct": 100 * (cf / r.peak_bytes - 1),
        "compared_as": {"attn_implementation": attn, "master_weights": "none", "steady_state": True},
        "peak_breakdown_gib": {k: round(v / GiB, 3) for k, v in r.peak_breakdown.items()},
        "stage_peaks_gib": {k: round(v / GiB, 3) for k, v in r.stage_peaks.items()},
        "seconds": r.seconds,
    }


def _config_from_path(path: str):

    from transformers import AutoConfig

    p = Path(path)
    return AutoConfig.from_pretrained(p if p.is_dir() else p.parent, local_files_only=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vlmrl plan", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    ns = p.parse_args(argv)
    return run_safely(ns)


def run_safely(ns) -> int:
    from vlmrl.config import ConfigError

    try:
        return run(ns)
    except (PlanError, ConfigError) as e:
        print(f"vlmrl plan: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
