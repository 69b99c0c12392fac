"""Ulysses sequence parallelism for the language model (the Qwen2.5-VL, Qwen2-VL and Qwen3-VL decoders, no KV cache).

SP ranks hold the same rows; each runs the decoder layers on a 1/sp share of the sequence. Around attention, an
all-to-all turns the sequence-sharded q/k/v [B, T/sp, H, D] into head-sharded [B, T, H/sp, D] (every rank then sees
the whole sequence for its heads, so attention is exact), and the inverse all-to-all brings the output back to
[B, T/sp, H, D]. Everything outside attention (norms, MLPs, rotary) is per-token and runs on the local share.

How it is wired (`sequence_parallel(model, group)`, active only inside the `with`):
- a forward pre-hook on the text model pads the sequence to a multiple of sp (padding = masked-out keys), keeps the
  full [B, T'] padding mask for attention and hands the layers this rank's share of inputs_embeds / position_ids;
- the text config's attention implementation is switched to `vlmrl_ulysses` (registered with transformers'
  AttentionInterface): all-to-all, SDPA with the full causal + padding mask, inverse all-to-all;
- a forward hook gathers last_hidden_state back to [B, T, hidden] on every rank.

Gradients: the loss after the gather is computed identically on every SP rank (same rows, same gathered hidden
states), so the layers after it (final norm excluded, LM head) get the whole gradient on every rank. The gather's
backward is sp x this rank's share of the incoming gradient (what a reduce-scatter-sum of the ranks' identical
gradients gives, without the communication), so the layers before it get sp x their share too: on every parameter the
MEAN of the SP ranks' gradients is the one-process gradient, which is what DDP / FSDP2 / ZeRO's averaging computes.

In `vlmrl train` (engine/distributed.py: `use_sequence_parallel`, `sequence_split`): sp = the number of processes
under DDP, one data-parallel rank (the rows counted once in the loss normaliser, the loss scaled by 1 before DDP
averages); `sequence_parallel_refusal` names what is not run yet (SP inside data parallelism, FSDP2 / ZeRO, LoRA, ...).

The vision encoder runs whole on every SP rank (its sharding is a later slice); only the decoder is split.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlmrl.families import model_types

ATTENTION_NAME = "vlmrl_ulysses"
SP_MODEL_FLAG = "vlmrl_sequence_parallel"  # set on the model while SP is active (the prefix/KV-cache path refuses it)


def covered_model_types() -> tuple[str, ...]:
    """The model types of the families marked `sequence_parallel` (a mixture-of-experts variant is refused apart)."""
    return model_types("sequence_parallel")


def mixture_of_experts(model_config) -> bool:
    """Whether the (text) model routes tokens to experts: its routers would see only a process's share of the tokens
    under SP (the router's auxiliary loss and routing replay would be a share's), not handled yet."""
    text = getattr(model_config, "text_config", None) or model_config
    return bool(getattr(text, "num_experts", 0) or getattr(text, "n_routed_experts", 0))


class SequenceParallelError(ValueError):
    """SP asked for something this slice does not do (a family, a head count, a KV cache)."""


# ---------------------------------------------------------------- pure pieces (no process group)


def pad_to_multiple(x: torch.Tensor, sp: int, dim: int, value=0) -> torch.Tensor:
    """x padded at the end of `dim` with `value` to the next multiple of sp (x itself when it already is one)."""
    extra = (-x.shape[dim]) % sp
    if not extra:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def local_share(x: torch.Tensor, rank: int, sp: int, dim: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/sp share of `dim` (its length a multiple of sp): [..., T/sp, ...]."""
    n = x.shape[dim] // sp
    return x.narrow(dim, rank * n, n)


def heads_send_buffer(x: torch.Tensor, sp: int) -> torch.Tensor:
    """Sequence-sharded [B, T/sp, H, D] -> send buffer [sp, B, T/sp, H/sp, D]: chunk j holds heads j*H/sp.. for rank j."""
    b, t, h, d = x.shape
    return x.reshape(b, t, sp, h // sp, d).permute(2, 0, 1, 3, 4).contiguous()


def merge_sequence(received: torch.Tensor) -> torch.Tensor:
    """Received [sp, B, T/sp, H/sp, D] (chunk j = rank j's sequence share) -> head-sharded [B, T, H/sp, D]."""
    sp, b, t, h, d = received.shape
    return received.permute(1, 0, 2, 3, 4).reshape(b, sp * t, h, d)


def sequence_send_buffer(y: torch.Tensor, sp: int) -> torch.Tensor:
    """Head-sharded [B, T, H/sp, D] -> send buffer [sp, B, T/sp, H/sp, D]: chunk j holds sequence share j for rank j."""
    b, t, h, d = y.shape
    return y.reshape(b, sp, t // sp, h, d).permute(1, 0, 2, 3, 4).contiguous()


def merge_heads(received: torch.Tensor) -> torch.Tensor:
    """Received [sp, B, T/sp, H/sp, D] (chunk j = rank j's heads) -> sequence-sharded [B, T/sp, H, D]."""
    sp, b, t, h, d = received.shape
    return received.permute(1, 2, 0, 3, 4).reshape(b, t, sp * h, d)


def simulated_all_to_all(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """What all_to_all does to the ranks' send buffers [sp, ...] (one per rank): rank r receives chunk r of every
    rank, in rank order. For testing the reshuffle in one process."""
    return [torch.stack([buf[r] for buf in buffers]) for r in range(len(buffers))]


def ulysses_mask(padding: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool attention mask over the whole (sp-padded) sequence: causal and the key not padding.

    padding: [B, T] 1 = real token. A padding query (which no real query reads) attends to itself, so that no
    row is fully masked (SDPA would give NaN there); real tokens' values are those of the unsplit model."""
    b, t = padding.shape
    causal = torch.ones(t, t, dtype=torch.bool, device=padding.device).tril()
    mask = causal.unsqueeze(0) & padding.bool().unsqueeze(1)
    mask |= torch.eye(t, dtype=torch.bool, device=padding.device).unsqueeze(0)
    return mask.unsqueeze(1)


def check_sp_size(sp: int, world_size: int, heads: int, kv_heads: int, field: str = "training.sequence_parallel_size") -> None:
    """SequenceParallelError naming `field` when sp does not divide the world size, the attention heads or the KV heads."""
    if sp < 1:
        raise SequenceParallelError(f"{field}={sp}: must be >= 1")
    for what, n in (("the number of processes", world_size), ("the attention heads", heads), ("the key/value heads", kv_heads)):
        if n % sp:
            raise SequenceParallelError(f"{field}={sp} must divide {what} ({n}); pick a divisor of {n}")


def sequence_parallel_refusal(sp: int, world_size: int, model_config, command: str = "train", cfg=None) -> str | None:
    """The one line refusing `vlmrl COMMAND` with sp > 1, or None when the run can go ahead (always None for sp 1).
    What runs: `vlmrl train` with sp = the number of processes (one SP group, no data parallelism beside it) on a
    covered family with divisible heads, full-weight training, the in-process loop sampler, single-turn rollouts.
    model_config: the model's transformers config (text_config read when present), None when not readable before
    loading (vlmrl's embedded model); cfg: the run's Config (its other settings checked), None to skip them."""
    if sp == 1:
        return None
    field = f"training.sequence_parallel_size={sp}"
    if command != "train":
        return f"{field}: not yet in `vlmrl {command}` (only `vlmrl train` runs Ulysses); set training.sequence_parallel_size=1"
    covered = ", ".join(covered_model_types())
    if model_config is None:  # vlmrl's embedded model: nothing to read before it is built
        return f"{field}: Ulysses covers {covered} for now, not the embedded model; set it to 1"
    model_type = getattr(model_config, "model_type", None)
    if model_type not in covered_model_types() or mixture_of_experts(model_config):
        return f"{field}: Ulysses covers {covered} (dense) for now, not {model_type}{' (experts)' * mixture_of_experts(model_config)}; set it to 1"
    text = getattr(model_config, "text_config", None) or model_config
    try:
        check_sp_size(sp, world_size, text.num_attention_heads, text.num_key_value_heads)
    except SequenceParallelError as e:
        return str(e)
    if sp != world_size:
        return (
            f"{field} with {world_size} processes: sequence parallelism inside data parallelism is not done yet; "
            f"set it to the number of processes ({world_size}) or 1"
        )
    return None if cfg is None else _setting_refusal(field, cfg)


def _setting_refusal(field: str, cfg) -> str | None:
    """The first setting of `cfg` that Ulysses does not run with yet, as one line naming both fields; None when none."""
    r = cfg.rollout
    refusals = (
        (cfg.model.use_lora, "model.use_lora=true (LoRA under Ulysses is not tested yet); train full weights"),
        (r.backend != "inprocess", f"rollout.backend={r.backend} (each SP rank would ask its own sampler); use rollout.backend=inprocess"),
        (r.engine != "loop", f"rollout.engine={r.engine} (not shown to sample identically on every SP rank yet); use rollout.engine=loop"),
        (cfg.multiturn, "multi-turn rollouts (they score through another path); unset tools.tools and tools.environment"),
        (cfg.algorithm.teacher_path is not None, "algorithm.teacher_path (the teacher is scored whole); unset it"),
    )
    for refused, why in refusals:
        if refused:
            return f"{field}: not yet with {why}, or set training.sequence_parallel_size=1"
    return None


# ---------------------------------------------------------------- the collectives, differentiable


def _all_to_all(buffer: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(buffer)
    dist.all_to_all_single(out, buffer.contiguous(), group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    return merge_sequence(_all_to_all(heads_send_buffer(x, dist.get_world_size(group)), group))


def _heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    return merge_heads(_all_to_all(sequence_send_buffer(y, dist.get_world_size(group)), group))


class SeqToHeads(torch.autograd.Function):
    """[B, T/sp, H, D] sequence-sharded -> [B, T, H/sp, D] head-sharded; backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """[B, T, H/sp, D] head-sharded -> [B, T/sp, H, D] sequence-sharded; backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


class GatherSequence(torch.autograd.Function):
    """[B, T/sp, ...] -> [B, T, ...] on every rank (rank order). Backward: sp x this rank's share of the gradient, the
    reduce-scatter-sum of the SP ranks' gradients when (as here) the loss after it is the same on every rank; gloo has
    no reduce-scatter, and the identical gradients make it unnecessary."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.rank, ctx.sp = group, dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.sp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return local_share(grad, ctx.rank, ctx.sp, 1) * ctx.sp, None


# ---------------------------------------------------------------- wiring into the model


@dataclass
class _State:
    group: object
    sp: int
    rank: int
    padding: torch.Tensor | None = None  # [B, T'] of the current forward
    length: int = 0  # T before the sp padding


_ACTIVE: list[_State] = []
# The longest sequence (sp-padded) a decoder forward ran under SP since the last `take_split_metrics`, and this
# process's share of it: the loop logs both, so a run shows that its rows were split.
_SPLIT = {"tokens": 0, "tokens_per_process": 0}


def take_split_metrics() -> dict[str, int]:
    """{sequence_parallel/tokens, sequence_parallel/tokens_per_process} since the last call (then reset)."""
    out = {f"sequence_parallel/{k}": v for k, v in _SPLIT.items()}
    _SPLIT.update(tokens=0, tokens_per_process=0)
    return out


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention interface under SP: query [B, H, T/sp, D], key/value [B, Hkv, T/sp, D] (local share,
    rotary applied) -> ([B, T/sp, H, D], None). The model's own mask (built for the local share) is replaced by the
    full-sequence causal + padding mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = _ACTIVE[-1]
    q, k, v = (SeqToHeads.apply(t.transpose(1, 2), state.group).transpose(1, 2) for t in (query, key, value))
    mask = ulysses_mask(state.padding)
    out, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=scaling, dropout=dropout, is_causal=False)
    return HeadsToSeq.apply(out, state.group), None  # out: [B, T, H/sp, D]


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)


def _pre_hook(module, args, kwargs):
    state = _ACTIVE[-1]
    if args or kwargs.get("input_ids") is not None or kwargs.get("inputs_embeds") is None:
        raise SequenceParallelError("sequence parallelism: the text model must be called with inputs_embeds (keywords)")
    if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
        raise SequenceParallelError("sequence parallelism runs without a KV cache (scoring and the update, not generation)")
    embeds = kwargs["inputs_embeds"]
    b, t = embeds.shape[:2]
    mask = kwargs.get("attention_mask")
    padding = torch.ones(b, t, dtype=torch.long, device=embeds.device) if mask is None else mask.long()
    if padding.ndim != 2:
        raise SequenceParallelError("sequence parallelism needs a [B, T] padding mask, not a prepared 4D mask")
    state.padding, state.length = pad_to_multiple(padding, state.sp, 1), t
    position_ids = kwargs.get("position_ids")
    if position_ids is None:  # what the text model derives without them (no cache): 0..T-1 on the 3 M-RoPE axes
        position_ids = torch.arange(t, device=embeds.device).view(1, 1, -1).expand(3, b, -1)
    kwargs = dict(kwargs, attention_mask=None)
    kwargs["inputs_embeds"] = local_share(pad_to_multiple(embeds, state.sp, 1), state.rank, state.sp, 1)
    _SPLIT["tokens"] = max(_SPLIT["tokens"], state.padding.shape[1])
    _SPLIT["tokens_per_process"] = max(_SPLIT["tokens_per_process"], kwargs["inputs_embeds"].shape[1])
    kwargs["position_ids"] = local_share(pad_to_multiple(position_ids, state.sp, -1), state.rank, state.sp, position_ids.ndim - 1)
    if kwargs.get("deepstack_visual_embeds") is not None:  # Qwen3-VL: features added to the image tokens' hidden states
        kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = deepstack_share(
            kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"], state.rank, state.sp
        )
    return args, kwargs


def deepstack_share(visual_pos_masks: torch.Tensor, embeds: list[torch.Tensor], rank: int, sp: int):
    """Qwen3-VL's DeepStack inputs cut to rank `rank`'s sequence share: visual_pos_masks [B, T] (bool, image tokens)
    -> [B, T'/sp] (T' = T padded to a multiple of sp, padding not visual); each of `embeds` [N, hidden] (one row per
    image token, in the mask's row-major order) -> [n, hidden], the rows of the image tokens in the share."""
    full = pad_to_multiple(visual_pos_masks.bool(), sp, 1, False)
    ordinal = (full.reshape(-1).long().cumsum(0) - 1).view_as(full)  # the embeds row of each image token
    mine = local_share(full, rank, sp, 1)
    rows = local_share(ordinal, rank, sp, 1)[mine]
    return mine, [e[rows.to(e.device)] for e in embeds]


def _post_hook(module, args, kwargs, output):
    state = _ACTIVE[-1]
    full = GatherSequence.apply(output.last_hidden_state, state.group)
    output.last_hidden_state = full[:, : state.length]
    return output


def _text_model(core):
    inner = getattr(core, "model", None)
    text = getattr(inner, "language_model", None)
    if getattr(core.config, "model_type", None) not in covered_model_types() or mixture_of_experts(core.config) or text is None:
        covered, found = ", ".join(covered_model_types()), getattr(core.config, "model_type", type(core).__name__)
        raise SequenceParallelError(f"sequence parallelism covers {covered} for now, not {found}")
    return text


@contextlib.contextmanager
def sequence_parallel(model: torch.nn.Module, group=None):
    """Within the `with`, `model`'s decoder runs Ulysses over `group` (default: all processes); sp = the group's size.
    Every rank of the group must make the same calls with the same rows. Leaves the model as it was on exit."""
    from vlmrl.models.loading import unwrap

    core = unwrap(model)
    text = _text_model(core)
    sp, rank = dist.get_world_size(group), dist.get_rank(group)
    check_sp_size(sp, sp, text.config.num_attention_heads, text.config.num_key_value_heads)
    _register_attention()
    _ACTIVE.append(_State(group=group, sp=sp, rank=rank))
    before = text.config._attn_implementation_internal
    text.config._attn_implementation_internal = ATTENTION_NAME
    handles = [text.register_forward_pre_hook(_pre_hook, with_kwargs=True), text.register_forward_hook(_post_hook, with_kwargs=True)]
    setattr(core, SP_MODEL_FLAG, True)
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        text.config._attn_implementation_internal = before
        _ACTIVE.pop()
        delattr(core, SP_MODEL_FLAG)
