"""The planner's multi-turn terms (issue 28 part 3): turns x tool images, by hand on a small architecture."""

import dataclasses

import pytest

from vlmrl.plan.coefficients import vision_block_bytes
from vlmrl.plan.estimate import plan
from vlmrl.plan.geometry import micro_batch, multiturn_completion_tokens, tool_images
from vlmrl.plan.spec import ModelSpec, PlanError, Workload
from vlmrl.plan.terms import activations_vision, batch_inputs, generation_temporaries, kv_cache, tool_image_encode, tool_image_inputs

pytestmark = pytest.mark.unit

# Patch 14, merge 2, temporal 2: a 56x56 image (max_pixels 3136) is 16 patches, 4 LLM tokens.
SPEC = ModelSpec(
    name="hand", family="qwen2_5_vl", total_params=1_000_000, vision_params=200_000, projector_params=10_000, embed_params=100_000,
    lm_head_params=0, hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, head_dim=16, vocab=1000, v_hidden=32,
    v_intermediate=64, v_layers=2, v_heads=2, patch_size=14, merge_size=2, temporal_patch=2,
)  # fmt: skip
SINGLE = Workload(max_pixels=3136, completion_tokens=64, num_generations=4, prompts_per_step=2, micro_batch=4)
MULTI = dataclasses.replace(SINGLE, tool_turns=2, tool_images_per_turn=1, tool_text_tokens=20, max_images=8)


def test_tool_images_and_the_scored_sequence_by_hand():
    assert tool_images(SINGLE) == 0 and multiturn_completion_tokens(SPEC, SINGLE) == 64
    # 3 model turns of 64, 2 tool turns of 20 text tokens + one 4-token image each.
    assert tool_images(MULTI) == 2
    assert multiturn_completion_tokens(SPEC, MULTI) == 3 * 64 + 2 * 20 + 2 * 4 == 240
    # The image budget counts the row's own image: 2 images per rollout leave one for the tools.
    assert tool_images(dataclasses.replace(MULTI, max_images=2)) == 1
    assert multiturn_completion_tokens(SPEC, dataclasses.replace(MULTI, max_images=2)) == 236
    # tools.max_total_tokens caps the sequence.
    assert multiturn_completion_tokens(SPEC, dataclasses.replace(MULTI, max_total_tokens=200)) == 200
    mb = micro_batch(SPEC, MULTI)
    assert (mb.C, mb.tool_patches) == (240, 32)
    assert mb.vision_patches == micro_batch(SPEC, SINGLE).vision_patches + 4 * 32  # every row's own tool images


def test_kv_cache_vision_and_pixel_terms_grow_with_turns_and_images():
    ms, mm = micro_batch(SPEC, SINGLE), micro_batch(SPEC, MULTI)
    rows = 2 * 4  # the loop engine holds every row of the step's generate call
    per_token = 2 * 4 * 2 * 16 * 2  # k and v, 4 layers, 2 KV heads, head dim 16, bf16
    assert kv_cache(SPEC, MULTI, mm) - kv_cache(SPEC, SINGLE, ms) == rows * (240 - 64) * per_token
    # Float32 pixel values of 8 rows x 2 tool images x 16 patches of 3 x 2 x 14 x 14 values.
    assert tool_image_inputs(SPEC, MULTI, mm) == 8 * 32 * 3 * 2 * 14 * 14 * 4 and tool_image_inputs(SPEC, SINGLE, ms) == 0
    # The update encodes each row's tool images (4 rows x 32 patches) through both vision blocks.
    assert activations_vision(SPEC, MULTI, mm) - activations_vision(SPEC, SINGLE, ms) == 2 * 4 * 32 * vision_block_bytes(SPEC, 2)
    # The rollout encodes one tool turn's image per held row: 8 x 16 patches x bf16 x (6 x 32 + 3 x 64).
    assert tool_image_encode(SPEC, MULTI, mm) == 8 * 16 * 2 * (6 * 32 + 3 * 64)
    assert generation_temporaries(SPEC, MULTI, mm) >= tool_image_encode(SPEC, MULTI, mm)
    # batch_inputs leaves the tool images to their own term (no double count); its rollout buffers grow with C.
    assert batch_inputs(SPEC, MULTI, mm) - batch_inputs(SPEC, SINGLE, ms) == 8 * (240 - 64) * (8 + 4)


def test_plan_of_a_multi_turn_step_and_refusals():
    single, multi = plan(SPEC, SINGLE), plan(SPEC, MULTI)
    assert multi.terms["tool_image_inputs"] > 0 and single.terms["tool_image_inputs"] == 0
    assert multi.phases["rollout"] - single.phases["rollout"] >= kv_cache(SPEC, MULTI, micro_batch(SPEC, MULTI)) - kv_cache(
        SPEC, SINGLE, micro_batch(SPEC, SINGLE)
    )
    assert multi.phases["update"] > single.phases["update"]
    with pytest.raises(PlanError, match="tool_turns"):
        plan(SPEC, dataclasses.replace(MULTI, tool_turns=-1))


def test_workload_from_config_reads_the_tools_section():
    from vlmrl.config import load_config
    from vlmrl.plan.config import workload_from_config

    single = workload_from_config(load_config(None, ["rollout.max_completion_length=48"]))
    assert (single.tool_turns, single.completion_tokens) == (0, 48)
    cfg = load_config(
        None,
        [
            "tools.tools=[zoom]",
            "rollout.engine=continuous",
            "tools.max_turns=3",
            "tools.max_turn_tokens=40",
            "tools.max_images=2",
            "tools.max_total_tokens=300",
        ],
    )
    w = workload_from_config(cfg)
    assert (w.tool_turns, w.completion_tokens, w.max_images, w.max_total_tokens) == (2, 40, 2, 300)
    # 3 turns of 40 + 2 tool turns of 32 text tokens + 1 image (the budget of 2 holds the row's own) at the pixel cap.
    assert multiturn_completion_tokens(SPEC, dataclasses.replace(w, max_pixels=3136)) == 3 * 40 + 2 * 32 + 4
