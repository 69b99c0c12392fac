"""The training process carries little beyond torch + transformers + the model: no Trainer utilities or peft pulled in
for convenience (transformers' get_scheduler alone imports peft and ~250 more modules). Measured in fresh processes."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

HEAVY = ("peft", "transformers.trainer", "transformers.optimization", "transformers.trainer_utils", "matplotlib", "datasets")

RUN = """
import json, sys, psutil
from vlmrl.config import load_config
from vlmrl.train import start_run
cfg = load_config(None, ["model.name_or_path={model}", "training.output_dir={out}", "logging.progress_bar=false",
                         "logging.tensorboard=false", "training.max_steps=1"])
start_run(cfg, lambda *_: None)
print(json.dumps({{"rss": psutil.Process().memory_info().rss, "modules": sorted(sys.modules)}}))
"""

BASELINE = """
import json, sys, psutil, torch, transformers
from transformers import AutoModelForImageTextToText, AutoTokenizer
AutoModelForImageTextToText.from_pretrained("{model}")
AutoTokenizer.from_pretrained("{model}")
print(json.dumps({{"rss": psutil.Process().memory_info().rss, "modules": sorted(sys.modules)}}))
"""


def measure(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_process_before_step_one_is_close_to_torch_transformers_and_the_model(tiny_qwen25vl, tmp_path):
    run = measure(RUN.format(model=tiny_qwen25vl, out=tmp_path / "run"))
    base = measure(BASELINE.format(model=tiny_qwen25vl))
    assert [m for m in HEAVY if m in run["modules"]] == []
    extra_mib = (run["rss"] - base["rss"]) / 2**20
    # Measured 2026-11-23 on the 2-core CPU: +13 MiB (data, rewards, optimizer, processor); get_scheduler alone was +2-3 MiB
    # of RSS here but 258 modules. A budget, not a timing: a heavy import (peft, the Trainer) breaks it.
    assert extra_mib < 48, f"{extra_mib:.0f} MiB above torch + transformers + the model"
