"""Exact mode of the memory planner (`vlmrl plan --trace`): one real update step, no memory used.

The real architecture (transformers modules built from the HF config, LoRA through peft, activation
checkpointing, chunked log-probs from `vlmrl.models.logprobs`, torch AdamW with foreach kernels as on CUDA) runs on
the meta device: every op computes shapes only. A `TorchDispatchMode` sees every tensor an op returns and
records the bytes of its storage until Python frees that storage (a weakref finaliser), so the live total and
its peak are the allocator-free figure `torch.cuda.max_memory_allocated` would report for the same tensors.

What is traced, in order (the steady state of an optimizer step after its first micro-batch: gradients and
AdamW states already exist, as in train.py from micro-batch 2 / step 2 on):
  1. scoring: the micro-batch forward under no_grad (what old / reference log-probs cost);
  2. update: forward with grad + the GRPO-style loss (log-prob ratio x advantage) + backward;
  3. clip_grad_norm_ + AdamW.step (foreach: its sqrt of exp_avg_sq is a full temporary).

Things this trace does NOT do (the closed form models them, the trace cannot check them): the rollout's KV
cache and sampling, CUDA context / allocator reserve, autocast (the trace runs in the weights' dtype; bf16
weights make autocast nearly a no-op, except that LoRA adapter inputs are then cast to fp32 and kept),
padding (no attention mask: the causal kernel path), and the vision bookkeeping is precomputed on the CPU.
Attention: with attn_implementation=eager the family's own eager code runs (its [B, heads, S, S] scores, float32
softmax and cast probabilities are traced like any op); sdpa and flash_attention_2 have no meta kernels, so a
stand-in with the memory of the fused CUDA kernels runs (saves q, k, v repeated to the query heads, output and a
float32 log-sum-exp per query head; no [T, T] matrix), registered under the name `vlmrl_trace`.
Scoring runs under model.eval() and the update under model.train(), as in train.py.
Vision inputs: Qwen-VL images and videos as [t, h, w] patch grids per prompt (a video's naive path encodes each row's
copy, as select_rows makes them), Qwen3.5's hybrid decoder with its Gated DeltaNet states gathered per row on the
shared prefix (prefix.repeat_cache_rows), every tile of the tiled families (LLaVA-OneVision with its image sizes, InternVL).
"""

from __future__ import annotations

import math
import time
import types
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vlmrl.families import family_of, model_types
import warnings


# Families whose vision bookkeeping (grids, window / interpolation indices) the trace precomputes. Qwen3-VL's DeepStack
# features (one [image tokens, hidden] per deepstack layer, added inside the decoder) are not traced: the trace hands
# the decoder its merged features only.
QWEN_TRACE_FAMILIES = model_types("dynamic_resolution")


class MemoryTracker(TorchDispatchMode):
    """Live bytes of every storage created by an op (or registered), by category; the peak and its breakdown."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, str]] = {}
        self.by_cat: dict[str, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_breakdown: dict[str, int] = {}
        self.stage = "setup"
        self.stage_peaks: dict[str, int] = {}
        self.category = "activations"

    def _free(self, key: int) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            n, cat = entry
            self.current -= n
            self.by_cat[cat] -= n

    def register(self, t: torch.Tensor, category: str) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live:
            return
        n = st.nbytes()
        self.live[key] = (n, category)
        self.by_cat[category] = self.by_cat.get(category, 0) + n
        self.current += n
        weakref.finalize(st, self._free, key)
        self._update_peak()

    def _update_peak(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            self.peak_breakdown = {k: v for k, v in self.by_cat.items() if v}
        if self.current > self.stage_peaks.get(self.stage, 0):
            self.stage_peaks[self.stage] = self.current

    def set_stage(self, stage: str, category: str) -> None:
        self.stage, self.category = stage, category
        self.stage_peaks[stage] = self.current

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.register(t, self.category)
        return out


# ---------------------------------------------------------------- attention stand-in


def _trace_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """Memory of the fused CUDA attention kernels: grouped KV heads are expanded as views (no copy)."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        b, h, t, d = key.shape
        key = key.unsqueeze(2).expand(b, h, groups, t, d).flatten(1, 2)
        value = value.unsqueeze(2).expand(b, h, groups, t, value.shape[-1]).flatten(1, 2)
    causal = (
        bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and query.shape[2] == key.shape[2] and query.shape[2] > 1
    )
    need_lse = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    out = torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, None, need_lse, 0.0, causal, scale=scaling)[0]
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register("vlmrl_trace", _trace_attention)
    return "vlmrl_trace"


def _set_attention(model: torch.nn.Module, name: str) -> None:
    seen = set()
    for m in model.modules():
        c = getattr(m, "config", None)
        if c is not None and id(c) not in seen:
            seen.add(id(c))
            for sub in [c] + [getattr(c, k, None) for k in ("text_config", "vision_config")]:
                if sub is not None:
                    sub._attn_implementation = name


# ---------------------------------------------------------------- the model on the meta device


@dataclass
class TraceSetup:
    """What one traced micro-batch looks like (all sizes per device)."""

    dtype: torch.dtype = torch.bfloat16
    gradient_checkpointing: bool = False
    use_lora: bool = False
    lora_r: int = 16
    lora_alpha: int = 32
    lora_target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    lora_vision: bool = False
    freeze_vision_tower: bool = False
    train_projector_only: bool = False
    rows: int = 4  # completions in the micro-batch (N)
    unique_prompts: int = 1  # distinct prompts among them (U); group_vision encodes each once
    prompt_text_tokens: int = 32  # prompt tokens that are not image tokens
    image_patches: int = 1024  # vision patches per prompt (Qwen: (H/14) x (W/14)); one image per prompt
    image_tiles: int = 1  # tiled families (LLaVA-OneVision anyres, InternVL): tiles the tower encodes per image
    image_hw: tuple = ()  # LLaVA-OneVision: the image's (height, width), which decides its unpadded features
    tiled_image_tokens: int = 0  # tiled families: LLM tokens of one image (planner.tiled_image); the tower's output is checked against it
    video_temporal_patches: int = 0  # Qwen-VL families: temporal patches of one video per prompt (0 = no video)
    video_frame_patches: int = 0  # vision patches of one video frame (one temporal patch)
    completion_tokens: int = 64
    logprob_chunk_tokens: int = 128
    group_vision: bool = True
    shared_prefix: bool = True
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    attn_implementation: str = "sdpa"  # eager: transformers' own eager attention runs (its [B, heads, S, S] scores are traced)
    loss: str = "grpo"  # grpo: ratio x advantage; sft: mean negative log-likelihood


def setup_for(spec, w) -> TraceSetup:
    """The micro-batch a planner Workload `w` describes, as the trace runs it: the one mapping from the closed form's
    description to the trace's (vlmrl plan --trace and benchmarks/planner_accuracy.py both use it)."""
    from vlmrl.plan.planner import image_patches, naive_fallback, square_image, tiled_image, video_grid, video_text_tokens

    w = naive_fallback(spec, w)[0]  # families without vlmrl's fast paths run the naive path

    G, N = w.num_generations, w.micro_batch
    unique = (-(-N // G) if (N % G == 0 or G % N == 0) else min(N, -(-N // G) + 1)) if w.group_vision else N
    return TraceSetup(
        dtype={"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[w.dtype],
        gradient_checkpointing=w.gradient_checkpointing,
        use_lora=w.use_lora,
        lora_r=w.lora_r,
        lora_target_modules=list(w.lora_targets),
        freeze_vision_tower=w.freeze_vision,
        train_projector_only=w.projector_only,
        loss="sft" if w.mode == "sft" else "grpo",
        rows=N,
        unique_prompts=unique,
        prompt_text_tokens=w.prompt_text_tokens + video_text_tokens(spec, w),  # Qwen3-VL / Qwen3.5 video timestamps
        image_patches=image_patches(spec, w.max_pixels) if w.images_per_prompt else 0,
        image_tiles=tiled_image(spec, *square_image(w.max_pixels))[0] if spec.tiling else 1,
        image_hw=square_image(w.max_pixels) if spec.tiling else (),
        tiled_image_tokens=tiled_image(spec, *square_image(w.max_pixels))[1] if spec.tiling else 0,
        video_temporal_patches=video_grid(spec, w)[0],
        video_frame_patches=video_grid(spec, w)[1],
        completion_tokens=w.completion_tokens,
        logprob_chunk_tokens=w.logprob_chunk_tokens,
        group_vision=w.group_vision,
        shared_prefix=w.shared_prefix,
        attn_implementation=w.attn_implementation,
    )


def build_meta_model(hf_config, setup: TraceSetup):
    """The model of `hf_config` on the meta device in setup.dtype, frozen / checkpointed / LoRA as vlmrl does it."""
    from transformers import AutoModelForImageTextToText

    from vlmrl.models.loading import prepare_trainable

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(hf_config, dtype=setup.dtype)
    mcfg = types.SimpleNamespace(
        freeze_vision_tower=setup.freeze_vision_tower,
        train_projector_only=setup.train_projector_only,
        lora_r=setup.lora_r,
        lora_alpha=setup.lora_alpha,
        lora_dropout=0.0,
        lora_target_modules=list(setup.lora_target_modules),
        lora_vision=setup.lora_vision,
        use_lora=setup.use_lora,
        gradient_checkpointing=setup.gradient_checkpointing,
    )
    model = prepare_trainable(model, mcfg)
    # The fused kernels (sdpa, flash_attention_2) have no meta implementation: a stand-in with their memory runs instead.
    # Eager attention is plain tensor ops, so the family's own eager_attention_forward runs as the run would run it.
    _set_attention(model, "eager" if setup.attn_implementation == "eager" else _register_attention())
    return model


def _qwen_grid(patches: int, merge: int) -> tuple[int, int]:
    """A (h, w) patch grid, multiples of `merge`, with about `patches` patches (square-ish)."""
    side = max(merge, round(math.sqrt(patches) / merge) * merge)
    w = max(merge, round(patches / side / merge) * merge)
    return side, w


class _Inputs:
    """Meta tensors for one micro-batch, with Qwen-VL vision bookkeeping computed on the CPU."""

    def __init__(self, model, setup: TraceSetup):
        from vlmrl.models.loading import unwrap

        core = unwrap(model)
        self.core, self.inner = core, core.model
        self.cfg = core.config
        self.family = getattr(self.cfg, "model_type", "")
        s = setup
        self.U = s.unique_prompts if s.group_vision else s.rows
        self.N, self.C = s.rows, s.completion_tokens
        v = getattr(self.cfg, "vision_config", None)
        self.vision_kwargs = {}
        self.has_video = bool(s.video_temporal_patches)
        self.row_pixels = None
        if self.has_video and self.family not in QWEN_TRACE_FAMILIES:
            raise ValueError(f"trace: video rows are traced for the Qwen-VL families only, not {self.family}")
        if self.family in QWEN_TRACE_FAMILIES:
            merge = v.spatial_merge_size
            per_prompt = []  # grid rows of one prompt: its image (t = 1), then its video (t temporal patches)
            if s.image_patches:
                per_prompt.append([1, *_qwen_grid(s.image_patches, merge)])
            if self.has_video:
                per_prompt.append([s.video_temporal_patches, *_qwen_grid(s.video_frame_patches, merge)])
            prompt_grid = torch.tensor(per_prompt, dtype=torch.long).reshape(-1, 3)
            self.patches = int(prompt_grid.prod(-1).sum())
            self.image_tokens = self.patches // merge**2
            self.grid = prompt_grid.repeat(self.U, 1)
            self.in_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
            self.pixels = torch.empty(self.U * self.patches, self.in_dim, device="meta", dtype=torch.float32) if self.patches else None
            self.vision_kwargs = self._qwen_bookkeeping(self.grid, v) if self.patches else {}
            if self.has_video:  # naive path (no shared prefix): every row encodes its own copy of its prompt's pixels
                self.row_grid = prompt_grid.repeat(self.N, 1)
                self.row_vision_kwargs = self._qwen_bookkeeping(self.row_grid, v)
        elif v is not None:
            size = getattr(v, "image_size", 336)
            patch = getattr(v, "patch_size", 14)
            size, patch = (x[0] if isinstance(x, (list, tuple)) else x for x in (size, patch))
            tiles = s.image_tiles
            self.patches = tiles * (size // patch) ** 2
            # Tokens after the tower: Gemma 3 pools to mm_tokens_per_image, InternVL's pixel shuffle divides by 1/ratio^2.
            ratio = getattr(self.cfg, "downsample_ratio", None)
            self.image_tokens = getattr(self.cfg, "mm_tokens_per_image", None) or (round(self.patches * ratio**2) if ratio else self.patches)
            self.pixels = torch.empty(self.U * tiles, 3, size, size, device="meta", dtype=torch.float32)
            self.grid = None
            self.image_tokens = s.tiled_image_tokens or self.image_tokens
            if family_of(self.family).tiling == "anyres":  # anyres: [images, tiles, ...] + each image's size (unpadding, newlines)
                self.pixels = self.pixels.reshape(self.U, tiles, 3, size, size)
                self.image_sizes = torch.tensor([list(s.image_hw)] * self.U)
        else:
            self.patches, self.image_tokens, self.pixels, self.grid = 0, 0, None, None
        self.P = s.prompt_text_tokens + self.image_tokens
        text_cfg = self.cfg.get_text_config()
        self.vocab = text_cfg.vocab_size

    def _qwen_bookkeeping(self, grid: torch.Tensor, v) -> dict:
        from transformers.vision_utils import (
            get_vision_attention_seqlens,
            get_vision_position_ids,
        )

        vis = self.inner.visual
        kw: dict = {}
        pos = get_vision_position_ids(grid, vis.spatial_merge_size)
        kw["position_ids"] = torch.empty(pos.shape, dtype=pos.dtype, device="meta")
        cu, mx = get_vision_attention_seqlens(grid, v)
        kw["cu_seqlens"], kw["max_seqlen"] = cu, mx
        if family_of(self.family).vision_interpolated_positions:  # learned positions resampled to each grid
            from transformers.vision_utils import get_vision_interpolation_indices_and_weights

            idx, wts = get_vision_interpolation_indices_and_weights(
                grid,
                num_grid_per_side=vis.num_grid_per_side,
                mode=vis.interpolation_mode,
                align_corners=vis.interpolation_align_corners,
                spatial_merge_size=v.spatial_merge_size,
            )
            kw["interp_indices"] = torch.empty(idx.shape, dtype=idx.dtype, device="meta")
            kw["interp_weights"] = torch.empty(wts.shape, dtype=wts.dtype, device="meta")
        if family_of(self.family).vision_windows:
            from transformers.utils.generic import get_max_seqlen
            from transformers.vision_utils import get_vision_window_index

            wi, cw = get_vision_window_index(grid, spatial_merge_size=vis.spatial_merge_size, window_size=vis.window_size, patch_size=vis.patch_size)
            kw["window_index"], kw["cu_window_seqlens"] = wi, cw
            kw["max_window_seqlen"] = get_max_seqlen(cw, v)
        return kw

    def image_features(self, per_row: bool = False) -> torch.Tensor | None:
        """Vision features of the U prompts (grouped / shared prefix), or with per_row (the naive path a batch with
        videos takes) of the N rows, each from its own copy of its prompt's pixel values (select_rows)."""
        if self.pixels is None:
            return None
        if self.family in QWEN_TRACE_FAMILIES:
            pixels, grid, kw = self.pixels, self.grid, dict(self.vision_kwargs)  # a fresh dict: the model pops entries
            if per_row:
                idx = torch.empty(self.N * self.patches, dtype=torch.long, device="meta")
                pixels, grid, kw = self.pixels.index_select(0, idx), self.row_grid, dict(self.row_vision_kwargs)
            kw["position_ids"] = torch.empty(kw["position_ids"].shape, dtype=kw["position_ids"].dtype, device="meta")
            out = self.inner.visual(pixels, grid_thw=grid, **kw)
            self.row_pixels = pixels if per_row else None  # select_rows' copy lives as long as the naive call's batch
            feats = getattr(out, "pooler_output", out)
            return feats
        if family_of(self.family).tiling == "anyres":
            c = self.cfg
            out = self.inner.get_image_features(
                pixel_values=self.pixels,
                image_sizes=self.image_sizes,
                vision_feature_layer=c.vision_feature_layer,
                vision_feature_select_strategy=c.vision_feature_select_strategy,
                vision_aspect_ratio=c.vision_aspect_ratio,
            )
        else:
            out = self.inner.get_image_features(pixel_values=self.pixels)
        feats = getattr(out, "pooler_output", out)
        if isinstance(feats, (list, tuple)):
            feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
        feats = feats.reshape(-1, feats.shape[-1])
        if feats.shape[0] != self.U * self.image_tokens:
            raise ValueError(f"trace: the tower gave {feats.shape[0]} features for {self.U} images of {self.image_tokens} tokens")
        return feats


def _positions(inp: _Inputs, rows: int, length: int):
    if inp.family in QWEN_TRACE_FAMILIES:
        return torch.empty(3, rows, length, dtype=torch.long, device="meta")
    return torch.empty(rows, length, dtype=torch.long, device="meta")


def _language_model(inner):
    return getattr(inner, "language_model", inner)


def micro_batch_logps(model, inp: _Inputs, setup: TraceSetup, needs_grad: bool) -> torch.Tensor:
    """[N, C] log-probs the way vlmrl computes them: vision once per unique prompt (group_vision), then either the
    shared-prefix path (prompt once per unique prompt, KV cache gathered to the rows; not under gradient
    checkpointing in training) or prompt + completion per row; chunked LM-head log-probs."""
    from vlmrl.models.logprobs import selective_logps
    from vlmrl.models.prefix import repeat_cache_rows

    core, inner = inp.core, inp.inner
    N, C, U, P = inp.N, inp.C, inp.U, inp.P
    embed = inner.get_input_embeddings()
    lm = _language_model(inner)
    targets = torch.empty(N, C, dtype=torch.long, device="meta")
    row_idx = torch.empty(N, dtype=torch.long, device="meta")
    prefix = setup.shared_prefix and setup.group_vision and not (needs_grad and setup.gradient_checkpointing) and inp.pixels is not None
    naive_video = inp.has_video and not prefix  # the grouped path hands a batch with videos to the naive path
    feats = inp.image_features(per_row=naive_video and setup.group_vision)
    if prefix:
        ids = torch.empty(U, P, dtype=torch.long, device="meta")
        emb = embed(ids)
        if feats is not None:
            mask = torch.empty(U, P, 1, dtype=torch.bool, device="meta").expand_as(emb)
            emb = emb.masked_scatter(mask, feats.to(emb.dtype))
        out = lm(inputs_embeds=emb, position_ids=_positions(inp, U, P), use_cache=True)
        first = out.last_hidden_state[:, -1].index_select(0, row_idx).unsqueeze(1)
        cache = out.past_key_values
        repeat_cache_rows(cache, rows=row_idx)  # vlmrl's own gather (KV layers, and Qwen3.5's conv / recurrent states)
        rest_emb = embed(torch.empty(N, C - 1, dtype=torch.long, device="meta"))
        rest = lm(
            inputs_embeds=rest_emb,
            position_ids=_positions(inp, N, C - 1),
            past_key_values=cache,
            cache_position=torch.arange(P, P + C - 1, device="meta"),
            use_cache=True,
        ).last_hidden_state
        predicting = torch.cat([first.to(rest.dtype), rest], dim=1)
        del out, cache
    else:
        ids = torch.empty(N, P + C, dtype=torch.long, device="meta")
        emb = embed(ids)
        if feats is not None:
            token_idx = torch.empty(N * inp.image_tokens, dtype=torch.long, device="meta")
            row_feats = feats.index_select(0, token_idx) if (setup.group_vision and not naive_video) else feats
            mask = torch.empty(N, P + C, 1, dtype=torch.bool, device="meta").expand_as(emb)
            emb = emb.masked_scatter(mask, row_feats.to(emb.dtype))
        hidden = lm(inputs_embeds=emb, position_ids=_positions(inp, N, P + C), use_cache=False).last_hidden_state
        predicting = hidden[:, P - 1 : P - 1 + C]
    logps = selective_logps(predicting, core.get_output_embeddings(), targets, 1.0, setup.logprob_chunk_tokens)
    inp.row_pixels = None  # the naive call's batch (with its pixel copies) is freed when it returns
    return logps


@dataclass
class TraceResult:
    peak_bytes: int
    peak_breakdown: dict
    stage_peaks: dict
    persistent: dict
    seconds: float
    image_tokens: int
    prompt_tokens: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@contextmanager
def _quiet():

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _persistent_tracker(model, params: list, opt, inp) -> MemoryTracker:
    """A MemoryTracker holding what lives through the whole step: weights, buffers, gradients, AdamW states, inputs."""
    tracker = MemoryTracker()
    for p in model.parameters():
        tracker.register(p, "weights")
    for b in model.buffers():
        tracker.register(b, "buffers")
    for p in params:
        tracker.register(p.grad, "gradients")
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.numel() > 1:
                tracker.register(v, "optimizer_states")
    if inp.pixels is not None:
        tracker.register(inp.pixels, "inputs")
    return tracker


def trace_update(hf_config, setup: TraceSetup) -> TraceResult:
    """Trace scoring + one update micro-batch + the optimizer step of `hf_config` under `setup`."""
    t0 = time.perf_counter()
    with _quiet():
        model = build_meta_model(hf_config, setup)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("no trainable parameters in this setup")
    # Steady state: gradients and AdamW states exist (they do from the second micro-batch / step on).
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=setup.weight_decay, foreach=True)
    opt.step()
    inp = _Inputs(model, setup)
    tracker = _persistent_tracker(model, params, opt, inp)
    persistent = dict(tracker.by_cat)
    with _quiet(), tracker:
        # Scoring runs in eval mode as in train.py (rollout and scoring under model.eval()): with checkpointing on,
        # transformers drops use_cache in training mode, and the shared-prefix scoring path needs the prompt's cache.
        model.eval()
        tracker.set_stage("scoring", "scoring_activations")
        with torch.no_grad():
            lp = micro_batch_logps(model, inp, setup, needs_grad=False)
        del lp
        model.train()
        tracker.set_stage("forward", "activations")
        logps = micro_batch_logps(model, inp, setup, needs_grad=True)
        if setup.loss == "sft":
            ratio = logps
            loss = -logps.mean()
        else:
            adv = torch.empty(inp.N, 1, device="meta")
            ratio = torch.exp(logps - logps.detach())
            loss = -(ratio * adv).mean()
        tracker.set_stage("backward", "backward_temporaries")
        loss.backward()
        del loss, ratio, logps
        tracker.set_stage("optimizer", "optimizer_temporaries")
        if setup.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, setup.max_grad_norm, foreach=False)  # scalar norms only
        opt.step()
    return TraceResult(
        peak_bytes=tracker.peak,
        peak_breakdown=tracker.peak_breakdown,
        stage_peaks=dict(tracker.stage_peaks),
        persistent=persistent,
        seconds=round(time.perf_counter() - t0, 2),
        image_tokens=inp.image_tokens,
        prompt_tokens=inp.P,
    )
