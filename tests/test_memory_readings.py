"""Host peak RSS is this process's own: a run started from a big parent (pytest after many tests, a notebook)
must not report the parent's size (ru_maxrss carries it over fork/vfork + exec; VmHWM does not)."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_child_of_a_big_process_reports_its_own_peak():
    parent_ballast = bytearray(600 * 2**20)
    for i in range(0, len(parent_ballast), 4096):  # touch every page: resident
        parent_ballast[i] = 1
    code = "from vlmrl.engine.memory import host_peak_rss; print(host_peak_rss())"
    child_peak_gib = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert child_peak_gib < 0.5, f"{child_peak_gib:.2f} GiB: the parent's 0.6 GiB leaked into the child's peak"
    del parent_ballast
