"""Compare each image-only stand-in processor with the real transformers processor, on a machine WITH torchvision
(the stand-ins exist because this project's CPU torch has none): builds every `vlmrl tiny` family whose Family names a
stand-in, loads the folder with `AutoProcessor` (the real class the folder names) and with the stand-in, and prints,
per output key, whether the two agree (ids exactly; pixels: max abs difference, PIL vs torchvision resampling).

    python scripts/check_standins.py [FAMILY ...]     # default: every family with a stand-in
"""

import json
import sys
import tempfile

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor, AutoTokenizer

from vlmrl.families import FAMILIES, family_of
from vlmrl.tiny_models.tiny_families import BUILDERS
from vlmrl.models.processing import build_row_prompt


def compare(name: str, images: list) -> None:
    folder = BUILDERS[name](tempfile.mkdtemp())
    model_type = json.loads((folder / "config.json").read_text())["model_type"]
    try:
        real = AutoProcessor.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # reported, not raised: the point is the table
        print(f"{name}: the real processor does not load: {type(e).__name__}: {str(e)[:160]}")
        return
    tokenizer = AutoTokenizer.from_pretrained(folder)
    standin = family_of(model_type).load_standin_processor(str(folder), tokenizer, (folder / "chat_template.jinja").read_text())
    texts = [build_row_prompt(standin, {"problem": "A <image> B <image>"}, 2), build_row_prompt(standin, {"problem": "C"}, 1)]
    nested = type(standin).__name__.startswith(("Gemma", "Idefics"))
    picked = [[images[0], images[1]], [images[3]]] if nested else [images[0], images[1], images[3]]
    try:
        a = real(text=texts, images=picked, return_tensors="pt", padding=True)
    except Exception as e:
        print(f"{name}: the real processor refuses the prompts: {type(e).__name__}: {str(e)[:160]}")
        return
    b = standin(text=texts, images=picked, return_tensors="pt", padding=True)
    print(f"{name}: real {type(real).__name__}, stand-in {type(standin).__name__}; keys only in the stand-in: {sorted(set(b) - set(a))}")
    for key in a:
        x, y = a[key], b.get(key)
        if not torch.is_tensor(x) or y is None:
            print(f"  {key}: {'missing in the stand-in' if y is None else 'not a tensor'}")
        elif x.shape != y.shape:
            print(f"  {key}: shapes differ {tuple(x.shape)} vs {tuple(y.shape)}")
        else:
            print(f"  {key}: {'equal' if torch.equal(x, y) else f'max abs diff {(x.float() - y.float()).abs().max().item():.4g}'}")


if __name__ == "__main__":
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in [(56, 56), (120, 300), (40, 48), (333, 97)]]
    names = sys.argv[1:] or [n for f in FAMILIES if f.standin_processor for n in f.tiny]
    for name in names:
        compare(name, images)
