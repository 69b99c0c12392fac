"""Adversarial tests for what a checkpoint / output folder can do to the loader: every loaded file planted with a
payload (a pickle whose __reduce__ creates a marker file) must be refused with a clear error and never run."""

import errno
import json
import os
import pathlib
import pickle
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

import vlmrl.checkpoints.files as ckpt
from vlmrl.checkpoints.files import CheckpointError, load_training_state, restore_rng, save_checkpoint
from vlmrl.config import ConfigError, load_config
from vlmrl.run.export import export_checkpoint
from vlmrl.checkpoints.state import consolidated_model_state, load_sharded_state
from vlmrl.checkpoints.run_manifest import MANIFEST_FILE
from vlmrl.data.tasks import make_count_task
from vlmrl.train import train

SRC_ENV = {**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).parents[1] / "src")}
LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"


class Payload:
    """Unpickling this creates `marker`: the proof that a loader ran code from a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def rehash(path: pathlib.Path) -> None:
    """What an attacker does after planting: a manifest that vouches for the planted files."""
    (path / ckpt.MANIFEST).unlink()
    ckpt._write_manifest(path, ckpt.checkpoint_step(path))


def linear_run():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def dcp_folder(folder, state):
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


# ---------------------------------------------------------------- torch.distributed.checkpoint (sharded checkpoints)
def test_sharded_state_round_trips_through_the_safe_loader(tmp_path):
    """The code-free reader loads what DCP wrote: weights, optimizer tensors and the param groups (bytes entries)."""
    model, opt = linear_run()
    folder = dcp_folder(tmp_path / "s", {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)})
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    load_sharded_state(fresh, folder, fresh_opt)
    assert torch.equal(fresh.weight, model.weight) and fresh_opt.param_groups[0]["lr"] == 1e-2
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert torch.equal(consolidated_model_state(folder)["weight"], model.weight)


LOADERS = {
    "resume (load_sharded_state)": lambda folder: load_sharded_state(torch.nn.Linear(3, 2), folder),
    "export (consolidated_model_state)": consolidated_model_state,
}


@pytest.mark.parametrize("loader", list(LOADERS))
def test_sharded_metadata_pickle_payload_never_runs(tmp_path, loader):
    model, _ = linear_run()
    folder = dcp_folder(tmp_path / "s", {"model": get_model_state_dict(model)})
    marker = tmp_path / "PWNED"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointError, match=r"refusing to load .*\.metadata: global .*open is not part of"):
        LOADERS[loader](folder)
    assert not marker.exists()


@pytest.mark.parametrize("loader", list(LOADERS))
def test_sharded_bytes_entry_payload_never_runs(tmp_path, loader):
    """A state entry stored as bytes (stock DCP reads those with torch.load(weights_only=False))."""
    marker = tmp_path / "PWNED"
    folder = dcp_folder(tmp_path / "s", {"model": {"weight": Payload(marker), "bias": torch.zeros(2)}})
    with pytest.raises(CheckpointError, match=r"refusing to load entry 'model.weight'.*not plain data"):
        LOADERS[loader](folder)
    assert not marker.exists()


def _load_planted_worker(rank: int, port: int, folder: str, queue) -> None:
    import torch.distributed as tdist

    # The test process hosts the rendezvous store (bound to its port at once): the workers join as clients.
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True")
    tdist.init_process_group("gloo")
    model = torch.nn.Linear(3, 2)
    try:
        load_sharded_state(model, folder, torch.optim.AdamW(model.parameters()))
        queue.put((rank, "loaded"))
    except Exception as e:  # reported whatever it is, so a wrong outcome fails the test instead of timing out
        queue.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("where", ["metadata", "bytes entry"])
def test_sharded_payload_is_refused_on_every_process_of_a_two_process_resume(tmp_path, where):
    """Two gloo processes resume from a planted folder: both get the refusal (none hangs), nothing runs."""
    import torch.multiprocessing as mp

    marker = tmp_path / "PWNED"
    model, opt = linear_run()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    if where == "bytes entry":
        state["optimizer"]["param_groups"][0]["lr"] = Payload(marker)
    folder = dcp_folder(tmp_path / "s", state)
    if where == "metadata":
        (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_load_planted_worker, args=(r, port, str(folder), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert not marker.exists()
    assert sorted(results) == [0, 1]
    assert all(r.startswith("UnsafeCheckpointError: refusing to load") for r in results.values()), results


def test_sharded_storage_path_outside_the_folder_is_refused(tmp_path):
    model, _ = linear_run()
    folder = dcp_folder(tmp_path / "s", {"model": get_model_state_dict(model)})
    from vlmrl.checkpoints.safe_load import MetadataUnpickler

    metadata = MetadataUnpickler(open(folder / ".metadata", "rb")).load()
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        consolidated_model_state(folder)


# ---------------------------------------------------------------- torch.load files of a checkpoint
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state_0.pt"])
def test_pt_file_payload_never_runs(tmp_path, name):
    from transformers import get_scheduler

    model, opt = linear_run()
    sched = get_scheduler("constant", opt)
    path = save_checkpoint(tmp_path, 1, save_model=lambda f: None, optimizer=opt, scheduler=sched, trainer_state={"epoch": 0}, config={})
    marker = tmp_path / "PWNED"
    torch.save({"state": {}, "param_groups": [], "x": Payload(marker)}, path / name)
    rehash(path)
    with pytest.raises(CheckpointError, match=rf"refusing to load .*{name}"):
        load_training_state(path, opt, sched)
        restore_rng(path)
    assert not marker.exists()


# ---------------------------------------------------------------- a real run's checkpoint: resume and export
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=0, seed=0, image_size=56)


def overrides(model, data, out, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        "data.eval_path=",
        f"training.output_dir={out}",
        "training.max_steps=2",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=4",
        "rollout.generation_batch_size=4",
        "rollout.max_completion_length=3",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        f"algorithm.reward_funcs=['{LENGTH_REWARD}']",
        *extra,
    ]


@pytest.fixture(scope="module")
def run_folder(tiny_qwen25vl, data, tmp_path_factory):
    """A run stopped after step 1: output_dir with checkpoint-1 (a clean copy per test: `fresh_run`)."""
    out = tmp_path_factory.mktemp("run") / "out"
    train(load_config(None, overrides(tiny_qwen25vl, data, out)), stop_after=1)
    return out


@pytest.fixture
def fresh_run(run_folder, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(run_folder, out)
    return out


def as_sharded(path: pathlib.Path, model_folder) -> dict:
    """Turn a checkpoint into an FSDP2 SHARDED_STATE_DICT one (DCP files under sharded/, model/ keeps only the
    config), written by one process. Returns the model state it holds."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path / "model")
    state = get_model_state_dict(model)
    dcp_folder(path / ckpt.SHARDED_DIR, {"model": state})
    (path / "model" / "model.safetensors").unlink()
    ts = json.loads((path / ckpt.TRAINER_STATE).read_text())
    ts["state_format"] = "sharded"
    (path / ckpt.TRAINER_STATE).write_text(json.dumps(ts))
    rehash(path)
    return state


def test_export_of_a_sharded_checkpoint_with_planted_payloads_runs_nothing(fresh_run, tmp_path, tiny_qwen25vl):
    path = fresh_run / "checkpoint-1"
    state = as_sharded(path, tiny_qwen25vl)
    exported = export_checkpoint(str(path), str(tmp_path / "exported"), log=lambda m: None)  # the untouched one exports
    weights = load_file(pathlib.Path(exported) / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in state.items() if k in weights) and len(weights) > 10

    marker = tmp_path / "PWNED"
    (path / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rehash(path)
    with pytest.raises(CheckpointError, match="refusing to load"):
        export_checkpoint(str(path), str(tmp_path / "exported2"), log=lambda m: None)
    assert not marker.exists() and not (tmp_path / "exported2" / "model.safetensors").exists()


def evil_model_folder(tiny, tmp_path, marker) -> pathlib.Path:
    """The tiny model plus remote code (auto_map) that creates `marker` when transformers imports it."""
    evil = tmp_path / "evil-model"
    shutil.copytree(tiny, evil)
    (evil / "evil_code.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((evil / "config.json").read_text())
    config["auto_map"] = {"AutoModelForImageTextToText": "evil_code.EvilModel"}
    (evil / "config.json").write_text(json.dumps(config))
    return evil


def test_export_takes_no_code_loading_settings_from_the_checkpoint(fresh_run, tmp_path, tiny_qwen25vl):
    """config.yaml in the checkpoint says trust_remote_code=true and points at a folder with code: export ignores
    both settings (says so) and loads no code; giving them on the command line needs the model path there too."""
    marker = tmp_path / "PWNED"
    evil = evil_model_folder(tiny_qwen25vl, tmp_path, marker)
    path = fresh_run / "checkpoint-1"
    tree = yaml.safe_load((path / "config.yaml").read_text())
    tree["model"].update(name_or_path=str(evil), trust_remote_code=True, allow_hub_download=True)
    (path / "config.yaml").write_text(yaml.safe_dump(tree))
    rehash(path)
    lines = []
    export_checkpoint(str(path), str(tmp_path / "exported"), log=lines.append)
    assert not marker.exists()
    assert any("ignoring model.trust_remote_code, model.allow_hub_download=true" in line for line in lines), lines
    assert (tmp_path / "exported" / "model.safetensors").exists()
    with pytest.raises(ConfigError, match="give model.name_or_path=<folder you trust> on the command line"):
        export_checkpoint(str(path), str(tmp_path / "exported2"), overrides=["model.trust_remote_code=true"])
    assert not marker.exists()


def test_resume_refuses_pickled_model_weights(fresh_run, tmp_path, tiny_qwen25vl, data):
    """model/ holding a pytorch_model.bin (a pickle) instead of safetensors: resume refuses, nothing runs."""
    path = fresh_run / "checkpoint-1"
    marker = tmp_path / "PWNED"
    (path / "model" / "model.safetensors").unlink()
    torch.save({"x": Payload(marker)}, path / "model" / "pytorch_model.bin")
    rehash(path)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        train(load_config(None, overrides(tiny_qwen25vl, data, fresh_run)))
    assert not marker.exists()


def test_resume_refuses_a_yaml_payload_in_config(fresh_run, tmp_path, tiny_qwen25vl, data):
    path = fresh_run / "checkpoint-1"
    marker = tmp_path / "PWNED"
    (path / "config.yaml").write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    rehash(path)
    with pytest.raises(CheckpointError, match="cannot read .*config.yaml"):
        train(load_config(None, overrides(tiny_qwen25vl, data, fresh_run)))
    assert not marker.exists()


# ---------------------------------------------------------------- one run per output_dir
HOLD_LOCK = (
    "import sys; from vlmrl.run.rundir import RunLock; lock = RunLock(sys.argv[1]); lock.acquire(); print('locked', flush=True); sys.stdin.read()"
)


def hold_lock_in_child(folder):

    child = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=SRC_ENV)
    assert child.stdout.readline().strip() == "locked"
    return child


def test_second_run_is_refused_then_a_dead_holders_lock_is_taken_over(tmp_path):
    from vlmrl.run.rundir import LOCK_FILE, RunLock, RunLockError

    out = tmp_path / "out"
    child = hold_lock_in_child(out)
    try:
        with pytest.raises(RunLockError, match=rf"in use by another vlmrl run \(PID {child.pid} on host {socket.gethostname()}"):
            RunLock(out).acquire()
        # The command line: one line, exit 2, before any model is loaded.
        cli = subprocess.run([sys.executable, "-m", "vlmrl", "train", f"training.output_dir={out}"], capture_output=True, text=True, env=SRC_ENV)
        assert cli.returncode == 2, cli.stderr
        assert cli.stderr.strip().count("\n") == 0 and f"PID {child.pid}" in cli.stderr, cli.stderr
    finally:
        child.send_signal(signal.SIGKILL)  # dies holding the lock: the file stays, flock is released by the kernel
        child.wait()
    assert (out / LOCK_FILE).exists()
    messages = []
    with RunLock(out, messages.append):
        holder = json.loads((out / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
    assert any(f"left by PID {child.pid}" in m and "no longer running" in m for m in messages), messages
    assert not (out / LOCK_FILE).exists()  # released: removed


def test_lock_without_flock_falls_back_to_the_pid_check(tmp_path, monkeypatch):
    import fcntl

    from vlmrl.run.rundir import LOCK_FILE, RunLock, RunLockError

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    alive = subprocess.Popen(["sleep", "30"])
    try:
        (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": alive.pid, "host": socket.gethostname()}))
        with pytest.raises(RunLockError, match=f"PID {alive.pid}"):
            RunLock(tmp_path).acquire()
    finally:
        alive.kill()
        alive.wait()
    messages = []
    with RunLock(tmp_path, messages.append):  # the same PID, now dead: taken over
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert any(f"PID {alive.pid}" in m for m in messages)


# ---------------------------------------------------------------- resume semantics
def snapshot(folder: pathlib.Path) -> dict:
    """Every file under `folder`: its bytes and modification time."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


def test_all_invalid_checkpoints_are_refused_not_restarted_over(fresh_run, tiny_qwen25vl, data):
    path = fresh_run / "checkpoint-1"
    blob = bytearray((path / "optimizer.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (path / "optimizer.pt").write_bytes(bytes(blob))
    before = snapshot(fresh_run)
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is invalid \(checkpoint-1: sha256 mismatch"):
        train(load_config(None, overrides(tiny_qwen25vl, data, fresh_run)))
    assert snapshot(fresh_run) == before
    # Asked for explicitly, a new run starts over; the invalid checkpoint is still there.
    train(load_config(None, overrides(tiny_qwen25vl, data, fresh_run, "training.resume=never")))
    assert path.is_dir() and (fresh_run / "final").is_dir()


def test_refused_resume_leaves_every_file_as_it_was(fresh_run, tiny_qwen25vl, data):
    before = snapshot(fresh_run)
    with pytest.raises(CheckpointError, match=r"rollout.max_completion_length: 3 -> 4"):
        train(load_config(None, overrides(tiny_qwen25vl, data, fresh_run, "rollout.max_completion_length=4")))
    assert snapshot(fresh_run) == before


def steps_of(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_rerun_steps_are_logged_once_and_a_finished_run_says_so(fresh_run, tiny_qwen25vl, data):

    from vlmrl.run.rundir import COMPLETE_FILE, RunAlreadyComplete

    cfg = load_config(None, overrides(tiny_qwen25vl, data, fresh_run))
    train(cfg)  # resumes from checkpoint-1, runs step 2
    assert steps_of(fresh_run / "metrics.jsonl") == [1, 2]
    samples = steps_of(fresh_run / "samples.jsonl")
    # A kill after step 2 was logged but before the run finished: step 2 runs again from checkpoint-1.
    (fresh_run / COMPLETE_FILE).unlink()
    shutil.rmtree(fresh_run / "final")
    with open(fresh_run / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "loss"')  # and a line cut by the kill
    lines = []
    train(cfg, log=lines.append)
    assert steps_of(fresh_run / "metrics.jsonl") == [1, 2]
    assert steps_of(fresh_run / "samples.jsonl") == samples
    assert any("removed 2 row(s) logged after step 1" in line for line in lines), lines

    before = snapshot(fresh_run)
    with pytest.raises(RunAlreadyComplete, match=r"is complete \(2 steps, final model in"):
        train(cfg)
    cli = subprocess.run(
        [sys.executable, "-m", "vlmrl", "train", *overrides(tiny_qwen25vl, data, fresh_run)], capture_output=True, text=True, env=SRC_ENV
    )
    assert cli.returncode == 0 and "is complete" in cli.stderr, cli.stderr
    assert snapshot(fresh_run) == before


# ---------------------------------------------------------------- save errors of every kind
def small_save(out, step, model, opt, **kw):
    from safetensors.torch import save_file

    return save_checkpoint(
        out,
        step,
        save_model=lambda f: save_file(model.state_dict(), str(f / "model.safetensors")),
        optimizer=opt,
        trainer_state={"epoch": 0},
        config={},
        **kw,
    )


def _raiser(error):
    def boom(*args, **kwargs):
        raise error

    return boom


def storage_errors():

    from safetensors import SafetensorError

    return {
        "torch full disk (RuntimeError unexpected pos)": RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
        "safetensors full disk": SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        ),
        "permission": PermissionError(errno.EACCES, "Permission denied"),
        "read-only file system": OSError(errno.EROFS, "Read-only file system"),
        "quota": OSError(errno.EDQUOT, "Disk quota exceeded"),
    }


@pytest.mark.parametrize("kind", list(storage_errors()))
@pytest.mark.parametrize("where", ["torch.save", "model writer"])
def test_every_storage_error_is_a_checkpoint_save_error(tmp_path, monkeypatch, kind, where):
    model, opt = linear_run()
    good = small_save(tmp_path, 1, model, opt)
    error = storage_errors()[kind]
    if where == "torch.save":
        monkeypatch.setattr(torch, "save", _raiser(error))
        with pytest.raises(ckpt.CheckpointSaveError, match=r"could not write checkpoint .*checkpoint-2 .*MiB free"):
            small_save(tmp_path, 2, model, opt)
    else:
        with pytest.raises(ckpt.CheckpointSaveError, match=r"earlier checkpoints in .* are intact"):
            save_checkpoint(tmp_path, 2, save_model=_raiser(error), optimizer=opt, trainer_state={}, config={})
    assert ckpt.verify_checkpoint(good) == (True, "ok")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != MANIFEST_FILE) == ["checkpoint-1"]


def test_a_bug_while_saving_is_not_hidden_as_a_save_error(tmp_path):
    model, opt = linear_run()
    with pytest.raises(ValueError, match="a bug"):
        save_checkpoint(tmp_path, 1, save_model=_raiser(ValueError("a bug")), optimizer=opt, trainer_state={}, config={})
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def small_fs(tmp_path):
    """A real 1 MiB tmpfs (root only): writes hit a real ENOSPC from the kernel."""

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (mount -t tmpfs); the injected-error tests cover the mapping")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_full_and_read_only_file_system(small_fs):

    from safetensors.torch import save_file

    from vlmrl.checkpoints.files import save_folder_atomically

    torch.manual_seed(0)
    small = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(small.parameters())
    small(torch.randn(1, 64)).sum().backward()
    opt.step()
    good = small_save(small_fs / "out", 1, small, opt)  # ~50 KiB: fits
    final = save_folder_atomically(small_fs / "out" / "final", lambda f: save_file(small.state_dict(), str(f / "model.safetensors")))
    big = torch.nn.Linear(400, 400)  # 640 KiB of weights, plus AdamW states: does not fit
    big_opt = torch.optim.AdamW(big.parameters())
    big(torch.randn(1, 400)).sum().backward()
    big_opt.step()
    with pytest.raises(ckpt.CheckpointSaveError, match=r"could not write checkpoint .*checkpoint-2.*MiB free"):
        small_save(small_fs / "out", 2, big, big_opt)
    with pytest.raises(ckpt.CheckpointSaveError, match=r"could not write .*final"):
        save_folder_atomically(final, lambda f: save_file({"w": torch.zeros(400, 1000)}, str(f / "model.safetensors")))
    assert ckpt.verify_checkpoint(good) == (True, "ok")
    assert sorted(p.name for p in (small_fs / "out").iterdir() if p.name != MANIFEST_FILE) == ["checkpoint-1", "final"]
    assert load_file(final / "model.safetensors")["weight"].shape == (64, 64)  # the previous final/ as it was

    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    with pytest.raises(ckpt.CheckpointSaveError, match="Read-only file system"):
        small_save(small_fs / "out", 3, small, opt)
    with pytest.raises(ckpt.CheckpointSaveError, match="Read-only file system"):
        save_folder_atomically(final, lambda f: None)
    assert ckpt.verify_checkpoint(good) == (True, "ok")


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_final_model_save_error_follows_on_save_error(fresh_run, tiny_qwen25vl, data, monkeypatch, policy):

    import vlmrl.models.loading

    real = vlmrl.models.loading.save_model

    def full_disk(model, processor, folder, *args, **kwargs):
        real(model, processor, folder, *args, **kwargs)  # written, then the disk fills up
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(vlmrl.models.loading, "save_model", full_disk)
    cfg = load_config(None, overrides(tiny_qwen25vl, data, fresh_run, f"training.on_save_error={policy}"))
    lines = []
    if policy == "stop":
        with pytest.raises(ckpt.CheckpointSaveError, match=r"could not write .*final: \[Errno 28\] No space left"):
            train(cfg, log=lines.append)
    else:
        train(cfg, log=lines.append)
        assert any("going on (training.on_save_error=continue), the run has no final model" in line for line in lines)
    assert not (fresh_run / "final").exists() and not (fresh_run / ".tmp-final").exists()
    assert ckpt.verify_checkpoint(fresh_run / "checkpoint-1") == (True, "ok")


def test_storage_error_classification_covers_sharded_writes():
    """DCP's save raises a CheckpointException (a BaseException) holding each rank's (exception, traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from vlmrl.checkpoints.files import is_storage_error

    full = CheckpointException("write_data", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    bug = CheckpointException("write_data", {0: (KeyError("model.x"), None)})
    wrapped = RuntimeError("while saving")
    wrapped.__cause__ = PermissionError(errno.EACCES, "Permission denied")
    assert is_storage_error(full) and is_storage_error(wrapped)
    assert not is_storage_error(bug) and not is_storage_error(ValueError("unexpected shape")) and not is_storage_error(None)


def test_resume_from_a_planted_sharded_checkpoint_runs_nothing(fresh_run, tmp_path, tiny_qwen25vl, data):
    """The whole resume path (train -> restore_after_wrap -> load_sharded_state) on a planted sharded checkpoint."""
    path = fresh_run / "checkpoint-1"
    as_sharded(path, tiny_qwen25vl)
    marker = tmp_path / "PWNED"
    (path / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    rehash(path)
    with pytest.raises(CheckpointError, match=r"refusing to load .*sharded/\.metadata"):
        train(load_config(None, overrides(tiny_qwen25vl, data, fresh_run)))
    assert not marker.exists()


def test_export_command_line_code_loading_needs_the_model_path(fresh_run, tmp_path, capsys):
    from vlmrl.cli import main

    assert main(["export", str(fresh_run), str(tmp_path / "x"), "model.trust_remote_code=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model.name_or_path=<folder you trust>" in err, err


def test_export_never_writes_over_a_users_folder(fresh_run, tmp_path, tiny_qwen25vl, capsys):
    """Issue 35 finding 15: `vlmrl export <checkpoint> <out>` into a folder holding the user's own model files refuses
    in one line (exit 2) and leaves them; a new folder, then the same folder again (an earlier export), are written."""
    from vlmrl.cli import main

    users = tmp_path / "my-model"
    shutil.copytree(tiny_qwen25vl, users)
    before = {p.name: p.read_bytes() for p in users.iterdir() if p.is_file()}
    assert main(["export", str(fresh_run / "checkpoint-1"), str(users)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"vlmrl export: {users} holds" in err and "config.json" in err, err
    assert {p.name: p.read_bytes() for p in users.iterdir() if p.is_file()} == before
    assert main(["export", str(fresh_run), str(fresh_run)]) == 2  # a run folder: its checkpoints are not an export's
    assert "is a vlmrl run folder" in capsys.readouterr().err
    out = tmp_path / "exported"
    for _ in range(2):  # the second export replaces the first
        assert main(["export", str(fresh_run / "checkpoint-1"), str(out)]) == 0
        assert (out / "model.safetensors").is_file()
    (out / "notes.txt").write_text("mine")
    assert main(["export", str(fresh_run / "checkpoint-1"), str(out)]) == 2
    assert "notes.txt" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"


def _drop_a_tensor(path):
    from safetensors.torch import load_file, save_file

    state = load_file(path)
    del state[next(k for k in sorted(state) if k.endswith("mlp.down_proj.weight"))]
    save_file(state, path, metadata={"format": "pt"})


def _claim_2_40_bytes(path):
    data = path.read_bytes()
    path.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])


@pytest.mark.parametrize("damage, says", [(_claim_2_40_bytes, "its header claims"), (_drop_a_tensor, "lack 1 tensor(s)")])
def test_export_refuses_a_base_model_whose_weights_are_damaged(fresh_run, tmp_path, tiny_qwen25vl, capsys, damage, says):
    """Issue 35 finding 17: a base model folder whose safetensors header claims 2^40 bytes ended export with a
    traceback; one missing a tensor exported without a word."""
    from vlmrl.cli import main

    base = tmp_path / "base"
    shutil.copytree(tiny_qwen25vl, base)
    damage(base / "model.safetensors")
    assert main(["export", str(fresh_run / "checkpoint-1"), str(tmp_path / "exported"), f"model.name_or_path={base}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("vlmrl export: ") and str(base) in err and says in err, err
    assert not (tmp_path / "exported").exists()
