"""logging.report_to: TensorBoard by default, W&B and MLflow (optional packages) driven through fake modules that record
every call, missing packages as one line before anything loads."""

import importlib.machinery
import sys
import types

import pytest

from vlmrl.config import ConfigError, load_config
from vlmrl.run.preflight import check_trackers
from vlmrl.run.tracking import RunLogger, TrackerError, resolve_report_to, tracker_options


class Calls(list):
    def __call__(self, name):
        return lambda *args, **kwargs: self.append((name, args, kwargs))


def fake_module(name):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = Calls()
    wandb = fake_module("wandb")

    class Run:
        summary = types.SimpleNamespace(update=calls("summary.update"))
        log = staticmethod(calls("log"))
        finish = staticmethod(calls("finish"))

    def init(**kwargs):
        calls.append(("init", (), kwargs))
        return Run()

    wandb.init = init
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    return calls


@pytest.fixture
def fake_mlflow(monkeypatch):
    calls = Calls()
    mlflow = fake_module("mlflow")
    for name in ("set_experiment", "start_run", "log_params", "log_metrics", "end_run"):
        setattr(mlflow, name, calls(name))
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    return calls


def test_resolve_report_to():
    assert resolve_report_to(["tensorboard"]) == ["tensorboard"]
    assert resolve_report_to("wandb") == ["wandb"]  # TRL users write a string
    assert resolve_report_to(["mlflow", "tensorboard"]) == ["tensorboard", "mlflow"]
    assert resolve_report_to(["none"]) == []
    with pytest.raises(ValueError, match="did you mean 'wandb'"):
        resolve_report_to(["wandbb"])
    with pytest.raises(ValueError, match="'none' cannot be combined"):
        resolve_report_to(["none", "wandb"])
    with pytest.raises(ConfigError, match="logging.report_to: unknown tracker 'tensorbord'; did you mean 'tensorboard'"):
        load_config(None, ["logging.report_to=[tensorbord]"])
    assert load_config(None, ["report_to=wandb"]).logging.report_to == "wandb"


def test_missing_package_is_one_line_before_loading(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails, as when it is not installed
    monkeypatch.setattr("vlmrl.run.tracking._installed", lambda package: package != "wandb")
    with pytest.raises(ConfigError, match=r"^logging.report_to includes wandb but the wandb package is not installed: pip install wandb"):
        check_trackers(load_config(None, ["logging.report_to=[tensorboard, wandb]"]))
    assert resolve_report_to("all") == ["tensorboard", "mlflow"]
    with pytest.raises(TrackerError, match="wandb package is not installed"):
        RunLogger("unused", total_steps=1, tensorboard=False, progress=False, report_to=["wandb"])


def test_wandb_gets_config_steps_evals_and_summary(fake_wandb, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = load_config(None, ["logging.report_to=[wandb]", f"training.output_dir={tmp_path / 'myrun'}", "training.seed=7"])
    options = tracker_options(cfg)
    assert options["tensorboard"] is False and options["report_to"] == ["wandb"]
    with RunLogger(tmp_path / "myrun", total_steps=4, logging_steps=2, progress=False, **options) as logger:
        for step in (1, 2, 3, 4):
            logger.log(step, {"reward": step / 10, "loss": float("nan"), "note": "text"})
        logger.log_eval(4, {"eval/accuracy": 0.5})
    names = [c[0] for c in fake_wandb]
    assert names == ["init", "log", "log", "log", "summary.update", "finish"]
    init = fake_wandb[0][2]
    assert init["mode"] == "offline" and init["name"] == "myrun" and init["config"]["training"]["seed"] == 7
    assert init["resume"] == "allow" and init["id"] == (tmp_path / "myrun" / "wandb_run_id").read_text().strip()
    assert [(c[1][0], c[2]["step"]) for c in fake_wandb if c[0] == "log"] == [
        ({"reward": 0.2}, 2),
        ({"reward": 0.4}, 4),
        ({"eval/accuracy": 0.5}, 4),
    ]  # every logging_steps; NaN and text left out
    assert fake_wandb[4][1][0] == {"reward": 0.4, "eval/accuracy": 0.5}
    assert fake_wandb[5][2] == {"exit_code": 0}
    # A resumed run continues the same W&B run.
    with RunLogger(tmp_path / "myrun", total_steps=4, initial_step=4, progress=False, **options):
        pass
    assert [c[2]["id"] for c in fake_wandb if c[0] == "init"] == [init["id"]] * 2


def test_mlflow_gets_params_metrics_and_failure(fake_mlflow, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "exp")
    cfg = load_config(None, ["logging.report_to=[mlflow, tensorboard]", f"training.output_dir={tmp_path / 'r'}"])
    options = tracker_options(cfg)
    assert options["tensorboard"] is True
    with pytest.raises(RuntimeError, match="boom"):
        with RunLogger(tmp_path / "r", total_steps=2, progress=False, **options) as logger:
            logger.log(1, {"reward": 1.0, "mem/host_peak_rss": 2})
            raise RuntimeError("boom")
    names = [c[0] for c in fake_mlflow]
    assert names[:2] == ["set_experiment", "start_run"] and fake_mlflow[0][1] == ("exp",)
    params = {k: v for c in fake_mlflow if c[0] == "log_params" for k, v in c[1][0].items()}
    assert params["training.output_dir"] == str(tmp_path / "r") and params["rollout.num_generations"] == str(cfg.rollout.num_generations)
    assert max(len(c[1][0]) for c in fake_mlflow if c[0] == "log_params") <= 100  # MLflow's batch limit
    metrics = [c for c in fake_mlflow if c[0] == "log_metrics"]
    assert metrics[0][1][0] == {"reward": 1.0, "mem/host_peak_rss": 2.0} and metrics[0][2] == {"step": 1}
    assert metrics[1][1][0] == {"final/reward": 1.0, "final/mem/host_peak_rss": 2.0}
    assert fake_mlflow[-1] == ("end_run", (), {"status": "FAILED"})
    assert list((tmp_path / "r" / "tb").glob("events.*"))


def test_non_main_process_starts_no_tracker(fake_wandb, tmp_path):
    with RunLogger(tmp_path, total_steps=1, progress=False, tensorboard=False, report_to=["wandb"], is_main_process=False) as lg:
        lg.log(1, {"reward": 1.0})
    assert fake_wandb == []


def test_sft_reports_to_wandb(fake_wandb, tiny_qwen25vl, tmp_path):
    from vlmrl.sft import sft
    from vlmrl.data.tasks import make_count_task

    data = make_count_task(tmp_path / "d", n_train=4, n_test=2, seed=0, image_size=56)
    sft(
        load_config(
            None,
            [
                f"model.name_or_path={tiny_qwen25vl}",
                f"data.train_path={data['train']}",
                f"data.eval_path={data['test']}",
                f"training.output_dir={tmp_path / 'sft'}",
                "sft.steps=2",
                "sft.batch_size=2",
                "logging.progress_bar=false",
                "logging.report_to=[wandb]",
                "rollout.max_completion_length=3",
                "data.max_pixels=3136",
                "data.min_pixels=3136",
            ],
        ),
        log=lambda *_: None,
    )
    logged = [c for c in fake_wandb if c[0] == "log"]
    assert [c[2]["step"] for c in logged] == [1, 2, 2]  # two steps, then the evaluation
    assert "eval/accuracy" in logged[-1][1][0] and [c[0] for c in fake_wandb][-1] == "finish"
    assert not (tmp_path / "sft" / "tb").exists()


def test_closed_on_error_closes_only_when_the_block_raises(fake_wandb, tmp_path):
    logger = RunLogger(tmp_path, total_steps=2, progress=False, tensorboard=False, report_to=["wandb"])
    with logger.closed_on_error():
        logger.log(1, {"reward": 1.0})
    assert [c[0] for c in fake_wandb] == ["init", "log"]  # still open: the caller logs more
    with pytest.raises(RuntimeError), logger.closed_on_error():
        raise RuntimeError("boom")
    assert fake_wandb[-1] == ("finish", (), {"exit_code": 1})


def test_grpo_final_evaluation_reaches_the_tracker_before_it_finishes(fake_wandb, tiny_qwen25vl, tmp_path):
    from vlmrl.data.tasks import make_count_task
    from vlmrl.train import train

    data = make_count_task(tmp_path / "d", n_train=4, n_test=2, seed=0, image_size=56)
    overrides = [
        f"model.name_or_path={tiny_qwen25vl}",
        f"data.train_path={data['train']}",
        f"data.eval_path={data['test']}",
        f"training.output_dir={tmp_path / 'run'}",
        "training.max_steps=1",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=4",
        "rollout.generation_batch_size=4",
        "rollout.max_completion_length=3",
        "logging.progress_bar=false",
        "logging.report=false",
        "logging.report_to=[wandb]",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
    ]
    train(load_config(None, overrides), log=lambda *_: None)
    names = [c[0] for c in fake_wandb]
    assert names == ["init", "log", "log", "summary.update", "finish"]  # the step, then the final evaluation
    assert "eval/accuracy" in fake_wandb[2][1][0] and "eval/accuracy" in fake_wandb[3][1][0]
