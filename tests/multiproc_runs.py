"""What the multi-process run tests share (test_distributed, test_deepspeed, test_oom_multiproc): the tiny model and
count task their runs train on, the GRPO arguments of those small runs, and launching `vlmrl` on several processes
(a subprocess environment without the test process's own rank variables, torchrun on two loopback nodes, a store
that spawned workers join)."""

import json
import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1]
# Every launched test run: CPU, no progress bar / trackers / report, 56x56 images.
CPU_QUIET = (
    "training.device=cpu",
    "logging.progress_bar=false",
    "logging.tensorboard=false",
    "logging.report=false",
    "data.min_pixels=3136",
    "data.max_pixels=3136",
)
LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"


def tiny_run_setup(tmp_path_factory, name: str, n_test: int = 0):
    """(folder, tiny Qwen2.5-VL folder, count task {train, test}) for a module's runs."""
    from vlmrl.data.tasks import make_count_task
    from vlmrl.tiny_models.tiny import build_tiny_qwen25vl

    root = tmp_path_factory.mktemp(name)
    model = build_tiny_qwen25vl(root / "model")
    data = make_count_task(root / "count", n_train=16, n_test=n_test, seed=0, image_size=56)
    return root, model, data


def grpo_args(setup, out, *extra, steps=3, micro_batch=2, generation_batch=8, completion_tokens=5, held_out=False) -> list[str]:
    """`vlmrl train` overrides of the small runs: G=2, optimizer steps of micro_batch x 2 completions, beta > 0 (the
    reference is scored too), lr 1e-3 so that steps move the weights; held_out evaluates the task's test rows."""
    _, model, data = setup
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        f"data.eval_path={data['test'] if held_out else ''}",
        f"training.output_dir={out}",
        f"training.max_steps={steps}",
        "rollout.num_generations=2",
        f"training.per_device_train_batch_size={micro_batch}",
        "training.gradient_accumulation_steps=2",
        f"rollout.generation_batch_size={generation_batch}",
        *(["training.eval_batch_size=4"] if held_out else []),
        f"rollout.max_completion_length={completion_tokens}",
        "optim.learning_rate=1e-3",
        "algorithm.beta=0.05",
        "rollout.sampling_seed=prompt",
        *CPU_QUIET,
        f"algorithm.reward_funcs=['{LENGTH_REWARD}']",
        *extra,
    ]


def launch_env(**extra) -> dict:
    """This process's environment for a launched run: offline, one thread, this checkout's source, and none of the
    rank variables a launcher sets itself."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(key, None)
    return {**env, **extra}


def run_launcher(cmd, expect=0, timeout=240, **extra_env) -> str:
    """Run `cmd` from the checkout's root; assert its exit code; its output (stdout + stderr)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=launch_env(**extra_env), timeout=timeout, cwd=ROOT)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def torchrun(*launcher_args) -> list[str]:
    """`torchrun LAUNCHER_ARGS -m vlmrl train` (the train arguments follow)."""
    return [sys.executable, "-m", "torch.distributed.run", *launcher_args, "-m", "vlmrl", "train"]


def free_port() -> int:
    """A port that was free a moment ago (bind, read, close): only where two launchers must agree on a port in
    advance. Spawned workers use `rendezvous_store`, which holds its port from the moment it is chosen."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(train_args: list[str], env: dict, timeout: int) -> list[str]:
    """Two torchrun launches, node ranks 0 and 1, one process each, meeting at 127.0.0.1; each one's output."""
    port = str(free_port())
    nodes = ("--nnodes", "2", "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port)
    procs = [
        subprocess.Popen(torchrun(*nodes, "--node_rank", str(n)) + train_args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for n in range(2)
    ]
    logs = []
    for p in procs:
        text, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, text[-6000:]
        logs.append(text)
    return logs


def rendezvous_store():
    """A TCPStore this test process hosts on a port the OS picks (bound at once: no other process can take it in
    between). Workers join it as clients (worker_env's TORCHELASTIC_USE_AGENT_STORE, as under torchrun's agent); keep
    the returned store alive until they are done."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def worker_env(rank: int, world: int, port: int) -> dict:
    """The variables torchrun gives worker `rank` of `world`, joining the store at `port`."""
    return dict(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
    )


def step_metrics(out) -> dict[int, dict]:
    """{step: metrics row} of a run's metrics.jsonl."""
    return {r["step"]: r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())}
