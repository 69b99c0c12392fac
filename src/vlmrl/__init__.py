"""vlmrl: GRPO and SFT for vision-language models."""

from vlmrl._torchvision import make_torchvision_importable

__version__ = "0.1.0"

make_torchvision_importable()  # before anything imports transformers (the vLLM venv's torchvision: _torchvision.py)
