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
