"""Per-token log-probs of completions under a VLM, without materialising full-vocabulary logits.

The decoder runs once over prompt + completion; only the hidden states that predict completion
tokens go through the LM head, a chunk of tokens at a time, and each chunk is recomputed in backward
(torch.utils.checkpoint), so at most one [chunk, V] logits block is alive at any moment.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Keys of an encoded prompt batch that are bookkeeping, not model inputs.
NON_MODEL_KEYS = ("images_per_row",)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF *ForConditionalGeneration under a peft wrapper (LoRA layers stay injected)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_inputs(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}


def _chunk_logps(hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """hidden [n, H], targets [n] -> log p(target) [n] in float32 (softmax upcast for bf16 safety)."""
    logits = lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), 1, targets.unsqueeze(1)).squeeze(1)


def selective_logps(
    hidden: torch.Tensor, lm_head: torch.nn.Module, targets: torch.Tensor, temperature: float = 1.0, chunk_tokens: int = 1024
) -> torch.Tensor:
    """hidden [N, T, H] predicting targets [N, T] -> [N, T] log-probs, chunked over N*T tokens."""
    n, t, h = hidden.shape
    flat_hidden, flat_targets = hidden.reshape(n * t, h), targets.reshape(n * t)
    out = []
    for start in range(0, n * t, chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        if torch.is_grad_enabled() and flat_hidden.requires_grad:
            out.append(checkpoint(_chunk_logps, flat_hidden[sl], lm_head, flat_targets[sl], temperature, use_reentrant=False))
        else:
            out.append(_chunk_logps(flat_hidden[sl], lm_head, flat_targets[sl], temperature))
    return torch.cat(out).view(n, t)


def completion_logps(
    model: torch.nn.Module,
    prompt_batch: dict,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
) -> torch.Tensor:
    """Log-probs of each completion token given its prompt.

    prompt_batch: encoded prompts, one row per completion (input_ids/attention_mask [N, P], left
    padded, plus vision inputs). completion_ids, completion_mask: [N, T] (right padded).
    Returns [N, T] float32; values at masked positions are meaningless (mask them).
    """
    from .processing import append_tokens

    core = unwrap(model)
    prompt_len = prompt_batch["input_ids"].shape[1]
    # append_tokens also extends per-token side inputs (Qwen-VL's mm_token_type_ids).
    inputs = model_inputs(append_tokens(prompt_batch, completion_ids, completion_mask))
    hidden = core.model(**inputs, use_cache=False).last_hidden_state
    # Position i predicts token i+1: the completion's T tokens are predicted by positions P-1 .. P+T-2.
    t = completion_ids.shape[1]
    predicting = hidden[:, prompt_len - 1 : prompt_len - 1 + t]
    return selective_logps(predicting, core.get_output_embeddings(), completion_ids, temperature, chunk_tokens)
