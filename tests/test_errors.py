"""User-caused failures end with one message and exit code 2 (VLMRL_DEBUG=1 adds the traceback); incomplete model folders
are diagnosed before anything loads."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from family_fixtures import ALL_FAMILY_FIXTURES

from vlmrl.cli import main
from vlmrl.models.loading import check_model_folder

SRC = str(Path(__file__).resolve().parents[1] / "src")
QUICK = [
    "training.max_steps=1",
    "rollout.num_generations=2",
    "training.per_device_train_batch_size=2",
    "rollout.max_completion_length=4",
    "data.task_train_size=4",
    "data.task_test_size=0",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.report=false",
]


def _copy(folder, tmp_path, name="model"):
    return Path(shutil.copytree(folder, tmp_path / name))


def _err_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("family", ALL_FAMILY_FIXTURES)
def test_complete_folders_have_nothing_missing(family, request):
    assert check_model_folder(request.getfixturevalue(family)) == []


@pytest.mark.parametrize(
    "delete, missing",
    [
        ("chat_template.jinja", "a chat template"),
        ("preprocessor_config.json", "image processor config (preprocessor_config.json)"),
        ("tokenizer.json", "tokenizer files"),
        ("model.safetensors", "weight files"),
        ("config.json", "config.json"),
    ],
)
def test_each_missing_piece_is_named(tiny_qwen25vl, tmp_path, delete, missing):
    folder = _copy(tiny_qwen25vl, tmp_path)
    (folder / delete).unlink()
    found = check_model_folder(folder)
    assert len(found) == 1 and found[0].startswith(missing), found


def test_template_in_tokenizer_config_counts_and_index_shards_are_checked(tiny_qwen25vl, tmp_path):
    folder = _copy(tiny_qwen25vl, tmp_path)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    assert check_model_folder(folder) == []
    index = {"weight_map": {"a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    assert check_model_folder(folder) == ["weight shards named in model.safetensors.index.json: model-00002-of-00002.safetensors"]


def _cli(args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "vlmrl", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_missing_chat_template_is_one_line_before_training_and_debug_shows_traceback(tiny_qwen25vl, tmp_path):
    # Without the check this crashed in step 1 (build_prompt, or get_rope_index's torch.cat on an empty list).
    folder = _copy(tiny_qwen25vl, tmp_path)
    (folder / "chat_template.jinja").unlink()
    args = ["train", f"model.name_or_path={folder}", f"training.output_dir={tmp_path / 'out'}", *QUICK]
    plain, debug = _cli(args), _cli(args, {"VLMRL_DEBUG": "1"})  # both at once: the imports dominate
    out, err = plain.communicate(timeout=300)
    assert plain.returncode == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        f"vlmrl train: model folder {folder} is incomplete: missing a chat template (chat_template.jinja, or chat_template "
        "in tokenizer_config.json) (vlmrl never downloads models unless model.allow_hub_download=true)"
    ]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # refused before the first step
    _, err = debug.communicate(timeout=300)
    assert debug.returncode == 2 and "Traceback (most recent call last)" in err and "require_complete_model_folder" in err
    assert err.rstrip().splitlines()[-1] == lines[0]


@pytest.mark.parametrize("delete", ["preprocessor_config.json", "tokenizer.json", "model.safetensors"])
def test_incomplete_folder_through_the_cli(tiny_qwen25vl, tmp_path, capsys, delete):
    folder = _copy(tiny_qwen25vl, tmp_path)
    (folder / delete).unlink()
    for command in ("train", "sft", "eval"):
        # eval needs its own data named (checked first); the model folder is checked before the data is read.
        eval_data = [f"data.eval_path={tmp_path / 'held_out.jsonl'}"] if command == "eval" else []
        assert main([command, f"model.name_or_path={folder}", f"training.output_dir={tmp_path / 'out'}", *QUICK, *eval_data]) == 2
        (line,) = _err_lines(capsys)
        assert line.startswith(f"vlmrl {command}: model folder {folder} is incomplete: missing ") and "Traceback" not in line


def test_out_of_memory_at_size_1_is_one_line(tiny_qwen25vl, tmp_path, capsys, monkeypatch):
    import vlmrl.engine.oom as oom

    monkeypatch.setitem(oom.INJECT_OOM_ABOVE, "rollout", 0)  # every piece, even one prompt, is "too large"
    assert main(["train", f"model.name_or_path={tiny_qwen25vl}", f"training.output_dir={tmp_path / 'out'}", *QUICK]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("vlmrl train: out of memory in rollout even at size 1") and "data.max_pixels" in line


def test_checkpoint_problems_are_one_message(tiny_qwen25vl, tmp_path, capsys):
    out = tmp_path / "out"
    base = [f"model.name_or_path={tiny_qwen25vl}", f"training.output_dir={out}", *QUICK, "training.save_steps=1", "training.save_final_model=false"]
    assert main(["train", *base]) == 0
    capsys.readouterr()
    checkpoint = out / "checkpoint-1"
    # A resume the config change makes inexact is refused.
    assert main(["train", *[a for a in base if not a.startswith("training.max_steps")], "training.max_steps=2", "optim.learning_rate=0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlmrl train: ") and "learning_rate" in err and "Traceback" not in err
    # Forced past the config check, a data set of another size is still refused (the sampler state cannot apply).
    assert main(["train", *base, "training.max_steps=2", "data.task_train_size=6", "training.resume_force=true"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("vlmrl train: sampler state has num_rows=4 but this sampler has 6; the data or seed changed")
    # A corrupt checkpoint named explicitly.
    weights = next((checkpoint / "model").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert main(["train", *base, "training.max_steps=2", f"training.resume={checkpoint}"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith(f"vlmrl train: training.resume={checkpoint}: checkpoint {checkpoint} is invalid")
    assert main(["export", str(checkpoint), str(tmp_path / "exported")]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("vlmrl export: ") and str(checkpoint) in line


def test_bad_data_and_rewards_exit_2(tiny_qwen25vl, tmp_path, capsys):
    from PIL import Image

    Image.new("RGB", (30000, 1)).save(tmp_path / "strip.png")
    (tmp_path / "d.jsonl").write_text(json.dumps({"image": "strip.png", "problem": "p", "solution": "1"}) + "\n")
    base = [f"model.name_or_path={tiny_qwen25vl}", f"training.output_dir={tmp_path / 'out'}", *QUICK]
    assert main(["train", *base, f"data.train_path={tmp_path / 'd.jsonl'}"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'd.jsonl'}:1: image: " in err and "Traceback" not in err
    assert main(["train", *base, "algorithm.reward_funcs=[nope.py:f]"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith("vlmrl train: reward 'nope.py:f': file not found")


def test_bugs_keep_their_traceback(monkeypatch):
    from vlmrl import cli

    def boom(ns):
        raise RuntimeError("a bug, not the user's fault")

    monkeypatch.setattr(cli, "_dispatch", boom)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["config"])
