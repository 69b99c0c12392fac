"""The memory planner's device terms, one pure function each: the bytes one device (the busiest rank) holds for one
GRPO / SFT step's weights, gradients, optimizer states, master weights, activations, log-prob head, KV cache,
reference model and engine buffers.

Every term is `term(spec, w, mb) -> bytes` over the architecture, the workload (already through profile_workload and
naive_fallback, as plan() runs it) and the micro-batch's token shape (geometry.micro_batch). `TERMS` names them
in the order `vlmrl plan` reports them; estimate.plan sums them into the phases. Pure arithmetic.
"""

from __future__ import annotations

from vlmrl.plan.coefficients import (
    DecoderBytes,
    eager_attention_bytes,
    first_linear_layer_bytes,
    linear_layer_bytes,
    linear_state_bytes,
    text_layer_bytes,
    vision_block_bytes,
)
from vlmrl.plan.geometry import MicroBatch, image_patches, tool_images, video_grid
from vlmrl.plan.profiles import logprob_head_bytes, pixel_copies_bytes
from vlmrl.plan.spec import COMM_BUCKET_BYTES, DTYPE_BYTES, ModelSpec, Workload

# ---------------------------------------------------------------- what trains, how it is sharded


def compute_bytes(w: Workload) -> int:
    """Bytes per activation element: 2 under bf16 autocast or with 16-bit weights, else 4."""
    return 2 if (w.autocast or DTYPE_BYTES[w.dtype] == 2) else 4


def full_shard(w: Workload) -> bool:
    """Weights are sharded too (ZeRO-3, FSDP)."""
    return w.sharding in ("zero3", "fsdp")


def trains_text(w: Workload) -> bool:
    return not w.projector_only


def trains_vision(w: Workload) -> bool:
    """The vision tower's own weights train (full fine-tuning, tower not frozen)."""
    return (not w.use_lora) and (not w.freeze_vision) and (not w.projector_only)


def trains_head(w: Workload) -> bool:
    """The embedding / LM head train (full fine-tuning of the language model)."""
    return trains_text(w) and not w.use_lora and not w.projector_only


def master_weights_scheme(w: Workload) -> str:
    """'none' (AdamW on the weights themselves, states in their dtype) or 'fp32' (a float32 master copy of every
    trainable parameter + float32 moments). 'auto' is what vlmrl runs under each engine: torch AdamW on the weights
    without DeepSpeed (none, ddp) and under FSDP2 (mixed_precision "no"); DeepSpeed ZeRO-1/2/3 always keep float32
    partitions for the optimizer, whatever the weights' dtype."""
    if w.master_weights != "auto":
        return w.master_weights
    return "fp32" if w.sharding in ("zero1", "zero2", "zero3") else "none"


def lora_params(spec: ModelSpec, w: Workload) -> int:
    return spec.lora_params(w.lora_r, w.lora_targets) if w.use_lora else 0


def trainable_params(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(trainable parameters, bytes each): LoRA adapters (float32, as peft keeps them), the projector, the language
    model + projector (frozen tower), or everything."""
    b = DTYPE_BYTES[w.dtype]
    if w.use_lora:
        return lora_params(spec, w), 4
    if w.projector_only:
        return spec.projector_params, b
    if w.freeze_vision:
        return spec.total_params - spec.vision_params + spec.projector_params, b
    return spec.total_params, b


def base_weight_bytes(spec: ModelSpec, w: Workload) -> int:
    """The whole model in its dtype plus float32 LoRA adapters (one unsharded copy)."""
    return spec.total_params * DTYPE_BYTES[w.dtype] + lora_params(spec, w) * 4


def _state_shards(w: Workload) -> int:
    return w.world_size if w.sharding in ("zero1", "zero2", "zero3", "fsdp") else 1


def optimizer_bytes(spec: ModelSpec, w: Workload) -> tuple[float, float, float]:
    """(float32 master copy, AdamW's two moments, the step's foreach sqrt(exp_avg_sq) temporary) per device under
    master_weights_scheme, sharded over the processes from ZeRO-1 on, wherever they live (device or host)."""
    trainable, tb = trainable_params(spec, w)
    shards = _state_shards(w)
    if master_weights_scheme(w) == "fp32":
        master = trainable * 4 / shards if tb < 4 else 0  # float32 trainables are their own master copy
        return master, trainable * 8 / shards, trainable * 4 / shards
    return 0, trainable * 2 * tb / shards, trainable * tb / shards


# ---------------------------------------------------------------- model states


def weights(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """The model's weights on the device: the whole copy, 1/n of it under ZeRO-3 / FSDP, none when offloaded."""
    if full_shard(w) and w.offload == "optimizer+params":
        return 0
    return base_weight_bytes(spec, w) / (w.world_size if full_shard(w) else 1)


def gradients(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """Gradients of the trainables in their dtype, sharded from ZeRO-2 on; offloaded runs stream them to the host
    bucket by bucket (4 buckets at most on the device)."""
    trainable, tb = trainable_params(spec, w)
    shards = w.world_size if w.sharding in ("zero2", "zero3", "fsdp") else 1
    grads = trainable * tb / shards
    return min(grads, COMM_BUCKET_BYTES * 4) if w.offload != "none" else grads


def master_weights(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """The float32 master copy on the device (none when the optimizer is offloaded)."""
    return optimizer_bytes(spec, w)[0] if w.offload == "none" else 0


def optimizer_states(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """AdamW's exp_avg and exp_avg_sq on the device (none when the optimizer is offloaded)."""
    return optimizer_bytes(spec, w)[1] if w.offload == "none" else 0


def optimizer_step_temporary(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """The foreach step's full-size temporary; none when the step runs on the CPU (offload, or a CPU run: torch AdamW
    runs per tensor there)."""
    return 0 if (w.offload != "none" or w.device == "cpu") else optimizer_bytes(spec, w)[2]


def model_states(spec: ModelSpec, w: Workload) -> dict:
    """Bytes per device of weights, gradients, the float32 master copy, AdamW's two moments and the step's
    full-size temporary under the precision scheme and the sharding (wherever the optimizer lives: the host terms
    count the offloaded ones). The same scheme on one device gives the same bytes under every engine."""
    trainable, tb = trainable_params(spec, w)
    master, moments, step_tmp = optimizer_bytes(spec, w)
    return {
        "trainable": trainable,
        "trainable_bytes": tb,
        "lora_params": lora_params(spec, w),
        "base_weights": base_weight_bytes(spec, w),
        "scheme": master_weights_scheme(w),
        "weights": weights(spec, w),
        "gradients": gradients(spec, w),
        "master": master,
        "moments": moments,
        "step_temporary": 0 if w.offload != "none" else step_tmp,
    }


# ---------------------------------------------------------------- reference model, engine buffers


def _reference_copy(w: Workload) -> bool:
    """A KL term needs a separate reference model (under LoRA the reference is the base with adapters off)."""
    return w.beta > 0 and not w.use_lora


def reference_model(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """The reference copy kept on the device (sharded like the weights under ZeRO-3 / FSDP)."""
    if not (_reference_copy(w) and w.ref_placement == "device"):
        return 0
    return spec.total_params * DTYPE_BYTES[w.dtype] / (w.world_size if full_shard(w) else 1)


def reference_moved_in_for_scoring(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> int:
    """memory.ref_placement=cpu: the whole reference moved onto the device for scoring only."""
    return spec.total_params * DTYPE_BYTES[w.dtype] if (_reference_copy(w) and w.ref_placement == "cpu") else 0


def teacher_model(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """algorithm.teacher_path: the frozen teacher kept on the device like a reference copy (its own parameter count,
    the policy's dtype; sharded under ZeRO-3 / FSDP as the reference is)."""
    if not (w.teacher_params and w.ref_placement == "device"):
        return 0
    return w.teacher_params * DTYPE_BYTES[w.dtype] / (w.world_size if full_shard(w) else 1)


def teacher_moved_in_for_scoring(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> int:
    """memory.ref_placement=cpu with a teacher: the whole teacher moved onto the device for scoring only."""
    return w.teacher_params * DTYPE_BYTES[w.dtype] if (w.teacher_params and w.ref_placement == "cpu") else 0


def judge_model(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """judge.model_path: the frozen reward judge, whole on each process's device (its own parameter count, the
    policy's dtype; never sharded: it generates alone in each process)."""
    return w.judge_params * DTYPE_BYTES[w.dtype]


def judge_generation(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """The judge's greedy generate over judge.batch_size requests (after the rollout, before scoring): its KV cache and
    largest temporary, from the judge's own config (plan.config.judge_generate_bytes)."""
    return w.judge_generate_bytes


def comm_buffers(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> int:
    """DDP / ZeRO / FSDP gradient buckets (several processes only)."""
    return COMM_BUCKET_BYTES if (w.world_size > 1 and w.sharding != "none") else 0


def gathered_parameters(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """ZeRO-3 / FSDP: whole parameters gathered at a time during forward/backward: two prefetched layers (the
    decoder's and the tower's layers share the non-embedding parameters evenly) + the biggest matrix."""
    if not full_shard(w):
        return 0
    b = DTYPE_BYTES[w.dtype]
    per_layer = (spec.total_params - spec.embed_params - spec.lm_head_params) / max(spec.layers + spec.v_layers, 1)
    return 2 * per_layer * b + max(spec.embed_params, spec.lm_head_params) * b


def generation_gather_bytes(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """Parameters gathered during the rollout: memory.generation_gather=full gathers the whole model once (ZeRO-3 /
    FSDP, GRPO); otherwise as in the update (gathered_parameters)."""
    if full_shard(w) and w.generation_gather == "full" and w.mode != "sft":
        return spec.total_params * DTYPE_BYTES[w.dtype]
    return gathered_parameters(spec, w)


def gathered_for_generation(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> float:
    """The rollout's gather beyond the update's (reported only when it differs)."""
    g = generation_gather_bytes(spec, w)
    return g if g != gathered_parameters(spec, w) else 0


# ---------------------------------------------------------------- inputs and rollout buffers


def pixel_value_copies(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """Plain trainers (profiles naive / trl) hold each prompt's pixel values G times."""
    return pixel_copies_bytes(w, mb.pixel_bytes)


def tool_image_inputs(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """Multi-turn: float32 pixel values of every row's tool images, kept for the step (the update re-encodes them)."""
    return w.rows_per_step * mb.tool_patches * 3 * spec.temporal_patch * spec.patch_size**2 * 4


def pixel_inputs(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """Float32 pixel values of the step's prompts (once per prompt, plus a plain trainer's copies) and of the rows'
    tool images (tool_image_inputs)."""
    return w.prompts_per_step * mb.pixel_bytes + pixel_value_copies(spec, w, mb) + tool_image_inputs(spec, w, mb)


def rollout_buffers(spec: ModelSpec, w: Workload, mb: MicroBatch) -> int:
    """Token ids and masks of every row (8 bytes per token) and float32 per completion token: log-probs, plus old
    log-probs (num_iterations > 1, or a teacher) and reference log-probs (beta > 0), teacher log-probs (a teacher).
    SFT: the micro-batch's ids and targets."""
    if w.mode == "sft":
        return mb.N * mb.C * 8 * 2
    rows = w.rows_per_step
    old = w.num_iterations > 1 or w.teacher_params > 0
    return rows * (mb.P + mb.C) * 8 + rows * mb.C * 4 * (1 + old + (w.beta > 0) + 2 * (w.teacher_params > 0))


def batch_inputs(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """The step's own prompt pixel values and its rollout buffers (the copies are pixel_value_copies, the tool images'
    pixels tool_image_inputs)."""
    return pixel_inputs(spec, w, mb) - pixel_value_copies(spec, w, mb) - tool_image_inputs(spec, w, mb) + rollout_buffers(spec, w, mb)


def naive_row_pixel_copies(spec: ModelSpec, w: Workload, mb: MicroBatch) -> int:
    """The naive path of a batch with videos or of a family without fast paths copies each row's pixel values; the
    copies live until the forward returns (they add to the end of the forward, not to backward)."""
    return mb.N * mb.pixel_bytes if ((mb.naive_video and w.group_vision) or mb.fallback) else 0


# ---------------------------------------------------------------- activations of one micro-batch


def _text_layer(spec: ModelSpec, w: Workload, cb: int) -> float:
    """A full-attention decoder layer's bytes per token; flash reads grouped k, v as they are (no copies repeated to
    the query heads)."""
    per_layer = text_layer_bytes(spec, w, cb)
    if w.attn_implementation == "flash_attention_2":
        per_layer -= (cb / 2) * 4 * (spec.heads - spec.kv_heads) * spec.head_dim
    return per_layer


def _linear_layer(spec: ModelSpec, w: Workload, cb: int) -> tuple[float, float]:
    """Qwen3.5's linear-attention layers: (bytes per token, per chunk-padded token); (0, 0) for other decoders."""
    return linear_layer_bytes(spec, w, cb) if spec.linear_attn_layers else (0.0, 0.0)


def decoder_bytes(spec: ModelSpec, w: Workload, mb: MicroBatch) -> DecoderBytes:
    cb = compute_bytes(w)
    first = first_linear_layer_bytes(spec, w, cb) if spec.linear_attn_layers else None
    return DecoderBytes(spec, _linear_layer(spec, w, cb)[1], mb.segments, first)


def eager_scores(spec: ModelSpec, w: Workload, mb: MicroBatch) -> dict:
    """eager_attention_bytes of the micro-batch: the decoder's calls, the images' vision blocks and, per temporal
    patch of a video, the video's (vision attention runs over one frame's patches at a time)."""
    cb = compute_bytes(w)
    eager = eager_attention_bytes(spec, w, cb, mb.attention_calls, mb.encodes, image_patches(spec, w.max_pixels) * w.images_per_prompt)
    t_video, frame = video_grid(spec, w)
    video = eager_attention_bytes(spec, w, cb, mb.attention_calls, mb.encodes * t_video, frame)
    return eager | {k: eager[k] + video[k] for k in ("vision", "vision_block")}


def _projector_only_text(spec: ModelSpec, w: Workload, mb: MicroBatch, cb: int) -> float:
    """Projector only: the decoder is frozen but the gradient still flows through it to the image features, so each
    layer keeps what its input gradient needs: everything but the inputs of the frozen norms and Linears."""
    h, qd = spec.hidden, spec.heads * spec.head_dim
    frozen_lin = (cb / 2) * (6 * h + 2 * spec.linear_v_heads * spec.linear_v_dim + 2 * spec.intermediate)
    per_layer = _text_layer(spec, w, cb) - (cb / 2) * (6 * h + 2 * qd + 2 * spec.intermediate)
    return decoder_bytes(spec, w, mb).all_layers(per_layer, _linear_layer(spec, w, cb)[0] - frozen_lin, mb.text_tokens)


def activations_text(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """The decoder layers' activations kept for backward: every layer's (text_layer_bytes per token), or with
    checkpointing each layer's input; on the shared prefix also the prompt cache the completion rows attend to (k, v
    at the KV heads, + repeated to the query heads unless flash) and Qwen3.5's gathered conv / recurrent states."""
    cb = compute_bytes(w)
    if not trains_text(w) and not w.gradient_checkpointing:
        return _projector_only_text(spec, w, mb, cb)
    if w.gradient_checkpointing:
        text_act = spec.layers * mb.text_tokens * cb * spec.hidden
    else:
        text_act = decoder_bytes(spec, w, mb).all_layers(_text_layer(spec, w, cb), _linear_layer(spec, w, cb)[0], mb.text_tokens)
    if mb.prefix:
        repeated = 0 if w.attn_implementation == "flash_attention_2" else spec.heads
        full_layers = spec.layers - spec.linear_attn_layers
        text_act += full_layers * mb.N * mb.P * cb * 2 * (spec.kv_heads + repeated) * spec.head_dim
        text_act += mb.N * linear_state_bytes(spec, cb)
    return text_act


def activations_vision(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """The vision tower's activations: every block's (vision_block_bytes per patch) when it trains; with
    checkpointing each block's input (kept even when the tower is frozen)."""
    cb = compute_bytes(w)
    if w.gradient_checkpointing:
        return spec.v_layers * mb.vision_patches * cb * spec.v_hidden
    if not (trains_vision(w) and spec.v_layers):
        return 0
    return spec.v_layers * mb.vision_patches * vision_block_bytes(spec, cb)


def activations_other(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """Outside the layers: embeddings, image-feature scatter, final norm, the completion slice (12h per token; 7h with
    checkpointing, where the embedding output is the only extra copy kept), patch embedding + merger (8 hv per patch,
    when the projector trains: a frozen tower's was measured smaller and is left out); vlmrl with log-prob chunking
    off also keeps the whole float32 log-softmax here."""
    cb = compute_bytes(w)
    projector_trains = trains_vision(w) or w.projector_only
    misc = (7 if w.gradient_checkpointing else 12) * spec.hidden * mb.text_tokens * (cb / 2) + (
        8 * spec.v_hidden * mb.vision_patches * (cb / 2) if projector_trains else 0
    )
    misc += logprob_head(spec, w, mb)["kept"] if w.profile == "vlmrl" else 0
    return misc


def eager_attention_scores(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """Eager attention's score tensors kept for backward (none with checkpointing: recomputed per layer)."""
    if w.gradient_checkpointing:
        return 0
    e = eager_scores(spec, w, mb)
    return e["text"] * trains_text(w) + e["vision"] * trains_vision(w)


def checkpoint_recompute(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """Gradient checkpointing: one layer recomputed in backward + its gradient buffers (x 1.35; a Gated DeltaNet
    layer x 1.1, its float32 chunk tensors freed as its backward goes), plus its eager scores and, while that layer's
    backward runs, their gradients."""
    if not w.gradient_checkpointing:
        return 0
    cb = compute_bytes(w)
    linear = 1.1 * decoder_bytes(spec, w, mb).layer(_linear_layer(spec, w, cb)[0], mb.text_tokens) if spec.linear_attn_layers else 0
    one_layer = max(1.35 * _text_layer(spec, w, cb) * mb.text_tokens, linear)
    e = eager_scores(spec, w, mb)
    return one_layer + (e["text_layer"] + e["transient"] if trains_text(w) else 0)


# ---------------------------------------------------------------- log-prob head


def logprob_head(spec: ModelSpec, w: Workload, mb: MicroBatch) -> dict:
    """{kept, backward, no_grad, unit} bytes of the log-prob head. vlmrl: one chunk of logprob_chunk_tokens completion
    tokens recomputed in backward (logits, float32 copy, log-softmax, gradients: 12 c/2 bytes per logit; 8 without
    grad), the whole float32 log-softmax kept when chunking is off; a plain trainer's head from plan_profiles. unit:
    the smallest vocabulary-sized tensor (host: mmapped when large)."""
    cb, N, C, V = compute_bytes(w), mb.N, mb.C, spec.vocab
    if w.profile != "vlmrl":
        return logprob_head_bytes(w, N, mb.P, C, V, spec.hidden, cb, trains_head(w))
    chunk = min(w.logprob_chunk_tokens, N * C) if w.logprob_chunk_tokens > 0 else N * C
    kept = 4 * N * C * V if w.logprob_chunk_tokens <= 0 else 0
    return {"kept": kept, "backward": 12 * chunk * V * (cb / 2), "no_grad": 8 * chunk * V * (cb / 2), "unit": chunk * V * cb}


def full_vocab_logits(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """A plain trainer's whole logits kept for backward (vlmrl's, with chunking off, count in activations_other)."""
    return logprob_head(spec, w, mb)["kept"] if w.profile != "vlmrl" else 0


def logprob_buffers(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """The log-prob head's backward transient."""
    return logprob_head(spec, w, mb)["backward"]


def head_gradient_temporary(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """The chunked log-prob backward runs with every activation alive; when the LM head trains, its weight gradient
    (fresh per chunk + the running sum) sits beside the chunk's logits. One chunk only: nothing to add."""
    one_chunk_of_many = 0 < w.logprob_chunk_tokens < mb.N * mb.C
    return 2 * spec.vocab * spec.hidden * DTYPE_BYTES[w.dtype] if (trains_head(w) and one_chunk_of_many and w.profile == "vlmrl") else 0


def embedding_grad_temporaries(spec: ModelSpec, w: Workload, mb: MicroBatch | None = None) -> int:
    """Fresh embedding / LM-head gradients before they are accumulated (tied: three vocabulary x hidden matrices)."""
    if not trains_head(w):
        return 0
    return (3 if spec.lm_head_params == 0 else 2) * spec.vocab * spec.hidden * DTYPE_BYTES[w.dtype]


# ---------------------------------------------------------------- shared prefix


def prefix_held_gradients(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """Shared prefix: every decoder weight is used twice (prompt pass, completion pass), so autograd holds each
    weight's gradient from the completion pass until the prompt pass adds its own."""
    if not (mb.prefix and trains_text(w)):
        return 0
    decoder_params = lora_params(spec, w) if w.use_lora else spec.total_params - spec.vision_params - spec.embed_params - spec.lm_head_params
    return decoder_params * trainable_params(spec, w)[1]


def prefix_backward_activations(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """Activations alive at the far end of the shared prefix's backward (beside the held gradients): the prompt
    pass's layers and scores, the vision tower's and the ones outside the layers."""
    if not (mb.prefix and trains_text(w)):
        return 0
    cb = compute_bytes(w)
    prompt = ((mb.U, mb.P),)
    act = (
        decoder_bytes(spec, w, mb).all_layers(_text_layer(spec, w, cb), _linear_layer(spec, w, cb)[0], mb.U * mb.P, prompt)
        + activations_vision(spec, w, mb)
        + activations_other(spec, w, mb)
        + eager_scores(spec, w, mb)["vision"] * trains_vision(w)
    )
    return act + eager_attention_bytes(spec, w, cb, ((mb.U, mb.P, mb.P),), 0, 0)["text"]


# ---------------------------------------------------------------- scoring and rollout


def scores(w: Workload) -> bool:
    """The step scores the rollout without grad: reference log-probs (beta > 0), old log-probs (num_iterations > 1)
    or the student's and the teacher's log-probs (a teacher; its scoring temporaries are planned at the policy's shapes)."""
    return w.beta > 0 or w.num_iterations > 1 or w.teacher_params > 0


def scoring_transient(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """The largest no-grad transient of scoring: the log-prob head, one layer's MLP / attention temporaries, or
    eager attention's scores of one layer call."""
    tokens = mb.text_tokens if (w.shared_prefix and w.group_vision) else mb.N * (mb.P + mb.C)
    layer = tokens * compute_bytes(w) * (4 * spec.hidden + 3 * spec.intermediate)
    return max(logprob_head(spec, w, mb)["no_grad"], layer, eager_scores(spec, w, mb)["transient"])


def scoring_temporaries(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    return scoring_transient(spec, w, mb) if scores(w) else 0


def generation_rows(w: Workload) -> tuple[int, int]:
    """(rows whose KV cache the rollout holds at once, prompts prefilled together). The loop holds every row of a
    generate call (prompts_per_call x G); the continuous decoder (shared prefix) a preallocated cache of
    decode_batch_size slots and prefills at most slots / G prompts at a time."""
    ppc = w.prompts_per_call or w.prompts_per_step
    rows = ppc * w.num_generations
    if w.rollout_engine != "continuous" or not w.shared_prefix:
        return rows, ppc
    slots = min(w.decode_batch_size or rows, rows)
    return slots, max(1, slots // w.num_generations)


def kv_cache(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """The rollout's KV cache: k and v of every full-attention layer for each held row's prompt + completion, plus
    Qwen3.5's per-row linear-attention states. SFT has no rollout; with vLLM (plan.vllm) the trainer does not generate."""
    if w.mode == "sft" or w.vllm_gpu_memory_utilization > 0:
        return 0
    cb = compute_bytes(w)
    rows = generation_rows(w)[0]
    per_token = 2 * (spec.layers - spec.linear_attn_layers) * spec.kv_heads * spec.head_dim * cb
    return rows * (mb.P + mb.C) * per_token + rows * linear_state_bytes(spec, cb)


def tool_image_encode(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """Multi-turn: the vision tower's temporaries while the rollout encodes one tool turn's images of every held row
    (rows pause on a call together) before they are placed in the cache. SFT and single-turn: none."""
    if w.mode == "sft" or not mb.tool_patches or not spec.v_layers:
        return 0
    per_turn = mb.tool_patches // max(1, tool_images(w)) * min(w.tool_images_per_turn, tool_images(w))
    return generation_rows(w)[0] * per_turn * compute_bytes(w) * (6 * spec.v_hidden + 3 * spec.v_intermediate)


def generation_temporaries(spec: ModelSpec, w: Workload, mb: MicroBatch) -> float:
    """The rollout's largest transient: a prefill layer's MLP / attention temporaries, eager scores of the prefill,
    the vision tower's temporaries over the prefilled images or over a tool turn's images (tool_image_encode), or
    sampling's float32 logits (3 per row). SFT, and a rollout vLLM samples (plan.vllm): none."""
    if w.mode == "sft" or w.vllm_gpu_memory_utilization > 0:
        return 0
    cb = compute_bytes(w)
    rows, ppc = generation_rows(w)
    prefill = ppc if w.shared_prefix else rows
    return max(
        prefill * mb.P * cb * (4 * spec.hidden + 3 * spec.intermediate),
        eager_attention_bytes(spec, w, cb, ((prefill, mb.P, mb.P),), 0, 0)["transient"],
        prefill * mb.patches * cb * (6 * spec.v_hidden + 3 * spec.v_intermediate) if spec.v_layers else 0,
        tool_image_encode(spec, w, mb),
        rows * spec.vocab * 4 * 3,
    )


# The device terms `vlmrl plan` reports, in its order (plan() adds allocator_reserve and cuda_context).
TERMS = {
    "weights": weights,
    "gradients": gradients,
    "master_weights": master_weights,
    "optimizer_states": optimizer_states,
    "optimizer_step_temporary": optimizer_step_temporary,
    "reference_model": reference_model,
    "teacher_model": teacher_model,
    "judge_model": judge_model,
    "activations_text": activations_text,
    "activations_vision": activations_vision,
    "activations_other": activations_other,
    "full_vocab_logits": full_vocab_logits,
    "eager_attention_scores": eager_attention_scores,
    "logprob_buffers": logprob_buffers,
    "checkpoint_recompute": checkpoint_recompute,
    "embedding_grad_temporaries": embedding_grad_temporaries,
    "prefix_held_gradients": prefix_held_gradients,
    "kv_cache": kv_cache,
    "generation_temporaries": generation_temporaries,
    "scoring_temporaries": scoring_temporaries,
    "reference_moved_in_for_scoring": reference_moved_in_for_scoring,
    "teacher_moved_in_for_scoring": teacher_moved_in_for_scoring,
    "judge_generation": judge_generation,
    "gathered_parameters": gathered_parameters,
    "gathered_for_generation": gathered_for_generation,
    "batch_inputs": batch_inputs,
    "tool_image_inputs": tool_image_inputs,
    "pixel_value_copies": pixel_value_copies,
    "naive_row_pixel_copies": naive_row_pixel_copies,
    "comm_buffers": comm_buffers,
}
