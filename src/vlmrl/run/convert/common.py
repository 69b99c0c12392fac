"""What every peer's converter shares: the `Conversion` being built (settings, why each key has no setting, notes),
the reasons listed for settings vlmrl takes elsewhere (vLLM, ZeRO / FSDP, the launcher, trackers, the hub), and what
a launch line says besides the trainer's keys (environment variables, the process count).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


VLLM = "vLLM: the source does not turn vLLM on, so vlmrl generates in-process (rollout.backend=inprocess)"
VLLM_GPU_ONLY = "vLLM on GPU only"
ZERO = "ZeRO / FSDP: launch with accelerate and a config from configs/accelerate (docs/scaling_out.md)"
LAUNCH = "processes and nodes: the launcher's (accelerate launch --num_processes / torchrun), not a config key"
TRACKER_NAME = "run / project names: the trackers' own environment variables (WANDB_PROJECT, WANDB_NAME, MLFLOW_EXPERIMENT_NAME)"
NO_HUB = "vlmrl reads local files and folders: download the dataset / model first and give its path"


class Conversion:
    """What a conversion produced: the vlmrl settings and the keys left out with why."""

    def __init__(self) -> None:
        self.settings: dict[str, Any] = {}
        self.unmapped: dict[str, str] = {}
        self.notes: list[str] = []  # lines `vlmrl convert` prints besides the unmapped keys (defaults filled, batch scaling)
        self.filled: set[str] = set()  # settings that are the peer's defaults, not read from the source

    def set(self, key: str, value: Any) -> None:
        self.settings[key] = value
        self.filled.discard(key)

    def fill(self, key: str, value: Any) -> None:
        """A setting the source leaves to its trainer's default (that default, written out)."""
        self.settings[key] = value
        self.filled.add(key)

    def skip(self, key: str, why: str) -> None:
        self.unmapped[key] = why

    def tree(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for dotted, value in self.settings.items():
            section, _, name = dotted.partition(".")
            if "." in name:  # data.columns.problem
                name, _, key = name.partition(".")
                out.setdefault(section, {}).setdefault(name, {})[key] = value
            else:
                out.setdefault(section, {})[name] = value
        return out


# Launch-line environment variables that carry a setting; the others are the shell's (listed, left to it).
ENV_KEYS = {"MAX_PIXELS": "data.max_pixels", "MIN_PIXELS": "data.min_pixels"}
ENV_PROCESSES = ("NPROC_PER_NODE", "NNODES")


def convert_environment(source: dict[str, Any], out: Conversion) -> set[str]:
    """The UPPERCASE keys (a launch line's ``VAR=value`` prefixes): ENV_KEYS set, the process counts read by
    process_count, the rest listed. Returns the keys handled."""
    handled = {k for k in source if k.isupper()}
    for key in sorted(handled):
        if key in ENV_KEYS:
            out.set(ENV_KEYS[key], source[key])
        elif key not in ENV_PROCESSES:
            out.skip(key, "an environment variable of the launch: set it in the shell that runs vlmrl if it still applies")
    return handled


def process_count(source: dict[str, Any]) -> tuple[int | None, str]:
    """(processes the source's run used, where that was read), or (None, why not): torchrun's --nproc_per_node x
    --nnodes, accelerate's --num_processes (or the num_processes of its --config_file when that file is here),
    ms-swift's NPROC_PER_NODE x NNODES."""
    for per_node, nodes, where in (("nproc_per_node", "nnodes", "torchrun"), ("NPROC_PER_NODE", "NNODES", "ms-swift")):
        if per_node in source:
            try:
                return int(source[per_node]) * int(source.get(nodes, 1) or 1), f"{where}'s {per_node} x {nodes}"
            except (TypeError, ValueError):  # name the one that is not (DLC scripts: --nnodes=${WORLD_SIZE}, set when it runs)
                bad = per_node if not str(source[per_node]).isdigit() else nodes
                return None, f"{bad}={source[bad]!r} is not a number"
    if "num_processes" in source:
        return int(source["num_processes"]), "--num_processes"
    accelerate = source.get("config_file")
    if isinstance(accelerate, list):  # `--config_file x.yaml script.py`: the launched script follows accelerate's options
        accelerate = next((a for a in accelerate if isinstance(a, str) and a.endswith((".yaml", ".yml", ".json"))), None)
    if isinstance(accelerate, str):
        path = Path(accelerate)
        if path.is_file():
            found = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("num_processes")
            if isinstance(found, int):
                return found, f"num_processes of {path}"
        return None, f"the accelerate config {accelerate} is not here"
    return None, "the source names no process count"
