"""`vlmrl check` predicts what `vlmrl train` would fail on, each in one line with exit 2 (issue 26 parts 5 and 7):
pickled weights, a chat template that raises, a resume the run would refuse (config, data or reward source changed
at the same paths); a refused resume changes no file."""

import pathlib
import random
import re
import shutil

import pytest
import torch
from PIL import Image

from vlmrl import cli, sft, train
from vlmrl.models import policy
from vlmrl.checkpoints.files import CheckpointError
from vlmrl.config import load_config
from vlmrl.checkpoints.fingerprints import changed_images, changed_inputs, file_fingerprint, image_fingerprints, path_fingerprint, run_fingerprints
from vlmrl.data.tasks import make_count_task

REWARDS = pathlib.Path(__file__).parent / "rewards_for_tests.py"


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=0, seed=0, image_size=56)


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the checks failed")

    for module in (policy, train, sft):
        monkeypatch.setattr(module, "load_policy", refuse)


def args(model, data_file, out, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data_file}",
        "data.eval_path=",
        f"training.output_dir={out}",
        "training.max_steps=2",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=4",
        "rollout.max_completion_length=3",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        *extra,
    ]


def one_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and "Traceback" not in "\n".join(err)
    return err[-1]


def snapshot(folder):
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- pickled weights, chat template
def test_pickled_weights_are_refused_in_one_line_with_the_conversion_command(tiny_qwen25vl, count_data, tmp_path, capsys, no_model_load):
    from safetensors.torch import load_file

    model = shutil.copytree(tiny_qwen25vl, tmp_path / "model")
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    for command in ("check", "train"):
        assert cli.main([command, *args(model, count_data["train"], tmp_path / "out")]) == 2
        line = one_line(capsys)
        assert f"model folder {model} holds pickled weights only (pytorch_model.bin)" in line
        assert "use_safetensors=False).save_pretrained(" in line


def test_a_chat_template_that_raises_fails_check(tiny_qwen25vl, count_data, tmp_path, capsys, no_model_load):
    model = shutil.copytree(tiny_qwen25vl, tmp_path / "model")
    # jinja's sandbox refuses attribute access to internals: SecurityError when rendered, not when loaded
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.__class__.__mro__ }}{% endfor %}")
    for command in ("check", "train"):
        assert cli.main([command, *args(model, count_data["train"], tmp_path / "out")]) == 2
        line = one_line(capsys)
        assert f"vlmrl {command}: the chat template of {model} fails on {count_data['train']}:" in line and "SecurityError" in line


# ---------------------------------------------------------------- fingerprints
def test_fingerprint_sees_a_changed_block_of_a_large_file(tmp_path, monkeypatch):
    import vlmrl.checkpoints.fingerprints as fp

    monkeypatch.setattr(fp, "FULL_HASH_BYTES", 4096)
    monkeypatch.setattr(fp, "BLOCK_BYTES", 512)
    monkeypatch.setattr(fp, "SAMPLED_BLOCKS", 8)
    big = tmp_path / "big.bin"
    data = bytearray(random.Random(0).randbytes(20000))
    big.write_bytes(bytes(data))
    before = file_fingerprint(big)
    data[0] ^= 1  # the first block is always sampled
    big.write_bytes(bytes(data))
    assert file_fingerprint(big) != before
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a").write_text("1")
    d0 = path_fingerprint(tmp_path / "dir")
    (tmp_path / "dir" / "b").write_text("2")
    assert path_fingerprint(tmp_path / "dir") != d0 and path_fingerprint(tmp_path / "absent") is None


def test_changed_inputs_names_what_changed():
    saved = {"data.train_path": "1:a", "reward r.py:f": "2:b"}
    assert changed_inputs(saved, dict(saved)) == []
    assert changed_inputs(None, saved) == []  # a checkpoint from before fingerprints
    assert changed_inputs(saved, {"data.train_path": "1:z", "reward r.py:f": "2:c"}) == [
        "data.train_path: its content changed (rows edited, added, removed or reordered)",
        "reward r.py:f: its source changed",
    ]


def test_image_fingerprints_name_a_replaced_or_gone_image_and_skip_embedded_ones(tmp_path, monkeypatch):
    import vlmrl.checkpoints.fingerprints as fp

    monkeypatch.setattr(fp, "IMAGE_BLOCK_BYTES", 256)  # a 4 KiB file is then sampled, not read whole
    cache = tmp_path / "cache"
    cache.mkdir()
    files = []
    for i, name in enumerate(["a.png", "b.png", "c.png", "cache/d.png"]):
        (tmp_path / name).write_bytes(random.Random(i).randbytes(4096))
        files.append(str(tmp_path / name))
    saved = image_fingerprints([{"images": files[:2]}, {"images": files[1:]}, {"problem": "text only"}], cache)
    assert list(saved) == files[:3]  # each once; the embedded image (vlmrl's cache) is its data file's
    assert changed_images(saved) == [] and changed_inputs({"images": saved}, {}) == []
    data = bytearray(random.Random(9).randbytes(4096))
    (tmp_path / "a.png").write_bytes(bytes(data))  # the same size, other bytes
    (tmp_path / "b.png").unlink()
    assert changed_images(saved) == [f"image {files[0]}: replaced (its content changed)", f"image {files[1]}: is gone"]
    assert changed_inputs({"images": saved}, {}) == changed_images(saved)  # what refuse_resume asks
    assert changed_images(saved, limit=1) == [f"image {files[0]}: replaced (its content changed)", "and 1 more images changed"]


def shuffle_rows(path):
    lines = path.read_text().splitlines()
    random.Random(1).shuffle(lines)
    path.write_text("\n".join(lines) + "\n")


# ~15 s each here: two in the slow tier.
@pytest.mark.parametrize(
    "change",
    [
        "shuffle",
        pytest.param("edit solutions", marks=pytest.mark.slow),
        pytest.param("append", marks=pytest.mark.slow),
        "reward source",
        "replace image",
    ],
)
def test_resume_after_inputs_changed_is_refused_by_check_and_train_and_changes_no_file(tiny_qwen25vl, count_data, tmp_path, capsys, change):
    src = pathlib.Path(count_data["train"])
    data_file = shutil.copytree(src.parent, tmp_path / "data") / src.name  # rows name their images relative to it
    reward = tmp_path / "my_reward.py"
    shutil.copy(REWARDS, reward)
    base = args(tiny_qwen25vl, data_file, tmp_path / "run", "training.save_steps=1", f"algorithm.reward_funcs=['{reward}:text_length']")
    out = tmp_path / "run"
    train.train(load_config(None, base), stop_after=1)
    assert run_fingerprints(load_config(None, base)).keys() == {"data.train_path", f"reward {reward}:text_length"}
    if change == "shuffle":
        shuffle_rows(data_file)
    elif change == "edit solutions":
        data_file.write_text(data_file.read_text().replace('"solution": "1"', '"solution": "7"'))
    elif change == "append":
        data_file.write_text(data_file.read_text() + data_file.read_text().splitlines()[0] + "\n")
    elif change == "replace image":  # the same name, other pixels (as a re-export or a fixed dataset would)
        image = data_file.parent / "images" / "train_00001.png"
        Image.new("RGB", (56, 56), (1, 2, 3)).save(image)
    else:
        reward.write_text(reward.read_text().replace("len(c) / 10", "len(c) / 11"))
    what = {
        "reward source": f"reward {reward}:text_length: its source changed",
        "replace image": f"image {data_file.parent.resolve() / 'images' / 'train_00001.png'}: replaced (its content changed)",
    }.get(change, "data.train_path: its content changed")
    before = snapshot(out)
    assert cli.main(["check", *base]) == 2
    assert what in one_line(capsys)
    with pytest.raises(CheckpointError, match=re.escape(f"the run's inputs changed since {out / 'checkpoint-1'}: {what}")):
        train.train(load_config(None, base))
    assert snapshot(out) == before  # bytes and modification times: config.yaml not rewritten, logs not cut
    if change in ("shuffle", "replace image"):
        lines = []
        train.train(load_config(None, [*base, "training.resume_force=true"]), log=lines.append)
        assert any(f"resuming despite changed inputs (training.resume_force=true): {what}" in line for line in lines)


# ---------------------------------------------------------------- CPU out of memory
def test_a_real_cpu_out_of_memory_is_recognised_and_retried_smaller():
    from vlmrl.engine.oom import is_out_of_memory, retry_on_oom

    def work(size):  # torch's CPU allocator refuses 1 PiB with a plain RuntimeError (as it did a 326 GB prompt)
        return torch.empty(2**50 if size > 2 else 8, dtype=torch.uint8).numel()

    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as e:
        assert is_out_of_memory(e)
    else:
        pytest.skip("this machine's overcommit setting lets 1 PiB be reserved")
    assert retry_on_oom(work, 8, "test", lambda _: None) == (8, 2)
    assert is_out_of_memory(MemoryError())
