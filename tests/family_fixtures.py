"""The tiny-model fixtures of every family vlmrl builds (tests/conftest.py), for tests parametrised over all of them."""

ALL_FAMILY_FIXTURES = [
    "tiny_qwen25vl",
    "tiny_qwen2vl",
    "tiny_llava",
    "tiny_qwen3vl",
    "tiny_gemma3",
    "tiny_qwen3vl_moe",
    "tiny_qwen35",
    "tiny_qwen35_moe",
    "tiny_llava_onevision",
    "tiny_internvl",
]
