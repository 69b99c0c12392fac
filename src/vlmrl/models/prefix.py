"""Shared prompt prefix: each prompt (text + image tokens) goes through the model once per group.

A GRPO group is G completions of one prompt. The naive paths run the prompt G times: HF generate with
num_return_sequences copies the prompt (and its images) G times before prefill, and scoring /
training forward prompt + completion per row. Here the U unique prompts are prefilled once, their KV
cache is repeated (rollout) or gathered (scoring, training) for the N completion rows, and only the
completion tokens run per row: each completion attends to one shared copy of its prompt.

- `sample_with_shared_prefix`: rollout. Greedy output equals HF generate token for token; sampling uses
  the same logits processors in the same order as HF generate, so it draws from the same distribution,
  by inverse CDF (`sample_rows`: one uniform number per row) instead of torch.multinomial (one
  exponential per vocabulary entry: 84 ms vs 6 ms per step for 16 rows x 151,936 on this CPU).
- `completion_logps_prefix`: per-token log-probs with gradients, equal to `completion_logps` within fp32
  rounding. Under gradient checkpointing transformers drops the KV cache inside checkpointed layers,
  so `prefix_supported` says no and callers use the grouped path instead.

| family (config.model_type) | shared prefix | positions of completion tokens                  |
|----------------------------|---------------|-------------------------------------------------|
| qwen2_vl, qwen2_5_vl,      | yes           | M-RoPE: prompt's max position + 1 + t (all axes) |
| qwen3_vl, qwen3_vl_moe,    |               |   (interleaved M-RoPE in Qwen3-VL: same ids)     |
| qwen3_5 (linear-attention  |               |                                                  |
|  conv + recurrent states   |               |                                                  |
|  gathered per row too)     |               |                                                  |
|  (DeepStack: the prefill   |               |                                                  |
|  carries it)               |               |                                                  |
| llava, gemma3 (the prefill | yes           | cache position P + t (the model's default)       |
|  carries Gemma 3's         |               |                                                  |
|  bidirectional image mask) |               |                                                  |
| anything else              | no (grouped / naive path) |                                    |
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from vlmrl.config import LOGPROB_CHUNK_TOKENS
from vlmrl.models.logprobs import MROPE_FAMILIES, PREFIX_VIDEO_FAMILIES, accepted_kwargs, grouped_family, model_inputs, selective_logps
from vlmrl.models.loading import unwrap
from vlmrl.models.logprobs import completion_logps, completion_logps_grouped
from vlmrl.models.processing import select_rows


def prefix_supported(model: torch.nn.Module, prompt_batch: dict, needs_grad: bool = False) -> bool:
    """True when the shared-prefix path applies: a tested family (with videos: the Qwen-VL families, whose prefill
    encodes each prompt's videos once), and (for a forward that keeps gradients) no gradient checkpointing in
    training mode; never while Ulysses sequence parallelism is active (engine/ulysses.py: it runs without a KV cache)."""
    if getattr(unwrap(model), "vlmrl_sequence_parallel", False):
        return False
    family = grouped_family(model)
    if family is None or (prompt_batch.get("pixel_values_videos") is not None and family not in PREFIX_VIDEO_FAMILIES):
        return False
    core = unwrap(model)
    checkpointing = getattr(core, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers < 5
        checkpointing = getattr(core, "is_gradient_checkpointing", False)
    return not (needs_grad and checkpointing and core.training)


@dataclass(frozen=True)
class LogprobOptions:
    """How per-token log-probs are computed: one object, one set of defaults, for GRPO scoring and update, SFT
    and evaluation (`from_config` reads them from memory.* / rollout.temperature / training.bf16)."""

    temperature: float = 1.0  # logits are divided by it (the rollout's sampling temperature)
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS  # tokens per LM-head chunk; 0 = one full block
    shared_prefix: bool = True  # prefill each prompt once and share its KV cache across its rows
    group_vision: bool = True  # encode each unique prompt's images once per forward
    bf16_autocast: bool = False  # run the forward under bfloat16 autocast
    device_type: str = "cpu"  # autocast's device type

    @classmethod
    def from_config(cls, cfg, device: torch.device) -> "LogprobOptions":
        m = cfg.memory
        return cls(
            temperature=cfg.rollout.temperature,
            chunk_tokens=m.logprob_chunk_tokens,
            shared_prefix=m.shared_prefix,
            group_vision=m.group_vision,
            bf16_autocast=cfg.training.bf16,
            device_type=torch.device(device).type,
        )

    def autocast(self):
        if not self.bf16_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=torch.bfloat16)


def completion_logps_for(
    model: torch.nn.Module,
    prompt_batch: dict,
    row_prompt: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    opts: LogprobOptions = LogprobOptions(),
) -> torch.Tensor:
    """[N, T] log-probs by the cheapest exact path: shared prefix when on and supported, else the grouped
    path (one vision pass per prompt; it falls back to the naive path per family), else the naive path
    (each row's prompt repeated: group_vision off). prompt_batch: the U unique prompts [U, P];
    row_prompt: [N] which prompt each completion row continues; completion_ids, completion_mask: [N, T]."""

    needs_grad = torch.is_grad_enabled()
    args = (completion_ids, completion_mask, opts.temperature, opts.chunk_tokens)
    with opts.autocast():
        if opts.shared_prefix and prefix_supported(model, prompt_batch, needs_grad):
            return completion_logps_prefix(model, prompt_batch, row_prompt, *args)
        if opts.group_vision:
            return completion_logps_grouped(model, prompt_batch, row_prompt, *args)
        return completion_logps(model, select_rows(prompt_batch, torch.as_tensor(row_prompt).reshape(-1)), *args)


def prefix_positions(model: torch.nn.Module, prompt_batch: dict) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(position_ids for the prompt or None = model default, next position [U] of the first new token).

    Qwen-VL: M-RoPE ids [3, U, P] from the model's get_rope_index; the first completion token sits at
    the prompt's largest position + 1 (what the model derives for text after the prompt). Others: the
    model's default positions 0..P-1, so the next one is P."""
    core = unwrap(model)
    input_ids = prompt_batch["input_ids"]
    if not uses_mrope(model):
        return None, torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.long, device=input_ids.device)
    inner = core.model
    mm_types = prompt_batch.get("mm_token_type_ids")
    if mm_types is None:
        mm_types = (input_ids == core.config.image_token_id).long() + 2 * (input_ids == getattr(core.config, "video_token_id", -1)).long()
    position_ids, _ = inner.get_rope_index(
        **accepted_kwargs(
            inner.get_rope_index,
            {
                "input_ids": input_ids,
                "mm_token_type_ids": mm_types,
                "image_grid_thw": prompt_batch.get("image_grid_thw"),
                "video_grid_thw": prompt_batch.get("video_grid_thw"),
                "second_per_grid_ts": prompt_batch.get("second_per_grid_ts"),
                "attention_mask": prompt_batch["attention_mask"],
            },
        )
    )
    masked = position_ids.masked_fill(prompt_batch["attention_mask"].unsqueeze(0) == 0, -1)
    return position_ids, masked.amax(dim=(0, 2)) + 1


def uses_mrope(model) -> bool:
    """M-RoPE families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): each row's completion continues at its prompt's next
    position on all three axes; the others take the cache position."""
    return grouped_family(model) in MROPE_FAMILIES


def mrope_positions(start: torch.Tensor, length: int) -> torch.Tensor:
    """M-RoPE position ids [3, N, length] of `length` tokens per row from `start` [N] on, the same on every axis."""
    pos = start.unsqueeze(1) + torch.arange(length, device=start.device)
    return pos.unsqueeze(0).expand(3, -1, -1)


def _continuation_positions(model, next_pos: torch.Tensor, offset: int, length: int) -> torch.Tensor | None:
    """Position ids of `length` tokens starting `offset` after the prompt, per row ([3, N, length] for Qwen)."""
    if not uses_mrope(model):
        return None  # default: cache_position
    return mrope_positions(next_pos + offset, length)


def repeat_cache_rows(cache, rows: torch.Tensor | None = None, repeats: int | None = None) -> None:
    """Gather (rows) or repeat_interleave (repeats) the batch dimension of a prefill cache, in place.

    KV layers have their own batch_select_indices / batch_repeat_interleave; linear-attention layers
    (Qwen3.5's Gated DeltaNet: causal-conv and recurrent states, no sequence axis) get the same done to
    each state tensor, so every row continues from its own prompt's state. Such layers then store new
    recurrent states by assignment, not in place: the continuation's backward still needs the gathered
    state it started from (the prompt pass's gradient flows through it)."""

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(repeats, dim=0) if repeats else t.index_select(0, rows.to(t.device))

    for layer in cache.layers:
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name, None)  # {state index: tensor [B, ...] or None}
            if isinstance(states, dict):
                states.update({k: pick(t) for k, t in states.items() if torch.is_tensor(t) and t.ndim})
        if isinstance(getattr(layer, "recurrent_states", None), dict):
            layer.update_recurrent_state = _assigning_update(layer)
        if torch.is_tensor(getattr(layer, "keys", None)):
            if repeats:
                layer.batch_repeat_interleave(repeats)
            else:
                layer.batch_select_indices(rows)


def _assigning_update(layer):
    def update_recurrent_state(recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        layer.recurrent_states[state_idx] = recurrent_states
        return recurrent_states

    return update_recurrent_state


def prefill_prompts(model, prompt_batch: dict, position_ids, lm_logits: bool):
    """One forward over the U prompts with a KV cache. Returns the HF output (logits of the last position
    when lm_logits, else last_hidden_state) whose past_key_values hold the prompts."""
    core = unwrap(model)
    inputs = model_inputs(prompt_batch)
    if position_ids is not None:
        inputs["position_ids"] = position_ids
    if lm_logits:
        return core(**inputs, use_cache=True, logits_to_keep=1)
    return core.model(**inputs, use_cache=True)


_MASK64 = (1 << 64) - 1


def row_seed(prompt_seed: int, generation: int) -> int:
    """Seed of one row's sampling stream from its prompt's seed and its index in the group (splitmix64 of both:
    nearby prompt seeds and generation indices give unrelated streams)."""
    z = (int(prompt_seed) * 0x9E3779B97F4A7C15 + int(generation) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch.Generator seeds must fit in int64


def draw_uniforms(generators: list[torch.Generator], device) -> torch.Tensor:
    """[N, 1] float64 uniforms, one from each row's stream (drawn on the CPU: one copy per step on a GPU)."""
    u = torch.cat([torch.rand(1, dtype=torch.float64, generator=g) for g in generators])
    return u.unsqueeze(1).to(device)


class SamplingWorkspace:
    """Vocabulary-sized buffers that one rollout reuses at every decode step (banned scores, probabilities, the float64
    CDF). Fresh tensors of three sizes per step fragment glibc's heap on the CPU: freed [N, V] blocks are split by the
    small tensors allocated between them (the growing KV cache), the next float64 CDF no longer fits and the heap grows
    by one CDF per decode step; measured on a 151,936-token vocabulary, 500 MiB of free heap by the end of a 64-token
    rollout. Reused buffers give the same values (same kernels, written in place)."""

    def __init__(self):
        self.buffers: dict[str, torch.Tensor] = {}

    def like(self, name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A buffer of like's shape [n, V] (the first n rows of one kept for the largest n seen)."""
        dtype = dtype or like.dtype
        n, v = like.shape
        buf = self.buffers.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1] != v or buf.dtype != dtype or buf.device != like.device:
            buf = self.buffers[name] = torch.empty((n, v), dtype=dtype, device=like.device)
        return buf[:n]

    def banned(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of logits [n, V] to ban tokens in, in place (logits stay as they are: the sampler's log-probs)."""
        return self.like("scores", logits).copy_(logits)


def sample_rows(scores: torch.Tensor, uniforms: torch.Tensor | None = None, workspace: SamplingWorkspace | None = None) -> torch.Tensor:
    """One token per row of scores [N, V] (logits, -inf = banned) drawn from softmax(scores) -> [N].
    uniforms: [N, 1] float64 in [0, 1), one per row (default: torch.rand from the global stream).
    workspace: buffers reused across decode steps (same tokens with or without).

    Inverse CDF: the float32 probabilities are summed in float64 (no drift over a 151,936-token
    vocabulary), one uniform number per row is searched in them. A token of probability 0 is never drawn
    (searchsorted(right=True) skips flat stretches of the CDF)."""
    if workspace is None:
        cdf = torch.softmax(scores, dim=-1).to(torch.float64).cumsum_(dim=-1)
    else:  # torch.softmax(x, -1) is aten._softmax(x, -1, False): the same kernel, written into the buffer
        probs = torch.ops.aten._softmax.out(scores, -1, False, out=workspace.like("probs", scores))
        cdf = workspace.like("cdf", scores, torch.float64).copy_(probs).cumsum_(dim=-1)
    if uniforms is None:
        uniforms = torch.rand(scores.shape[0], 1, dtype=torch.float64, device=scores.device)
    u = uniforms * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=scores.shape[1] - 1)


def keep_decoding(local_unfinished: bool, agreement: Callable[[bool], bool] | None) -> bool:
    """Whether the decode loop takes another step: this process's rows (agreement None), or `agreement(local)` where
    processes whose forwards hold collectives (ZeRO-3 / FSDP2 with memory.generation_gather=layers: every module
    forward all-gathers its parameters) must run the same number of decode forwards (Engine.decode_agreement)."""
    return local_unfinished if agreement is None else agreement(local_unfinished)


@torch.no_grad()
def sample_with_shared_prefix(
    model: torch.nn.Module,
    prompt_batch: dict,
    *,
    num_generations: int,
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    suppress_ids: list[int],
    do_sample: bool = True,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_new_tokens: int = 0,
    row_seeds: list[int] | None = None,
    return_logps: bool = False,
    decode_agreement: Callable[[bool], bool] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """G completions per prompt of `prompt_batch` ([U, P], left padded) -> ids [U*G, T], rows of prompt u
    at u*G .. u*G+G-1, padded with pad_id after EOS (the layout HF generate returns after the prompt).
    return_logps: also [U*G, T] float32 log_softmax(logits / temperature) of each chosen token at the decode step
    that chose it (the sampler's side of the rollout-training mismatch, mismatch.py).

    The prompts are prefilled once ([U, P]: one vision pass per prompt), the cache is repeated G times,
    then all U*G rows decode one token per forward. row_seeds: [U*G] seeds of per-row sampling streams
    (`continuous.row_seed`; the continuous decoder's streams); default one global stream (torch.rand).
    decode_agreement: None, or how the processes agree to take another step (`keep_decoding`)."""
    core = unwrap(model)
    G = num_generations if do_sample else 1
    prompt_mask = prompt_batch["attention_mask"]
    P = prompt_batch["input_ids"].shape[1]
    position_ids, next_pos = prefix_positions(model, prompt_batch)
    out = prefill_prompts(model, prompt_batch, position_ids, lm_logits=True)
    cache = out.past_key_values
    repeat_cache_rows(cache, repeats=G)
    next_pos = next_pos.repeat_interleave(G)
    attention_mask = prompt_mask.repeat_interleave(G, dim=0)
    logits = out.logits[:, -1].to(torch.float32).repeat_interleave(G, dim=0)
    del out

    warpers = sampling_warpers(do_sample, temperature, top_k, top_p)
    device = logits.device
    eos = torch.tensor(eos_ids, device=device)
    suppress = torch.tensor(suppress_ids, dtype=torch.long, device=device)
    n = logits.shape[0]
    generators = [torch.Generator().manual_seed(s) for s in row_seeds] if do_sample and row_seeds is not None else None
    workspace = SamplingWorkspace()
    unfinished = torch.ones(n, dtype=torch.bool, device=device)
    tokens: list[torch.Tensor] = []
    done_at = None
    logps: list[torch.Tensor] = []
    for t in range(max_new_tokens):
        scores = banned_scores(logits, workspace, suppress, eos if t < min_new_tokens else None)
        if do_sample:
            scores = warpers(None, scores)
            chosen = sample_rows(scores, None if generators is None else draw_uniforms(generators, device), workspace)
        else:
            chosen = scores.argmax(dim=-1)
        chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad_id))
        tokens.append(chosen)
        if return_logps:
            logps.append(chosen_logps(logits, chosen, temperature))
        unfinished &= ~torch.isin(chosen, eos)
        local = bool(unfinished.any())
        if not local and done_at is None:
            done_at = t + 1  # this process's rows are done; further steps (kept in step with other processes) are dropped
        if not keep_decoding(local, decode_agreement) or t == max_new_tokens - 1:
            break
        attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=1)
        step = {
            "input_ids": chosen.unsqueeze(1),
            "attention_mask": attention_mask,
            "past_key_values": cache,
            "cache_position": torch.tensor([P + t], device=device),
            "use_cache": True,
            "logits_to_keep": 1,
            **_positions_arg(model, next_pos, t),
        }
        logits = core(**step).logits[:, -1].to(torch.float32)
    ids = torch.stack(tokens[:done_at], dim=1)
    return (ids, torch.stack(logps[:done_at], dim=1)) if return_logps else ids


def sampling_warpers(do_sample: bool, temperature: float, top_k: int, top_p: float):
    """HF generate's warpers in its order (after the token bans): temperature, top-k, top-p; none when greedy."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList()
    if do_sample:
        if temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p))
    return warpers


def banned_scores(logits: torch.Tensor, workspace, suppress: torch.Tensor, eos: torch.Tensor | None) -> torch.Tensor:
    """[N, V] logits with the suppressed ids (vision placeholders) and, before min_new_tokens (`eos` given), the EOS ids
    at -inf, in the workspace's copy; `logits` itself when nothing is banned."""
    if not suppress.numel() and eos is None:
        return logits
    scores = workspace.banned(logits)
    if suppress.numel():
        scores.index_fill_(1, suppress, float("-inf"))
    if eos is not None:
        scores.index_fill_(1, eos, float("-inf"))
    return scores


def _positions_arg(model, next_pos: torch.Tensor, t: int) -> dict:
    """{"position_ids": ...} of decode step t where the family needs explicit positions (M-RoPE), else {}."""
    positions = _continuation_positions(model, next_pos, t, 1)
    return {} if positions is None else {"position_ids": positions}


def chosen_logps(logits: torch.Tensor, chosen: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [n, V] float32, chosen [n] -> [n] log_softmax(logits / temperature) at the chosen ids (the quantity the
    scoring pass computes for the same token)."""
    scaled = logits / temperature if temperature != 1.0 else logits
    return scaled.gather(1, chosen.unsqueeze(1)).squeeze(1) - torch.logsumexp(scaled, dim=-1)


def completion_logps_prefix(
    model: torch.nn.Module,
    prompt_batch: dict,
    row_prompt: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> torch.Tensor:
    """`completion_logps_grouped` with the prompt run once per unique prompt, not once per row.

    prompt_batch: the U unique prompts ([U, P] + vision inputs); row_prompt: [N] prompt index of each row;
    completion_ids, completion_mask: [N, T] right padded. Returns [N, T] float32 log-probs.

    The prompts' forward yields their last hidden state (which predicts each row's first token) and a KV
    cache; the cache is gathered to the N rows (index_select: backward sums the rows' gradients into the
    one prompt pass) and the completions' first T-1 tokens run on top of it."""
    core = unwrap(model)
    rows = torch.as_tensor(row_prompt, dtype=torch.long).reshape(-1).to(prompt_batch["input_ids"].device)
    P = prompt_batch["input_ids"].shape[1]
    T = completion_ids.shape[1]
    position_ids, next_pos = prefix_positions(model, prompt_batch)
    out = prefill_prompts(model, prompt_batch, position_ids, lm_logits=False)
    first = out.last_hidden_state[:, -1].index_select(0, rows).unsqueeze(1)  # [N, 1, H]
    if T > 1:
        cache = out.past_key_values
        repeat_cache_rows(cache, rows=rows)
        mask = torch.cat(
            [prompt_batch["attention_mask"].index_select(0, rows), completion_mask[:, : T - 1].to(prompt_batch["attention_mask"])], dim=1
        )
        step = {
            "input_ids": completion_ids[:, : T - 1],
            "attention_mask": mask,
            "past_key_values": cache,
            "cache_position": torch.arange(P, P + T - 1, device=rows.device),
            "use_cache": True,
        }
        positions = _continuation_positions(model, next_pos.index_select(0, rows), 0, T - 1)
        if positions is not None:
            step["position_ids"] = positions
        rest = core.model(**step).last_hidden_state
        predicting = torch.cat([first.to(rest.dtype), rest], dim=1)
    else:
        predicting = first
    del out
    return selective_logps(predicting, core.get_output_embeddings(), completion_ids, temperature, chunk_tokens)
