"""DeepSpeed ZeRO-2/3 for real, on two CPU processes (gloo, DeepSpeed's CPU accelerator), launched the way a user
launches it: `accelerate launch --config_file configs/accelerate/deepspeed_zero{2,3}.yaml --num_processes 2 -m vlmrl train`.

What is compared: the same GRPO run under DDP (torchrun, 2 processes). Per-step losses and rewards agree to 1e-6
relative; final weights to 1e-5 absolute, except the attention key biases: attention's softmax ignores a constant added
to every key score of a query, so their exact gradient is zero and AdamW turns the ~1e-9 rounding noise there into
steps of up to lr (1e-3), whichever engine runs. Resume from a DeepSpeed checkpoint is compared bit for bit with the
uninterrupted DeepSpeed run (same world size).

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

import pytest
import torch
from safetensors.torch import load_file

from vlmrl.tasks import make_count_task

ROOT = pathlib.Path(__file__).parents[1]
LENGTH_REWARD = str(pathlib.Path(__file__).parent / "rewards_for_tests.py") + ":text_length"
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed is not installed (pip install -e '.[deepspeed]'; `make test` installs it)")


def _env(**extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(key, None)
    return {**env, **extra}


def _run(cmd, expect=0, timeout=420, **extra_env):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(**extra_env), timeout=timeout)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from vlmrl.tiny import build_tiny_qwen25vl

    root = tmp_path_factory.mktemp("ds")
    model = build_tiny_qwen25vl(root / "model")
    data = make_count_task(root / "count", n_train=16, n_test=0, seed=0, image_size=56)
    return root, model, data


def _args(setup, out, *extra):
    _, model, data = setup
    # 4 prompts x G=2 per step, optimizer steps of 4 completions: each of 2 processes holds one prompt of every
    # optimizer step; beta > 0 scores the reference too.
    return [
        f"model.name_or_path={model}",
        f"data.train_path={data['train']}",
        "data.eval_path=",
        f"training.output_dir={out}",
        "training.max_steps=3",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=2",
        "training.gradient_accumulation_steps=2",
        "rollout.generation_batch_size=8",
        "rollout.max_completion_length=5",
        "optim.learning_rate=1e-3",
        "algorithm.beta=0.05",
        "rollout.sampling_seed=prompt",
        "training.device=cpu",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        f"algorithm.reward_funcs=['{LENGTH_REWARD}']",
        *extra,
    ]


def _accelerate(stage: int, *args) -> list[str]:
    config = ROOT / "configs" / "accelerate" / f"deepspeed_zero{stage}.yaml"
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes", "2", "-m", "vlmrl", "train", *args]


def _metrics(out):
    return {r["step"]: r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines())}


def _worst_difference(a_file, b_file, skip=lambda k: False):
    a, b = load_file(a_file), load_file(b_file)
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a if not skip(k))


@pytest.fixture(scope="module")
def ddp(setup):
    out = setup[0] / "ddp"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "vlmrl", "train", *_args(setup, out)])
    return out


def _interrupted_copy(out, name):
    """`out` as it was after step 2 (checkpoint-2 the newest): what a run killed during step 3 leaves."""
    copy = out.parent / name
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns("final", "checkpoint-3", "run_complete.json"))
    (copy / "metrics.jsonl").write_text("".join(x + "\n" for x in (out / "metrics.jsonl").read_text().splitlines()[:2]))
    return copy


# ---------------------------------------------------------------- GRPO under ZeRO-2 and ZeRO-3
@needs_deepspeed
@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_trains_like_ddp_checkpoints_resume_bit_exact_and_export(setup, ddp, stage):
    out = setup[0] / f"zero{stage}"
    log = _run(_accelerate(stage, *_args(setup, out, "training.save_steps=2")))
    assert "2 processes (deepspeed)" in log and f"DeepSpeed ZeRO-{stage} (fp32 weights" in log
    assert "unknown inputs or outputs type" not in log  # ZeRO-3's hooks see tensors (Completions travel as a tuple)
    a, b = _metrics(out), _metrics(ddp)
    for s in (1, 2, 3):
        assert a[s]["reward"] == b[s]["reward"], s  # the same completions were sampled
        assert a[s]["loss"] == pytest.approx(b[s]["loss"], rel=1e-6, abs=1e-9), s
    worst = _worst_difference(out / "final" / "model.safetensors", ddp / "final" / "model.safetensors", skip=lambda k: "k_proj.bias" in k)
    assert worst < 1e-5, worst

    # The checkpoint: vlmrl's single-process layout (full weights, torch's AdamW state), not DeepSpeed's pickles.
    ckpt = out / "checkpoint-2"
    assert json.loads((ckpt / "trainer_state.json").read_text())["engine"] == "deepspeed"
    weights = load_file(ckpt / "model" / "model.safetensors")
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(saved["state"]) == len(weights) and all(saved["state"][i]["exp_avg"].dim() >= 1 for i in saved["state"])
    assert all(float(v["step"]) == 4 for v in saved["state"].values())  # 2 steps x 2 optimizer steps
    assert not list(ckpt.rglob("*.pt")) or all(
        p.name in ("optimizer.pt", "scheduler.pt") or p.name.startswith("rng_state_") for p in ckpt.rglob("*.pt")
    )

    # Killed after step 2: the same command resumes from checkpoint-2 and ends bit-identical to the uninterrupted run.
    resumed = _interrupted_copy(out, f"zero{stage}_resumed")
    log = _run(_accelerate(stage, *_args(setup, resumed, "training.save_steps=2")))
    assert "resumed from" in log and "checkpoint-2" in log
    a, b = load_file(resumed / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    exported = setup[0] / f"zero{stage}_exported"
    _run([sys.executable, "-m", "vlmrl", "export", str(ckpt), str(exported)])
    e = load_file(exported / "model.safetensors")
    assert e.keys() == weights.keys() and all(torch.equal(e[k], weights[k]) for k in e)


# ---------------------------------------------------------------- refusals: DeepSpeed or exit 2, never another engine
@needs_deepspeed
@pytest.mark.multiproc
def test_zero_gradient_clipping_that_contradicts_the_config_exits_2_in_one_line(setup):
    log = _run(_accelerate(2, *_args(setup, setup[0] / "clip", "optim.max_grad_norm=0.5")), expect=2)
    lines = [x for x in log.splitlines() if "gradient_clipping=1.0" in x]
    assert lines and "optim.max_grad_norm=0.5" in lines[0] and "Traceback" not in log


def test_deepspeed_asked_without_the_package_exits_2(monkeypatch):
    """A launch asking for DeepSpeed where the package cannot be imported: one line naming the fix, not DDP."""
    import importlib.util as iu

    from vlmrl.distributed import DistributedError, require_deepspeed

    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "deepspeed" else importlib.util.find_spec(name, *a))
    with pytest.raises(DistributedError, match=r"pip install 'vlmrl\[deepspeed\]'"):
        require_deepspeed()


def test_deepspeed_asked_but_another_engine_set_up_is_refused(monkeypatch):
    """accelerate set up plain multi-CPU (e.g. use_cpu: true) while the launcher asked for DeepSpeed: refused."""
    from types import SimpleNamespace

    from vlmrl.collectives import Collectives
    from vlmrl.distributed import DistributedError, engine_for

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    accel = SimpleNamespace(
        state=SimpleNamespace(distributed_type="DistributedType.MULTI_CPU", num_processes=2, process_index=0, local_process_index=0)
    )
    with pytest.raises(DistributedError, match="asks for DeepSpeed .* accelerate set up distributedtype.multi_cpu"):
        engine_for(Collectives(accel), accel)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    assert engine_for(Collectives(accel), accel).name == "ddp"


def test_deepspeed_config_checks_fills_and_describes():
    from vlmrl.deepspeed_config import check_config, describe, fill_config
    from vlmrl.distributed import DistributedError

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
