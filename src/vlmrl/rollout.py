"""Rollout: sample G completions per prompt with Hugging Face generate."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .logprobs import model_inputs


@dataclass
class Completions:
    """ids, mask: [B*G, T] right-padded; completions of prompt b at rows b*G .. b*G+G-1.
    truncated: [B*G] bool, True where no EOS came within max_new_tokens."""

    ids: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor

    @property
    def lengths(self) -> torch.Tensor:
        return self.mask.sum(dim=1)


def completion_mask(ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, T] ids -> (mask [N, T] with 1 up to and including the first EOS, truncated [N] bool)."""
    is_eos = torch.isin(ids, torch.tensor(eos_ids, device=ids.device))
    seen_before = torch.cumsum(is_eos.int(), dim=1) - is_eos.int()  # EOS count strictly before each position
    mask = (seen_before == 0).long()
    return mask, ~is_eos.any(dim=1)


def eos_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError("the model has no eos_token_id and neither has its tokenizer; generation could never stop")
    return ids


def vision_token_ids(model: torch.nn.Module) -> list[int]:
    """Placeholder ids (image/video pad, vision start/end) that a completion must never contain: the
    model would read them as slots for image features when the completion is scored."""
    cfg = model.config
    ids = set()
    for name in ("image_token_id", "image_token_index", "video_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id"):
        for holder in (cfg, getattr(cfg, "text_config", None)):
            value = getattr(holder, name, None) if holder is not None else None
            if isinstance(value, int) and value >= 0:
                ids.add(value)
    return sorted(ids)


def cat_right_padded(pieces: list[torch.Tensor], value) -> torch.Tensor:
    """[n_i, T_i] pieces -> [sum n_i, max T_i], each right-padded with `value`."""
    width = max(p.shape[1] for p in pieces)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value) for p in pieces])


def cat_completions(pieces: list[Completions], pad_id: int) -> Completions:
    """Per-prompt rollouts concatenated into one, ids right-padded with pad_id (masks with 0)."""
    if len(pieces) == 1:
        return pieces[0]
    return Completions(
        ids=cat_right_padded([p.ids for p in pieces], pad_id),
        mask=cat_right_padded([p.mask for p in pieces], 0),
        truncated=torch.cat([p.truncated for p in pieces]),
    )


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    tokenizer,
    prompt_batch: dict,
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    prompts_per_call: int | None = None,
    min_new_tokens: int = 0,
    shared_prefix: bool = True,
) -> Completions:
    """Sample `num_generations` completions for each prompt row of `prompt_batch` ([B, P]).

    prompts_per_call bounds how many prompts go through one generate() call (the generation batch),
    independently of the training micro-batch. shared_prefix prefills each prompt once and shares its
    KV cache across its G samples (`prefix.sample_with_shared_prefix`); otherwise HF generate with
    num_return_sequences (prompt and images processed G times). Returns [B*G, T] completions grouped
    by prompt.
    """
    from .prefix import prefix_supported, sample_with_shared_prefix
    from .processing import select_rows

    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    n_prompts = prompt_batch["input_ids"].shape[0]
    step = prompts_per_call or n_prompts
    pieces = []
    for start in range(0, n_prompts, step):
        rows = list(range(start, min(start + step, n_prompts)))
        chunk = select_rows(prompt_batch, rows) if step < n_prompts else prompt_batch
        if shared_prefix and prefix_supported(model, chunk):
            pieces.append(
                sample_with_shared_prefix(
                    model,
                    chunk,
                    num_generations=num_generations,
                    max_new_tokens=max_new_tokens,
                    eos_ids=eos,
                    pad_id=pad,
                    suppress_ids=vision_token_ids(model),
                    do_sample=do_sample,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=top_k,
                    min_new_tokens=min_new_tokens,
                )
            )
            continue
        chunk = model_inputs(chunk)
        out = model.generate(
            **chunk,
            do_sample=do_sample,
            num_return_sequences=num_generations if do_sample else 1,
            max_new_tokens=max_new_tokens,
            temperature=temperature if do_sample else None,
            top_p=top_p if do_sample else None,
            top_k=(top_k or None) if do_sample else None,
            eos_token_id=eos,
            pad_token_id=pad,
            suppress_tokens=vision_token_ids(model) or None,
            min_new_tokens=min_new_tokens or None,
        )
        pieces.append(out[:, chunk["input_ids"].shape[1] :])
    ids = cat_right_padded(pieces, pad)
    mask, truncated = completion_mask(ids, eos)
    ids = ids.masked_fill(mask == 0, pad)
    return Completions(ids=ids, mask=mask, truncated=truncated)
