"""RunLogger files, memory readings and the PNG report."""

import json
import math

import pytest
from PIL import Image

from vlmrl.engine.memory import memory_stats, phase_memory, reset_peaks
from vlmrl.run.report import make_report, summary_table
from vlmrl.run.tracking import RunLogger, read_jsonl


def _strict_lines(path):
    """Parse every line with NaN/Infinity rejected, as a non-Python JSON reader would."""

    def reject(token):
        raise ValueError(f"non-standard JSON constant {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_runlogger_writes_strict_jsonl_and_tensorboard(tmp_path):
    with RunLogger(tmp_path, total_steps=3, progress=False) as logger:
        logger.log(1, {"reward": 0.5, "loss": float("nan"), "kl": float("inf"), "time/step": 0.1})
        logger.log(2, {"reward": 0.75, "loss": 1.0})
        logger.log_eval(2, {"eval/accuracy": 0.4, "eval/iou": float("nan")})
        logger.log_samples(2, [{"prompt": "p", "completion": "c", "rewards": {"accuracy": 1.0}, "advantage": 0.3}])
        logger.info("hello")
    rows = _strict_lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] is None and rows[0]["kl"] is None and rows[0]["reward"] == 0.5
    assert isinstance(rows[0]["time"], float)
    (ev,) = _strict_lines(tmp_path / "eval.jsonl")
    assert ev["eval/accuracy"] == 0.4 and ev["eval/iou"] is None
    (sample,) = _strict_lines(tmp_path / "samples.jsonl")
    assert sample == {"step": 2, "prompt": "p", "completion": "c", "rewards": {"accuracy": 1.0}, "advantage": 0.3}
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_runlogger_appends_on_resume(tmp_path):
    with RunLogger(tmp_path, total_steps=4, tensorboard=False, progress=False) as logger:
        logger.log(1, {"reward": 0.1})
        logger.log(2, {"reward": 0.2})
    with RunLogger(tmp_path, total_steps=4, initial_step=2, tensorboard=False, progress=True) as logger:
        logger.log(3, {"reward": 0.3, "mem/host_peak_rss": 1.5})
        logger.log(4, {"reward": 0.4})
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_non_main_process_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    with RunLogger(out, total_steps=2, is_main_process=False) as logger:
        logger.log(1, {"reward": 1.0})
        logger.log_eval(1, {"eval/accuracy": 1.0})
        logger.log_samples(1, [{"prompt": "p"}])
        logger.info("should not print")
    assert not out.exists()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_read_jsonl_skips_truncated_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2, "rew')
    assert read_jsonl(path) == [{"step": 1}]
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_memory_stats():
    reset_peaks()
    stats = memory_stats()
    assert {"mem/host_rss", "mem/host_peak_rss"} <= stats.keys()
    assert stats["mem/host_peak_rss"] > 0 and stats["mem/host_rss"] > 0
    # The lifetime peak can't be below the current RSS (allow rounding between the two reads).
    assert stats["mem/host_peak_rss"] >= stats["mem/host_rss"] * 0.9
    assert all(isinstance(v, float) and math.isfinite(v) for v in stats.values())
    with phase_memory("rollout") as m:
        _ = bytearray(1 << 20)
    assert "mem/rollout/host_rss" in m and m["mem/rollout/host_rss"] > 0
    metrics = {}
    with phase_memory("update", metrics):
        pass
    assert metrics["mem/update/host_rss"] > 0


def _is_png(path):
    assert path.exists() and path.stat().st_size > 0
    with Image.open(path) as img:
        assert img.format == "PNG"
        img.verify()


def _fake_run(out, steps=30, with_eval=True):
    with RunLogger(out, total_steps=steps, tensorboard=False, progress=False) as logger:
        for s in range(1, steps + 1):
            logger.log(
                s,
                {
                    "reward": s / steps,
                    "rewards/accuracy/mean": s / steps / 2,
                    "loss": 1 / s,
                    "kl": 0.01 * s if s != 5 else float("nan"),
                    "completions/mean_length": 10 + s,
                    "mem/host_peak_rss": 1.2,
                    "mem/gpu_peak_allocated": 3.0,
                    "time/step": 0.5,
                },
            )
            if with_eval and s % 10 == 0:
                logger.log_eval(s, {"eval/accuracy": s / 40, "eval/iou": s / 50, "eval/num_samples": 20.0})


@pytest.mark.parametrize("with_eval", [True, False])
def test_make_report(tmp_path, with_eval):
    _fake_run(tmp_path, with_eval=with_eval)
    path = make_report(tmp_path, title="test run")
    assert path == tmp_path / "report.png"
    _is_png(path)


def test_make_report_missing_keys(tmp_path):
    # An SFT-like run: no reward, kl, lengths or memory; plus a resumed duplicate step.
    with RunLogger(tmp_path, total_steps=3, tensorboard=False, progress=False) as logger:
        for s in (1, 2, 2, 3):
            logger.log(s, {"loss": 1.0 / s})
    _is_png(make_report(tmp_path))
    # And a folder with no logs at all.
    _is_png(make_report(tmp_path / "empty"))


def test_summary_table():
    text = summary_table([("accuracy before", "40.0%"), ("accuracy after", "75.0%")], title="demo")
    assert "accuracy after" in text and "75.0%" in text and "demo" in text
    assert "gain" in summary_table({"gain": 0.35}, title="t")


def test_partial_last_line_from_a_killed_writer_is_cut(tmp_path):
    from vlmrl.run.tracking import RunLogger, read_jsonl

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "lo')
    logger = RunLogger(tmp_path, total_steps=3, initial_step=1, tensorboard=False, progress=False)
    logger.log(2, {"loss": 0.25})
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["loss"] == 0.25
