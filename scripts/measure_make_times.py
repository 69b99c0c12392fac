"""Time the README's set-up commands on a fresh clone and write benchmarks/results/make_times_cpu.json.

    python scripts/measure_make_times.py [--repo .] [--work /tmp/make-times] [--skip-demo]

Clones the repository's HEAD into a fresh folder, runs `make test` (install + lint + the default suite) and then
`make demo` there, timing each, and records the pytest summary line. The README's "make-times" block is rendered
from the result by scripts/readme_figures.py.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path


def timed(command: list[str], cwd: Path, env: dict) -> tuple[float, str, int]:
    start = time.monotonic()
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)
    return time.monotonic() - start, done.stdout + done.stderr, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repo", default=str(Path(__file__).parents[1]))
    parser.add_argument("--work", default="/tmp/make-times")
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", args.repo, str(work)], check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=work, capture_output=True, text=True).stdout.strip()
    env = {**os.environ, "VLMRL_CACHE": str(work / ".cache")}
    result = {"date": datetime.date.today().isoformat(), "commit": commit, "cpu_count": os.cpu_count(), "machine": platform.machine()}
    seconds, output, code = timed(["make", "test"], work, env)
    (work / "make_test.log").write_text(output)  # kept for reading failures
    summary = re.findall(r"=+ ((?:\d+ failed, )?\d+ passed.*?) in ([\d.]+)s", output)
    result["make_test"] = {"seconds": round(seconds, 1), "returncode": code, "pytest_summary": summary[-1][0] if summary else None}
    result["make_test"]["pytest_seconds"] = float(summary[-1][1]) if summary else None
    if not args.skip_demo:
        seconds, output, code = timed(["make", "demo"], work, env)
        result["make_demo"] = {"seconds": round(seconds, 1), "returncode": code}
    out = Path(args.repo) / "benchmarks" / "results" / "make_times_cpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
