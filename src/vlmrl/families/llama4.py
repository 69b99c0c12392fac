"""Llama 4 (Scout, Maverick): ViT with 2-D RoPE on fixed-size tiles, pixel-shuffle adapter, Llama 4 MoE decoder
(routed top-1 experts plus a shared expert, chunked-attention RoPE layers and NoPE layers). Its image processor is
torchvision-only, so a PIL stand-in (images that fit one tile) feeds transformers' Llama4Processor here.

Naive path only: chunked attention depends on absolute positions (left padding shifts the chunks per row), and the
tiles of each image (a global tile after the grid) have no grouped / shared-prefix equality test yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="llama4",
    model_types=("llama4",),
    tiny=("llama4",),
    fallback_reason="Llama 4's chunked attention and image tiles have no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin_2026b:load_llama4_processor",
    # transformers 5.23 repeats image features for num_return_sequences only from a pooler_output, which Llama 4's
    # vision model does not return: its generate fails on a placeholder/feature count mismatch.
    repeat_rows_for_generate=True,
)
