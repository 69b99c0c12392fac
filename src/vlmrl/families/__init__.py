"""The family registry: one `Family` per VLM family (a file in this package), the generic fallback for any other
model type, and the one-time log line when a model falls back to the naive path.

Every model-type choice in vlmrl reads this registry (a test fails on a model-type string outside this package);
adding a family is a file here plus one line in FAMILIES (docs/families.md, "Adding a family").
"""

from __future__ import annotations

import logging

from vlmrl.families import (
    ernie4_5_vl,
    gemma3,
    gemma4,
    glm4v,
    glm5_next,
    idefics3,
    internvl,
    kimi_k25,
    lfm2_vl,
    llama4,
    llava,
    llava_onevision,
    minicpmv,
    mistral3,
    molmo2,
    qwen2_5_vl,
    qwen2_vl,
    qwen3_5,
    qwen3_vl,
    smolvlm,
)
from vlmrl.families.base import GENERIC, NO_FAST_PATH, Family

__all__ = ["FAMILIES", "GENERIC", "Family", "family_of", "grouped_labels", "log_fallback", "model_types"]

# In this order: lists built from the registry (messages, docs) keep it.
FAMILIES: tuple[Family, ...] = (
    qwen2_vl.FAMILY,
    qwen2_5_vl.FAMILY,
    qwen3_vl.FAMILY,
    qwen3_5.FAMILY,
    gemma3.FAMILY,
    llava_onevision.FAMILY,
    internvl.FAMILY,
    smolvlm.FAMILY,
    idefics3.FAMILY,
    llava.FAMILY,
    mistral3.FAMILY,
    gemma4.FAMILY,
    glm4v.FAMILY,
    ernie4_5_vl.FAMILY,
    minicpmv.FAMILY,
    kimi_k25.FAMILY,
    molmo2.FAMILY,
    lfm2_vl.FAMILY,
    llama4.FAMILY,
    glm5_next.FAMILY,
)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
if len(_BY_TYPE) != sum(len(f.model_types) for f in FAMILIES):
    raise RuntimeError("vlmrl.families: a model type is claimed by two families")


def family_of(model_type: str | None) -> Family:
    """The Family of a config.model_type; GENERIC (naive path everywhere) for one no family names."""
    return _BY_TYPE.get(model_type or "", GENERIC)


def model_types(feature: str | None = None) -> tuple[str, ...]:
    """Model types of every family, or of those whose `feature` attribute is set (e.g. "continuous"), registry order."""
    return tuple(t for f in FAMILIES if feature is None or getattr(f, feature) for t in f.model_types)


def grouped_labels(feature: str) -> tuple[str, ...]:
    """The grouped-path names (Family.grouped) of the families whose `feature` attribute is set, each once."""
    return tuple(dict.fromkeys(f.grouped for f in FAMILIES if f.grouped and getattr(f, feature)))


logger = logging.getLogger("vlmrl.families")
_logged: set[str] = set()


def fallback_reason(model_type: str | None) -> str:
    return family_of(model_type).fallback_reason or NO_FAST_PATH


def log_fallback(model_type: str | None, reason: str | None = None) -> None:
    """Log once per model type that grouped vision and the shared prefix fall back to the naive path, and why."""
    key = model_type or "?"
    if key in _logged:
        return
    _logged.add(key)
    logger.warning("model_type %s: grouped vision and shared prefix off, naive path (%s)", key, reason or fallback_reason(model_type))
