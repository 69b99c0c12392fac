"""`vlmrl train rollout.backend=vllm` end to end against the real vLLM CPU build (`make test-vllm`); skipped with the
reason where vllm is not installed."""

import importlib.util
import json

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed in this Python: `make test-vllm` runs these in .venv-vllm"
    ),
]

# On CPU the share is of the first NUMA node's memory and counts this process's own (the trainer, the test session).
GPU_SHARE = "0.3"


def test_grpo_run_with_the_vllm_backend(tmp_path):
    """2 steps through the CLI with TRL's names; the mismatch and sync metrics are logged every step."""
    from vlmrl.cli import main
    from vlmrl.fixtures.tiny import build_tiny_qwen25vl

    folder = build_tiny_qwen25vl(tmp_path / "model")
    args = [
        f"model.name_or_path={folder}",
        f"training.output_dir={tmp_path / 'run'}",
        "data.task=count",
        "data.task_train_size=16",
        "data.task_test_size=4",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "use_vllm=true",  # TRL's names
        f"vllm_gpu_memory_utilization={GPU_SHARE}",
        "rollout.num_generations=4",
        "rollout.max_completion_length=8",
        "training.per_device_train_batch_size=8",
        "training.gradient_accumulation_steps=1",
        "training.max_steps=2",
        "training.eval_steps=0",
        "logging.progress_bar=false",
    ]
    assert main(["train", *args]) == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["mismatch/max_abs_logp_diff"] < 1e-4 and m["vllm/probe_max_abs_logp_diff"] < 1e-4 and m["vllm/sync_seconds"] > 0
