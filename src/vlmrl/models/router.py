"""MoE routers: find them, read their logits during the update's forward, and weight the routed tokens so the
load-balancing loss (losses.load_balancing_loss) is the same on every log-prob path.

The fast paths call the decoder differently from the naive one (the shared-prefix path runs each prompt once and
the completions on its cache; the naive path runs prompt + completion per row, the last completion token
included). Every call's routed tokens are recorded with the call's attention mask; `call_weights` then gives each
token the weight it has on the naive path, minus the last completion column (which predicts nothing and is not
run by the shared-prefix path): a prompt run once for k rows weighs k.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmrl.models.loading import unwrap
from vlmrl.algo.losses import load_balancing_loss
from vlmrl.config import ConfigError


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


def routing_for(model: torch.nn.Module, aux_loss_coef: float) -> Routing | None:
    """The run's routing; a load-balancing coefficient on a model without routers is a config error."""

    routing = find_routing(model)
    if routing is None and aux_loss_coef > 0:
        raise ConfigError(f"algorithm.router_aux_loss_coef={aux_loss_coef} but the model has no MoE router (a dense model); set it to 0")
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
