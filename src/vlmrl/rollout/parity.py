"""Rollout/training parity of a sampler that builds its own prompts (vLLM), checked on every sample; pure functions.

vLLM is given the chat text and the raw images and expands every image placeholder itself; the trainer scores the
completions against the prompt its own processor expanded. When the two differ (a prompt whose image tokens were
already expanded gets expanded again, other resize bounds, another processor version) the completions were sampled
from one prompt and trained on another, silently. `prompt_mismatch` names the first difference of one row.
"""

from __future__ import annotations

import torch


class RolloutParityError(RuntimeError):
    """The sampler's prompt of a row is not the trainer's, or its weights are not the trainer's; one line."""


def prompt_mismatch(sampler_ids: list[int], trainer_ids: list[int], vision_ids: dict[str, int]) -> str | None:
    """None when the two prompts are the same token ids; else what differs, first the count of each vision token
    (`vision_ids`: name -> id, e.g. {"image": 151655}), then the first position that differs."""
    if sampler_ids == trainer_ids:
        return None
    for name, token in vision_ids.items():
        a, b = sampler_ids.count(token), trainer_ids.count(token)
        if a != b:
            return f"vLLM's prompt has {a} {name} tokens, the trainer's processor built {b}"
    first = next((i for i, (a, b) in enumerate(zip(sampler_ids, trainer_ids)) if a != b), min(len(sampler_ids), len(trainer_ids)))
    return (
        f"vLLM's prompt ({len(sampler_ids)} tokens) differs from the trainer's ({len(trainer_ids)} tokens) from position {first} "
        f"(vLLM {sampler_ids[first : first + 3]}, trainer {trainer_ids[first : first + 3]})"
    )


def check_prompts(sampler_prompts: list[list[int]], trainer_batch: dict, vision_ids: dict[str, int], row_names: list[str]) -> None:
    """Raise RolloutParityError naming the first row whose sampler prompt ids differ from the trainer's.
    trainer_batch: input_ids / attention_mask [P, L] (left padded); sampler_prompts and row_names: P each."""
    ids, mask = trainer_batch["input_ids"], trainer_batch["attention_mask"].bool()
    for i, sampled in enumerate(sampler_prompts):
        problem = prompt_mismatch(list(sampled), ids[i][mask[i]].tolist(), vision_ids)
        if problem is not None:
            raise RolloutParityError(
                f"{row_names[i]}: {problem}; the completions would be trained on another prompt than the one they were sampled from"
            )


def probe_mismatch(sampler_logps: torch.Tensor, trainer_logps: torch.Tensor, tolerance: float) -> str | None:
    """None when the two [T] log-prob vectors of the probe sequence agree within `tolerance`; else what differs."""
    diff = (sampler_logps.double() - trainer_logps.double()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst <= tolerance:
        return None
    return (
        f"after the weight push, vLLM's log-probs of the probe sequence differ from the trainer's by up to {worst:.3g} "
        f"(tolerance {tolerance:g}): vLLM is not sampling with the trained weights"
    )
