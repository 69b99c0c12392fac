"""`vlmrl check` gives the planner's verdict for the device in use (plan_check.py), from config.json only."""

import time

import pytest

from vlmrl import cli

import vlmrl.run.verdict as plan_check

from vlmrl.models import policy

from vlmrl import sft

from vlmrl import train
from vlmrl.config import load_config
from vlmrl.plan.planner import GiB
from vlmrl.data.tasks import make_count_task


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=4, seed=0, image_size=56)


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("vlmrl check loaded the model")

    for module in (policy, train, sft):
        monkeypatch.setattr(module, "load_policy", refuse)


def cfg_for(model, *extra):
    return load_config(None, [f"model.name_or_path={model}", "training.device=cpu", *extra])


def test_cpu_verdict_against_host_memory(tiny_qwen25vl):
    ok = plan_check.planner_verdict(cfg_for(tiny_qwen25vl))
    assert ok.fits is True and ok.line.startswith("planner: fits on this CPU: predicted host peak RSS ")
    assert "host memory (this machine)" in ok.line and "vlmrl sft (stage 2)" in ok.line and ok.summary.startswith("plan: tensors ")
    small = plan_check.planner_verdict(cfg_for(tiny_qwen25vl, "training.auto_fit_host_memory_gib=0.05"))
    assert small.fits is False and "does NOT fit on this CPU" in small.line
    assert "of 0.05 GiB host memory (training.auto_fit_host_memory_gib)" in small.line
    assert "rollout.max_completion_length" in small.line  # says what to lower


def test_the_larger_of_grpo_and_sft_decides(tiny_qwen25vl):
    # SFT's target length is rollout.max_completion_length too: a huge one is SFT's larger plan.
    long = plan_check.planner_verdict(cfg_for(tiny_qwen25vl, "rollout.max_completion_length=4000000"))
    assert long.fits is False and "(vlmrl sft (stage 2)) of" in long.line and "; vlmrl train (GRPO step) " in long.line
    # 65,536 completions per micro-batch in GRPO, 8 rows in SFT: GRPO's.
    wide = plan_check.planner_verdict(cfg_for(tiny_qwen25vl, "rollout.num_generations=65536", "training.per_device_train_batch_size=65536"))
    assert wide.fits is False and "(vlmrl train (GRPO step)) of" in wide.line and "; vlmrl sft (stage 2) " in wide.line


def test_gpu_verdict_against_device_memory(tiny_qwen25vl, monkeypatch):
    monkeypatch.setattr(plan_check, "_run_context", lambda cfg: (False, 2 * GiB, {}))  # a 2 GiB GPU
    fits = plan_check.planner_verdict(cfg_for(tiny_qwen25vl))
    assert fits.fits is True and fits.line.startswith("planner: fits on this GPU: predicted GPU total ") and "of 2.00 GiB GPU memory" in fits.line
    assert "CUDA context" in fits.summary
    over = plan_check.planner_verdict(cfg_for(tiny_qwen25vl, "rollout.max_completion_length=4000000"))
    assert over.fits is False and "does NOT fit on this GPU" in over.line
    monkeypatch.setattr(plan_check, "_run_context", lambda cfg: (False, None, {}))  # no size known
    unknown = plan_check.planner_verdict(cfg_for(tiny_qwen25vl))
    assert unknown.fits is None and "no verdict (no device size known)" in unknown.line


def test_a_model_the_planner_cannot_read_gives_no_verdict(tmp_path):
    folder = tmp_path / "odd"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "something_new"}')
    verdict = plan_check.planner_verdict(cfg_for(folder))
    assert verdict.fits is None and verdict.line.startswith("planner: no verdict (")


def run_check(capsys, *argv):
    t0 = time.perf_counter()
    code = cli.main(["check", *argv])
    return code, capsys.readouterr().err.strip(), time.perf_counter() - t0


def test_check_prints_the_verdict_and_fails_a_config_that_cannot_fit(tiny_qwen25vl, count_data, tmp_path, capsys, no_model_load):
    base = [
        f"model.name_or_path={tiny_qwen25vl}",
        f"data.train_path={count_data['train']}",
        f"data.eval_path={count_data['test']}",
        f"training.output_dir={tmp_path / 'o'}",
        "training.device=cpu",
    ]
    code, err, _ = run_check(capsys, *base)
    lines = err.splitlines()
    assert code == 0 and lines[-1] == f"vlmrl check: OK ({tiny_qwen25vl})"
    assert lines[-3].startswith("planner: fits on this CPU") and lines[-2].startswith("plan: tensors")
    assert f"output_dir {tmp_path / 'o'}: new run" in lines and any(line.startswith("model defaults: pretrained") for line in lines)
    for bad in ("rollout.max_completion_length=4000000", "training.auto_fit_host_memory_gib=0.05"):
        code, err, seconds = run_check(capsys, *base, bad)
        lines = err.splitlines()
        assert code == 1, err
        assert "does NOT fit on this CPU" in lines[-3]
        assert lines[-1].startswith("vlmrl check: every check passed, but the run is predicted NOT to fit")
        assert seconds < 20, seconds  # no weights load: seconds, on a busy 2-core machine too
