"""Issue 35, faults and hostile inputs: user code that forks (finding 14) or changes the working directory (16)
cannot take the run's lock, messages or folder with it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.data.tasks import make_count_task

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=4, seed=0, image_size=56)


def run_args(model, data, out, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
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


def vlmrl(args, cwd=None):
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "vlmrl", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------- 14: a reward's forked child
FORKING_REWARD = """import fcntl, json, os, sys

OUT, REPORT = {out!r}, {report!r}


def lock_state():
    try:
        fd = os.open(os.path.join(OUT, ".vlmrl-run.lock"), os.O_RDWR)
    except FileNotFoundError:
        return "missing"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return "held"
    finally:
        os.close(fd)
    return "free"


def forking(completions, **kwargs):
    pid = os.fork()
    if pid == 0:  # the child: {mode}
        {child}
    _, status = os.waitpid(pid, 0)
    with open(REPORT, "a") as f:
        f.write(json.dumps({{"pid": os.getpid(), "child_status": os.waitstatus_to_exitcode(status), "lock": lock_state()}}) + "\\n")
    return [0.0] * len(completions)
"""

CHILD = {
    "exits": "sys.exit(0)",  # e.g. a helper process that is done
    "raises": "raise ValueError('the child failed')",
    "returns": "return [1.0] * len(completions)",  # falls through the reward as a copy of the trainer
}


@pytest.mark.parametrize("mode", sorted(CHILD))
def test_a_rewards_forked_child_leaves_the_lock_and_the_messages_to_the_run(tiny_qwen25vl, count_data, tmp_path, mode):
    out, report = tmp_path / "out", tmp_path / "report.jsonl"
    (tmp_path / "r.py").write_text(FORKING_REWARD.format(out=str(out), report=str(report), mode=mode, child=CHILD[mode]))
    done = vlmrl(["train", *run_args(tiny_qwen25vl, count_data, out, f"algorithm.reward_funcs=['{tmp_path / 'r.py'}:forking']")])
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in report.read_text().splitlines()]
    # Preflight calls the reward before the lock is taken; every call during training finds it held by the parent.
    assert {line["pid"] for line in lines} == {lines[0]["pid"]}, "a forked child went on running the run"
    assert all(line["lock"] == "held" for line in lines[1:]) and len(lines) >= 3, lines
    assert {line["child_status"] for line in lines} == {1 if mode == "raises" else 0}
    # No fatal-sounding line from a child (the parent's own closing note, that no evaluation ran, is not one).
    fatal = [x for x in done.stderr.splitlines() if x.startswith("vlmrl train:") and "no evaluation ran" not in x]
    assert not fatal and "called sys.exit" not in done.stderr, done.stderr
    if mode == "raises":
        assert "ValueError: the child failed" in done.stderr and "the run goes on in process" in done.stderr
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (out / ".vlmrl-run.lock").exists()  # the parent removed it at its end


def test_the_lock_is_removed_only_by_the_process_that_took_it(tmp_path):
    from vlmrl.run.rundir import LOCK_FILE, RunLock

    lock = RunLock(tmp_path, log=lambda _: None)
    lock.acquire()
    pid = os.fork()
    if pid == 0:  # a copy of the run (forked by user code) that unwinds through the run's `with RunLock`
        lock.release()
        os._exit(0)
    os.waitpid(pid, 0)
    assert (tmp_path / LOCK_FILE).exists()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


# ---------------------------------------------------------------- 16: a reward that changes the working directory
CHDIR_REWARD = """import os

ELSEWHERE = {elsewhere!r}


def chdirs(completions, **kwargs):
    os.makedirs(ELSEWHERE, exist_ok=True)
    os.chdir(ELSEWHERE)  # e.g. a reward that runs a grader inside its own folder
    return [0.0] * len(completions)
"""


def test_relative_paths_stay_where_the_command_ran_when_a_reward_chdirs(tiny_qwen25vl, count_data, tmp_path):
    import shutil

    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    shutil.copytree(os.path.dirname(count_data["train"]), work / "data")
    (work / "r.py").write_text(CHDIR_REWARD.format(elsewhere=str(elsewhere)))
    relative = {"train": "data/" + os.path.basename(count_data["train"])}
    extra = ["algorithm.reward_funcs=['r.py:chdirs']", "training.save_steps=1"]
    done = vlmrl(["train", *run_args(tiny_qwen25vl, relative, "out", *extra)], cwd=work)
    assert done.returncode == 0, done.stderr
    out = work / "out"
    assert (out / "final").is_dir() and (out / "config.yaml").is_file() and (out / "checkpoint-2").is_dir()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert sorted(p.name for p in elsewhere.iterdir()) == []  # nothing of the run followed the reward
    # the same command again, from the same folder, finds its finished run there
    again = vlmrl(["train", *run_args(tiny_qwen25vl, relative, "out", *extra)], cwd=work)
    assert again.returncode == 0 and f"the vlmrl train run in {out} is complete" in again.stderr, again.stderr


# ---------------------------------------------------------------- 18: a hostile chat template
HOSTILE_TEMPLATES = {
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "bloats": "{{ 'x' * 2000000000 }}",
}


def hostile_folder(model, tmp_path, payload):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    (folder / "chat_template.jinja").write_text(payload + (folder / "chat_template.jinja").read_text())
    return folder


@pytest.fixture
def short_budget(monkeypatch):
    """The render time budget at 2 s (10 s in a run), so the looping templates are refused quickly."""
    import vlmrl.data.template_budget as budget

    monkeypatch.setattr(budget, "RENDER_TIME_S", 2.0)


@pytest.mark.parametrize("attack", sorted(HOSTILE_TEMPLATES))
@pytest.mark.parametrize("command", ["check", "train"])
def test_a_hostile_chat_template_is_refused_in_one_line(tiny_qwen25vl, count_data, tmp_path, capsys, short_budget, attack, command):
    from vlmrl.cli import main

    folder = hostile_folder(tiny_qwen25vl, tmp_path, HOSTILE_TEMPLATES[attack])
    assert main([command, *run_args(folder, count_data, tmp_path / "out")]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith(f"vlmrl {command}:")]
    assert f"the chat template in {folder / 'chat_template.jinja'}" in line, line
    assert ("ran longer than 2 s" if attack == "loops" else "more than 1 GiB of memory") in line, line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_template_that_loops_on_some_rows_only_is_stopped_in_process(tiny_qwen25vl, count_data, tmp_path, capsys, short_budget):
    """The probe's synthetic prompt passes; a real row with a 7 in it makes the template loop: the in-process budget
    (SIGALRM) stops that render in one line instead of hanging."""
    from vlmrl.cli import main

    loop = "{% if '7' in (messages|string) %}" + HOSTILE_TEMPLATES["loops"] + "{% endif %}"
    folder = hostile_folder(tiny_qwen25vl, tmp_path, loop)
    rows = [json.loads(x) for x in open(count_data["train"])]
    rows[3]["problem"] = rows[3]["problem"] + " (7)"
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "images").symlink_to(os.path.join(os.path.dirname(count_data["train"]), "images"))
    assert main(["check", *run_args(folder, {"train": str(data)}, tmp_path / "out")]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vlmrl check:")]
    assert f"the chat template in {folder / 'chat_template.jinja'} ran longer than 2 s rendering one prompt" in line, line


def test_data_prompt_template_is_rendered_under_the_same_budget(tiny_qwen25vl, count_data, tmp_path, capsys):
    from vlmrl.cli import main

    template = tmp_path / "format.jinja"
    template.write_text("{{ content }}" + HOSTILE_TEMPLATES["bloats"])
    assert main(["check", *run_args(tiny_qwen25vl, count_data, tmp_path / "out", f"data.prompt_template={template}")]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vlmrl check:")]
    assert f"data.prompt_template={template}" in line and "memory" in line, line


# ---------------------------------------------------------------- 17: a model folder whose weights do not fit
def _rewrite(folder, edit):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    edit(state)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})


def _drop_down_proj(state):
    del state[next(k for k in sorted(state) if k.endswith("mlp.down_proj.weight"))]


def _widen_down_proj(state):
    import torch

    key = next(k for k in sorted(state) if k.endswith("mlp.down_proj.weight"))
    state[key] = torch.zeros(state[key].shape[0], state[key].shape[1] + 1)


def _huge_header(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])


def _wrong_declared_shape(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    key = next(k for k in sorted(header) if k.endswith("mlp.down_proj.weight"))
    header[key]["shape"] = [header[key]["shape"][0], header[key]["shape"][1] // 2]  # no longer digits: same header length
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)  # same length: the offsets of the data stay right
    path.write_bytes(data[:8] + raw[:n] + data[8 + n :])


DAMAGES = {
    "missing tensor": (lambda f: _rewrite(f, _drop_down_proj), "lack 1 tensor(s) the model in config.json needs"),
    "wrong shape": (lambda f: _rewrite(f, _widen_down_proj), "do not have the shape config.json gives"),
    "header of 2^40 bytes": (_huge_header, "its header claims 1,099,511,627,776 bytes"),
    "offsets past the end": (_truncate, "past the file's end"),
    "declared shape against its bytes": (_wrong_declared_shape, "spans"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_check_refuses_weights_that_do_not_fit_the_model(tiny_qwen25vl, count_data, tmp_path, capsys, damage):
    import shutil

    from vlmrl.cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen25vl, folder)
    plant, says = DAMAGES[damage]
    plant(folder)
    assert main(["check", *run_args(folder, count_data, tmp_path / "out")]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("vlmrl check:")]
    assert str(folder) in line and says in line, line


def test_train_refuses_a_missing_tensor_instead_of_training_it_from_random(tiny_qwen25vl, count_data, tmp_path, capsys):
    import shutil

    from vlmrl.cli import main

    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen25vl, folder)
    _rewrite(folder, _drop_down_proj)
    assert main(["train", *run_args(folder, count_data, tmp_path / "out")]) == 2
    assert "lack 1 tensor(s)" in capsys.readouterr().err
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize("family", ["tiny_qwen25vl", "tiny_qwen3vl_moe", "tiny_gemma3", "tiny_qwen35"])
def test_every_familys_complete_folder_passes_the_weight_check(request, family):
    """No false alarm: saved names differ from module names (renamed, fused experts, tied heads); transformers decides."""
    from vlmrl.models.weight_files import check_expected_weights, check_weight_files

    folder = request.getfixturevalue(family)
    assert check_weight_files(folder)
    check_expected_weights(folder)
