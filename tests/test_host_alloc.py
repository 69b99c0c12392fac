"""engine/host_alloc.py: glibc's mmap threshold pinned, so a freed large chunk no longer moves later ones onto the heap."""

import os
import subprocess
import sys

import pytest

from vlmrl.engine import host_alloc

pytestmark = pytest.mark.unit

glibc = pytest.mark.skipif(host_alloc._libc() is None, reason="glibc only")

# A fresh process (the allocator's state is per process): malloc+free 4 MiB (mmapped: above the 128 KiB start), then
# malloc 1 MiB and print whether it was mmapped (mallinfo2's hblkhd = bytes in mmapped chunks).
PROBE = """
import ctypes, sys
from vlmrl.engine.host_alloc import pin_mmap_threshold
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
class MI2(ctypes.Structure):
    names = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    _fields_ = [(n, ctypes.c_size_t) for n in names]
libc.mallinfo2.restype = MI2
pinned = pin_mmap_threshold() if sys.argv[1] == "pin" else None
libc.free(libc.malloc(4 << 20))
before = libc.mallinfo2().hblkhd
p = libc.malloc(1 << 20)
print(pinned, libc.mallinfo2().hblkhd - before >= (1 << 20))
"""


def _probe(mode: str, **env) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | env
    return subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env).stdout.split()


@glibc
def test_pinned_threshold_keeps_a_1mib_chunk_mmapped_after_a_4mib_free():
    assert _probe("plain") == ["None", "False"]  # glibc's own rule: the free raised the threshold to 4 MiB
    assert _probe("pin") == ["True", "True"]


@glibc
@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "4194304"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}])
def test_the_users_malloc_settings_are_left_alone(env):
    assert _probe("pin", **env)[0] == "False"


# ---------------------------------------------------------------- which runs pin it, and the user's settings winning
def _fake_deepspeed(stage: int, device: str = "cpu"):
    """An Accelerator as accelerate builds it for a DeepSpeed launch (only what Distributed and its engine read)."""
    from types import SimpleNamespace

    import torch

    plugin = SimpleNamespace(zero_stage=stage, deepspeed_config={"zero_optimization": {"stage": stage}})
    one = dict(num_processes=1, process_index=0, local_process_index=0)
    state = SimpleNamespace(distributed_type="DistributedType.DEEPSPEED", deepspeed_plugin=plugin, **one)
    return SimpleNamespace(state=state, device=torch.device(device))


class _Started(Exception):
    """Raised by the first step after the pin: the run goes no further."""


CASES = [(3, None, True), (2, None, False), (3, "MALLOC_MMAP_THRESHOLD_", False), (3, "GLIBC_TUNABLES", False)]


def test_zero3_on_a_gpu_does_not_pin():
    """On a GPU ZeRO-3's gathers are device memory: the host allocator is left as it is."""
    from vlmrl.engine.distributed import Distributed

    assert Distributed(_fake_deepspeed(3, "cuda")).pins_host_allocator is None
    assert Distributed(_fake_deepspeed(3, "cpu")).pins_host_allocator is not None


@pytest.mark.parametrize("command", ["train", "sft"])
@pytest.mark.parametrize("stage, user_env, pinned", CASES)
def test_a_zero3_run_pins_the_threshold_at_its_start_unless_the_user_set_malloc(monkeypatch, tmp_path, command, stage, user_env, pinned):
    import vlmrl.sft as sft_module
    import vlmrl.train as train_module
    from vlmrl.config import load_config
    from vlmrl.engine.distributed import Distributed

    for k in [*host_alloc._USER_SETTINGS, "GLIBC_TUNABLES"]:
        monkeypatch.delenv(k, raising=False)
    if user_env:
        monkeypatch.setenv(user_env, "glibc.malloc.mmap_threshold=4194304" if user_env == "GLIBC_TUNABLES" else "4194304")
    calls = []  # recorded, not done to the shared pytest process
    monkeypatch.setattr(host_alloc, "pin_mmap_threshold", lambda: calls.append(True) or True)
    monkeypatch.setattr(Distributed, "from_env", classmethod(lambda cls, cpu=False: cls(_fake_deepspeed(stage))))

    def started(*a, **k):
        raise _Started

    monkeypatch.setattr(train_module, "predict_for_run", started)  # the step after the pin in start_run
    monkeypatch.setattr(sft_module, "prepare_run", started)  # and in start_sft
    cfg = load_config(None, [f"training.output_dir={tmp_path}", "training.max_steps=1", "sft.steps=1"])
    lines = []
    with pytest.raises(_Started):
        (train_module.start_run if command == "train" else sft_module.start_sft)(cfg, lines.append)
    assert calls == ([True] if pinned else [])
    said = [line for line in lines if line.startswith("host allocator:")]
    if pinned:
        why = "DeepSpeed ZeRO-3 (its parameter gathers)"
        assert said == [f"host allocator: glibc's mmap threshold pinned at 128 KiB for {why} (engine/host_alloc.py)"]
    elif user_env:
        assert len(said) == 1 and f"the environment's {user_env} kept instead" in said[0]
    else:
        assert said == []  # ZeRO-2: nothing done, nothing said
