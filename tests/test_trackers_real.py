"""logging.report_to against the real packages: Weights & Biases in offline mode (its run file read back with wandb's
own record definitions) and MLflow with a local store (read back with MlflowClient). Each test is skipped when its
package is not installed (`pip install wandb mlflow`); tests/test_trackers.py covers the same calls with stand-ins."""

import dataclasses
import importlib.util
import json
import struct
import time

import pytest

from vlmrl.config import load_config
from vlmrl.run.tracking import RunLogger, TrackerError, _flat_config, mlflow_key, tracker_options

needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is not installed (pip install wandb)")
needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed (pip install mlflow)")


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B in offline mode with every folder it writes inside tmp_path."""
    for name, sub in (
        ("WANDB_DIR", "wandb"),
        ("WANDB_CONFIG_DIR", "wandb-config"),
        ("WANDB_CACHE_DIR", "wandb-cache"),
        ("WANDB_DATA_DIR", "wandb-data"),
    ):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    return tmp_path / "wandb"


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """MLflow with a local file store in tmp_path (MLflow 3 needs MLFLOW_ALLOW_FILE_STORE=true for it)."""
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "vlmrl-test")
    return uri


def wandb_records(run_file):
    """The records of an offline W&B run file: a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type),
    each record one protobuf `Record` (wandb.proto), possibly split over chunks (types FIRST / MIDDLE / LAST)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _has_exit_record(run_file) -> bool:
    try:
        return any(r.WhichOneof("record_type") == "exit" for r in wandb_records(run_file))
    except Exception:  # noqa: BLE001 - a record cut by a write in progress
        return False


def wandb_run(wandb_dir, wait_s: float = 60.0):
    """(run record, history rows {key: value}, summary {key: value}, exit code) of the one offline run in wandb_dir.
    W&B's background service writes the file: `finish()` can return before the last records reach the disk, so this
    waits (up to `wait_s`) for the exit record."""
    (run_file,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + wait_s
    while not _has_exit_record(run_file) and time.monotonic() < deadline:
        time.sleep(0.2)

    def items(entries):
        return {e.key or "/".join(e.nested_key): json.loads(e.value_json) for e in entries}

    run, history, summary, exit_code = None, [], {}, None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history.append(items(record.history.item))
        elif kind == "summary":
            summary.update(items(record.summary.update))
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return run, history, summary, exit_code


@needs_wandb
def test_wandb_offline_run_holds_name_config_steps_and_summary(wandb_offline, tmp_path):
    cfg = load_config(None, ["logging.report_to=[wandb]", f"training.output_dir={tmp_path / 'myrun'}", "training.seed=7"])
    with RunLogger(tmp_path / "myrun", total_steps=4, logging_steps=2, progress=False, **tracker_options(cfg)) as logger:
        for step in (1, 2, 3, 4):
            logger.log(step, {"reward": step / 10, "loss": float("nan"), "note": "text"})
        logger.log_eval(4, {"eval/accuracy": 0.5})
    run, history, summary, exit_code = wandb_run(wandb_offline)
    assert run.display_name == "myrun" and run.run_id == (tmp_path / "myrun" / "wandb_run_id").read_text().strip()
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["training"]["seed"] == 7 and config["rollout"]["num_generations"] == cfg.rollout.num_generations
    steps = {row["_step"]: {k: v for k, v in row.items() if not k.startswith("_")} for row in history}
    assert steps == {2: {"reward": 0.2}, 4: {"reward": 0.4, "eval/accuracy": 0.5}}  # every logging_steps; NaN and text left out
    assert summary["reward"] == 0.4 and summary["eval/accuracy"] == 0.5
    assert exit_code == 0


@needs_wandb
def test_wandb_offline_failed_run_exits_nonzero(wandb_offline, tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with RunLogger(tmp_path / "r", total_steps=2, progress=False, tensorboard=False, report_to=["wandb"]) as logger:
            logger.log(1, {"reward": 1.0})
            raise RuntimeError("boom")
    assert wandb_run(wandb_offline)[3] == 1


def mlflow_runs():
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name("vlmrl-test")
    return client, client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])


@needs_mlflow
def test_mlflow_file_store_holds_name_params_steps_and_summary(mlflow_store, tmp_path):
    cfg = load_config(None, ["logging.report_to=[mlflow]", f"training.output_dir={tmp_path / 'myrun'}", "training.seed=7"])
    with RunLogger(tmp_path / "myrun", total_steps=4, logging_steps=2, progress=False, **tracker_options(cfg)) as logger:
        for step in (1, 2, 3, 4):
            # a reward named by its file path and a factory spec (two rewards sharing a name): not a valid MLflow name as is
            logger.log(step, {"reward": step / 10, "loss": float("nan"), "rewards//data/r.py:f(a=1)/mean": 1.0})
        logger.log_eval(4, {"eval/accuracy": 0.5})
    client, (run,) = mlflow_runs()
    assert run.info.run_name == "myrun" and run.info.status == "FINISHED"
    assert run.data.params["training.seed"] == "7" and len(run.data.params) == len(_flat_config(dataclasses.asdict(cfg)))  # every field
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward")] == [(2, 0.2), (4, 0.4)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [(4, 0.5)]
    assert run.data.metrics["final/reward"] == 0.4 and run.data.metrics["final/eval/accuracy"] == 0.5
    assert run.data.metrics[mlflow_key("rewards//data/r.py:f(a=1)/mean")] == 1.0
    assert "loss" not in run.data.metrics  # NaN is left out


@needs_mlflow
def test_mlflow_failed_run_is_marked_failed(mlflow_store, tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with RunLogger(tmp_path / "r", total_steps=2, progress=False, tensorboard=False, report_to=["mlflow"]) as logger:
            logger.log(1, {"reward": 1.0})
            raise RuntimeError("boom")
    _, (run,) = mlflow_runs()
    assert run.info.status == "FAILED"


@needs_mlflow
def test_mlflow_resumed_run_continues_the_same_run(mlflow_store, tmp_path):
    out = tmp_path / "r"
    first = load_config(None, [f"training.output_dir={out}", "logging.logging_steps=1"])
    with RunLogger(out, total_steps=3, progress=False, tensorboard=False, report_to=["mlflow"], run_config=dataclasses.asdict(first)) as logger:
        logger.log(1, {"reward": 0.1})
    # Resumed with a logging field changed (allowed on resume): MLflow cannot change a parameter, so it keeps the first value.
    resumed = load_config(None, [f"training.output_dir={out}", "logging.logging_steps=5"])
    with RunLogger(
        out, total_steps=3, initial_step=1, progress=False, tensorboard=False, report_to=["mlflow"], run_config=dataclasses.asdict(resumed)
    ) as logger:
        logger.log(2, {"reward": 0.2})
        logger.log(3, {"reward": 0.3})
    client, (run,) = mlflow_runs()  # one run, not two
    assert run.info.run_id == (out / "mlflow_run_id").read_text().strip() and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert run.data.params["logging.logging_steps"] == "1"
    (out / "mlflow_run_id").write_text("0123456789abcdef\n")  # a run this store does not have: a new run, not an error
    with RunLogger(out, total_steps=1, progress=False, tensorboard=False, report_to=["mlflow"]) as logger:
        logger.log(1, {"reward": 1.0})
    assert len(mlflow_runs()[1]) == 2


@needs_mlflow
def test_mlflow_refused_store_is_one_line(mlflow_store, tmp_path, monkeypatch):
    from mlflow import environment_variables

    if not hasattr(environment_variables, "MLFLOW_ALLOW_FILE_STORE"):
        pytest.skip("this MLflow accepts file stores without MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    with pytest.raises(
        TrackerError, match=r"^logging.report_to includes mlflow but it failed to start: MlflowException: .*MLFLOW_ALLOW_FILE_STORE"
    ) as e:
        RunLogger(tmp_path / "r", total_steps=1, progress=False, tensorboard=False, report_to=["mlflow"])
    assert "\n" not in str(e.value)


def test_mlflow_key():
    assert mlflow_key("rewards//data/r.py:f(a=1)/mean") == "rewards/data/r.py_f_a_1_/mean"
    assert mlflow_key("a/../b/./c") == "a/_/b/_/c"
    assert mlflow_key("eval/accuracy") == "eval/accuracy"


@needs_wandb
@needs_mlflow
def test_grpo_run_reports_to_wandb_and_mlflow(wandb_offline, mlflow_store, tiny_qwen25vl, tmp_path):
    from vlmrl.data.tasks import make_count_task
    from vlmrl.train import train

    data = make_count_task(tmp_path / "d", n_train=4, n_test=2, seed=0, image_size=56)
    out = tmp_path / "grpo-run"
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_qwen25vl}",
            f"data.train_path={data['train']}",
            f"data.eval_path={data['test']}",
            f"training.output_dir={out}",
            "training.max_steps=2",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=4",
            "rollout.generation_batch_size=4",
            "rollout.max_completion_length=4",
            "logging.progress_bar=false",
            "logging.report=false",
            "logging.report_to=[tensorboard, wandb, mlflow]",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
        ],
    )
    train(cfg, log=lambda *_: None)
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run, history, summary, exit_code = wandb_run(wandb_offline)
    assert run.display_name == "grpo-run" and exit_code == 0
    assert [row["reward"] for row in history if "reward" in row] == [row["reward"] for row in logged]
    assert "eval/accuracy" in summary and summary["loss"] == logged[-1]["loss"]
    client, (ml_run,) = mlflow_runs()
    assert ml_run.info.run_name == "grpo-run" and ml_run.info.status == "FINISHED"
    assert ml_run.data.params["model.name_or_path"] == str(tiny_qwen25vl)
    assert [m.step for m in client.get_metric_history(ml_run.info.run_id, "reward")] == [1, 2]
    assert "final/eval/accuracy" in ml_run.data.metrics
    assert list((out / "tb").glob("events.*"))  # TensorBoard alongside
