"""Guards of the loop, tried from outside: rewards that overflow float32, a NaN loss, a final evaluation that fails
or runs out of memory, an OOM in the update of a reused rollout."""

import json
import math
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.checkpoints.files import list_checkpoints
from vlmrl.config import load_config
from vlmrl.data.tasks import make_count_task
from vlmrl.train import NonFiniteStop, train

pytestmark = pytest.mark.integration

REWARDS = str(pathlib.Path(__file__).parent / "rewards_for_tests.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=12, n_test=6, seed=0, image_size=56)


def cfg(model, data, out, *extra, reward="text_length", eval_rows=False):
    return load_config(
        None,
        [
            f"model.name_or_path={model}",
            f"data.train_path={data['train']}",
            f"data.eval_path={data['test'] if eval_rows else ''}",
            f"training.output_dir={out}",
            "training.max_steps=3",
            "rollout.num_generations=4",
            "training.per_device_train_batch_size=4",
            "rollout.generation_batch_size=8",
            "rollout.max_completion_length=5",
            "optim.learning_rate=1e-2",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            f"algorithm.reward_funcs=['{REWARDS}:{reward}']",
            *extra,
        ],
    )


def metrics(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def initial_weights(model):
    return load_file(pathlib.Path(model) / "model.safetensors")


def test_overflowing_rewards_skip_the_step_and_stop_with_a_checkpoint(tiny_qwen25vl, data, tmp_path, capsys):
    """Rewards of 3e38 (finite in float32) overflow the group mean: every step is skipped, the weights never change,
    and after training.max_nonfinite_steps the run stops with a checkpoint of the untouched weights."""
    out = tmp_path / "run"
    lines = []
    with pytest.raises(NonFiniteStop, match="2 optimizer steps in a row"):
        train(cfg(tiny_qwen25vl, data, out, "training.max_nonfinite_steps=2", reward="overflowing"), log=lines.append)
    rows = metrics(out)
    assert [r["nonfinite/skipped_steps"] for r in rows] == [1.0, 1.0]
    lines += capsys.readouterr().out.splitlines()
    assert any("skipped a non-finite optimizer step" in line and "advantages are not finite" in line for line in lines)
    (ckpt,) = list_checkpoints(out)
    saved, start = load_file(ckpt / "model" / "model.safetensors"), initial_weights(tiny_qwen25vl)
    assert all(torch.isfinite(w).all() for w in saved.values())
    assert all(torch.equal(saved[k], start[k]) for k in start)


def test_a_nan_loss_skips_one_optimizer_step_and_training_goes_on(tiny_qwen25vl, data, tmp_path, monkeypatch, capsys):
    """The first micro-batch's loss is NaN (as from an overflow in the model): that optimizer step changes nothing,
    is counted, and the later steps train normally; no weight on disk is NaN."""
    from vlmrl import train as train_module

    real, calls = train_module.per_token_loss, []

    def nan_once(*args, **kwargs):
        loss, parts = real(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 1 else loss), parts

    monkeypatch.setattr(train_module, "per_token_loss", nan_once)
    out = tmp_path / "run"
    lines = []
    train(cfg(tiny_qwen25vl, data, out), log=lines.append)
    rows = metrics(out)
    assert [r["nonfinite/skipped_steps"] for r in rows] == [1.0, 0.0, 0.0]
    lines += capsys.readouterr().out.splitlines()
    assert any("micro-batch 1 of 1" in line and "loss nan" in line for line in lines)
    final, start = load_file(out / "final" / "model.safetensors"), initial_weights(tiny_qwen25vl)
    assert all(torch.isfinite(w).all() for w in final.values())
    assert any(not torch.equal(final[k], start[k]) for k in start)  # steps 2 and 3 trained


def test_a_failing_final_evaluation_keeps_the_trained_model(tiny_qwen25vl, data, tmp_path, capsys):
    out = tmp_path / "run"
    lines = []
    result = train(cfg(tiny_qwen25vl, data, out, "training.eval_batch_size=3", reward="fails_on_three", eval_rows=True), log=lines.append)
    assert result["eval/failed"] == 1.0
    assert (out / "final" / "model.safetensors").exists() and len(metrics(out)) == 3
    lines += capsys.readouterr().out.splitlines()
    assert any("final evaluation failed" in line and "cannot score a batch of three" in line for line in lines)


def test_evaluation_out_of_memory_halves_its_batch_with_the_same_result(tiny_qwen25vl, data, tmp_path, monkeypatch, capsys):
    import vlmrl.engine.oom as oom

    plain = train(cfg(tiny_qwen25vl, data, tmp_path / "plain", "training.eval_batch_size=6", eval_rows=True), log=lambda *_: None)
    monkeypatch.setattr(oom, "INJECT_OOM_ABOVE", {"eval": 2})
    lines = []
    halved = train(cfg(tiny_qwen25vl, data, tmp_path / "halved", "training.eval_batch_size=6", eval_rows=True), log=lines.append)
    lines += capsys.readouterr().out.splitlines()
    assert any("out of memory in evaluation at size 6" in line for line in lines)
    evals = {k: v for k, v in plain.items() if k.startswith("eval/")}
    assert evals and evals == {k: v for k, v in halved.items() if k.startswith("eval/")}


def test_update_oom_with_a_reused_rollout_is_exact(tiny_qwen25vl, data, tmp_path, monkeypatch):
    """num_iterations=2: an OOM in the update shrinks only the update's micro-batch; old log-probs stay scored at the
    scoring size, so the run equals one configured with the smaller update and that scoring size, bit for bit."""
    import vlmrl.engine.oom as oom

    extra = ["algorithm.num_iterations=2", "algorithm.beta=0.05", "rollout.generation_batch_size=8"]
    small = tmp_path / "small"
    train(
        cfg(
            tiny_qwen25vl,
            data,
            small,
            *extra,
            "training.per_device_train_batch_size=2",
            "training.gradient_accumulation_steps=2",
            "memory.scoring_micro_batch_size=4",
        ),
        log=lambda *_: None,
    )
    monkeypatch.setattr(oom, "INJECT_OOM_ABOVE", {"update": 2})
    recovered = tmp_path / "recovered"
    train(cfg(tiny_qwen25vl, data, recovered, *extra), log=lambda *_: None)
    a, b = metrics(recovered), metrics(small)
    assert [r["micro_batch_size"] for r in a] == [2, 2, 2]
    assert [(r["loss"], r["reward"], r["kl"]) for r in a] == [(r["loss"], r["reward"], r["kl"]) for r in b]
    wa, wb = load_file(recovered / "final" / "model.safetensors"), load_file(small / "final" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not math.isnan(a[-1]["loss"])


def test_adamw_state_exists_before_the_first_optimizer_step(tiny_qwen25vl, data, tmp_path, monkeypatch):
    """An allocation inside optimizer.step cannot be undone halfway; the run creates AdamW's moments before step 1.
    Simulated: AdamW's lazy state creation runs out of memory, which the run must never reach."""
    real = torch.optim.Adam._init_group

    def no_memory_for_new_state(self, group, *args, **kwargs):
        if any(p.grad is not None and len(self.state[p]) == 0 for p in group["params"]):
            raise torch.OutOfMemoryError("simulated: no memory for AdamW's moment buffers inside optimizer.step")
        return real(self, group, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "_init_group", no_memory_for_new_state)
    train(cfg(tiny_qwen25vl, data, tmp_path / "run", "training.max_steps=1"), log=lambda *_: None)
    assert len(metrics(tmp_path / "run")) == 1
