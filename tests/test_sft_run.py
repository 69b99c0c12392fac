"""`vlmrl sft` as a full run: checkpoints and exact resume (across the stage boundary too), micro-batches at a constant
effective batch, the shared ending (a stop during the final evaluation is finished by the next run, not retrained)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.config import load_config
from vlmrl.sft import sft, stages_of
from vlmrl.data.tasks import make_count_task

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=12, n_test=4, seed=0, image_size=56)


def args(model, data, out, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        f"data.eval_path={data['test']}",
        f"training.output_dir={out}",
        "sft.projector_steps=2",
        "sft.steps=3",
        "sft.batch_size=4",
        "sft.learning_rate=1e-3",
        "rollout.max_completion_length=4",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "training.device=cpu",
        *extra,
    ]


def weights(out):
    return load_file(out / "final" / "model.safetensors")


def losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def straight(tiny_qwen25vl, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "straight"
    sft(load_config(None, args(tiny_qwen25vl, data, out)))
    return out


@pytest.mark.parametrize("stop_at", [2, 3], ids=["at-the-stage-boundary", "inside-stage-2"])
def test_stopped_sft_resumes_to_the_same_weights(tiny_qwen25vl, data, straight, tmp_path, stop_at):
    """Stopped after `stop_at` (a checkpoint is written, as on SIGTERM), then the same command again: the same losses
    and bit-identical final weights. At the boundary the checkpoint holds stage 1's optimizer; stage 2 starts its own."""
    out = tmp_path / "run"
    cfg = load_config(None, args(tiny_qwen25vl, data, out))
    lines: list[str] = []
    sft(cfg, log=lines.append, stop_after=stop_at)
    assert (out / f"checkpoint-{stop_at}").is_dir() and not (out / "final").exists()
    state = json.loads((out / f"checkpoint-{stop_at}" / "trainer_state.json").read_text())
    assert state["stage"] == ("projector" if stop_at == 2 else "language") and state["samples_consumed"] == 4 * stop_at
    lines.clear()
    sft(cfg, log=lines.append)
    assert any(f"resumed from {out / f'checkpoint-{stop_at}'}" in line for line in lines), lines
    assert losses(out) == losses(straight)
    a, b = weights(straight), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "run_complete.json").read_text())["kind"] == "sft"


@pytest.fixture(scope="module")
def micro1(tiny_qwen25vl, data, tmp_path_factory):
    """The straight run with sft.micro_batch_size=1: four forwards/backwards per step."""
    out = tmp_path_factory.mktemp("sft") / "micro1"
    sft(load_config(None, args(tiny_qwen25vl, data, out, "sft.micro_batch_size=1")))
    return out


def test_micro_batches_keep_the_effective_batch(straight, micro1):
    """sft.batch_size=4 cut into micro-batches of 1 row: four forwards/backwards per step, the same weights to float
    rounding (the loss is normalised by the whole batch's target tokens).

    Tolerance: the gradients are summed in another order (~1e-7 relative), and AdamW's normalisation turns that into
    an update difference of up to its whole step (lr) on the few parameters whose gradient is near zero, so the largest
    element difference is no measure: it was 4.3e-5 on an AMD EPYC and 1.13e-4 on an Intel Xeon (same packages). What
    rounding cannot do is move many elements: at most 0.1% may differ by more than lr / 100 (measured: 10 of 708,032
    elements on the Xeon). Keeping only the last micro-batch's gradients moves most."""
    out = micro1
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["micro_batch_size"] == 1 for r in rows)
    for step, loss in losses(straight).items():
        assert losses(out)[step] == pytest.approx(loss, rel=1e-5)
    a, b = weights(straight), weights(out)
    diff = torch.cat([(a[k] - b[k]).abs().flatten() for k in a])
    moved = int((diff > 1e-3 / 100).sum())  # sft.learning_rate 1e-3
    assert moved <= diff.numel() // 1000, f"{moved} of {diff.numel()} elements differ by more than lr/100"


def test_an_oom_in_sft_halves_the_micro_batch_and_drops_the_partial_gradient(tiny_qwen25vl, data, micro1, tmp_path, monkeypatch):
    """Micro-batches of 2: the first runs forward and backward, the second runs out of memory. The step is redone in
    micro-batches of 1 at the same effective batch, the first micro-batch's gradient dropped: the run is the one
    configured with micro-batches of 1 from the start, bit for bit, and the checkpoint keeps the smaller size."""
    import vlmrl.engine.oom as oom

    monkeypatch.setattr(oom, "INJECT_OOM_ON_CALL", {"sft": 2})
    monkeypatch.setattr(oom, "_calls", {})
    out = tmp_path / "recovered"
    lines: list[str] = []
    sft(load_config(None, args(tiny_qwen25vl, data, out, "sft.micro_batch_size=2", "training.save_steps=5")), log=lines.append)
    assert [json.loads(x)["micro_batch_size"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1] * 5
    assert losses(out) == losses(micro1)
    a, b = weights(micro1), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "checkpoint-5" / "trainer_state.json").read_text())["sizes"] == {"update": 1}


def test_lora_sft_checkpoints_resumes_bit_exact_and_exports(tiny_qwen25vl, data, tmp_path):
    """Stage-2 SFT with LoRA adapters: the checkpoint holds the adapter, a run stopped after step 2 resumes to the
    uninterrupted run's weights bit for bit, and `vlmrl export` of the last checkpoint gives `final/`'s weights."""
    from vlmrl.run.export import export_checkpoint

    lora = ("model.use_lora=true", "sft.projector_steps=0", "sft.steps=3", "training.save_steps=1", "training.save_total_limit=1")
    straight, out = tmp_path / "straight", tmp_path / "run"
    sft(load_config(None, args(tiny_qwen25vl, data, straight, *lora)))
    assert (straight / "checkpoint-3" / "model" / "adapter_model.safetensors").exists()
    trained, base = weights(straight), load_file(tiny_qwen25vl / "model.safetensors")
    assert trained.keys() == base.keys() and any(not torch.equal(trained[k], base[k]) for k in base)  # the adapters merged
    sft(load_config(None, args(tiny_qwen25vl, data, out, *lora)), stop_after=2)
    lines: list[str] = []
    sft(load_config(None, args(tiny_qwen25vl, data, out, *lora)), log=lines.append)
    assert any(f"resumed from {out / 'checkpoint-2'}" in line for line in lines), lines
    assert losses(out) == losses(straight)
    a, b = weights(straight), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    export_checkpoint(str(out / "checkpoint-3"), str(tmp_path / "exported"))
    e = load_file(tmp_path / "exported" / "model.safetensors")
    assert e.keys() == a.keys() and all(torch.equal(e[k], a[k]) for k in e)


def test_a_stop_during_the_final_evaluation_is_finished_by_the_next_run(tiny_qwen25vl, data, straight, tmp_path, monkeypatch):
    """SIGTERM while the final evaluation runs: it ends between batches with one line, final/ is on disk; the same
    command again evaluates final/ and writes the report and the completion marker, without training again."""
    import vlmrl.evaluate

    out = tmp_path / "run"
    cfg = load_config(None, args(tiny_qwen25vl, data, out, "training.eval_batch_size=2"))
    real = vlmrl.evaluate.evaluate
    calls = {"n": 0}

    def signalled(*a, stop=None, **k):  # the signal arrives as the final evaluation starts: its flag is set
        import os
        import signal

        calls["n"] += 1
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, stop=stop, **k)

    monkeypatch.setattr(vlmrl.evaluate, "evaluate", signalled)
    lines: list[str] = []
    sft(cfg, log=lines.append)
    assert calls["n"] == 1 and (out / "final").is_dir() and not (out / "run_complete.json").exists()
    assert (out / "run_ending.json").exists() and not (out / "eval.jsonl").exists()
    trained = (out / "final" / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(vlmrl.evaluate, "evaluate", real)
    lines.clear()
    metrics = sft(cfg, log=lines.append)
    assert any("finishing what was left" in line for line in lines), lines
    assert (out / "final" / "model.safetensors").stat().st_mtime_ns == trained  # not trained or saved again
    assert losses(out) == losses(straight) and sorted(losses(out)) == [1, 2, 3, 4, 5]
    assert "eval/num_samples" in metrics and json.loads((out / "run_complete.json").read_text())["step"] == 5
    assert not (out / "run_ending.json").exists()
    evals = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [5] and evals[0]["eval/num_samples"] == 4.0


def test_epochs_set_the_length_of_stage_2():
    cfg = load_config(None, ["sft.projector_steps=2", "sft.batch_size=4", "sft.epochs=1.5"])
    stages = stages_of(cfg.sft, num_rows=10)  # ceil(1.5 x 10 / 4) = 4 steps
    assert [(s.name, s.first, s.last) for s in stages] == [("projector", 1, 2), ("language", 3, 6)]
    assert [(s.name, s.steps) for s in stages_of(load_config(None, ["sft.projector_steps=0", "sft.steps=3"]).sft, 10)] == [("language", 3)]


def test_sigterm_during_sft_checkpoints_and_says_so(tiny_qwen25vl, data, tmp_path, monkeypatch, capsys):
    """SIGTERM in stage 2 (`vlmrl sft` used to die with exit 143, nothing saved): the step finishes, a checkpoint
    is written, one line says how to resume, sft returns (the CLI exits 0)."""
    import vlmrl.checkpoints.faults

    monkeypatch.setattr(vlmrl.checkpoints.faults, "_seen", {})
    monkeypatch.setenv(vlmrl.checkpoints.faults.ENV, "step@3:SIGTERM")
    out = tmp_path / "run"
    sft(load_config(None, args(tiny_qwen25vl, data, out)))
    said = capsys.readouterr().out
    assert "stopped by SIGTERM after step 3; run the same command again to resume" in said, said
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"] and not (out / "final").exists()
    assert sorted(losses(out)) == [1, 2, 3]
