"""What a rollout backend that holds its own copy of the model (vLLM) is pushed: the trained weights under the base
model's parameter names, as its checkpoint has them.

Full-weight training: the model's state dict as it is. LoRA (peft): every adapted layer's base weight plus its
adapters' delta (W + scaling * B @ A, peft's own `get_delta_weight`), under the base layer's name (peft's
`.base_layer.` removed); the adapter tensors themselves are not pushed. The live model is never merged in place
(merging and unmerging again would round its base weights)."""

from __future__ import annotations

import re

import torch

from vlmrl.models.loading import has_lora, unwrap

# peft's adapter tensors inside an adapted layer (lora_A / lora_B modules, embedding adapters, DoRA magnitudes)
ADAPTER_KEY = re.compile(r"\.lora_(A|B|embedding_A|embedding_B|magnitude_vector)\.")


@torch.no_grad()
def pushed_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """[(name, tensor)] in the base model's names: LoRA merged out of place (module docstring)."""
    base = unwrap(model)
    if not has_lora(model):
        return [(name, whole(t)) for name, t in base.state_dict().items()]
    deltas = lora_deltas(base)
    out = []
    for key, t in base.state_dict().items():
        if ADAPTER_KEY.search(key):
            continue
        t = whole(t)
        merged = t + whole(deltas[key]).to(t.dtype) if key in deltas else t
        out.append((key.replace(".base_layer.", "."), merged.detach()))
    return out


def whole(t: torch.Tensor) -> torch.Tensor:
    """A parameter as one tensor: an FSDP2 shard (DTensor) all-gathered (every process calls this at once, in the
    same order), anything else as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor().detach() if isinstance(t, DTensor) else t.detach()


def lora_deltas(base: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{state-dict key of an adapted layer's base weight: the sum of its active adapters' deltas}. Raises ValueError
    for a layer this cannot merge out of place (a parameter adapter, model.lora_target_parameters; one merged in place)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    deltas = {}
    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if isinstance(module, ParamWrapper) or module.merged:
            raise ValueError(f"{name}: a LoRA layer of type {type(module).__name__} (merged={module.merged}) cannot be pushed merged")
        active = [a for a in module.active_adapters if a in module.lora_A or a in getattr(module, "lora_embedding_A", {})]
        if active and not module.disable_adapters:
            deltas[f"{name}.base_layer.weight"] = sum(module.get_delta_weight(a) for a in active)
    return deltas
