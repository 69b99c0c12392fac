"""The prompt budget (issue 26 part 7): `check` and `train` measure every row's prompt, image tokens included, before
any weights load; a row over the budget is refused in one line naming file:line and its lengths (or dropped and
counted with data.skip_bad_rows), never cut. The findings: a 2 MB prompt passed `check` and made `train` attempt a
326 GB allocation; a 200 MB row passed `check` and `train` passed 8 GiB of RSS in 22 s. Reproduced on 4a7336b (before
the budget) with the count task and the tiny Qwen2.5-VL, each in a subprocess under RLIMIT_AS: the 2 MB prompt, `check`
OK (exit 0), then `train` still running after 600 s under 6 GiB; the 200 MB row, `check` OK, then `train` killed by
the tokenizer's failed allocation (SIGABRT, a Rust backtrace, 3.4 GiB RSS) under 5 GiB."""

import json
import resource
import shutil
import subprocess
import sys
import time

import pytest
import torch
from PIL import Image

from vlmrl import cli, sft, train
from vlmrl.config import load_config
from vlmrl.data.errors import DataError
from vlmrl.data.tasks import make_count_task
from vlmrl.models import policy
from vlmrl.run.datasets import configured_processor, encode_rows, load_datasets
from vlmrl.run.prompt_budget import PromptCounter, context_length

SENTENCE = "How many red squares are there in the picture above? "


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the prompt budget refused the row")

    for module in (policy, train, sft):
        monkeypatch.setattr(module, "load_policy", refuse)


def data_with_long_prompt(folder, megabytes: float, row: int = 2):
    """The count task (8 rows, 56x56 images) with row `row`'s problem made `megabytes` long."""
    files = make_count_task(folder, n_train=8, n_test=0, seed=0, image_size=56)
    lines = files["train"].read_text().splitlines()
    record = json.loads(lines[row])
    record["problem"] = SENTENCE * int(megabytes * 2**20 / len(SENTENCE))
    lines[row] = json.dumps(record)
    files["train"].write_text("\n".join(lines) + "\n")
    return files["train"]


def args(model, data_file, out, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data_file}",
        "data.eval_path=",
        f"training.output_dir={out}",
        "training.max_steps=1",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=4",
        "rollout.max_completion_length=3",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "training.device=cpu",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        *extra,
    ]


def last_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def test_a_2mb_prompt_is_refused_by_check_train_and_sft_before_the_weights_load(tiny_qwen25vl, tmp_path, capsys, no_model_load):
    data_file = data_with_long_prompt(tmp_path / "data", 2)
    out = tmp_path / "out"
    for command in ("check", "train", "sft"):
        assert cli.main([command, *args(tiny_qwen25vl, data_file, out)]) == 2
        line = last_line(capsys)
        assert line.startswith(f"vlmrl {command}: {data_file}:3: the prompt is at least ") and "characters of text" in line, line
        assert "over the prompt budget: the model's context of 4096 tokens" in line and "image tokens are never cut" in line
    assert not (out / "config.yaml").exists()  # refused before anything was written


def test_an_over_budget_row_is_dropped_and_counted_with_skip_bad_rows(tiny_qwen25vl, tmp_path, capsys):
    data_file = data_with_long_prompt(tmp_path / "data", 0.25)
    out = tmp_path / "out"
    assert cli.main(["check", *args(tiny_qwen25vl, data_file, out, "data.skip_bad_rows=true")]) == 0
    err = capsys.readouterr().err
    assert f"7 of 8 rows kept, 7 images; 1 bad rows skipped (prompt_too_long: 1; rows {data_file}:3)" in err
    assert "prompts: the longest is " in err and "budget the model's context of 4096 tokens" in err
    (record,) = [json.loads(x) for x in (out / "bad_rows.jsonl").read_text().splitlines()]
    assert record["source"] == f"{data_file}:3" and record["kind"] == "prompt_too_long" and "characters of text" in record["reason"]


def test_the_count_is_the_processors_with_image_tokens_and_max_prompt_length_names_both(tiny_qwen25vl, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    sizes = [[], [(56, 56)], [(112, 56), (56, 168)], [(200, 90)]]
    rows = []
    for i, row_sizes in enumerate(sizes):
        names = []
        for j, size in enumerate(row_sizes):
            Image.new("RGB", size, (10 * i, 20 * j, 90)).save(folder / f"{i}_{j}.png")
            names.append(f"{i}_{j}.png")
        rows.append({"images": names, "problem": "<image>" * len(names) + SENTENCE * (i + 1), "solution": "1"})
    data_file = folder / "train.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, args(tiny_qwen25vl, data_file, tmp_path / "out", "data.max_pixels=12544"))
    processor = configured_processor(cfg)
    data = load_datasets(cfg, processor=processor)
    counter = PromptCounter(processor, cfg)
    for row in data.train:  # what step 1 encodes, one row at a time
        expected = int(encode_rows(processor, [row], cfg, torch.device("cpu"))["attention_mask"].sum())
        total, text, _ = counter.row(row, None)
        assert total == expected and (text < total) == bool(row["images"])
    assert data.prompts.longest == max(counter.row(r, None)[0] for r in data.train)
    longest = data.prompts.longest
    tight = args(tiny_qwen25vl, data_file, tmp_path / "out", "data.max_pixels=12544", f"data.max_prompt_length={longest - 1}")
    with pytest.raises(DataError) as e:
        load_datasets(load_config(None, tight))
    message = str(e.value)
    assert "\n" not in message and f"{data_file}:" in message and f"the prompt is {longest:,} tokens (" in message
    assert " image tokens), over the prompt budget: data.max_prompt_length=" in message


def test_context_length_is_read_from_the_text_config(tmp_path, tiny_qwen25vl):
    assert context_length(tiny_qwen25vl) == 4096
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 321}, "max_position_embeddings": 9}))
    assert context_length(tmp_path) == 321
    assert context_length(tmp_path / "absent") is None


def test_check_plans_for_the_longest_prompt(tiny_qwen25vl, tmp_path, capsys):
    data_file = data_with_long_prompt(tmp_path / "data", 0.005)  # ~2,100 text tokens: under the budget
    base = args(tiny_qwen25vl, data_file, tmp_path / "out", "training.auto_fit_host_memory_gib=0.2")
    assert cli.main(["check", *base]) == 1
    err = capsys.readouterr().err
    assert "prompts of up to " in err and "planner: does NOT fit on this CPU" in err
    short = make_count_task(tmp_path / "short", n_train=8, n_test=0, seed=0, image_size=56)["train"]
    cli.main(["check", *args(tiny_qwen25vl, short, tmp_path / "out2", "training.auto_fit_host_memory_gib=0.2")])
    planned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("plan: tensors")]
    longest = [line for line in err.splitlines() if line.startswith("plan: tensors")]
    assert float(longest[0].split()[2]) > float(planned[0].split()[2])  # the long prompt's tensors are planned larger


def _limited(gib):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (int(gib * 2**30), int(gib * 2**30)))

    return apply


@pytest.mark.slow  # writes and reads a 200 MB file (~20 s here)
def test_a_200mb_row_is_refused_by_train_in_one_line_under_a_memory_limit(tiny_qwen25vl, tmp_path):
    data_file = data_with_long_prompt(tmp_path / "data", 200, row=0)
    out = tmp_path / "out"
    start = time.time()
    # 4 GiB of address space (the libraries take ~2): where the 200 MB row once passed 8 GiB of RSS, this process dies
    done = subprocess.run(
        [sys.executable, "-m", "vlmrl", "train", *args(tiny_qwen25vl, data_file, out)],
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_limited(4),
    )
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"vlmrl train: {data_file}:1: the prompt is at least ") and "209,715," in line, line
    assert "Traceback" not in done.stderr and not (out / "config.yaml").exists()
    print(f"200 MB row refused in {time.time() - start:.1f} s")
    shutil.rmtree(tmp_path / "data")
