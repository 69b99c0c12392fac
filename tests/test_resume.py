"""Checkpoint/resume on the real loop: exact resume, refusals, save failures, graceful stop."""

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.checkpoints.files import CheckpointError, CheckpointSaveError, list_checkpoints, verify_checkpoint
from vlmrl.config import load_config
from vlmrl.data.tasks import make_count_task
from vlmrl.train import train

LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=12, n_test=0, seed=0, image_size=56)


def overrides(model, data, out, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        "data.eval_path=",
        f"training.output_dir={out}",
        "training.max_steps=4",
        "rollout.num_generations=4",
        "training.per_device_train_batch_size=4",
        "rollout.generation_batch_size=8",
        "rollout.max_completion_length=5",
        "optim.learning_rate=1e-3",
        "optim.lr_scheduler_type=cosine",
        "optim.warmup_ratio=0.2",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        f"algorithm.reward_funcs=['{LENGTH_REWARD}']",
        *extra,
    ]


def losses(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["reward"]) for r in rows}


def final_weights(out):
    return load_file(out / "final" / "model.safetensors")


VARIANTS = {
    "plain": [],
    "iterations+accumulation+kl": [
        "algorithm.num_iterations=2",
        "training.per_device_train_batch_size=2",
        "training.gradient_accumulation_steps=2",
        "algorithm.beta=0.05",
    ],
    "lora+kl": ["model.use_lora=true", "model.lora_r=4", "algorithm.beta=0.05", "optim.learning_rate=1e-2"],
}


# (variant, family): every variant on Qwen2.5-VL; full-weight + KL and LoRA + KL on the newer families.
# The full-weight ones on the newer families take 10-20 s each here: slow tier.
RESUME_CASES = [(v, "tiny_qwen25vl") for v in VARIANTS] + [
    pytest.param("iterations+accumulation+kl", "tiny_qwen3vl", marks=pytest.mark.slow),
    ("lora+kl", "tiny_qwen3vl"),
    pytest.param("iterations+accumulation+kl", "tiny_gemma3", marks=pytest.mark.slow),
    ("lora+kl", "tiny_gemma3"),
    ("lora+kl", "tiny_qwen3vl_moe"),
    ("lora+kl", "tiny_qwen35"),
    ("lora+kl", "tiny_qwen35_moe"),
    ("lora+kl", "tiny_llava_onevision"),
    ("lora+kl", "tiny_internvl"),
    ("lora+kl", "tiny_qwen2vl"),
    pytest.param("lora+kl", "tiny_llava", marks=pytest.mark.slow),  # 15-30 s here (336 px CLIP tower)
]


@pytest.mark.parametrize("variant,family", RESUME_CASES)
def test_stop_and_resume_is_bit_exact(variant, family, request, data, tmp_path):
    extra = VARIANTS[variant]
    model_path = request.getfixturevalue(family)
    straight = tmp_path / "straight"
    train(load_config(None, overrides(model_path, data, straight, *extra)))

    resumed = tmp_path / "resumed"
    cfg = load_config(None, overrides(model_path, data, resumed, *extra))
    train(cfg, stop_after=2)  # a preemption after step 2: checkpoint-2, no final model
    assert [p.name for p in list_checkpoints(resumed)] == ["checkpoint-2"]
    assert not (resumed / "final").exists()
    lines = []
    train(cfg, log=lines.append)
    assert any("resumed from" in line and "checkpoint-2" in line and "step 2" in line for line in lines), lines

    assert losses(resumed) == losses(straight)  # same per-step losses and rewards, bit for bit
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_breaking_config_change_is_refused_then_forced(tiny_qwen25vl, data, tmp_path):
    out = tmp_path / "run"
    train(load_config(None, overrides(tiny_qwen25vl, data, out)), stop_after=1)
    with pytest.raises(CheckpointError, match=r"rollout.max_completion_length: 5 -> 6"):
        train(load_config(None, overrides(tiny_qwen25vl, data, out, "rollout.max_completion_length=6")))
    lines = []
    train(
        load_config(
            None, overrides(tiny_qwen25vl, data, out, "rollout.max_completion_length=6", "training.resume_force=true", "logging.log_completions=1")
        ),
        log=lines.append,
    )
    assert any("max_completion_length" in line for line in lines)


def test_weights_only_checkpoint_never_pretends_to_resume(tiny_qwen25vl, data, tmp_path):
    out = tmp_path / "run"
    train(load_config(None, overrides(tiny_qwen25vl, data, out, "training.save_only_model=true")), stop_after=2)
    with pytest.raises(CheckpointError, match="weights only"):
        train(load_config(None, overrides(tiny_qwen25vl, data, out, "training.save_only_model=true")))
    lines = []
    train(
        load_config(None, overrides(tiny_qwen25vl, data, out, "training.save_only_model=true", "training.resume_weights_only=true")), log=lines.append
    )
    assert any("new schedule" in line for line in lines)


def test_corrupt_newest_checkpoint_falls_back(tiny_qwen25vl, data, tmp_path):
    out = tmp_path / "run"
    cfg = load_config(None, overrides(tiny_qwen25vl, data, out, "training.save_steps=1"))
    train(cfg, stop_after=2)
    newest = out / "checkpoint-2" / "optimizer.pt"
    raw = bytearray(newest.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    newest.write_bytes(bytes(raw))
    lines = []
    train(cfg, log=lines.append)
    assert any("checkpoint-2" in line for line in lines)  # named as skipped
    assert any("resumed from" in line and "checkpoint-1" in line for line in lines)


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_save_failure(policy, tiny_qwen25vl, data, tmp_path, monkeypatch):
    import vlmrl.checkpoints.state as train_mod

    out = tmp_path / "run"
    cfg = load_config(None, overrides(tiny_qwen25vl, data, out, "training.save_steps=1", f"training.on_save_error={policy}"))
    real = train_mod.save_trainable_weights
    calls = {"n": 0}

    def flaky(model, folder):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(folder))
        real(model, folder)

    monkeypatch.setattr(train_mod, "save_trainable_weights", flaky)
    if policy == "stop":
        with pytest.raises(CheckpointSaveError, match="checkpoint-2"):
            train(cfg)
        assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1"]
    else:
        train(cfg)
        assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-3", "checkpoint-4"]
    assert verify_checkpoint(out / "checkpoint-1")[0]
    assert not list(out.glob(".tmp-*"))


def _cli(model, data, out, *extra):
    return [sys.executable, "-m", "vlmrl", "train", *overrides(model, data, out, *extra)]


def test_sigterm_finishes_step_saves_and_exits_zero(tiny_qwen25vl, data, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        _cli(tiny_qwen25vl, data, out, "training.max_steps=1000"), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    seen = []
    for line in proc.stdout:  # ready when the first step is logged (a printed line, not a polled file)
        seen.append(line)
        if line.startswith("GRPO step 1/"):
            break
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    text = "".join(seen) + rest
    assert proc.returncode == 0, text
    assert "stopped by SIGTERM" in text and "resume" in text
    (ckpt,) = list_checkpoints(out)
    assert verify_checkpoint(ckpt)[0]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert ckpt.name == f"checkpoint-{steps[-1]}"


def test_injected_oom_halves_micro_batch_and_matches_smaller_config(tiny_qwen25vl, data, tmp_path, monkeypatch):
    """An OOM in any phase redoes the same work in halves: the run equals one configured small from the start,
    and no gradient is counted twice."""
    import vlmrl.engine.oom as oom

    extra = ["training.per_device_train_batch_size=4", "training.gradient_accumulation_steps=2", "algorithm.num_iterations=2", "algorithm.beta=0.05"]
    small = tmp_path / "small"
    train(
        load_config(
            None,
            overrides(
                tiny_qwen25vl,
                data,
                small,
                *extra[1:],
                "training.per_device_train_batch_size=2",
                "training.gradient_accumulation_steps=4",
                "memory.generation_prompts_per_call=1",
            ),
        )
    )

    monkeypatch.setattr(oom, "INJECT_OOM_ABOVE", {"rollout": 1, "scoring": 2, "update": 2})
    lines = []
    recovered = tmp_path / "recovered"
    train(load_config(None, overrides(tiny_qwen25vl, data, recovered, *extra)), log=lines.append)
    rows = [json.loads(x) for x in (recovered / "metrics.jsonl").read_text().splitlines()]
    assert all(r["micro_batch_size"] == 2 for r in rows)
    # rollout 2 -> 1 prompts per call; scoring 4 -> 2 rows (the update then starts at 2 and fits)
    a, b = losses(recovered), losses(small)
    assert a.keys() == b.keys()
    for step in a:
        assert a[step][1] == b[step][1]  # same rollout -> same rewards
        assert a[step][0] == pytest.approx(b[step][0], rel=1e-5, abs=1e-7)
    wa, wb = final_weights(recovered), final_weights(small)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-6) for k in wa)


def test_oom_at_size_one_names_the_knobs(tiny_qwen25vl, data, tmp_path, monkeypatch):
    import vlmrl.engine.oom as oom

    monkeypatch.setattr(oom, "INJECT_OOM_ABOVE", {"update": 0})
    with pytest.raises(oom.OutOfMemoryGaveUp, match="gradient_checkpointing"):
        train(load_config(None, overrides(tiny_qwen25vl, data, tmp_path / "run")))


def test_oom_after_a_backward_discards_partial_gradients(tiny_qwen25vl, data, tmp_path, monkeypatch):
    import vlmrl.engine.oom as oom

    small = tmp_path / "small"
    train(
        load_config(None, overrides(tiny_qwen25vl, data, small, "training.per_device_train_batch_size=2", "training.gradient_accumulation_steps=4"))
    )
    # Micro-batch 1 (4 rows) runs forward+backward, micro-batch 2 hits the OOM: its step is redone at 2 rows.
    monkeypatch.setattr(oom, "INJECT_OOM_ON_CALL", {"update": 2})
    monkeypatch.setattr(oom, "_calls", {})
    recovered = tmp_path / "recovered"
    train(
        load_config(
            None, overrides(tiny_qwen25vl, data, recovered, "training.per_device_train_batch_size=4", "training.gradient_accumulation_steps=2")
        )
    )
    assert losses(recovered) == losses(small)  # bit-identical: the partial gradient of micro-batch 1 was dropped
    wa, wb = final_weights(recovered), final_weights(small)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_token_budget_micro_batches_give_the_same_training(tiny_qwen25vl, data, tmp_path):
    """memory.max_tokens_per_micro_batch only changes how an optimizer step is cut, not what it computes."""
    extra = ["training.per_device_train_batch_size=4", "training.gradient_accumulation_steps=2", "algorithm.num_iterations=2", "algorithm.beta=0.05"]
    rows_cut = tmp_path / "rows"
    train(load_config(None, overrides(tiny_qwen25vl, data, rows_cut, *extra)))
    packed = tmp_path / "packed"
    train(load_config(None, overrides(tiny_qwen25vl, data, packed, *extra, "memory.max_tokens_per_micro_batch=60")))
    rows = [json.loads(x) for x in (packed / "metrics.jsonl").read_text().splitlines()]
    assert all(r["micro_batch_tokens"] == 60 for r in rows)
    a, b = losses(rows_cut), losses(packed)
    for step in a:
        assert a[step][1] == b[step][1]
        assert a[step][0] == pytest.approx(b[step][0], rel=1e-4, abs=1e-6)
    # Different cuts sum gradients in a different order; Adam magnifies the last-bit differences of near-zero
    # gradient entries, so compare the weight updates as a whole rather than bit for bit.
    w0, wa, wb = load_file(pathlib.Path(tiny_qwen25vl) / "model.safetensors"), final_weights(rows_cut), final_weights(packed)
    delta_a = torch.cat([(wa[k] - w0[k]).flatten() for k in wa])
    delta_b = torch.cat([(wb[k] - w0[k]).flatten() for k in wa])
    assert delta_a.norm() > 0
    assert (delta_a - delta_b).norm() / delta_a.norm() < 1e-2
