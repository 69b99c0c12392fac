"""Which VLM families take which fast path, and the one-time log line when one falls back to the naive path.

The fast paths (grouped vision: one vision encode per prompt; shared prefix: one prefill per prompt)
re-implement part of each family's forward, so they are enabled per config.model_type, only for the
families whose equivalence tests (values and gradients vs the naive path, greedy rollout == HF generate)
exist. Every other family runs the naive path, which is each model's own forward: same results, more work.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vlmrl.models.families")

# model_type -> why it takes the naive path (families not listed: "no fast path implemented for it").
FALLBACK_REASONS = {
    "smolvlm": "SmolVLM's image splitting is not equivalence-tested yet",
    "idefics3": "Idefics3's image splitting is not equivalence-tested yet",
}
_logged: set[str] = set()


def fallback_reason(model_type: str | None) -> str:
    return FALLBACK_REASONS.get(model_type or "", "no fast path is implemented for this model type")


def log_fallback(model_type: str | None, reason: str | None = None) -> None:
    """Log once per model type that grouped vision and the shared prefix fall back to the naive path, and why."""
    key = model_type or "?"
    if key in _logged:
        return
    _logged.add(key)
    logger.warning("model_type %s: grouped vision and shared prefix off, naive path (%s)", key, reason or fallback_reason(model_type))
