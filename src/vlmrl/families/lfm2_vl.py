"""LFM2-VL (Liquid AI): SigLIP2 NaFlex tower (any aspect ratio, patches padded per image), pixel-unshuffle projector,
LFM2 hybrid decoder (short convolutions and attention layers). Its image processor has a torchvision backend only,
so a PIL stand-in (images not split into tiles) feeds transformers' Lfm2VlProcessor here.

Naive path only: the hybrid decoder's convolution state would have to be carried with the KV cache per row for the
shared prefix, and the padded NaFlex patches per image for grouped vision; neither has its equality test yet."""

from vlmrl.families.base import Family

FAMILY = Family(
    name="lfm2-vl",
    model_types=("lfm2_vl",),
    tiny=("lfm2-vl",),
    fallback_reason="LFM2-VL's convolution state and NaFlex patches have no grouped / shared-prefix equality test yet",
    standin_processor="vlmrl.processors.standin_2026b:load_lfm2_vl_processor",
)
