"""`Family`: what vlmrl knows about one VLM family, in one value (see docs/families.md, "Adding a family").

Every fast path re-implements part of a family's forward, so each is switched on per family, only where its
equivalence tests exist (values and gradients against the naive path, greedy rollout equal to HF generate). A model
type no Family names gets `GENERIC`: the naive path, which is each model's own forward (same results, more work).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

NO_FAST_PATH = "no fast path is implemented for this model type"


@dataclass(frozen=True)
class Family:
    """One family: its config.model_type values and every per-family choice vlmrl makes (all off by default)."""

    name: str  # the family's name in docs and logs
    model_types: tuple[str, ...]  # config.model_type values it covers (all behave the same here)
    tiny: tuple[str, ...] = ()  # its `vlmrl tiny --family` names (keys of tiny_models.tiny_families.BUILDERS)
    fallback_reason: str = NO_FAST_PATH  # logged once when it takes the naive path

    # Vision features: how the grouped path (one vision encode per prompt) computes and places them.
    grouped: str | None = None  # the grouped path's name for it (logprobs.grouped_family); None: naive path only
    grouped_needs: tuple[str, ...] = ("vision_tower",)  # attributes of model.model the grouped path relies on
    encoder_outputs: bool = False  # shared features handed to the model's own forward as mm_encoder_outputs
    # Positions: explicit M-RoPE [3, N, L] position ids from the model's own get_rope_index (else default positions).
    mrope: bool = False

    # Fast paths beyond grouped vision.
    prefix_videos: bool = False  # the shared prefix takes prompts with videos
    continuous: bool = False  # rollout.engine=continuous reproduces its decode step
    multiturn: bool = False  # multi-turn tool rollouts (a plain KV cache)
    sequence_parallel: bool = False  # Ulysses sequence parallelism (engine/ulysses.py) is tested on it
    # The naive rollout repeats each prompt row G times itself: HF generate's num_return_sequences does not repeat
    # this family's image features (Llama 4 in transformers 5.23)
    repeat_rows_for_generate: bool = False

    # Processor quirks.
    dynamic_resolution: bool = False  # Qwen-VL towers: patches per grid_thw; QwenImageProcessor when AutoProcessor fails
    standin_processor: str | None = None  # "module:function" loading an image-only stand-in when AutoProcessor fails
    video: bool = False  # vlmrl feeds its processor video rows
    timestamped_video: bool = False  # the processor writes `<t seconds>` before each temporal patch
    video_seconds_per_patch: bool = False  # the processor takes second_per_grid_ts (Qwen2.5-VL)

    # Planner geometry (plan/hf.py, plan/geometry.py, plan/trace.py).
    plan_video: bool = False  # the planner models its video rows (temporal patches, checked against the trace)
    vision_width_key: str | None = None  # vision config field holding the tower's width, when not hidden_size
    vision_mlp_gated: bool | None = None  # the tower's MLP kind when the planner cannot tell (False: fc1 -> act -> fc2)
    vision_windows: bool = False  # windowed vision attention (Qwen2.5-VL window_index)
    vision_interpolated_positions: bool = False  # learned vision positions resampled to each grid (Qwen3-VL)
    tiling: str | None = None  # "anyres" (LLaVA-OneVision) or "dynamic" (InternVL tiles)
    norms_per_layer: int | None = None  # decoder norms per layer when not the usual 2 (Gemma 3: 4)
    linear_attention: bool = False  # hybrid decoder with Gated DeltaNet layers (Qwen3.5)
    # MoE routing: text and vision tokens go to separate expert sets (ERNIE-4.5-VL), each router seeing only its own
    # tokens; vlmrl's load-balancing loss and routing replay assume one router per layer over every token.
    modality_experts: bool = False

    def tiny_builder(self, name: str | None = None) -> Callable:
        """Its tiny offline builder (`name`: one of self.tiny, default the first)."""
        from vlmrl.tiny_models.tiny_families import BUILDERS

        return BUILDERS[name or self.tiny[0]]

    def load_standin_processor(self, path: str, tokenizer, chat_template: str | None):
        """The image-only stand-in processor of a model folder (`standin_processor`)."""
        module, function = self.standin_processor.split(":")
        return getattr(importlib.import_module(module), function)(path, tokenizer, chat_template)


# Any model type transformers loads that no Family names: the naive path everywhere.
GENERIC = Family(name="generic", model_types=())
