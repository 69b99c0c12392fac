"""MoE routers: find them, read their logits during the update's forward, and weight the routed tokens so the
load-balancing loss (losses.load_balancing_loss) is the same on every log-prob path.

The fast paths call the decoder differently from the naive one (the shared-prefix path runs each prompt once and
the completions on its cache; the naive path runs prompt + completion per row, the last completion token
included). Every call's routed tokens are recorded with the call's attention mask; `call_weights` then gives each
token the weight it has on the naive path, minus the last completion column (which predicts nothing and is not
run by the shared-prefix path): a prompt run once for k rows weighs k.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from vlmrl.models.loading import unwrap
from vlmrl.algo.losses import load_balancing_loss
from vlmrl.config import ConfigError
from vlmrl.families import family_of


@dataclass(frozen=True)
class Routing:
    """The routers of an MoE model: one per MoE decoder layer."""

    routers: tuple[torch.nn.Module, ...]
    decoder: torch.nn.Module  # the text decoder whose forward calls them (its kwargs carry the attention mask)
    num_experts: int
    top_k: int


def find_routing(model: torch.nn.Module) -> Routing | None:
    """The model's top-k routers (modules with integer `top_k` and `num_experts` and an [E, H] weight, as
    transformers' Qwen3-VL-MoE / Qwen3.5-MoE routers are), or None for a dense model."""
    routers = tuple(
        m
        for m in model.modules()
        if isinstance(getattr(m, "top_k", None), int)
        and isinstance(getattr(m, "num_experts", None), int)
        and isinstance(getattr(m, "weight", None), torch.Tensor)
        and m.weight.dim() == 2
        and m.weight.shape[0] == m.num_experts
    )
    if not routers:
        return None
    core = unwrap(model)
    decoder = core.get_decoder() if hasattr(core, "get_decoder") else core
    return Routing(routers=routers, decoder=decoder, num_experts=routers[0].num_experts, top_k=routers[0].top_k)


def routing_for(model: torch.nn.Module, aux_loss_coef: float, replay: str = "off") -> Routing | None:
    """The run's routing; a load-balancing coefficient or routing replay on a model without routers (or with per-modality
    expert sets, Family.modality_experts) is a config error. None: nothing to record."""

    family = family_of(getattr(getattr(unwrap(model), "config", None), "model_type", None))
    if family.modality_experts:
        if aux_loss_coef > 0 or replay != "off":
            raise ConfigError(
                f"algorithm.router_aux_loss_coef={aux_loss_coef}, algorithm.routing_replay={replay}: {family.name} routes text and "
                "vision tokens to separate expert sets, which vlmrl's load-balancing loss and routing replay do not model; set "
                "algorithm.router_aux_loss_coef=0 and algorithm.routing_replay=off"
            )
        return None  # no router/aux_loss logged: a per-router subset of the tokens is not the loss vlmrl defines
    routing = find_routing(model)
    if routing is None and aux_loss_coef > 0:
        raise ConfigError(f"algorithm.router_aux_loss_coef={aux_loss_coef} but the model has no MoE router (a dense model); set it to 0")
    if routing is None and replay != "off":
        raise ConfigError(f"algorithm.routing_replay={replay} but the model has no MoE router (a dense model); set it to off")
    return routing


@dataclass
class RoutedCall:
    """One decoder call: its routers' logits ([B*S, E] per MoE layer) and its token mask [B, S]."""

    mask: torch.Tensor
    logits: list[torch.Tensor] = field(default_factory=list)


class capture_routing:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Records the router logits of every decoder call inside the block (forward only: leave the block before
    backward, so gradient checkpointing's recomputation is not recorded twice). routing None: records nothing."""

    def __init__(self, routing: Routing | None):
        self.routing = routing
        self.calls: list[RoutedCall] = []
        self._handles: list = []

    def _on_decoder(self, module, args, kwargs):
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None and args:
            tokens = args[0]
        batch, seq = int(tokens.shape[0]), int(tokens.shape[1])
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            mask = mask[:, -seq:].detach()  # a cached call's mask spans the cache too
        else:
            mask = torch.ones(batch, seq, device=tokens.device)
        self.calls.append(RoutedCall(mask=mask))

    def _on_router(self, module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        self.calls[-1].logits.append(logits)

    def __enter__(self) -> "capture_routing":
        if self.routing is None:
            return self
        self._handles.append(self.routing.decoder.register_forward_pre_hook(self._on_decoder, with_kwargs=True))
        self._handles += [r.register_forward_hook(self._on_router) for r in self.routing.routers]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def call_weights(mask: torch.Tensor, rows_per_prompt: torch.Tensor, prompt_width: int, completion_width: int) -> torch.Tensor:
    """[B, S] weights of one decoder call's tokens on the naive path's terms.

    mask: the call's [B, S] attention mask. rows_per_prompt: [U] rows of the micro-batch per prompt.
    A call over the U prompts (shared prefix) weighs each prompt by its rows; a call over whole rows
    (S = P + T: naive and grouped paths) drops the last completion column."""
    weights = mask.float().clone()
    if weights.shape[1] == prompt_width + completion_width:
        weights[:, -1] = 0
    if weights.shape[0] == rows_per_prompt.numel():
        weights = weights * rows_per_prompt.to(weights.device, torch.float32).unsqueeze(1)
    return weights


def routed_aux_loss(capture: capture_routing, rows_per_prompt: torch.Tensor, prompt_width: int, completion_width: int) -> torch.Tensor:
    """The load-balancing loss of the calls `capture` recorded (losses.load_balancing_loss)."""

    logits, weights = [], []
    for call in capture.calls:
        w = call_weights(call.mask, rows_per_prompt, prompt_width, completion_width).reshape(-1)
        for layer in call.logits:
            if layer.shape[0] != w.numel():
                raise ValueError(f"a router saw {layer.shape[0]} tokens in a decoder call of {w.numel()}")
            logits.append(layer)
            weights.append(w)
    if not logits:
        raise ValueError("no router ran inside the captured forward")
    r = capture.routing
    return load_balancing_loss(logits, weights, r.num_experts, r.top_k)


def micro_batch_aux_loss(capture: capture_routing, prompt_batch: dict, row_prompt: torch.Tensor, completion_width: int) -> torch.Tensor:
    """`routed_aux_loss` of one log-prob forward (completion_logps_for's arguments: U prompts, [N] row_prompt)."""
    n_prompts, prompt_width = prompt_batch["input_ids"].shape
    return routed_aux_loss(capture, torch.as_tensor(row_prompt).reshape(-1).bincount(minlength=n_prompts), prompt_width, completion_width)


# ---------------------------------------------------------------- routing replay (Rollout Routing Replay, R3)
# The rollout records, for every token its decoder calls run, the top-k experts each MoE layer chose (and their
# weights); the scoring and update forwards then route the same tokens to the same experts, so a router that moved
# (an optimizer step) or a near tie that kernels break differently (another batch shape, bf16) cannot send a token
# elsewhere than the sampler did. Prompt tokens are replayed too: completions attend to their hidden states.


def _call_shape(args, kwargs) -> tuple[int, int, bool]:
    """(batch, sequence, continues a cache) of a decoder call."""
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None and args:
        tokens = args[0]
    cache = kwargs.get("past_key_values")
    if cache is None:
        cache = kwargs.get("cache")  # transformers >= 5.24's name for it
    cached = cache is not None and hasattr(cache, "get_seq_length") and int(cache.get_seq_length()) > 0
    return int(tokens.shape[0]), int(tokens.shape[1]), cached


@dataclass
class RecordedRoutes:
    """Expert choices of a rollout. prompt: [U, P, L, k] for its U prompts (left padded as encoded); completion:
    [N, T, L, k] for its rows (completion token t as the decoder's input; -1 where no call ran it: the last token,
    which predicts nothing). *_weights: the same shapes' routing weights (float32), or None when not kept.
    L = MoE layers in Routing.routers order, k = top_k."""

    prompt: torch.Tensor
    completion: torch.Tensor
    prompt_weights: torch.Tensor | None = None
    completion_weights: torch.Tensor | None = None

    def for_rows(self, prompts: list[int], rows: list[int], width: int) -> "RecordedRoutes":
        """The routes of a micro-batch: its unique prompts and its rows' first `width` completion tokens (-1 past T)."""

        def crop(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t[rows, :width]
            if t.shape[1] < width:
                pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), -1, dtype=t.dtype, device=t.device)
                t = torch.cat([t, pad], dim=1)
            return t

        pw = self.prompt_weights[prompts] if self.prompt_weights is not None else None
        return RecordedRoutes(self.prompt[prompts], crop(self.completion), pw, crop(self.completion_weights))


class _RouterHooks:
    """Shared context-manager plumbing of record_routing and replay_routing: on entry, a pre-hook on the decoder
    (`_on_decoder`, which sees each call's shape) and a forward hook on every router (`_on_router(layer, ...)`);
    on exit, all removed. Nothing is hooked when `_active()` is false (no routers, or nothing to replay)."""

    def _active(self) -> bool:
        raise NotImplementedError

    def __enter__(self):
        if not self._active():
            return self
        self._handles.append(self.routing.decoder.register_forward_pre_hook(self._on_decoder, with_kwargs=True))
        for j, r in enumerate(self.routing.routers):
            self._handles.append(r.register_forward_hook(functools.partial(self._on_router, j)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class record_routing(_RouterHooks):  # noqa: N801 - used as a context manager, like torch.no_grad
    """Records the experts of every decoder call of the shared-prefix decode loop(s) inside the block: each loop is a
    prefill of U prompts ([U, P]) then one call per decoded token ([U*G, 1]). routing None: records nothing.
    `routes(num_generations)` assembles them (loops in call order: prompts and rows concatenated)."""

    def __init__(self, routing: Routing | None, keep_weights: bool = False):
        self.routing = routing
        self.keep_weights = keep_weights
        self.loops: list[list[tuple[int, int, list]]] = []  # per loop: (batch, seq, per-layer (indices, weights)) per call
        self._handles: list = []

    def _on_decoder(self, module, args, kwargs):
        batch, seq, cached = _call_shape(args, kwargs)
        if not cached:
            self.loops.append([])
        if not self.loops:
            raise ValueError("routing replay: a cached decoder call before any prefill")
        self.loops[-1].append((batch, seq, [None] * len(self.routing.routers)))

    def _active(self) -> bool:
        return self.routing is not None

    def _on_router(self, layer: int, module, args, output):
        _, weights, indices = output
        kept = weights.detach().float() if self.keep_weights else None
        self.loops[-1][-1][2][layer] = (indices.detach().to(torch.int16), kept)

    def routes(self, num_generations: int) -> RecordedRoutes:
        prompts, rows, prompt_w, rows_w = [], [], [], []
        for calls in self.loops:
            (u, p, layers), steps = calls[0], calls[1:]
            n = u * num_generations
            if any(b != n or s != 1 for b, s, _ in steps):
                raise ValueError(
                    f"routing replay: a decode loop of {u} prompts ran calls of shapes {sorted({(b, s) for b, s, _ in steps})}, "
                    f"not [{n}, 1]: expert choices are recorded only in the shared-prefix loop (rollout.engine=loop)"
                )
            prompts.append(_stack_layers([layers], u, p, 0))
            rows.append(_stack_layers([c[2] for c in steps], n, 1, 0))
            if self.keep_weights:
                prompt_w.append(_stack_layers([layers], u, p, 1))
                rows_w.append(_stack_layers([c[2] for c in steps], n, 1, 1))
        if not prompts:
            raise ValueError("routing replay: no decode loop ran inside record_routing")
        return RecordedRoutes(
            torch.cat(prompts),
            _cat_rows(rows),
            torch.cat(prompt_w) if self.keep_weights else None,
            _cat_rows(rows_w) if self.keep_weights else None,
        )


def _stack_layers(calls: list[list], batch: int, seq: int, which: int) -> torch.Tensor:
    """Calls (in sequence order) of per-layer (indices, weights) [batch*seq, k] -> [batch, calls*seq, L, k]."""
    if not calls:
        return torch.full((batch, 0, 1, 1), -1, dtype=torch.int16)
    per_call = [torch.stack([layer[which] for layer in layers], dim=1).reshape(batch, seq, len(layers), -1) for layers in calls]
    return torch.cat(per_call, dim=1)


def _cat_rows(pieces: list[torch.Tensor]) -> torch.Tensor:
    """[n_i, T_i, L, k] pieces -> [sum n_i, max T_i, L, k], right padded with -1."""
    width = max(p.shape[1] for p in pieces)
    shape = next((p.shape[2:] for p in pieces if p.shape[1]), pieces[0].shape[2:])
    out = []
    for p in pieces:
        pad = torch.full((p.shape[0], width - p.shape[1], *shape), -1, dtype=p.dtype)
        out.append(torch.cat([p.reshape(p.shape[0], p.shape[1], *shape), pad], dim=1))
    return torch.cat(out)


class replay_routing(_RouterHooks):  # noqa: N801 - used as a context manager, like torch.no_grad
    """Inside the block, every router call of a log-prob forward over `routes` (RecordedRoutes.for_rows of the
    micro-batch) uses the recorded experts: a call over the U prompts ([U, P]) their prompt routes, a cached call over
    the rows' completions ([N, S]) their first S completion tokens', a call over whole rows ([N, P + T]) both.
    mode experts: the weights are the current router's probabilities of those experts, renormalised as transformers'
    top-k routers do (the router keeps its gradient); experts_and_weights: the recorded weights (no gradient to the
    router through them). Tokens without a record (-1) keep the router's own choice. Keep the block open over
    backward when layers are checkpointed (their recomputation routes again)."""

    def __init__(self, routing: Routing | None, routes: RecordedRoutes | None, row_prompt: torch.Tensor, mode: str = "experts"):
        self.routing, self.routes, self.mode = routing, routes, mode
        self.row_prompt = torch.as_tensor(row_prompt, dtype=torch.long).reshape(-1).cpu()
        self.current: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._handles: list = []

    def _select(self, batch: int, seq: int, cached: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        r = self.routes
        n_prompts, prompt_width = r.prompt.shape[:2]
        n_rows = r.completion.shape[0]
        if cached and batch == n_rows:
            return r.completion[:, :seq], None if r.completion_weights is None else r.completion_weights[:, :seq]
        if not cached and batch == n_prompts and seq == prompt_width:
            return r.prompt, r.prompt_weights
        if not cached and batch == n_rows and seq == prompt_width + r.completion.shape[1]:
            idx = torch.cat([r.prompt[self.row_prompt], r.completion], dim=1)
            w = None if r.prompt_weights is None else torch.cat([r.prompt_weights[self.row_prompt], r.completion_weights], dim=1)
            return idx, w
        raise ValueError(
            f"routing replay: a decoder call over [{batch}, {seq}] tokens{' (cached)' if cached else ''} matches no recorded "
            f"tokens ({n_prompts} prompts x {prompt_width}, {n_rows} rows x {r.completion.shape[1]})"
        )

    def _active(self) -> bool:
        return self.routing is not None and self.routes is not None

    def _on_decoder(self, module, args, kwargs):
        self.current = self._select(*_call_shape(args, kwargs))

    def _on_router(self, layer: int, module, args, output):
        logits, weights, indices = output
        recorded, recorded_w = self.current
        chosen = recorded[:, :, layer].reshape(-1, recorded.shape[-1]).to(device=indices.device, dtype=torch.long)
        if chosen.shape != indices.shape:
            raise ValueError(f"routing replay: {tuple(chosen.shape)} recorded choices for a router call of {tuple(indices.shape)}")
        valid = (chosen >= 0).all(dim=-1, keepdim=True)
        chosen = torch.where(valid, chosen, indices)
        if self.mode == "experts_and_weights":
            new = recorded_w[:, :, layer].reshape(-1, recorded_w.shape[-1]).to(device=weights.device, dtype=weights.dtype)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, chosen)
            new = (probs / probs.sum(dim=-1, keepdim=True)).to(weights.dtype)
        return logits, torch.where(valid, new, weights), chosen
