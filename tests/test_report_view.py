"""What a person sees: report.png's panels (GRPO loss caption, learning signal, KL only with a reference, chance lines
where the task defines them), the progress bar's memory for the device in use, and SFT's samples.jsonl and summary."""

import json

import pytest
import yaml

from vlmrl.config import load_config, save_config, to_dict
from vlmrl.run.report import GRPO_LOSS_CAPTION, build_report, make_report, run_settings
from vlmrl.data.tasks import chance_levels, make_count_task, write_task_info
from vlmrl.run.tracking import RunLogger


def fake_run(out, grpo=True, steps=6, extra=None, **config_overrides):
    """metrics.jsonl / eval.jsonl of a short run, and its config.yaml as a run saves it."""
    overrides = [f"training.output_dir={out}", *(f"{k}={v}" for k, v in config_overrides.items())]
    save_config(load_config(None, overrides), out / "config.yaml")
    with RunLogger(out, total_steps=steps, tensorboard=False, progress=False) as logger:
        for s in range(1, steps + 1):
            metrics = {"loss": 1e-8 * s, "time/step": 0.5, "mem/host_peak_rss": 0.4, "plan/host_peak_rss": 0.42}
            if grpo:
                metrics.update(reward=s / steps, reward_std=0.3, frac_reward_zero_std=0.5, clip_ratio=0.01, kl=0.0)
            logger.log(s, {**metrics, **(extra or {})})
        logger.log_eval(steps, {"eval/accuracy": 0.5, "eval/num_samples": 8.0})


def axes_by_title(fig):
    return {ax.get_title(): ax for ax in fig.axes if ax.get_title()}


def texts(ax):
    return [t.get_text() for t in ax.texts]


def chance_line_labels(ax):
    return [line.get_label() for line in ax.lines if line.get_label().startswith("chance")]


def test_grpo_report_explains_the_loss_and_shows_the_learning_signal(tmp_path):
    fake_run(tmp_path, **{"algorithm.beta": 0.04})
    axes = axes_by_title(build_report(tmp_path))
    assert GRPO_LOSS_CAPTION in texts(axes["loss (policy gradient)"])
    signal = [line.get_label() for line in axes["learning signal"].lines]
    assert {"reward std", "groups with equal rewards", "clipped token fraction"} <= set(signal)
    assert "KL to reference" in axes  # beta > 0: a reference exists, its KL is drawn


def test_tool_use_panel_only_for_runs_that_log_tool_metrics(tmp_path):
    tools = {"tools/turns_mean": 1.5, "tools/calls_mean": 0.5, "tools/success_rate": 1.0, "tools/model_tokens_mean": 40.0}
    fake_run(tmp_path / "tools", extra=tools)
    axes = axes_by_title(build_report(tmp_path / "tools"))
    # Counts and shares share a panel; token counts (another scale) stay out of it.
    assert {line.get_label() for line in axes["tool use (per rollout)"].lines} == {"turns_mean", "calls_mean", "success_rate"}
    fake_run(tmp_path / "plain")
    assert "tool use (per rollout)" not in axes_by_title(build_report(tmp_path / "plain"))


def test_kl_panel_is_left_out_when_beta_is_zero(tmp_path):
    fake_run(tmp_path, **{"algorithm.beta": 0.0})
    assert run_settings(tmp_path)[0] == 0.0
    axes = axes_by_title(build_report(tmp_path))
    assert "KL to reference" not in axes and "reward" in axes
    assert make_report(tmp_path).is_file()


def test_report_without_a_config_keeps_kl_and_draws_no_chance(tmp_path):
    fake_run(tmp_path)
    (tmp_path / "config.yaml").unlink()
    assert run_settings(tmp_path) == (None, {})
    axes = axes_by_title(build_report(tmp_path))
    assert "KL to reference" in axes and chance_line_labels(axes["eval"]) == []


def test_builtin_count_task_draws_its_chance_line(tmp_path):
    files = make_count_task(tmp_path / "data" / "count", n_train=2, n_test=2, image_size=56, max_count=4)
    assert chance_levels(files["test"]) == {"accuracy": 0.25}
    fake_run(tmp_path)  # data.train_path empty: the built-in task, generated under output_dir/data/count
    assert run_settings(tmp_path)[1] == {"accuracy": 0.25}
    (line,) = [line for line in axes_by_title(build_report(tmp_path))["eval"].lines if line.get_label().startswith("chance")]
    assert line.get_label() == "chance (accuracy 0.25)" and list(line.get_ydata()) == [0.25, 0.25]


def test_user_data_gets_a_chance_line_only_when_it_declares_one(tmp_path):
    data = tmp_path / "mine"
    data.mkdir()
    (data / "test.jsonl").write_text("")
    fake_run(tmp_path / "run", **{"data.train_path": data / "train.jsonl", "data.eval_path": data / "test.jsonl"})
    assert chance_line_labels(axes_by_title(build_report(tmp_path / "run"))["eval"]) == []
    write_task_info(data, {"chance": {"accuracy": 0.2, "iou": "n/a"}})  # five-choice questions; junk values ignored
    assert chance_levels(data / "test.jsonl") == {"accuracy": 0.2}
    assert chance_line_labels(axes_by_title(build_report(tmp_path / "run"))["eval"]) == ["chance (accuracy 0.2)"]
    (data / "task.json").write_text("{not json")
    assert chance_levels(data / "test.jsonl") == {}


def test_sft_report_has_its_own_panels(tmp_path):
    fake_run(tmp_path, grpo=False)
    axes = axes_by_title(build_report(tmp_path))
    assert "loss (target negative log-likelihood)" in axes and GRPO_LOSS_CAPTION not in texts(axes["loss (target negative log-likelihood)"])
    assert not {"reward", "learning signal", "KL to reference", "completion length"} & set(axes)


def test_memory_panel_predicts_only_for_the_device_used(tmp_path):
    fake_run(tmp_path)
    labels = [line.get_label() for line in axes_by_title(build_report(tmp_path))["peak memory"].lines]
    assert "host_peak_rss (predicted)" in labels and not any("peak_reserved" in label for label in labels)


@pytest.mark.parametrize(
    "metrics, shown, hidden",
    [
        ({"mem/host_rss": 0.4, "mem/host_peak_rss": 0.43, "plan/host_peak_rss": 0.4, "plan/peak_allocated": 0.01}, "host=0.43G/plan 0.4G", "gpu"),
        (
            {"mem/host_peak_rss": 2.0, "mem/gpu_peak_allocated": 3.0, "mem/gpu_peak_reserved": 3.5, "plan/peak_reserved": 3.4},
            "gpu=3.5G/plan 3.4G",
            "host",
        ),
        ({"mem/host_peak_rss": 0.43}, "host=0.43G", "plan"),  # no prediction (the planner could not read the model)
    ],
)
def test_bar_shows_the_memory_of_the_device_in_use(tmp_path, capsys, metrics, shown, hidden):
    with RunLogger(tmp_path, total_steps=1, tensorboard=False, progress=False) as logger:
        logger.log(1, {"reward": 0.5, "time/step": 1.0, **metrics})
    line = capsys.readouterr().out
    assert shown in line and hidden not in line.lower()


def test_sft_writes_samples_report_and_summary(tiny_qwen25vl, tmp_path, capsys):
    from vlmrl.sft import sft

    data = make_count_task(tmp_path / "d", n_train=4, n_test=3, seed=0, image_size=56)
    out = tmp_path / "sft"
    cfg = load_config(
        None,
        [
            f"model.name_or_path={tiny_qwen25vl}",
            f"data.train_path={data['train']}",
            f"data.eval_path={data['test']}",
            f"training.output_dir={out}",
            "sft.projector_steps=0",
            "sft.steps=2",
            "sft.batch_size=2",
            "training.eval_steps=1",
            "logging.log_completions=2",
            "logging.tensorboard=false",
            "rollout.max_completion_length=3",
            "data.max_pixels=3136",
            "data.min_pixels=3136",
        ],
    )
    final = sft(cfg, log=lambda *_: None)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]  # at the evaluation after step 1, and the final one
    rows = [json.loads(line) for line in data["test"].read_text().splitlines()]
    for sample, row in zip(samples, rows[:2] * 2):
        assert sample["kind"] == "eval" and sample["prompt"] == row["problem"] and sample["target"] == row["response"]
        assert sample["correct"] is (sample["rewards"]["accuracy"] == 1.0) and isinstance(sample["completion"], str)
    assert (out / "report.png").is_file()
    assert "SFT finished" in capsys.readouterr().out and "eval/accuracy" in final
    assert yaml.safe_load((out / "config.yaml").read_text()) == to_dict(cfg)
