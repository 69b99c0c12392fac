"""DeepSpeed ZeRO-2/3 for real, on two CPU processes (gloo, DeepSpeed's CPU accelerator), launched the way a user
launches it: `accelerate launch --config_file configs/accelerate/deepspeed_zero{2,3}.yaml --num_processes 2 -m vlmrl train`.

What is compared: the same GRPO run under DDP (torchrun, 2 processes). Per-step losses and rewards agree to 1e-6
relative; final weights to 1e-5 absolute, except the attention key biases: attention's softmax ignores a constant added
to every key score of a query, so their exact gradient is zero and AdamW turns the ~1e-9 rounding noise there into
steps of up to lr (1e-3), whichever engine runs. Resume from a DeepSpeed checkpoint is compared bit for bit with the
uninterrupted DeepSpeed run (same world size).

SFT runs the same way (`vlmrl sft` under ZeRO-2/3, against DDP; FSDP2's SFT twin sits here too, sharing the DDP
reference run).

The first DeepSpeed launch on a machine JIT-compiles DeepSpeed's shared-memory all-reduce op (cached afterwards in
~/.cache/torch_extensions): expect it to take a minute longer.
"""

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file

from multiproc_runs import CPU_QUIET, ROOT, grpo_args, launch_env, run_launcher, step_metrics, tiny_run_setup, torchrun, two_nodes

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed (pip install -e '.[deepspeed]'; `make test` installs it)")


def _run(cmd, expect=0, timeout=420, **extra_env):
    return run_launcher(cmd, expect, timeout=timeout, **extra_env)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return tiny_run_setup(tmp_path_factory, "ds")


def _args(setup, out, *extra):
    # 4 prompts x G=2 per step, optimizer steps of 4 completions: each of 2 processes holds one prompt of every
    # optimizer step.
    return grpo_args(setup, out, *extra)


@dataclass(frozen=True)
class Zero:
    """One DeepSpeed setup as a user launches it: `accelerate launch --config_file configs/accelerate/<config>`, with
    `--deepspeed_config_file configs/deepspeed/<json>` on the command line where `json` is set (it takes the place of
    the yaml's own JSON file)."""

    stage: int
    config: str
    json: str | None = None
    settings: str = "fp32 weights, offload_optimizer none, offload_param none"  # the log line's, after "DeepSpeed ZeRO-N ("


# The setups the runs use. ZeRO-2: deepspeed_json.yaml, which names the DeepSpeed JSON configs/deepspeed/zero2.json (the
# user's JSON, taken as it is). ZeRO-3 and ZeRO-3 with offload: the shipped yamls (accelerate's own deepspeed section).
# ZeRO-1, ZeRO-2 with optimizer offload, ZeRO-3 with both offloads (SFT's), ZeRO-2 in bf16: their JSON files given on
# the command line.
# With offload_optimizer, accelerate steps DeepSpeedCPUAdam instead of torch's AdamW (a C++ loop, the same update in
# another float order): on identical gradients the two end 6e-8 apart after 6 steps at lr 1e-3 (measured by hand, 200k
# elements, gradients from 1e-9 to 1), so offload runs keep DDP's 1e-5: what remains is the gradients' reduction order,
# amplified where AdamW divides a tiny gradient by its own size, as without offload (measured vs DDP, k_proj biases
# skipped: ZeRO-1 3.1e-7, ZeRO-2 offload 4.3e-7, ZeRO-3 offload 7.7e-6, ZeRO-3 without offload 7.7e-6 in the same session).
ZERO = {
    1: Zero(1, "deepspeed_json.yaml", "zero1.json"),
    2: Zero(2, "deepspeed_json.yaml"),
    3: Zero(3, "deepspeed_zero3.yaml"),
    "2-offload": Zero(2, "deepspeed_json.yaml", "zero2_offload.json", "fp32 weights, offload_optimizer cpu, offload_param none"),
    "3-offload": Zero(3, "deepspeed_zero3_offload.yaml", None, "fp32 weights, offload_optimizer cpu, offload_param cpu"),
    "3-offload-json": Zero(3, "deepspeed_json.yaml", "zero3_offload.json", "fp32 weights, offload_optimizer cpu, offload_param cpu"),
    "2-bf16": Zero(2, "deepspeed_json.yaml", "zero2_bf16.json", "bf16 weights, offload_optimizer none, offload_param none"),
}


def _accelerate(setup, *args) -> list[str]:
    """`accelerate launch` on 2 processes with ZERO[setup] (or the named file in configs/accelerate/)."""
    zero = ZERO.get(setup) or Zero(0, setup)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "configs" / "accelerate" / zero.config)]
    if zero.json:
        cmd += ["--deepspeed_config_file", str(ROOT / "configs" / "deepspeed" / zero.json)]
    return [*cmd, "--num_processes", "2", "-m", "vlmrl", "train", *args]


def _torchrun(*args) -> list[str]:
    return torchrun("--standalone", "--nproc_per_node", "2") + list(args)


def _worst_difference(a_file, b_file, skip=lambda k: False):
    a, b = load_file(a_file), load_file(b_file)
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a if not skip(k))


@pytest.fixture(scope="module")
def ddp(setup):
    out = setup[0] / "ddp"
    _run(_torchrun(*_args(setup, out)))
    return out


_RUNS: dict = {}


def _zero_run(setup, name):
    """The 3-step GRPO run under ZERO[name] with checkpoints at steps 2 and 3 (once per test session): (folder, log)."""
    if (setup[0], name) not in _RUNS:
        out = setup[0] / f"zero{name}"
        _RUNS[setup[0], name] = out, _run(_accelerate(name, *_args(setup, out, "training.save_steps=2")))
    return _RUNS[setup[0], name]


def _interrupted_copy(out, name):
    """`out` as it was after step 2 (checkpoint-2 the newest): what a run killed during step 3 leaves."""
    copy = out.parent / name
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("final", "checkpoint-3", "run_complete.json"))
    (copy / "metrics.jsonl").write_text("".join(x + "\n" for x in (out / "metrics.jsonl").read_text().splitlines()[:2]))
    return copy


def _slow(*names) -> list:
    return [pytest.param(name, marks=pytest.mark.slow) for name in names]


# ---------------------------------------------------------------- GRPO under ZeRO-1/2/3, with offload
@needs_deepspeed
@pytest.mark.multiproc
# ZeRO-2 in the default tier; the others in the slow tier (make test stays near 10 min)
@pytest.mark.parametrize("name", [2, *_slow(3, 1, "2-offload", "3-offload")])
def test_zero_trains_like_ddp_checkpoints_resume_bit_exact_and_export(setup, ddp, name):
    """GRPO under ZeRO[name] on 2 processes: DDP's rewards, losses and final weights (to ZERO[name].worst), the
    checkpoint in vlmrl's layout, resume bit-exact against the same setup's uninterrupted run, export."""
    zero = ZERO[name]
    out, log = _zero_run(setup, name)
    assert "2 processes (deepspeed)" in log and f"DeepSpeed ZeRO-{zero.stage} ({zero.settings}" in log
    if zero.config == "deepspeed_json.yaml":
        assert "reduce_bucket_size 50000000, allgather_bucket_size 50000000" in log  # the user's JSON, as it is
    assert "unknown inputs or outputs type" not in log  # ZeRO-3's hooks see tensors (Completions travel as a tuple)
    assert ("glibc's mmap threshold pinned at 128 KiB for DeepSpeed ZeRO-3" in log) == (zero.stage == 3)  # engine/host_alloc.py
    a, b = step_metrics(out), step_metrics(ddp)
    for s in (1, 2, 3):
        assert a[s]["reward"] == b[s]["reward"], s  # the same completions were sampled
        # Losses after the first update carry the weights' rounding (ZeRO reduces gradients in another order than DDP)
        # through the old log-probs of a rollout that spans two optimizer steps: measured 7.7e-6 relative at step 2.
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-4, abs=1e-8), s
    worst = _worst_difference(out / "final" / "model.safetensors", ddp / "final" / "model.safetensors", skip=lambda k: "k_proj.bias" in k)
    print(f"GRPO ZeRO[{name}] vs DDP: largest final weight difference {worst:.3g}")
    assert worst < 1e-5, worst

    # The checkpoint: vlmrl's single-process layout (full weights, torch's AdamW state), not DeepSpeed's pickles.
    ckpt = out / "checkpoint-2"
    assert json.loads((ckpt / "trainer_state.json").read_text())["engine"] == "deepspeed"
    weights = load_file(ckpt / "model" / "model.safetensors")
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(saved["state"]) == len(weights) and all(saved["state"][i]["exp_avg"].dim() >= 1 for i in saved["state"])
    assert all(float(v["step"]) == 4 for v in saved["state"].values())  # 2 steps x 2 optimizer steps
    # No DeepSpeed files (global_step*/, *_optim_states.pt, zero_to_fp32.py): the pickles its loader would unpickle.
    assert sorted(p.name for p in ckpt.rglob("*.pt")) == ["optimizer.pt", "rng_state_0.pt", "rng_state_1.pt", "scheduler.pt"]
    assert not list(ckpt.glob("global_step*")) and not list(ckpt.rglob("*.py"))

    # Killed after step 2: the same command resumes from checkpoint-2 and ends bit-identical to the uninterrupted run.
    resumed = _interrupted_copy(out, f"zero{name}_resumed")
    log = _run(_accelerate(name, *_args(setup, resumed, "training.save_steps=2")))
    assert "resumed from" in log and "checkpoint-2" in log
    a, b = load_file(resumed / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    exported = setup[0] / f"zero{name}_exported"
    _run([sys.executable, "-m", "vlmrl", "export", str(ckpt), str(exported)])
    e = load_file(exported / "model.safetensors")
    assert e.keys() == weights.keys() and all(torch.equal(e[k], weights[k]) for k in e)


# ---------------------------------------------------------------- SFT under ZeRO-2 and ZeRO-3
def _sft_args(setup, out, *extra):
    """Stage-2 SFT, 3 steps of 8 rows: 4 rows per process per step, in micro-batches of 2 (gradient accumulation under
    the engine's no_sync), a checkpoint at step 2."""
    _, model, data = setup
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        "data.eval_path=",
        f"training.output_dir={out}",
        "sft.projector_steps=0",
        "sft.steps=3",
        "sft.batch_size=8",
        "sft.micro_batch_size=2",
        "sft.learning_rate=1e-3",
        "training.save_steps=2",
        "rollout.max_completion_length=4",
        *CPU_QUIET,
        *extra,
    ]


def _as_sft(cmd: list[str]) -> list[str]:
    """A `... -m vlmrl train ...` launch as `... -m vlmrl sft ...`."""
    i = cmd.index("train")
    assert cmd[i - 1] == "vlmrl"
    return [*cmd[:i], "sft", *cmd[i + 1 :]]


@pytest.fixture(scope="module")
def sft_ddp(setup):
    out = setup[0] / "sft_ddp"
    log = _run(_as_sft(_torchrun(*_sft_args(setup, out))))
    assert "2 processes (ddp)" in log and "4 of 8 rows per step on each process" in log  # the DDP cell of the engine table
    return out


def _sft_zero_run(setup, name):
    """The 3-step SFT run under ZERO[name] (once per test session): (folder, log)."""
    if (setup[0], "sft", name) not in _RUNS:
        out = setup[0] / f"sft_zero{name}"
        _RUNS[setup[0], "sft", name] = out, _run(_as_sft(_accelerate(name, *_sft_args(setup, out))))
    return _RUNS[setup[0], "sft", name]


@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.parametrize("name", [2, *_slow(3, 1, "2-offload", "3-offload-json")])
def test_sft_under_zero_trains_like_ddp(setup, sft_ddp, name):
    """`vlmrl sft` under `accelerate launch` with ZERO[name] on 2 processes: the log names the stage, the losses and
    final weights are DDP's (to float rounding: the engines reduce gradients in another order), the checkpoint is
    vlmrl's layout; ZeRO-1 and the offload setups resume bit-exact here (ZeRO-2/3: in
    test_sft_zero_sigkill_anywhere_then_resume_equals_uninterrupted, slow tier)."""
    zero = ZERO[name]
    out, log = _sft_zero_run(setup, name)
    assert "2 processes (deepspeed)" in log and f"DeepSpeed ZeRO-{zero.stage} ({zero.settings}" in log and "unknown inputs or outputs type" not in log
    assert ("glibc's mmap threshold pinned at 128 KiB for DeepSpeed ZeRO-3" in log) == (zero.stage == 3)  # engine/host_alloc.py
    a, b = step_metrics(out), step_metrics(sft_ddp)
    assert sorted(a) == [1, 2, 3] and all(a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-5) for s in a)
    worst = _worst_difference(out / "final" / "model.safetensors", sft_ddp / "final" / "model.safetensors")
    print(f"SFT ZeRO[{name}] vs DDP: largest final weight difference {worst:.3g}")
    # measured 2.1e-6 (ZeRO-2), 3.0e-6 (ZeRO-3), 2.0e-6 (ZeRO-1), 2.0e-6 (ZeRO-2 offload), 3.0e-6 (ZeRO-3 offload)
    assert worst < 1e-5, worst

    ckpt = out / "checkpoint-2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["engine"] == "deepspeed" and state["stage"] == "language" and state["samples_consumed"] == 16
    # The gathered optimizer state in torch's AdamW layout, the same entries as DDP's checkpoint (the trainable language
    # model and projector: stage 2 leaves the vision tower frozen), equal to float rounding.
    saved, ddp = (torch.load(o / "checkpoint-2" / "optimizer.pt", weights_only=True) for o in (out, sft_ddp))
    assert saved["param_groups"][0]["params"] == ddp["param_groups"][0]["params"] and saved["state"].keys() == ddp["state"].keys()
    for i, moments in saved["state"].items():
        assert float(moments["step"]) == 2 and moments["exp_avg"].shape == ddp["state"][i]["exp_avg"].shape
        assert torch.allclose(moments["exp_avg_sq"], ddp["state"][i]["exp_avg_sq"], rtol=1e-4, atol=1e-9)
    assert sorted(p.name for p in ckpt.rglob("*.pt")) == ["optimizer.pt", "rng_state_0.pt", "rng_state_1.pt", "scheduler.pt"]
    assert not list(ckpt.glob("global_step*")) and not list(ckpt.rglob("*.py"))

    # `vlmrl export` of the step-3 checkpoint (one process): a plain folder with the final weights, bit for bit.
    exported = setup[0] / f"sft_zero{name}_exported"
    _run([sys.executable, "-m", "vlmrl", "export", str(out / "checkpoint-3"), str(exported)])
    a, b = load_file(exported / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    if name in (2, 3):
        return  # their resume: test_sft_zero_sigkill_anywhere_then_resume_equals_uninterrupted (slow tier)
    # Cut after step 2: the same command resumes from checkpoint-2 to the uninterrupted run's final weights, bit for bit.
    resumed = _interrupted_copy(out, f"sft_zero{name}_resumed")
    assert f"resumed from {resumed / 'checkpoint-2'}" in _run(_as_sft(_accelerate(name, *_sft_args(setup, resumed))))
    a = load_file(resumed / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- bf16 weights under ZeRO-2
@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.slow  # two launches per stage (~30-40 s each here)
@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_zero2_bf16_trains_resumes_bit_exact_and_final_loads(setup, kind, request):
    """`"bf16": {"enabled": true}` in the user's JSON under ZeRO-2: DeepSpeed runs the model in bf16 and steps fp32
    masters. The log says bf16; the losses are finite (SFT: they fall and follow the fp32 DDP run's to bf16 rounding);
    checkpoints hold the fp32 masters, not bf16 copies; a run cut after step 2 resumes to the uninterrupted run's final
    weights bit for bit; final/ loads with from_pretrained, every weight found."""
    from transformers import AutoModelForImageTextToText

    if kind == "sft":
        out, log = _sft_zero_run(setup, "2-bf16")
        relaunch = lambda folder: _as_sft(_accelerate("2-bf16", *_sft_args(setup, folder)))  # noqa: E731
        a, b = step_metrics(out), step_metrics(request.getfixturevalue("sft_ddp"))
        # bf16 keeps 8 significant bits (relative rounding 2^-9 per operation): measured 6e-5, 1.1e-4, 3.2e-4 relative.
        assert all(a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-2) for s in (1, 2, 3)) and a[3]["loss"] < a[2]["loss"] < a[1]["loss"]
    else:
        out, log = _zero_run(setup, "2-bf16")
        relaunch = lambda folder: _accelerate("2-bf16", *_args(setup, folder, "training.save_steps=2"))  # noqa: E731
        a = step_metrics(out)
    assert f"DeepSpeed ZeRO-2 ({ZERO['2-bf16'].settings}" in log and sorted(a) == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(a[s]["loss"])) for s in a)
    # The trained weights in the checkpoint are DeepSpeed's fp32 masters: values a bf16 copy cannot hold.
    weights = load_file(out / "checkpoint-2" / "model" / "model.safetensors")
    assert {v.dtype for v in weights.values()} == {torch.float32}
    assert any(not torch.equal(v, v.bfloat16().float()) for v in weights.values())

    resumed = _interrupted_copy(out, f"{kind}_bf16_resumed")
    assert "checkpoint-2" in _run(relaunch(resumed))
    final, again = load_file(out / "final" / "model.safetensors"), load_file(resumed / "final" / "model.safetensors")
    assert final.keys() == again.keys() and all(torch.equal(final[k], again[k]) for k in final)

    model, info = AutoModelForImageTextToText.from_pretrained(out / "final", output_loading_info=True)
    assert not any(info.values()), info  # no missing / unexpected / mismatched weights
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.multiproc
@pytest.mark.slow  # two FSDP2 launches; the SFT engine seam is the ZeRO tests' (no DeepSpeed needed here)
def test_sft_under_fsdp2_trains_like_ddp_resumes_bit_exact_and_exports(setup, sft_ddp):
    """`vlmrl sft` on 2 processes with the environment `accelerate launch --config_file configs/accelerate/fsdp2.yaml`
    exports (vlmrl applies `fully_shard` on CPU): DDP's losses and weights to float rounding, a run cut after step 2
    resumes to the same weights bit for bit, `vlmrl export` of checkpoint-3 gives `final/`."""
    fsdp2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    out = setup[0] / "sft_fsdp2"
    log = _run(_as_sft(_torchrun(*_sft_args(setup, out))), **fsdp2)
    assert "2 processes (fsdp2)" in log
    a, b = step_metrics(out), step_metrics(sft_ddp)
    assert sorted(a) == [1, 2, 3] and all(a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-5) for s in a)
    worst = _worst_difference(out / "final" / "model.safetensors", sft_ddp / "final" / "model.safetensors")
    print(f"SFT FSDP2 vs DDP: largest final weight difference {worst:.3g}")
    assert worst < 1e-5, worst  # measured 1.2e-6 by hand (a k_proj bias)
    assert json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["engine"] == "fsdp2"

    resumed = _interrupted_copy(out, "sft_fsdp2_resumed")
    log = _run(_as_sft(_torchrun(*_sft_args(setup, resumed))), **fsdp2)
    assert f"resumed from {resumed / 'checkpoint-2'}" in log, log[-3000:]
    a, b = load_file(resumed / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    exported = setup[0] / "sft_fsdp2_exported"
    _run([sys.executable, "-m", "vlmrl", "export", str(out / "checkpoint-3"), str(exported)])
    e = load_file(exported / "model.safetensors")
    assert e.keys() == b.keys() and all(torch.equal(e[k], b[k]) for k in e)


# ---------------------------------------------------------------- LoRA, and ZeRO-3 decoding layer by layer
@needs_deepspeed
@pytest.mark.slow  # two more launches (~1-2 min here)
def test_lora_under_zero3_with_layer_by_layer_generation_trains_like_ddp(setup):
    """LoRA adapters under ZeRO-3, the rollout gathering one module at a time (memory.generation_gather=layers: the
    processes decode in step), the reference = the adapter-disabled policy through the engine: the same run as DDP."""
    lora = ("model.use_lora=true", "memory.generation_gather=layers", "training.max_steps=2")
    ddp_out, out = setup[0] / "lora_ddp", setup[0] / "lora_zero3"
    _run(_torchrun(*_args(setup, ddp_out, *lora)))
    log = _run(_accelerate(3, *_args(setup, out, *lora, "training.save_steps=2")))
    assert "DeepSpeed ZeRO-3" in log and "unknown inputs or outputs type" not in log
    a, b = step_metrics(out), step_metrics(ddp_out)
    assert [a[s]["reward"] for s in (1, 2)] == [b[s]["reward"] for s in (1, 2)]
    assert (out / "checkpoint-2" / "model" / "adapter_model.safetensors").exists()  # LoRA checkpoints hold the adapter
    worst = _worst_difference(out / "final" / "model.safetensors", ddp_out / "final" / "model.safetensors", skip=lambda k: "k_proj.bias" in k)
    assert worst < 1e-5, worst


# ---------------------------------------------------------------- SIGKILL anywhere, saves included
def _kill_tree(proc) -> None:
    """SIGKILL the launcher and every process under it at once (the workers may sit in their own process groups)."""
    import signal

    import psutil

    launcher = psutil.Process(proc.pid)
    launcher.suspend()  # it spawns no worker between the listing below and the kill
    tree = [launcher, *launcher.children(recursive=True)]
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree[1:], timeout=30)


def _sigkill_anywhere(cmd: list[str], out: pathlib.Path, kills_wanted: int, seed: int, latest: float, **env) -> tuple[int, int, list]:
    """Launch `cmd` again and again, SIGKILLing the whole launch (accelerate's launcher and both processes) each time,
    until `kills_wanted` kills; then run it to the end. Kills follow the run's progress, not the clock (the machine's
    load and CPU vary): each attempt first completes one checkpoint (so every attempt moves the run on), then dies either
    as its next checkpoint starts being written (odd kills) or at a random moment up to `latest` seconds later but no
    later than the next checkpoint's completion (even kills: in a step, a save or the logging). So an attempt moves the
    run on by one checkpoint (odd) or at most two (even), whatever the CPU's speed: `kills_wanted` kills fit in any run
    of 1.5 * kills_wanted steps or more (with a clock-only delay, a faster Xeon ran several steps per attempt and a
    12-step run ended after 5 of its 6 kills).
    Returns (kills, kills while a checkpoint was being written, history)."""
    import random
    import time

    def newest() -> int:
        return max((int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")), default=0)

    def tmp_folders() -> set:
        return {(p.name, p.stat().st_mtime_ns) for p in out.glob(".tmp-checkpoint-*")} if out.exists() else set()

    rng, kills, mid_saves, finished, history = random.Random(seed), 0, 0, False, []
    while kills < kills_wanted:
        start = newest()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=launch_env(**env), cwd=ROOT)
        t0 = time.time()
        while proc.poll() is None and newest() <= start and time.time() - t0 < 600:
            time.sleep(0.005)
        before = tmp_folders()
        if kills % 2:  # as the next save starts
            while proc.poll() is None and not (tmp_folders() - before) and time.time() - t0 < 600:
                time.sleep(0.001)
        else:  # a random moment, cut short when the next checkpoint is complete
            deadline = time.time() + rng.uniform(0.0, latest)
            while proc.poll() is None and newest() <= start + 1 and time.time() < deadline:
                time.sleep(0.001)
        if proc.poll() is not None:
            assert proc.returncode == 0
            finished = True
            break
        _kill_tree(proc)
        kills += 1
        mid = bool(tmp_folders() - before)
        mid_saves += mid
        history.append((newest(), "mid-save" if mid else ""))
    if not finished:
        _run(cmd, **env)
    print(f"{kills} SIGKILLs, {mid_saves} while a checkpoint was being written: {history}")
    return kills, mid_saves, history


def _assert_same_run(straight: pathlib.Path, out: pathlib.Path, steps: int) -> None:
    """`out` (killed and resumed) ended with `straight`'s final weights bit for bit, every step logged with one loss,
    `straight`'s."""
    a, b = load_file(straight / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    by_step: dict = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        by_step.setdefault(row["step"], set()).add(row["loss"])
    assert sorted(by_step) == list(range(1, steps + 1)) and all(len(v) == 1 for v in by_step.values())
    assert {k: next(iter(v)) for k, v in by_step.items()} == {k: r["loss"] for k, r in step_metrics(straight).items()}


@needs_deepspeed
@pytest.mark.slow  # ~8 launches of 2 DeepSpeed processes: several minutes per stage here
@pytest.mark.parametrize("stage", [2, 3])
def test_grpo_zero_sigkill_anywhere_then_resume_equals_uninterrupted(setup, stage):
    """GRPO under ZeRO-`stage` SIGKILLed at random moments, every other time as soon as a checkpoint starts being
    written; the same command resumes each time. The final weights equal the uninterrupted run's bit for bit, and every
    step is logged with the same loss."""
    kills_wanted = int(os.environ.get("VLMRL_KILLS", "6"))
    extra = ("training.max_steps=12", "training.save_steps=1", "training.save_total_limit=2")  # room for 6+ kills: each attempt saves >= 1
    straight = setup[0] / f"kill_straight{stage}"
    _run(_accelerate(stage, *_args(setup, straight, *extra)))
    out = setup[0] / f"killed{stage}"
    kills, mid_saves, _ = _sigkill_anywhere(_accelerate(stage, *_args(setup, out, *extra)), out, kills_wanted, seed=1234, latest=2.0)
    _assert_same_run(straight, out, 12)
    # The comparison first: a run that ended before its last kill still proves what it can.
    assert kills >= kills_wanted and mid_saves >= 1


@pytest.mark.multiproc
@pytest.mark.slow  # ~8 two-process launches per engine: several minutes each here
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_grpo_sigkill_anywhere_under_ddp_and_fsdp2(setup, engine):
    """The GRPO kill test above under DDP and FSDP2 (torchrun, with the environment `accelerate launch` exports for
    fsdp2.yaml): the same final weights and per-step losses as the uninterrupted run of the same engine."""
    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"} if engine == "fsdp2" else {}
    kills_wanted = int(os.environ.get("VLMRL_KILLS", "6"))
    extra = ("training.max_steps=12", "training.save_steps=1", "training.save_total_limit=2")
    straight = setup[0] / f"kill_straight_{engine}"
    assert f"2 processes ({engine})" in _run(_torchrun(*_args(setup, straight, *extra)), **env)
    out = setup[0] / f"killed_{engine}"
    kills, mid_saves, _ = _sigkill_anywhere(_torchrun(*_args(setup, out, *extra)), out, kills_wanted, seed=7, latest=2.0, **env)
    _assert_same_run(straight, out, 12)
    # The comparison first: a run that ended before its last kill still proves what it can.
    assert kills >= kills_wanted and mid_saves >= 1


@needs_deepspeed
@pytest.mark.slow  # ~8 launches of 2 DeepSpeed processes each: several minutes per stage here
@pytest.mark.parametrize("stage", [2, 3])
def test_sft_zero_sigkill_anywhere_then_resume_equals_uninterrupted(setup, stage):
    """`vlmrl sft` under ZeRO-`stage`, killed and resumed as the GRPO run above (SFT steps take a fraction of a second
    here: kills land up to 0.5 s after a checkpoint). Ends bit-identical to the uninterrupted ZeRO-`stage` SFT run."""
    kills_wanted = int(os.environ.get("VLMRL_KILLS", "6"))
    extra = ("sft.steps=16", "training.save_steps=1", "training.save_total_limit=2")
    straight = setup[0] / f"sft_kill_straight{stage}"
    _run(_as_sft(_accelerate(stage, *_sft_args(setup, straight, *extra))))
    out = setup[0] / f"sft_killed{stage}"
    kills, mid_saves, _ = _sigkill_anywhere(_as_sft(_accelerate(stage, *_sft_args(setup, out, *extra))), out, kills_wanted, seed=stage, latest=0.5)
    _assert_same_run(straight, out, 16)
    # The comparison first: a run that ended before its last kill still proves what it can.
    assert kills >= kills_wanted and mid_saves >= 1


# ---------------------------------------------------------------- two nodes on loopback
def _two_nodes(setup, out, *extra):
    """Two torchrun launches (node ranks 0 and 1, one process each) with the environment `accelerate launch` exports
    for a ZeRO-3 config (its multi-node DeepSpeed launch goes through pdsh by default)."""
    env = launch_env(ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="3")
    return two_nodes(_args(setup, out, *extra), env, timeout=420)


@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.slow  # ~1-3 min of 2 launches; DDP keeps its two-node test in the default tier
def test_zero3_two_nodes_on_loopback_checkpoint_and_resume(setup, ddp):
    out = setup[0] / "zero3_nodes"
    logs = _two_nodes(setup, out, "training.max_steps=2", "training.save_steps=2")
    assert "DeepSpeed ZeRO-3" in logs[0] and "2 processes (deepspeed)" in logs[0]
    ckpt = out / "checkpoint-2"
    assert (ckpt / "rng_state_0.pt").exists() and (ckpt / "rng_state_1.pt").exists()
    logs = _two_nodes(setup, out)  # max_steps 2 -> 3: resume from checkpoint-2 on both nodes
    assert "resumed from" in logs[0] and "checkpoint-2" in logs[0]
    worst = _worst_difference(out / "final" / "model.safetensors", ddp / "final" / "model.safetensors", skip=lambda k: "k_proj.bias" in k)
    assert worst < 1e-5, worst


# ---------------------------------------------------------------- refusals: DeepSpeed or exit 2, never another engine
@needs_deepspeed
@pytest.mark.multiproc
def test_zero_gradient_clipping_that_contradicts_the_config_exits_2_in_one_line(setup):
    log = _run(_accelerate("deepspeed_zero2.yaml", *_args(setup, setup[0] / "clip", "optim.max_grad_norm=0.5")), expect=1)
    _assert_workers_exit_2_with(log, "vlmrl train: the DeepSpeed config sets gradient_clipping=1.0 but optim.max_grad_norm=0.5")


def _assert_workers_exit_2_with(log: str, line: str) -> None:
    """Both processes printed `line` and exited with code 2, without a traceback of their own (accelerate's launcher
    then exits 1 with its ChildFailedError summary)."""
    assert log.count(line) == 2, log[-4000:]
    assert "failed (exitcode: 2)" in log and "[rank0]: Traceback" not in log and "[rank1]: Traceback" not in log


def test_deepspeed_asked_without_the_package_exits_2(monkeypatch):
    """A launch asking for DeepSpeed where the package cannot be imported: one line naming the fix, not DDP."""
    import importlib.util as iu

    from vlmrl.engine.distributed import DistributedError, require_deepspeed

    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "deepspeed" else importlib.util.find_spec(name, *a))
    with pytest.raises(DistributedError, match=r"pip install 'vlmrl\[deepspeed\]'"):
        require_deepspeed()


def test_deepspeed_asked_but_another_engine_set_up_is_refused(monkeypatch):
    """accelerate set up plain multi-CPU (e.g. use_cpu: true) while the launcher asked for DeepSpeed: refused."""
    from types import SimpleNamespace

    from vlmrl.engine.collectives import Collectives
    from vlmrl.engine.distributed import DistributedError, engine_for

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    accel = SimpleNamespace(
        state=SimpleNamespace(distributed_type="DistributedType.MULTI_CPU", num_processes=2, process_index=0, local_process_index=0)
    )
    with pytest.raises(DistributedError, match="asks for DeepSpeed .* accelerate set up distributedtype.multi_cpu"):
        engine_for(Collectives(accel), accel)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert engine_for(Collectives(accel), accel).name == "ddp"


def test_deepspeed_config_checks_fills_and_describes():
    from vlmrl.engine.deepspeed_config import check_config, describe, fill_config
    from vlmrl.engine.distributed import DistributedError

    ds = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto", "offload_param": {"device": "cpu"}}}
    check_config(ds, 0.5)
    fill_config(ds, 4, hidden_size=64)
    assert ds["gradient_clipping"] == 0.5 and ds["train_micro_batch_size_per_gpu"] == 4 and ds["gradient_accumulation_steps"] == 1
    assert ds["zero_optimization"]["reduce_bucket_size"] == 4096 and ds["zero_optimization"]["stage3_prefetch_bucket_size"] == 3686
    line = describe({**ds, "bf16": {"enabled": True}})
    assert line.startswith("DeepSpeed ZeRO-3 (bf16 weights") and "offload_param cpu" in line and "reduce_bucket_size 4096" in line
    user = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000}}
    fill_config(user, 8, hidden_size=64)
    assert user["train_micro_batch_size_per_gpu"] == 2 and user["zero_optimization"]["reduce_bucket_size"] == 1000  # the user's values stay
    with pytest.raises(DistributedError, match="gradient_accumulation_steps=4"):
        check_config({"gradient_accumulation_steps": 4}, 1.0)
    with pytest.raises(DistributedError, match=r"gradient_clipping=2.0 but optim.max_grad_norm=1.0"):
        check_config({"gradient_clipping": 2.0}, 1.0)
    # fp16: DeepSpeed's CPU accelerator raises "Type fp16 is not supported on your device." (a traceback on every
    # process, measured); on GPUs an overflow would skip a step behind vlmrl's back. Refused before anything loads.
    with pytest.raises(DistributedError, match=r'"fp16": \{"enabled": true\}.* use "bf16": \{"enabled": true\}'):
        check_config({"fp16": {"enabled": True}}, 1.0)
    check_config({"fp16": {"enabled": False}, "bf16": {"enabled": True}}, 1.0)


@needs_deepspeed
@pytest.mark.slow  # builds DeepSpeedCPUAdam's C++ op on first use (~1 min here; cached in ~/.cache/torch_extensions)
def test_cpu_adam_resumed_from_its_saved_state_steps_bit_for_bit_like_the_uninterrupted_one():
    """DeepSpeedCPUAdam (the optimizer under offload_optimizer) keeps beta^t as a running product in C++; a fresh one
    handed a saved state at step k computes it with pow() instead. engines._catch_up_cpu_adam replays the product:
    resumed after any of 11 steps, the weights equal the uninterrupted run's; without it, a resume at step 4 with
    vlmrl's default betas (0.9, 0.99) ends elsewhere (what the ZeRO-2 offload resume test first showed)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from vlmrl.engine.engines import _catch_up_cpu_adam

    torch.manual_seed(0)
    grads = [torch.randn(1000) for _ in range(12)]
    kw = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)

    def run(gs, start=None, state=None, catch_up=True):
        p = torch.nn.Parameter(torch.zeros(1000) if start is None else start.clone())
        opt = DeepSpeedCPUAdam([p], **kw)
        if state is not None:
            opt.state[p] = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
            if catch_up:
                _catch_up_cpu_adam(opt, state["step"])
        for g in gs:
            p.grad = g.clone()
            opt.step()
        return p.detach(), opt.state[p]

    straight, _ = run(grads)
    for k in range(1, 12):
        weights, state = run(grads[:k])
        assert torch.equal(run(grads[k:], weights, state)[0], straight), k
    weights, state = run(grads[:4])
    assert not torch.equal(run(grads[4:], weights, state, catch_up=False)[0], straight)


def test_zero2_bf16_reference_is_cast_like_the_policy():
    """ZeRO-1/2 keep the frozen reference outside DeepSpeed; with bf16 weights it is cast to bf16 as DeepSpeed casts
    the policy (the KL term compares like with like); fp32 configs leave it alone."""
    from types import SimpleNamespace

    from vlmrl.engine.engines import DeepSpeedEngine

    plugin = SimpleNamespace(zero_stage=2, deepspeed_config={"bf16": {"enabled": True}})
    engine = DeepSpeedEngine(None, SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)))
    reference = torch.nn.Linear(2, 2)
    assert engine.wrap_reference(reference) is None and reference.weight.dtype == torch.bfloat16
    plugin.deepspeed_config = {"bf16": {"enabled": False}}
    reference = torch.nn.Linear(2, 2)
    assert engine.wrap_reference(reference) is None and reference.weight.dtype == torch.float32


# ---------------------------------------------------------------- loading never runs code, under DeepSpeed too
class Payload:
    """Unpickling this creates `marker`: the proof that a loader ran code from a file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _plant(path: pathlib.Path, name: str, marker: pathlib.Path) -> None:
    """`name` in checkpoint `path` replaced by a pickle payload, and a manifest that vouches for it (what an attacker
    with write access does)."""
    import vlmrl.checkpoints.files as ckpt

    if name == "model/pytorch_model.bin":  # pickled weights in place of model.safetensors
        (path / "model" / "model.safetensors").unlink()
    torch.save({"state": {}, "param_groups": [], "x": Payload(marker)}, path / name)
    (path / ckpt.MANIFEST).unlink()
    ckpt._write_manifest(path, ckpt.checkpoint_step(path))


@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "name",
    [
        "optimizer.pt",  # read by every process after deepspeed.initialize (DeepSpeedEngine.load_state)
        pytest.param("scheduler.pt", marks=pytest.mark.slow),
        pytest.param("rng_state_1.pt", marks=pytest.mark.slow),  # read by process 1 only
        pytest.param("model/pytorch_model.bin", marks=pytest.mark.slow),
    ],
)
def test_zero2_resume_from_a_planted_checkpoint_runs_nothing(setup, name):
    """A DeepSpeed checkpoint holds only vlmrl's files (safetensors, weights-only torch files, JSON, YAML): a payload
    planted in any of them is refused (the processes exit 2) on a 2-process ZeRO-2 resume, and never runs."""
    out, _ = _zero_run(setup, 2)
    planted = _interrupted_copy(out, "planted-" + name.replace("/", "-"))
    marker = setup[0] / ("PWNED-" + name.replace("/", "-"))
    _plant(planted / "checkpoint-2", name, marker)
    log = _run(_accelerate(2, *_args(setup, planted, "training.save_steps=2")), expect=1)
    assert "failed (exitcode: 2)" in log and "[rank0]: Traceback" not in log and "[rank1]: Traceback" not in log, log[-4000:]
    assert "refusing to load" in log or "model.safetensors" in log, log[-3000:]
    assert not marker.exists()


# ---------------------------------------------------------------- out of memory on one process
@needs_deepspeed
@pytest.mark.slow  # ~1 min here; the FSDP2 twin is in test_oom_multiproc.py
def test_zero3_oom_on_one_process_stops_every_process_with_one_line(setup):
    """ZeRO-3's forward and backward hold all-gathers and reduce-scatters: rank 1 running out of memory in the update
    cannot be redone alone. Both processes exit 2 with the same one-line message (the env is what `accelerate launch`
    exports for a ZeRO-3 config; the processes meet at a store this test hosts, so a hang is a timeout, not a block)."""
    from test_oom_multiproc import _launch

    import vlmrl.engine.oom as oom

    out = setup[0] / "zero3-oom"
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3", oom.INJECT_ENV: "rank=1,phase=update,above=2"}
    (code0, log0), (code1, log1) = _launch(setup, out, "training.save_final_model=false", "data.eval_path=", env=env, timeout=300)
    message = "out of memory in update at size 4 on process 1 of 2: the engine's forward and backward hold collectives"
    assert "DeepSpeed ZeRO-3" in log0
    assert code1 == 2 and f"vlmrl train: {message}" in log1 and "Traceback" not in log1, log1[-3000:]
    assert code0 == 2 and f"vlmrl train: {message}" in log0 and "(process 0 stops too)" in log0, log0[-3000:]


# ---------------------------------------------------------------- ZeRO-3 / FSDP2 layers mode: processes decode in step
def test_synced_decoding_runs_every_step_and_returns_the_same_tokens(setup):
    """With a decode_agreement (Engine.decode_agreement) the decode loop goes on while any process has unfinished rows (here: always, as
    if another process were still decoding), so every process runs the same number of forwards, each of which
    all-gathers under ZeRO-3 / FSDP2 layers mode; the steps after this process's rows finished are dropped."""
    from vlmrl.config import load_config
    from vlmrl.data.rows import load_dataset_split
    from vlmrl.models.loading import unwrap
    from vlmrl.models.prefix import sample_with_shared_prefix
    from vlmrl.run.datasets import encode_rows
    from vlmrl.models.policy import load_policy

    _, model_path, data = setup
    cfg = load_config(None, [f"model.name_or_path={model_path}", "data.min_pixels=3136", "data.max_pixels=3136", "training.device=cpu"])
    model, processor = load_policy(cfg, torch.device("cpu"))
    rows, _ = load_dataset_split(data["train"], limit_images=4, skip_bad_rows=False)
    prompts = encode_rows(processor, rows[:2], cfg, torch.device("cpu"))
    vocab = unwrap(model).get_output_embeddings().weight.shape[0]
    # Every token ends a row: all rows finish after their first token.
    kw = dict(num_generations=2, max_new_tokens=6, eos_ids=list(range(vocab)), pad_id=0, suppress_ids=[], do_sample=False)
    core = unwrap(model)
    calls = []
    hook = core.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        alone = sample_with_shared_prefix(model, prompts, **kw)
        n_alone = len(calls)
        # another process still decoding until the last step
        synced = sample_with_shared_prefix(model, prompts, **kw, decode_agreement=lambda local: True)
    finally:
        hook.remove()
    assert alone.shape == (2, 1) and torch.equal(synced, alone)  # greedy: one row per prompt
    assert len(calls) - n_alone == n_alone + 5  # the same prefill plus 5 decode forwards (max_new_tokens - 1)
