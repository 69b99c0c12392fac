"""vlmrl: GRPO and SFT for vision-language models."""

__version__ = "0.1.0"
