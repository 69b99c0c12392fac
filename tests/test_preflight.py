"""Checks before any weights load (preflight.py, cli.py), eval's data rule, skipped rows named, the no-signal warning."""

import json
import shutil
import time

import pytest

from vlmrl import cli

from vlmrl.models import policy
from vlmrl.run import datasets as run_datasets

from vlmrl import sft

from vlmrl import train
from vlmrl.config import ConfigError, load_config
from vlmrl.data.rows import load_dataset_split
from vlmrl.models.loading import ModelLoadError
from vlmrl.models.loading import check_model_folder as model_folder_problems
from vlmrl.run.preflight import check_eval_data, check_model_folder
from vlmrl.run.signals import no_signal_message, update_no_signal_streak, warn_if_no_learning_signal
from vlmrl.data.tasks import make_count_task

VLMR1_REWARD = """
def vlmr1_accuracy(completions, solution, **kwargs):
    return [1.0 if c[0]["content"].strip() == f"<answer>{s}</answer>" else 0.0 for c, s in zip(completions, solution)]
"""


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=4, seed=0, image_size=56)


@pytest.fixture
def model_copy(tiny_qwen25vl, tmp_path):
    return shutil.copytree(tiny_qwen25vl, tmp_path / "model")


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading weights fails the test: every check here must come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the checks failed")

    for module in (policy, train, sft):  # train.py and sft.py bind load_policy at import
        monkeypatch.setattr(module, "load_policy", refuse)


def run_cli(capsys, *argv):
    t0 = time.perf_counter()
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err, time.perf_counter() - t0


def test_complete_folder_has_no_problems(tiny_qwen25vl, tiny_llava):
    assert model_folder_problems(tiny_qwen25vl) == []
    assert model_folder_problems(tiny_llava) == []


def test_incomplete_folder_lists_everything_missing(model_copy):
    for name in ("tokenizer.json", "vocab.json", "chat_template.jinja", "preprocessor_config.json"):
        (model_copy / name).unlink(missing_ok=True)
    tok_config = json.loads((model_copy / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (model_copy / "tokenizer_config.json").write_text(json.dumps(tok_config))
    problems = model_folder_problems(model_copy)
    assert [p.split(" ")[0] for p in problems] == ["image", "tokenizer", "a"], problems
    cfg = load_config(None, [f"model.name_or_path={model_copy}"])
    with pytest.raises(ModelLoadError, match=r"incomplete: missing image processor config .*; tokenizer files .*; a chat template"):
        check_model_folder(cfg)


def test_sharded_weights_with_a_missing_shard(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert model_folder_problems(model_copy) == ["weight shards named in model.safetensors.index.json: model-00002-of-00002.safetensors"]
    (model_copy / "model.safetensors.index.json").write_text("{not json")
    assert "readable model.safetensors.index.json" in model_folder_problems(model_copy)[0]


def test_cli_refuses_incomplete_model_before_loading(model_copy, count_data, capsys, no_model_load, tmp_path):
    (model_copy / "tokenizer.json").unlink()
    (model_copy / "vocab.json").unlink(missing_ok=True)
    code, err, seconds = run_cli(
        capsys, "train", f"model.name_or_path={model_copy}", f"data.train_path={count_data['train']}", f"training.output_dir={tmp_path / 'out'}"
    )
    assert code == 2 and err.startswith("vlmrl train: model folder") and "missing tokenizer files" in err
    assert "Traceback" not in err and seconds < 10  # generous on a shared machine; no_model_load is the real guarantee


def test_cli_broken_data_fails_fast_with_model_present(tiny_qwen25vl, count_data, capsys, no_model_load, tmp_path):
    bad = tmp_path / "bad.jsonl"
    lines = count_data["train"].read_text().splitlines()
    bad.write_text("\n".join([lines[0], '{"problem": "p"}', "{oops"]) + "\n")
    shutil.copytree(count_data["train"].parent / "images", tmp_path / "images")
    for command in ("train", "sft"):
        code, err, seconds = run_cli(
            capsys, command, f"model.name_or_path={tiny_qwen25vl}", f"data.train_path={bad}", f"training.output_dir={tmp_path / 'out'}"
        )
        assert code == 2 and f"{bad}:2: solution: missing" in err and f"{bad}:3: row: invalid JSON" in err
        assert seconds < 10  # generous on a shared machine; no_model_load is the real guarantee


def test_cli_reward_problems_fail_before_loading(tiny_qwen25vl, count_data, capsys, no_model_load, tmp_path):
    base = [f"model.name_or_path={tiny_qwen25vl}", f"data.train_path={count_data['train']}", f"training.output_dir={tmp_path / 'o'}"]
    code, err, _ = run_cli(capsys, "train", *base, "algorithm.reward_funcs=[acurracy]")
    assert code == 2 and "did you mean 'accuracy'?" in err
    code, err, _ = run_cli(capsys, "train", *base, "algorithm.reward_funcs=[accuracy, accuracy]")
    assert code == 2 and err == "vlmrl train: algorithm.reward_funcs lists the same reward twice: ['accuracy', 'accuracy']"
    rewards = tmp_path / "r.py"
    rewards.write_text(VLMR1_REWARD)
    # A VLM-R1 reward with string completions fails now, on a real row, saying which switch makes it run.
    code, err, _ = run_cli(capsys, "train", *base, f"algorithm.reward_funcs=['{rewards}:vlmr1_accuracy']")
    assert code == 2 and "raised on sample 0" in err and "algorithm.completion_format=conversational" in err


def test_check_command_passes_without_loading(tiny_qwen25vl, count_data, capsys, no_model_load, tmp_path):
    rewards = tmp_path / "r.py"
    rewards.write_text(VLMR1_REWARD)
    code, err, _ = run_cli(
        capsys,
        "check",
        f"model.name_or_path={tiny_qwen25vl}",
        f"data.train_path={count_data['train']}",
        f"data.eval_path={count_data['test']}",
        f"training.output_dir={tmp_path / 'o'}",
        f"algorithm.reward_funcs=['{rewards}:vlmr1_accuracy']",
        "algorithm.completion_format=conversational",
    )
    assert code == 0, err
    assert "8 of 8 rows kept" in err and "4 of 4 rows kept" in err and err.endswith("vlmrl check: OK (" + str(tiny_qwen25vl) + ")")


def test_validated_data_is_reused_once(count_data, tmp_path):
    cfg = load_config(None, [f"data.train_path={count_data['train']}", f"training.output_dir={tmp_path}"])
    first = run_datasets.load_datasets(cfg, keep_for_run=True)
    assert run_datasets.load_datasets(cfg) is first  # the run gets the preflight's rows
    assert run_datasets.load_datasets(cfg) is not first  # and only once
    other = load_config(None, [f"data.train_path={count_data['train']}", f"training.output_dir={tmp_path}", "data.limit_images=1"])
    run_datasets.load_datasets(cfg, keep_for_run=True)
    assert run_datasets.load_datasets(other) is not first  # other settings: read again


def test_eval_refuses_to_guess_its_data(tmp_path, capsys, no_model_load, count_data):
    check_eval_data(load_config(None, []))  # the embedded model on the built-in task: its test split is the data
    check_eval_data(load_config(None, ["model.name_or_path=/m", "data.eval_path=x.jsonl"]))
    with pytest.raises(ConfigError, match=r"data.eval_path is empty \(data.train_path=t.jsonl is your data\)"):
        check_eval_data(load_config(None, ["data.train_path=t.jsonl"]))
    with pytest.raises(ConfigError, match=r"set data.eval_path=<held-out file> to score /models/mine"):
        check_eval_data(load_config(None, ["model.name_or_path=/models/mine"]))
    # The final model of a vlmrl run on the built-in task may be evaluated on it; one trained on user data may not.
    for train_path, allowed in (("", True), ("data/t.jsonl", False)):
        run = tmp_path / f"run{allowed}"
        (run / "final").mkdir(parents=True)
        (run / "config.yaml").write_text(f"data:\n  train_path: '{train_path}'\n")
        cfg = load_config(None, [f"model.name_or_path={run / 'final'}"])
        if allowed:
            check_eval_data(cfg)
        else:
            with pytest.raises(ConfigError, match="data.eval_path is empty"):
                check_eval_data(cfg)
    code, err, _ = run_cli(capsys, "eval", "model.name_or_path=/models/mine", f"data.train_path={count_data['train']}")
    assert code == 2 and err.count("\n") == 0 and "data.eval_path" in err


def test_skipped_rows_are_named_and_written(count_data, tmp_path):
    lines = count_data["train"].read_text().splitlines()
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([lines[0]] + ['{"problem": "p"}'] * 7 + [lines[1]]) + "\n")
    shutil.copytree(count_data["train"].parent / "images", tmp_path / "images")
    _, report = load_dataset_split(data, limit_images=None, skip_bad_rows=True)
    assert f"rows {data}:2, 3, 4, 5, 6 and 2 more" in report.summary()
    cfg = load_config(
        None, [f"data.train_path={data}", f"data.eval_path={data}", "data.skip_bad_rows=true", f"training.output_dir={tmp_path / 'out'}"]
    )
    loaded = run_datasets.load_datasets(cfg)
    assert all(line.endswith(f"(all listed in {tmp_path / 'out' / 'bad_rows.jsonl'})") for line in loaded.reports)
    records = [json.loads(x) for x in (tmp_path / "out" / "bad_rows.jsonl").read_text().splitlines()]
    assert [r["source"] for r in records if r["split"] == "train"] == [f"{data}:{i}" for i in range(2, 9)]
    assert len(records) == 14 and records[0]["reason"] == "missing" and records[0]["field"] == "solution"
    run_datasets.load_datasets(cfg)  # run again: the file is rewritten, not appended to
    assert len((tmp_path / "out" / "bad_rows.jsonl").read_text().splitlines()) == 14
    data.write_text(lines[0] + "\n")  # data fixed: no stale list left behind
    run_datasets.load_datasets(cfg)
    assert not (tmp_path / "out" / "bad_rows.jsonl").exists()


# -- no learning signal ----------------------------------------------------------------------------------------------
def test_no_signal_streak_and_warning():
    cfg = load_config(None, ["model.defaults=pretrained", "logging.no_signal_warn_steps=3", "optim.learning_rate=1e-6"])
    state, warnings = {}, []
    flat = {"frac_reward_zero_std": 1.0, "reward": 0.0, "completions/truncated_frac": 0.75}
    for frac in [1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0] + [1.0] * 26:
        metrics = {**flat, "frac_reward_zero_std": frac}
        warn_if_no_learning_signal(metrics, cfg, state, warnings.append)
    assert metrics["no_signal_steps"] == 30
    assert len(warnings) == 2  # at the 3rd step of the streak, then at the 30th
    text = warnings[0]
    assert text.startswith("WARNING: no learning signal for 3 steps")
    assert "optim.learning_rate=1e-06" in text and "rollout.temperature=1" in text and "no completion earns any reward" in text
    assert "75% of completions hit rollout.max_completion_length=32" in text
    assert update_no_signal_streak(4, {"frac_reward_zero_std": 0.99}) == 0
    assert "the same reward (1)" in no_signal_message(5, {"reward": 1.0}, cfg)
    quiet = load_config(None, ["logging.no_signal_warn_steps=0"])
    warn_if_no_learning_signal({**flat}, quiet, {}, warnings.append)
    assert len(warnings) == 2


def test_train_warns_when_rewards_are_constant(tiny_qwen25vl, count_data, tmp_path):
    rewards = tmp_path / "r.py"
    rewards.write_text("def constant(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    logged = []
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_qwen25vl}",
            f"data.train_path={count_data['train']}",
            "data.eval_path=''",
            f"training.output_dir={tmp_path / 'run'}",
            "training.max_steps=2",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=2",
            "rollout.max_completion_length=3",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "training.save_final_model=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            f"algorithm.reward_funcs=['{rewards}:constant']",
            "logging.no_signal_warn_steps=2",
        ],
    )
    import vlmrl.run.tracking as tracking

    original = tracking.RunLogger.info
    tracking.RunLogger.info = lambda self, msg: logged.append(msg)
    try:
        train.train(cfg)
    finally:
        tracking.RunLogger.info = original
    assert [m for m in logged if m.startswith("WARNING: no learning signal for 2 steps")]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["no_signal_steps"] for r in rows] == [1, 2]


def test_report_shades_no_signal_steps_and_bar_shows_them(tmp_path):
    from vlmrl.run.report import make_report, no_signal_spans
    from vlmrl.run.tracking import RunLogger

    rows = [{"step": s, "frac_reward_zero_std": f} for s, f in [(1, 1.0), (2, 1.0), (3, 0.5), (4, 1), (6, 1.0), (7, 1.0)]]
    assert no_signal_spans(rows) == [(1.0, 2.0), (4.0, 4.0), (6.0, 7.0)]
    assert RunLogger._summary({"reward": 0.0, "no_signal_steps": 3}) == "reward=0 no-signal=3"
    assert RunLogger._summary({"reward": 0.0, "no_signal_steps": 0}) == "reward=0"
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps({**r, "reward": 0.0}) for r in rows))
    assert make_report(tmp_path).stat().st_size > 0


def test_a_column_named_like_a_reward_argument_is_a_data_error(tiny_qwen25vl, tmp_path, capsys, no_model_load, count_data):
    row = json.loads(count_data["train"].read_text().splitlines()[0])
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({**row, "image": str(count_data["train"].parent / row["image"]), "completion_ids": 3}) + "\n")
    code, err, _ = run_cli(capsys, "check", f"model.name_or_path={tiny_qwen25vl}", f"data.train_path={data}", f"training.output_dir={tmp_path / 'o'}")
    assert code == 2 and f"{data}:1: dataset column 'completion_ids' clashes" in err and "Traceback" not in err
