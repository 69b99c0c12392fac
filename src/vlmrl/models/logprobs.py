"""Per-token log-probs of completions under a VLM, without materialising full-vocabulary logits.

The decoder runs once over prompt + completion; only the hidden states that predict completion
tokens go through the LM head, a chunk of tokens at a time, and each chunk is recomputed in backward
(torch.utils.checkpoint), so at most one [chunk, V] logits block is alive at any moment.

Two entry points: `completion_logps` (one prompt row per completion: the reference path) and
`completion_logps_grouped` (unique prompts + a row -> prompt map: the vision tower runs once per
unique prompt and its features are shared by that prompt's completions; same values and gradients).
`vision_encode_counter` counts vision-tower calls and encoded images (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vlmrl.config import LOGPROB_CHUNK_TOKENS
from vlmrl.models.loading import unwrap
from vlmrl.families import family_of, grouped_labels, log_fallback
from vlmrl.models.loading import vision_tower
from vlmrl.models.processing import item_order, append_tokens, select_rows
from torch.nn.modules import module as nn_module
import inspect

# Keys of an encoded prompt batch that are bookkeeping, not model inputs.
NON_MODEL_KEYS = ("images_per_row", "videos_per_row", "image_num_patches")


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}


def decoder_hidden(core: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """[N, L, H] final (normed) hidden states for `inputs`, without the LM head over every position: the base model
    (core.model) where the model has one; else (Llama 4: vision tower, projector and language_model side by side)
    its own forward with the logits of the last position only, and its last hidden state."""
    inner = getattr(core, "model", None)
    if inner is not None:
        return inner(**inputs, use_cache=False).last_hidden_state
    return core(**inputs, use_cache=False, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]


# `with entropies_collected() as out:` -> every selective_logps call inside appends its [N, T] entropies to out.
_ENTROPY_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("vlmrl_entropy_sink", default=None)


@contextlib.contextmanager
def entropies_collected():
    """Collects the per-token entropies (nats, of softmax(logits / temperature), detached, float32) that every
    selective_logps call inside the block computes from the same LM-head chunks as its log-probs: one [chunk, V]
    block at a time, no extra forward. Yields a list that gets one [N, T] tensor per call."""
    out: list[torch.Tensor] = []
    token = _ENTROPY_SINK.set(out)
    try:
        yield out
    finally:
        _ENTROPY_SINK.reset(token)


def _chunk_logps(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float, entropy: bool = False):
    """hidden [n, H], targets [n] -> log p(target) [n] in float32 (softmax upcast for bf16 safety); with entropy, also
    the [n] entropies of the distributions, without gradient (one more pass over the chunk's logits, nothing kept)."""
    logits = lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = F.log_softmax(logits, dim=-1)
    chosen = torch.gather(log_probs, 1, targets.unsqueeze(1)).squeeze(1)
    if not entropy:
        return chosen
    with torch.no_grad():
        return chosen, -(log_probs.exp() * log_probs).sum(dim=-1)


class _FusedHeadLogps(torch.autograd.Function):
    """log p(target) of every token through a bias-free linear LM head, one reused [chunk, V] float32 buffer.

    Forward keeps no logits: per chunk the logits go into the buffer, torch's log-softmax kernel rewrites them in place
    and the target's value is read. Backward recomputes each chunk's log-softmax into the same buffer, runs torch's
    log-softmax backward kernel over it in place (the gathered targets' upstream gradient scattered into a block of
    `_GRAD_ROWS` rows at a time), and accumulates the weight gradient with addmm_ into one [V, H] tensor, chunks in
    autograd's order (last first). So a float32 head gives the checkpointed chunks' values and gradients bit for bit
    (same kernels, same summation order: tests/test_fused_head.py) while its backward holds one buffer and one weight
    gradient, where the checkpointed path holds logits, log-softmax, their gradients and a fresh weight gradient per
    chunk: for a 151,936-token vocabulary that is the bulk of a step's growth. A bfloat16/float16 head rounds its
    weight gradient once per addmm_ instead of once per chunk and a sum: within one ulp of that path, not equal."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int):
        m = hidden.shape[0]
        out = torch.empty(m, dtype=torch.float32, device=hidden.device)
        buf, low = _head_buffers(hidden, weight, chunk)
        for start in range(0, m, chunk):
            sl = slice(start, min(start + chunk, m))
            log_probs = _head_log_softmax(hidden[sl], weight, buf, low, temperature)
            out[sl] = log_probs.gather(1, targets[sl].unsqueeze(1)).squeeze(1)
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = None
        buf, low = _head_buffers(hidden, weight, chunk)
        block = buf.new_empty(min(_GRAD_ROWS, buf.shape[0]), buf.shape[1])
        grad_out = grad_out.to(torch.float32)
        m = hidden.shape[0]
        for start in reversed(range(0, m, chunk)):  # autograd adds the checkpointed chunks' weight gradients last first
            sl = slice(start, min(start + chunk, m))
            d = _head_log_softmax(hidden[sl], weight, buf, low, temperature)
            for row in range(0, d.shape[0], block.shape[0]):
                rows = slice(row, min(row + block.shape[0], d.shape[0]))
                g = block[: rows.stop - rows.start].zero_()  # gather's backward: the upstream gradient at the target
                g.scatter_add_(1, targets[sl][rows].unsqueeze(1), grad_out[sl][rows].unsqueeze(1))
                torch._log_softmax_backward_data(g, d[rows], -1, torch.float32, out=d[rows])  # row by row: in place is safe
            if temperature != 1.0:
                d.div_(temperature)
            if low is not None:  # the head's own dtype for its matmuls, as autograd through .float() would
                d = low[: d.shape[0]].copy_(d)
            if want_hidden:
                torch.matmul(d, weight, out=grad_hidden[sl])
            if want_weight:
                grad_weight = torch.matmul(d.t(), hidden[sl]) if grad_weight is None else grad_weight.addmm_(d.t(), hidden[sl])
        return grad_hidden, grad_weight, None, None, None


# Rows of the one-hot upstream gradient built at a time in the fused head's backward ([rows, V] float32).
_GRAD_ROWS = 16


def _head_buffers(hidden: torch.Tensor, weight: torch.Tensor, chunk: int):
    """The float32 [chunk, V] buffer, and a [chunk, V] one in the head's dtype when that is not float32."""
    rows = min(chunk, hidden.shape[0])
    buf = torch.empty(rows, weight.shape[0], dtype=torch.float32, device=hidden.device)
    low = torch.empty(rows, weight.shape[0], dtype=weight.dtype, device=hidden.device) if weight.dtype != torch.float32 else None
    return buf, low


def _head_log_softmax(h: torch.Tensor, weight: torch.Tensor, buf: torch.Tensor, low: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """h [c, H] -> log_softmax(float32 logits / temperature) [c, V] in buf: the ops of `_chunk_logps` (the module's
    matmul, through `low` in the head's dtype as lm_head(h).float(); the division; torch's log-softmax kernel), each
    writing into buf."""
    c = h.shape[0]
    if low is None:
        logits = torch.matmul(h, weight.t(), out=buf[:c])
    else:
        logits = buf[:c].copy_(torch.matmul(h, weight.t(), out=low[:c]))
    if temperature != 1.0:
        logits.div_(temperature)
    return torch._log_softmax(logits, -1, False, out=logits)  # row by row over the last dim: in place is safe


def fused_head_applies(hidden: torch.Tensor, lm_head: torch.nn.Module) -> bool:
    """The fused head reads the weight directly, so only for a plain bias-free nn.Linear whose forward nothing
    intercepts: no module hooks (FSDP2 / ZeRO-3 gather parameters in them), no LoRA wrapper, no sharded or
    DeepSpeed-partitioned weight, no autocast (which would change the matmul's dtype); CPU and CUDA only."""

    weight = getattr(lm_head, "weight", None)
    if hidden.device.type not in ("cpu", "cuda"):  # the planner's meta-device trace models the checkpointed chunks
        return False
    return (
        type(lm_head) is torch.nn.Linear
        and lm_head.bias is None
        and isinstance(weight, torch.Tensor)
        and type(weight.data) is torch.Tensor
        and not hasattr(weight, "ds_id")
        and weight.dtype == hidden.dtype
        and not (lm_head._forward_hooks or lm_head._forward_pre_hooks)
        and not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
        and not torch.is_autocast_enabled(hidden.device.type)
    )


def selective_logps(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0, chunk_tokens: int = LOGPROB_CHUNK_TOKENS
) -> torch.Tensor:
    """hidden [N, T, H] predicting targets [N, T] -> [N, T] log-probs, chunked over N*T tokens.

    chunk_tokens <= 0 turns the memory savers off: one [N*T, V] logits block, kept for backward
    (the naive path; benchmarks and equivalence tests compare against it). A plain linear head goes through
    `_FusedHeadLogps` (one reused buffer); any other head through checkpointed chunks."""
    n, t, h = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(n * t, h), targets.reshape(n * t)
    sink = _ENTROPY_SINK.get()
    entropy = sink is not None
    if chunk_tokens <= 0:
        chunks = [_chunk_logps(flat_hidden, lm_head, flat_targets, temperature, entropy)]
    elif fused_head_applies(flat_hidden, lm_head):
        logps = _FusedHeadLogps.apply(flat_hidden, lm_head.weight, flat_targets, float(temperature), int(chunk_tokens)).view(n, t)
        if entropy:  # a second, gradient-free pass over the head: the log-probs stay the fused path's, as in the update
            with torch.no_grad():
                parts = [
                    _chunk_logps(flat_hidden[s : s + chunk_tokens], lm_head, flat_targets[s : s + chunk_tokens], temperature, True)[1]
                    for s in range(0, n * t, chunk_tokens)
                ]
            sink.append(torch.cat(parts).view(n, t))
        return logps
    else:
        chunks = []
        for start in range(0, n * t, chunk_tokens):
            sl = slice(start, start + chunk_tokens)
            if torch.is_grad_enabled() and flat_hidden.requires_grad:
                chunks.append(checkpoint(_chunk_logps, flat_hidden[sl], lm_head, flat_targets[sl], temperature, entropy, use_reentrant=False))
            else:
                chunks.append(_chunk_logps(flat_hidden[sl], lm_head, flat_targets[sl], temperature, entropy))
    if not entropy:
        return torch.cat(chunks).view(n, t)
    sink.append(torch.cat([e for _, e in chunks]).view(n, t).detach())
    return torch.cat([lp for lp, _ in chunks]).view(n, t)


def completion_logps(
    model: torch.nn.Module,
    prompt_batch: dict,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> torch.Tensor:
    """Log-probs of each completion token given its prompt.

    prompt_batch: encoded prompts, one row per completion (input_ids/attention_mask [N, P], left
    padded, plus vision inputs). completion_ids, completion_mask: [N, T] (right padded).
    Returns [N, T] float32; values at masked positions are meaningless (mask them).
    """

    core = unwrap(model)
    prompt_len = prompt_batch["input_ids"].shape[1]
    # append_tokens also extends per-token side inputs (Qwen-VL's mm_token_type_ids).
    inputs = model_inputs(append_tokens(prompt_batch, completion_ids, completion_mask))
    hidden = decoder_hidden(core, inputs)
    # Position i predicts token i+1: the completion's T tokens are predicted by positions P-1 .. P+T-2.
    t = completion_ids.shape[1]
    predicting = hidden[:, prompt_len - 1 : prompt_len - 1 + t]
    return selective_logps(predicting, core.get_output_embeddings(), completion_ids, temperature, chunk_tokens)


# ---------------------------------------------------------------- grouped path: one vision pass per prompt

# Grouped-path names (families.Family.grouped) with M-RoPE (explicit [3, N, L] position ids from the model's own
# get_rope_index), and those whose shared prefix takes videos; from the registry.
MROPE_FAMILIES = grouped_labels("mrope")
PREFIX_VIDEO_FAMILIES = grouped_labels("prefix_videos")


def grouped_family(model: torch.nn.Module) -> str | None:
    """The family's grouped-path name (Family.grouped: 'qwen', 'qwen3', 'gemma3', 'llava', 'onevision', 'internvl')
    when `completion_logps_grouped` shares vision work for this model, else None.

    Decided by config.model_type (the families whose forward this module re-implements and tests)
    and checked against the structure it needs (model.model.get_image_features, Family.grouped_needs).
    None is logged once per model type with the reason (`families.log_fallback`).
    """

    core = unwrap(model)
    inner = getattr(core, "model", None)
    model_type = getattr(getattr(core, "config", None), "model_type", None)
    if inner is None or not hasattr(inner, "get_image_features") or not hasattr(inner, "get_input_embeddings"):
        log_fallback(model_type, "the model has no model.get_image_features / get_input_embeddings")
        return None
    family = family_of(model_type)
    if family.grouped is not None and all(hasattr(inner, name) for name in family.grouped_needs):
        return family.grouped
    log_fallback(model_type)
    return None


def _image_features(out, n_images: int, sizes: list[int] | None) -> torch.Tensor:
    """get_image_features' result (ModelOutput with pooler_output, tuple/list per image, or a tensor)
    -> all images' features concatenated, [sum of tokens, H], image after image."""
    feats = getattr(out, "pooler_output", None) if not isinstance(out, (torch.Tensor, tuple, list)) else out
    if feats is None:
        raise TypeError(f"get_image_features returned {type(out).__name__} without pooler_output")
    if isinstance(feats, torch.Tensor):
        # One tensor: [n_images, tokens, H] (LLaVA, older transformers) or already [sum tokens, H].
        if feats.ndim == 3:
            feats = list(feats.unbind(0))
        else:
            return feats
    feats = list(feats)
    if len(feats) != n_images:
        raise ValueError(f"get_image_features returned features for {len(feats)} images, expected {n_images}")
    if sizes is not None and [int(f.shape[0]) for f in feats] != sizes:
        raise ValueError(f"image feature lengths {[int(f.shape[0]) for f in feats]} != expected {sizes}")
    return torch.cat([f.reshape(-1, f.shape[-1]) for f in feats], dim=0)


def accepted_kwargs(fn, kwargs: dict) -> dict:
    """The kwargs `fn` accepts (all of them when it takes **kwargs)."""

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def group_rows(prompt_of_row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt index per row [N] -> (unique prompt indices [U] sorted, row_prompt [N] into them).

    For a micro-batch: `unique, row_prompt = group_rows(prompt_of_row[idx])`, then
    `completion_logps_grouped(model, select_rows(prompts, unique), row_prompt, ...)`.
    """
    unique, row_prompt = torch.unique(torch.as_tensor(prompt_of_row, dtype=torch.long).reshape(-1), return_inverse=True)
    return unique, row_prompt


def completion_logps_grouped(
    model: torch.nn.Module,
    prompt_batch: dict,
    row_prompt: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> torch.Tensor:
    """`completion_logps` for rows that share prompts, running the vision tower once per unique prompt.

    prompt_batch: the U unique prompts of this micro-batch (an encode_prompts batch or
    `select_rows(prompts, unique_ids)`: input_ids/attention_mask [U, P] + their vision inputs).
    row_prompt: LongTensor [N], row i continues prompt row_prompt[i] (0 <= row_prompt[i] < U).
    completion_ids, completion_mask: [N, T] right padded. Returns [N, T] float32, equal (values and
    gradients, vision tower and projector included) to
    `completion_logps(model, select_rows(prompt_batch, row_prompt), ...)`.

    How: the U prompts' images go through `get_image_features` once; each row's image-token
    embeddings are an index_select of its prompt's features (so backward sums the rows' gradients
    into one vision pass, as the naive path's repeated passes sum them into the weights); the decoder
    gets `inputs_embeds`, and for Qwen-VL explicit M-RoPE `position_ids` from the model's own
    `get_rope_index` on the N rows (text-only work). Every prompt in prompt_batch is encoded, so pass
    only prompts some row uses.

    | family (config.model_type)          | grouped path                                          |
    |-------------------------------------|-------------------------------------------------------|
    | qwen2_vl, qwen2_5_vl                | yes: shared features + get_rope_index position ids    |
    | qwen3_vl, qwen3_vl_moe, qwen3_5,    | yes: shared features (+ Qwen3-VL's DeepStack) handed to|
    |  qwen3_5_moe                        |  the model as mm_encoder_outputs (it builds           |
    |                                     |  visual_pos_masks and its own M-RoPE positions)       |
    | gemma3                              | yes: shared features as mm_encoder_outputs (the model |
    |                                     |  builds its bidirectional image-block mask)           |
    | llava_onevision, internvl           | yes: per-image (anyres) / per-tile features as        |
    |                                     |  mm_encoder_outputs, gathered to the rows             |
    | llava (LLaVA-1.5 style)             | yes: shared features, default positions               |
    | anything else (idefics, smolvlm...) | no: falls back to the naive path on                   |
    |                                     |  select_rows(prompt_batch, row_prompt) (same values), |
    |                                     |  reason logged once (Family.fallback_reason)          |
    | prompt batch without images, or     | naive path (nothing to share / videos not handled)    |
    |  with videos (pixel_values_videos)  |                                                       |
    """

    row_prompt = torch.as_tensor(row_prompt, dtype=torch.long).reshape(-1)
    n_prompts = prompt_batch["input_ids"].shape[0]
    if row_prompt.numel() != completion_ids.shape[0]:
        raise ValueError(f"row_prompt has {row_prompt.numel()} rows but completion_ids has {completion_ids.shape[0]}")
    if row_prompt.numel() and (int(row_prompt.min()) < 0 or int(row_prompt.max()) >= n_prompts):
        raise IndexError(f"row_prompt {row_prompt.tolist()} out of range for {n_prompts} prompts")
    family = grouped_family(model)
    if family is None or prompt_batch.get("pixel_values") is None or prompt_batch.get("pixel_values_videos") is not None:
        return completion_logps(model, select_rows(prompt_batch, row_prompt), completion_ids, completion_mask, temperature, chunk_tokens)

    core = unwrap(model)
    inner = core.model
    device = prompt_batch["input_ids"].device
    rows = row_prompt.to(device)
    per_prompt = prompt_batch.get("images_per_row")
    if per_prompt is None:
        raise KeyError("completion_logps_grouped: prompt batch has vision inputs but no images_per_row; build it with encode_prompts")
    per_prompt = per_prompt.to("cpu").long()
    spec = family_of(getattr(core.config, "model_type", None))
    if spec.encoder_outputs:
        hidden = _encoder_outputs_grouped_hidden(inner, prompt_batch, row_prompt, per_prompt, completion_ids, completion_mask)
        prompt_len, t = prompt_batch["input_ids"].shape[1], completion_ids.shape[1]
        predicting = hidden[:, prompt_len - 1 : prompt_len - 1 + t]
        return selective_logps(predicting, core.get_output_embeddings(), completion_ids, temperature, chunk_tokens)
    n_images = int(per_prompt.sum())

    # 1. Vision: all images of the U prompts, once.
    feats, sizes = _shared_image_features(inner, prompt_batch, spec, n_images)

    # 2. Token index of each row's image features inside `feats` (row order, image order).
    row_images = _row_images(row_prompt, per_prompt)
    token_idx = _token_index(sizes, row_images)

    # 3. Text of the N rows (prompt gathered + completion) and its embeddings with image features scattered in.
    text = {
        k: v.index_select(0, rows) for k, v in prompt_batch.items() if k in ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
    }
    text = append_tokens(text, completion_ids, completion_mask)
    input_ids, attention_mask = text["input_ids"], text["attention_mask"]
    embeds = inner.get_input_embeddings()(input_ids)
    image_mask = input_ids == core.config.image_token_id
    n_tokens = int(image_mask.sum())
    if n_tokens != token_idx.numel():
        raise ValueError(f"{n_tokens} image tokens in the rows but {token_idx.numel()} image features for them")
    row_feats = feats.index_select(0, token_idx.to(feats.device)).to(embeds.device, embeds.dtype)
    embeds = embeds.masked_scatter(image_mask.unsqueeze(-1).expand_as(embeds), row_feats)

    # 4. Decoder over inputs_embeds; Qwen-VL positions exactly as the model derives them from input_ids.
    position_ids = None
    if spec.mrope:
        position_ids = _mrope_position_ids(inner, prompt_batch["image_grid_thw"], row_images, text, image_mask)
    hidden = inner(inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids, use_cache=False).last_hidden_state
    prompt_len = prompt_batch["input_ids"].shape[1]
    t = completion_ids.shape[1]
    predicting = hidden[:, prompt_len - 1 : prompt_len - 1 + t]
    return selective_logps(predicting, core.get_output_embeddings(), completion_ids, temperature, chunk_tokens)


def _shared_image_features(inner, prompt_batch: dict, spec, n_images: int) -> tuple[torch.Tensor, list[int]]:
    """(features of all the prompt batch's images [sum of tokens, H], tokens per image): one get_image_features call.
    M-RoPE families size each image from its grid_thw; the others split the features evenly over the images."""
    if spec.mrope:
        grid = prompt_batch["image_grid_thw"]
        merge = inner.visual.spatial_merge_size**2
        sizes = (grid.prod(-1) // merge).tolist()
        out = inner.get_image_features(
            **accepted_kwargs(inner.get_image_features, {"pixel_values": prompt_batch["pixel_values"], "image_grid_thw": grid, "return_dict": True})
        )
    else:
        extra = {k: prompt_batch[k] for k in ("image_sizes",) if k in prompt_batch}
        sizes = None
        out = inner.get_image_features(
            **accepted_kwargs(inner.get_image_features, {"pixel_values": prompt_batch["pixel_values"], **extra, "return_dict": True})
        )
    feats = _image_features(out, n_images, sizes)
    if sizes is None:
        per_image = feats.shape[0] // max(n_images, 1)
        if per_image * n_images != feats.shape[0]:
            raise ValueError(f"{feats.shape[0]} image feature tokens do not split evenly over {n_images} images")
        sizes = [per_image] * n_images
    return feats, sizes


def _token_index(sizes: list[int], row_images: list[int]) -> torch.Tensor:
    """Indices into the concatenated image features of row_images' tokens, image after image: [their tokens]."""
    token_start = torch.tensor([0] + sizes, dtype=torch.long).cumsum(0)
    if row_images:
        return torch.cat([torch.arange(int(token_start[i]), int(token_start[i + 1])) for i in row_images])
    return torch.zeros(0, dtype=torch.long)


def _mrope_position_ids(inner, grid: torch.Tensor, row_images: list[int], text: dict, image_mask: torch.Tensor) -> torch.Tensor:
    """M-RoPE position ids [3, N, L] of the rows, from the model's own get_rope_index over their input_ids."""
    row_image_idx = torch.tensor(row_images, dtype=torch.long, device=grid.device)
    grid_rows = grid.index_select(0, row_image_idx)
    mm_types = text.get("mm_token_type_ids")
    if mm_types is None:
        mm_types = image_mask.long()
    rope_kwargs = accepted_kwargs(
        inner.get_rope_index,
        {
            "input_ids": text["input_ids"],
            "mm_token_type_ids": mm_types,
            "image_grid_thw": grid_rows,
            "video_grid_thw": None,
            "attention_mask": text["attention_mask"],
        },
    )
    position_ids, _ = inner.get_rope_index(**rope_kwargs)
    return position_ids


def _row_images(row_prompt: torch.Tensor, per_prompt: torch.Tensor) -> list[int]:
    """Image indices (into the prompt batch's images) of every row, row after row: [sum of the rows' images]."""
    image_start = torch.cat([torch.zeros(1, dtype=torch.long), per_prompt.cumsum(0)])
    return [i for p in row_prompt.tolist() for i in range(int(image_start[p]), int(image_start[p + 1]))]


def _gather_images(features, row_images: list[int]):
    """Per-image features (a tensor [n_images, ...] or a tuple with one tensor per image) -> the same kind, for row_images."""
    if torch.is_tensor(features):
        return features.index_select(0, torch.tensor(row_images, dtype=torch.long, device=features.device))
    return tuple(features[i] for i in row_images)


def _encoder_outputs_grouped_hidden(
    inner: torch.nn.Module,
    prompt_batch: dict,
    row_prompt: torch.Tensor,
    per_prompt: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Decoder hidden states [N, P+T, H] of the N rows, with each prompt's images encoded once (Qwen3-VL, Gemma 3).

    The U prompts' images go through `get_image_features` once; every row gets its prompt's per-image
    features (and Qwen3-VL's DeepStack features) as the model's own `mm_encoder_outputs`: gathered views of
    one pass, so backward sums the rows' gradients into it. The model's forward then does the rest as on
    the naive path: scatters them, builds Qwen3-VL's visual_pos_masks and M-RoPE positions (get_rope_index)
    or Gemma 3's bidirectional image-block mask (token_type_ids)."""

    grid = prompt_batch.get("image_grid_thw")
    vision_in = {"pixel_values": prompt_batch["pixel_values"], "return_dict": True}
    if grid is not None:
        vision_in["image_grid_thw"] = grid
    if prompt_batch.get("image_sizes") is not None:  # LLaVA-OneVision: anyres unpadding needs each image's size
        vision_in["image_sizes"] = prompt_batch["image_sizes"]
        vision_in["batch_num_images"] = per_prompt.tolist()
    out = inner.get_image_features(**vision_in)
    row_images = _row_images(row_prompt, per_prompt)
    tiles = prompt_batch.get("image_num_patches")  # InternVL: features are per tile; an image is its run of tiles
    if tiles is not None:
        row_images = item_order(tiles.reshape(-1), torch.tensor(row_images, dtype=torch.long))  # their tiles, image after image
    out.pooler_output = _gather_images(out.pooler_output, row_images)
    if getattr(out, "deepstack_features", None) is not None:
        out.deepstack_features = [_gather_images(layer, row_images) for layer in out.deepstack_features]
    rows = row_prompt.to(prompt_batch["input_ids"].device)
    text_keys = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
    text = append_tokens({k: v.index_select(0, rows) for k, v in prompt_batch.items() if k in text_keys}, completion_ids, completion_mask)
    if grid is not None:
        if "mm_token_type_ids" not in text:
            text["mm_token_type_ids"] = (text["input_ids"] == inner.config.image_token_id).long()
        text["image_grid_thw"] = grid.index_select(0, torch.tensor(row_images, dtype=torch.long, device=grid.device))
    return inner(**text, mm_encoder_outputs={"image": out}, use_cache=False).last_hidden_state


class VisionCounter:
    """Counts vision-tower forward calls and the images they encode (see `vision_encode_counter`)."""

    def __init__(self):
        self.calls = 0
        self.images = 0


def _images_in_call(args: tuple, kwargs: dict) -> int:
    grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
    if torch.is_tensor(grid):  # Qwen-VL: one grid row per image
        return int(grid.shape[0])
    pixels = kwargs.get("pixel_values", args[0] if args else None)
    return int(pixels.shape[0]) if torch.is_tensor(pixels) and pixels.ndim == 4 else 0


class vision_encode_counter:  # noqa: N801 - used as a context manager, like torch.no_grad
    """`with vision_encode_counter(model) as c: ...` -> c.calls forward calls of the vision tower and
    c.images images encoded by them (Qwen-VL: rows of grid_thw; LLaVA-style: pixel_values batch)."""

    def __init__(self, model: torch.nn.Module):

        self.tower = vision_tower(model)
        self.counter = VisionCounter()
        self._handle = None

    def _hook(self, module, args, kwargs):
        self.counter.calls += 1
        self.counter.images += _images_in_call(args, kwargs)

    def __enter__(self) -> VisionCounter:
        self._handle = self.tower.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self.counter

    def __exit__(self, *exc) -> None:
        self._handle.remove()
