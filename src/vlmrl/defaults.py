"""Model-aware defaults: the embedded tiny model gets the settings its demo proved; every other model keeps each
field's own default (TRL-like values for pretrained models: GRPO lr 1e-6, SFT lr 2e-5).

The field defaults are right for a pretrained 3B-7B model and learn nothing on the embedded model (0.7 M random
weights): at lr 1e-6 SFT leaves it at 0% and GRPO sees zero reward in every group. So `load_config` resolves
`model.defaults` once, before the config is built:

- ``auto`` (default): ``tiny`` when the model is the embedded one, else ``pretrained``. The embedded model is
  recognised by name (`embedded:tiny-qwen2.5-vl`) or by the ``vlmrl_tiny`` key that `tiny.default_model_path`
  writes into its config.json (never by a path's name). transformers keeps unknown config.json keys through
  `save_pretrained`, so a model SFT or GRPO trained from the embedded one (``outputs/sft/final``) carries it too.
- ``tiny``: every field in TINY_DEFAULTS that the YAML and the overrides leave unset takes its value there;
  whatever the user wrote wins.
- ``pretrained``: every field keeps its own default.

The resolved choice replaces ``auto`` in the config (so config.yaml records it, with a comment naming the
fields it filled), and `describe` gives the one line the commands log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

EMBEDDED_MODEL = "embedded:tiny-qwen2.5-vl"  # config.py imports it from here (this module imports nothing of vlmrl)
TINY_MARKER = "vlmrl_tiny"  # config.json key written by tiny.default_model_path (its value: the build's name)

# The settings `make demo` runs with (src/vlmrl/demo.py), measured there: after SFT 25% (format learnt, counting at
# chance), after 100 GRPO steps 75% (benchmarks/results/demo_cpu.md); and a GRPO length measured on two data sets
# (benchmarks/results/newcomer_path_cpu_2026-11-23.md). Data sizes are not here: they belong to the task.
TINY_DEFAULTS: dict[str, Any] = {
    # GRPO on 0.7 M random weights: 1e-6 moves nothing in 100 steps; 3e-4 learns counting by step 100 (1e-4 needs ~400).
    "optim.learning_rate": 3e-4,
    # Held-out accuracy by GRPO step at these settings, count task (1,000 rows, embedded bytes): 38% after SFT, 50% at
    # 100, 75% at 200, 100% at 300; colour task: 27% until step 200, 50% at 250, 66% at 300. 300 steps take ~2-4 min.
    "training.max_steps": 300,
    # 8 samples per prompt, 8 prompts per step: with G=4 and 1 prompt per step (the field defaults) most groups of a
    # 25%-accurate model have equal rewards and give no gradient.
    "rollout.num_generations": 8,
    "training.per_device_train_batch_size": 32,
    "training.gradient_accumulation_steps": 2,
    # `<answer>4</answer>` is 3 tokens of the tiny tokenizer (+ EOS), a word it has no merge for up to 7
    # (`<answer>right</answer>`); 32 mostly samples noise after the answer and takes 4x the time.
    "rollout.max_completion_length": 8,
    # 56 x 56 pixels = 4 image tokens after the 2x2 merger: what the tiny vision tower was run on; larger images
    # only cost time on a CPU. Fixed (min = max) so every image gives the same number of tokens.
    "data.min_pixels": 56 * 56,
    "data.max_pixels": 56 * 56,
    # SFT: stage 1 aligns the random projector (20 steps at 3e-3), stage 2 trains everything (25 steps at 1e-3, vision
    # tower included: random weights need it). Short on purpose: the format is learnt, the task is left to GRPO.
    "sft.projector_steps": 20,
    "sft.projector_learning_rate": 3e-3,
    "sft.steps": 25,
    "sft.learning_rate": 1e-3,
    "sft.train_vision_tower": True,
    "sft.batch_size": 32,
}
PROFILES = ("auto", "tiny", "pretrained")


def embedded_reason(name_or_path: Any) -> str | None:
    """Why `name_or_path` is the embedded tiny model (or one trained from it), or None when it is not."""
    if not isinstance(name_or_path, str) or not name_or_path:
        return None
    if name_or_path == EMBEDDED_MODEL:
        return f"model.name_or_path is {EMBEDDED_MODEL}"
    config_json = Path(name_or_path).expanduser() / "config.json"
    try:
        data = json.loads(config_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # no folder yet, or not one vlmrl can read: the model check reports it later
    if isinstance(data, dict) and data.get(TINY_MARKER):
        return f"{config_json} has the {TINY_MARKER!r} key (vlmrl's embedded tiny model, or a model trained from it)"
    return None


def apply_model_defaults(tree: dict[str, dict[str, Any]]) -> list[str]:
    """Resolve tree["model"]["defaults"] in place (auto -> tiny or pretrained) and, for tiny, fill every
    TINY_DEFAULTS field the tree does not set. Returns the `section.field` keys filled (empty for pretrained).
    An unknown model.defaults value is left for the config's own type check to report."""
    model = tree.setdefault("model", {})
    choice = model.get("defaults", "auto")
    if choice == "auto":
        choice = "tiny" if embedded_reason(model.get("name_or_path", EMBEDDED_MODEL)) else "pretrained"
    model["defaults"] = choice
    if choice != "tiny":
        return []
    filled = []
    for key, value in TINY_DEFAULTS.items():
        section, name = key.split(".")
        if name not in tree.get(section, {}):
            tree.setdefault(section, {})[name] = value
            filled.append(key)
    return filled


def _value_of(cfg, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def tiny_fields_in_use(cfg) -> list[str]:
    """`key=value` for each TINY_DEFAULTS field whose value in `cfg` is the tiny one (those the profile filled,
    and any the user set to the same value)."""
    return [f"{key}={_value_of(cfg, key)}" for key, value in TINY_DEFAULTS.items() if _value_of(cfg, key) == value]


def describe(cfg) -> str:
    """The one line a command logs: which defaults the fields left unset got, and why."""
    m = cfg.model
    if m.defaults == "tiny":
        why = embedded_reason(m.name_or_path) or "model.defaults=tiny"
        return (
            f"model defaults: tiny ({why}): fields you leave unset take the embedded model's demo-proven values "
            f"({', '.join(tiny_fields_in_use(cfg)) or 'none: you set them all'}); model.defaults=pretrained keeps each field's own"
        )
    why = "model.defaults=pretrained" if embedded_reason(m.name_or_path) else f"{m.name_or_path} is not the embedded tiny model"
    return (
        f"model defaults: pretrained ({why}): fields you leave unset keep their own defaults "
        f"(optim.learning_rate={cfg.optim.learning_rate:g}, sft.learning_rate={cfg.sft.learning_rate:g}, "
        f"rollout.max_completion_length={cfg.rollout.max_completion_length})"
    )


def config_header(cfg) -> str:
    """Comment lines for the top of a saved config.yaml: the resolved defaults and the fields at the tiny values."""
    if cfg.model.defaults != "tiny":
        return ""
    return (
        "# model.defaults: tiny -- the embedded tiny model's demo-proven values (vlmrl/model_defaults.py) filled the\n"
        f"# fields the run's YAML and overrides left unset; at those values: {', '.join(tiny_fields_in_use(cfg))}\n"
    )
