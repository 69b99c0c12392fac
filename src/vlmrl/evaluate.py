"""Held-out evaluation: greedy decoding, reward means, accuracy / mean IoU."""

from __future__ import annotations

import torch

from .config import Config
from .rollout import generate
from .runtime import encode_rows, score_rollout


def evaluate(model, processor, rows: list[dict], cfg: Config, reward_funcs: dict, device: torch.device) -> dict[str, float]:
    """Greedy completions for `rows`; returns `eval/<reward>` means (e.g. eval/accuracy, eval/iou) and
    eval/reward (the unweighted mean of all rewards per sample, then over samples)."""
    from .processing import decode

    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    lengths = []
    bs = cfg.training.eval_batch_size
    for start in range(0, len(rows), bs):
        chunk = rows[start : start + bs]
        prompts = encode_rows(processor, chunk, cfg, device)
        comp = generate(model, processor.tokenizer, prompts, num_generations=1, do_sample=False,
                        max_new_tokens=cfg.rollout.max_completion_length)
        texts = decode(processor, comp.ids)
        _, per_reward = score_rollout(cfg, reward_funcs, {k: 1.0 for k in reward_funcs}, chunk, 1, texts, comp)
        for name, values in per_reward.items():
            valid = [v for v in values if v is not None]
            sums[name] = sums.get(name, 0.0) + sum(valid)
            counts[name] = counts.get(name, 0) + len(valid)
        lengths += comp.lengths.tolist()
    model.train(was_training)
    out = {f"eval/{k}": sums[k] / counts[k] for k in sums if counts[k]}
    out["eval/mean_length"] = sum(lengths) / max(1, len(lengths))
    out["eval/num_samples"] = float(len(rows))
    return out
