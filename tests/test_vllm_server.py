"""rollout.vllm_mode=server against the real vLLM CPU build (`make test-vllm`): `vlmrl rollout-server` in its own
process on loopback, the trainer as its client, weights over gloo. Skipped with the reason where vllm is missing."""

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from multiproc_runs import LENGTH_REWARD, ROOT, launch_env, run_launcher, step_metrics

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vllm is not installed in this Python: `make test-vllm` runs these in .venv-vllm"
    ),
]

STEPS = 4  # GRPO steps of the runs (16 rows, 8 prompts a step: steps 3 and 4 sample steps 1 and 2's prompts again)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(model folder, port, process, its log) of one `vlmrl rollout-server` for the module's runs."""
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    root = tmp_path_factory.mktemp("server")
    folder = build_tiny_qwen25vl(root / "model")
    port, proc, log = start_server(folder, root)
    yield folder, port, proc, log
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def train_cmd(folder, port, out, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vlmrl",
        "train",
        f"model.name_or_path={folder}",
        f"training.output_dir={out}",
        "data.task=count",
        "data.task_train_size=16",
        "data.task_test_size=4",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "rollout.backend=vllm",
        "rollout.vllm_mode=server",
        f"rollout.vllm_server_port={port}",
        "rollout.vllm_server_timeout=600",
        "rollout.num_generations=4",
        "rollout.max_completion_length=8",
        f"algorithm.reward_funcs=['{LENGTH_REWARD}']",  # a signal for a random model: the weights move every step
        "optim.learning_rate=1e-3",
        "training.per_device_train_batch_size=8",
        "training.gradient_accumulation_steps=1",
        f"training.max_steps={STEPS}",
        "training.save_steps=1",
        "training.eval_steps=0",
        "logging.progress_bar=false",
        *extra,
    ]


def weights(out) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def straight(server, tmp_path_factory):
    """The uninterrupted run's folder (STEPS steps through the module's server)."""
    folder, port, _, _ = server
    out = tmp_path_factory.mktemp("straight") / "run"
    log = run_launcher(train_cmd(folder, port, out), timeout=1200)
    assert f"rollout: vLLM server at 127.0.0.1:{port}" in log and "weights over gloo" in log
    return out


def kill_after_checkpoint(cmd, out, step: int = 2) -> None:
    """Launch `cmd` and SIGKILL it once its step-`step` checkpoint is written (so in the next step: its rollout, push
    or update), following the run's progress, not the clock."""
    killed = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=launch_env(), cwd=ROOT)
    while killed.poll() is None and not (out / f"checkpoint-{step}").exists():
        time.sleep(0.01)
    assert killed.poll() is None, "the run ended before it could be killed"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (out / "final").exists()


def assert_same_run(straight, cut) -> None:
    """`cut` (killed, resumed) has `straight`'s per-step rewards and losses and its final weights, bit for bit; the
    probe and the per-sample mismatch within 1e-4 at every step."""
    a, b = step_metrics(straight), step_metrics(cut)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        assert (b[step]["reward"], b[step]["loss"]) == (a[step]["reward"], a[step]["loss"]), step
        assert b[step]["vllm/probe_max_abs_logp_diff"] < 1e-4 and b[step]["mismatch/max_abs_logp_diff"] < 1e-4
    assert len({a[s]["reward"] for s in a}) > 1  # the weights moved: a server on the old weights would sample otherwise
    wa, wb = weights(straight), weights(cut)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_server_mode_trains_and_resumes_after_a_kill(server, straight, tmp_path):
    """4 GRPO steps through the server; the same run SIGKILLed once its step-2 checkpoint is written and launched
    again: it reconnects, pushes the checkpoint's weights (the probe proves the server runs them) and ends with the
    uninterrupted run's per-step rewards and losses and its final weights, bit for bit: the server samples each
    prompt from its own seed, so the same weights give the same samples."""
    folder, port, proc, log = server
    cut = tmp_path / "cut"
    kill_after_checkpoint(train_cmd(folder, port, cut), cut)
    resumed = run_launcher(train_cmd(folder, port, cut), timeout=1200)
    assert "resumed from" in resumed and "checkpoint-2" in resumed
    assert_same_run(straight, cut)
    text = log.read_text()
    assert text.count("building the vLLM engine") == 1 and text.count("session 3 ended") == 1  # one engine, 3 trainers
    assert proc.poll() is None


def test_a_resume_against_a_restarted_server_is_the_same_run(server, straight, tmp_path):
    """The trainer and its server both killed (a whole job restarted): the run resumes against a new server, at
    another port (rollout.vllm_server_port may change on resume), whose engine is built anew, and still ends as the
    uninterrupted run did, bit for bit."""
    folder = server[0]
    first, proc, _ = start_server(folder, tmp_path, share="0.15")
    cut = tmp_path / "cut"
    try:
        kill_after_checkpoint(train_cmd(folder, first, cut), cut)
    finally:
        proc.kill()
        proc.wait()
    second, proc, log = start_server(folder, tmp_path, share="0.15")
    try:
        resumed = run_launcher(train_cmd(folder, second, cut), timeout=1200)
        assert "resumed from" in resumed and f"rollout: vLLM server at 127.0.0.1:{second}" in resumed
        assert_same_run(straight, cut)
        assert "session 1 ended" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def start_server(folder, root, share="0.3"):
    """(port, process, log) of a `vlmrl rollout-server` on `folder`."""
    port, group_port = free_port(), free_port()
    log = root / f"server-{port}.log"
    cmd = [sys.executable, "-m", "vlmrl", "rollout-server", str(folder), "--port", str(port), "--group-port", str(group_port)]
    with open(log, "w") as sink:
        proc = subprocess.Popen([*cmd, "--gpu-memory-utilization", share], stdout=sink, stderr=subprocess.STDOUT, env=launch_env(), cwd=ROOT)
    return port, proc, log


def test_two_servers_in_data_parallel_sample_what_one_server_samples(server, tmp_path):
    """rollout.vllm_servers with two servers: 2 steps whose rewards equal those of the same 2 steps on one server
    (each prompt samples from its own seed, whichever server gets it), both servers probed after every push."""
    folder, port, _, _ = server
    other, proc, log = start_server(folder, tmp_path, share="0.15")
    try:
        servers = f"rollout.vllm_servers=['127.0.0.1:{port}', '127.0.0.1:{other}']"
        both = run_launcher(train_cmd(folder, port, tmp_path / "dp", servers, "training.max_steps=2"), timeout=1200)
        assert f"rollout: vLLM server at 127.0.0.1:{port}, 127.0.0.1:{other}" in both
        run_launcher(train_cmd(folder, port, tmp_path / "one", "training.max_steps=2"), timeout=1200)
        a, b = step_metrics(tmp_path / "dp"), step_metrics(tmp_path / "one")
        assert sorted(a) == sorted(b) == [1, 2]
        for step in a:
            assert a[step]["reward"] == b[step]["reward"] and a[step]["loss"] == pytest.approx(b[step]["loss"], abs=1e-6)
            assert a[step]["vllm/probe_max_abs_logp_diff"] < 1e-4 and a[step]["mismatch/max_abs_logp_diff"] < 1e-4
        assert "session 1 ended" in log.read_text()
    finally:
        proc.kill()
        proc.wait()


def test_lora_run_and_its_evaluation_through_the_server(server, tmp_path):
    """model.use_lora in server mode: every push is the merged model (rollout/weights.py) over the weight group and the
    server's probe passes at every step; the held-out evaluation after step 2 decodes through the server."""
    folder, port, _, _ = server
    out = tmp_path / "lora"
    extra = ("model.use_lora=true", "model.lora_r=8", "optim.learning_rate=3e-2", "training.max_steps=2", "training.eval_steps=2")
    log = run_launcher(train_cmd(folder, port, out, *extra), timeout=1200)
    assert "evaluation: greedy decoding through vLLM" in log
    metrics = step_metrics(out)
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["vllm/probe_max_abs_logp_diff"] < 1e-4 and m["mismatch/max_abs_logp_diff"] < 1e-4 and m["vllm/sync_seconds"] > 0
    evaluated = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert evaluated and evaluated[-1]["eval/num_samples"] == 4


# SIGKILLs the module's server: keep it after every other test that uses `server`.
def test_a_server_that_dies_mid_run_ends_the_run_in_one_line(server, tmp_path):
    """The server is SIGKILLed after the run's first checkpoint: the trainer's next request finds it gone and the
    run exits 2 with one line naming host:port (no hang, no traceback); its checkpoint stays for a resume."""
    folder, port, proc, _ = server
    out = tmp_path / "run"
    run = subprocess.Popen(train_cmd(folder, port, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env(), cwd=ROOT)
    while run.poll() is None and not (out / "checkpoint-1").exists():
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, err = run.communicate(timeout=600)
    assert run.returncode == 2, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"vlmrl train: the rollout server at 127.0.0.1:{port} is gone"), last
    assert "Traceback" not in err
    assert (out / "checkpoint-1").exists()
    assert json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["global_step"] == 1
