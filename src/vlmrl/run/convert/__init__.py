"""`vlmrl convert --from trl|easyr1|ms-swift|vlm-r1 FILE_OR_ARGS`: another trainer's config as a vlmrl YAML.

Reads a YAML config (TRL's flat keys, EasyR1's nested sections), a launch script (the ``--key value`` arguments
of its ``torchrun`` / ``accelerate launch`` / ``swift rlhf`` line, or EasyR1's OmegaConf ``config=x.yaml a.b=c``
line; shell variables set in the script filled in), or those arguments themselves. Every key either becomes a
vlmrl setting or is listed with why it has none (vLLM settings: vlmrl generates in-process; ZeRO / FSDP settings:
the accelerate config to launch with). A loss choice becomes vlmrl's settings of the same math or is refused, and a
source of which nothing can be read is refused: never an empty config.

One module per peer (trl, easyr1, ms_swift, vlm_r1) over shared pieces (common, source: reading the input, vllm);
this module picks the peer's converter and finishes its result (batch scaling, unresolved values, the written YAML).
"""

from __future__ import annotations


import re

from pathlib import Path
from typing import Any, Callable

import yaml

from vlmrl.config import ConfigError
from vlmrl.config import merge_key, build_config
from vlmrl.run.convert.common import Conversion, process_count
from vlmrl.run.convert.easyr1 import from_easyr1
from vlmrl.run.convert.ms_swift import from_ms_swift, swift_batch_defaults
from vlmrl.run.convert.source import read_source
from vlmrl.run.convert.trl import from_trl
from vlmrl.run.convert.vlm_r1 import from_vlm_r1


PEERS = ("trl", "easyr1", "ms-swift", "vlm-r1")

CONVERTERS: dict[str, Callable[[dict], Conversion]] = {"trl": from_trl, "easyr1": from_easyr1, "ms-swift": from_ms_swift, "vlm-r1": from_vlm_r1}


PER_DEVICE_PEERS = ("trl", "ms-swift", "vlm-r1")  # their batch sizes are per GPU; vlmrl's and EasyR1's are global


def scale_batches(result: Conversion, source: dict[str, Any], processes: int | None) -> None:
    """A per-GPU trainer's batches as vlmrl's global ones: gradient accumulation (and steps_per_generation, TRL's
    generation batch in per-device batches) x processes, so each optimizer step and each rollout sees the same number
    of completions as the source's run. TRL's generation_batch_size is global already."""
    where = "--processes"
    if processes is None:
        processes, where = process_count(source)
    if processes is None:
        result.notes.append(f"batch sizes: the source's per-GPU sizes as for 1 process ({where}); give --processes N for the GPUs it ran on")
        return
    if processes < 1:
        raise ConfigError(f"vlmrl convert: --processes must be >= 1, got {processes}")
    if processes > 1:
        for key in ("training.gradient_accumulation_steps", "rollout.steps_per_generation"):
            if key in result.settings or key == "training.gradient_accumulation_steps":
                result.set(key, int(result.settings.get(key, 1)) * processes)
    result.notes.append(f"batch sizes: per-GPU sizes x {processes} processes ({where}) in gradient_accumulation_steps, as vlmrl's are global")


UNRESOLVED = re.compile(r"\$\{?(\w+)")
PLACEHOLDER = re.compile(r"<[^<>]+>")  # R1-V's `--output_dir <OUTPUT_DIR>`: for the user to fill in


def refuse_empty(peer: str, args: list[str], source: dict[str, Any], result: Conversion) -> None:
    """Never an empty config with exit 0: a source of which no setting was read (only the peer's defaults are left)
    is refused in one line saying what was read."""
    if any(key not in result.filled for key in result.settings):
        return
    what = args[0] if len(args) == 1 else " ".join(args)
    if not source:
        found = "no --key value arguments, no key=value (OmegaConf) arguments and no settings"
    else:
        keys = [str(k) for k in source]
        found = f"{len(keys)} keys ({', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}) but no value vlmrl can write"
    nested = any(isinstance(v, dict) for v in source.values())
    other = ""
    if peer != "easyr1" and nested:
        other = " (nested sections: EasyR1's layout? --from easyr1)"
    elif peer == "easyr1" and source and not nested:
        other = " (flat --key value arguments: --from trl, ms-swift or vlm-r1?)"
    raise ConfigError(f"--from {peer} {what}: found {found}{other}; nothing written")


def _comment_after_continuation(args: list[str]) -> list[str]:
    """R1-V's run_grpo_clevr.sh has `--dataset_name X \\  #https://...`: bash ends the command at that comment, so the
    options after it never reached the trainer. command_lines reads the command on, as its author meant; say so."""
    if len(args) != 1 or not Path(args[0]).is_file() or Path(args[0]).suffix in (".yaml", ".yml", ".json"):
        return []
    lines = Path(args[0]).read_text(encoding="utf-8").splitlines()
    found = [i + 1 for i, line in enumerate(lines) if not line.lstrip().startswith("#") and re.search(r"\\[ \t]*#[^\n]*$", line)]
    return [
        f"line {n}: a # comment after a continuation backslash ends the command in bash (the options after it were not "
        "passed); read as one command, as written"
        for n in found
    ]


BATCH_KEYS = ("training.gradient_accumulation_steps", "training.per_device_train_batch_size", "rollout.num_generations")


def drop_unresolved(result: Conversion) -> None:
    """Settings whose value still holds a shell variable the script computes when it runs (``${REPO_HOME}``):
    left out and listed, rather than written as a path with ``$`` in it."""
    for key, value in list(result.settings.items()):
        texts = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, str)]
        found = [m for m in map(UNRESOLVED.search, texts) if m]
        if key in BATCH_KEYS and (found or isinstance(value, bool) or not isinstance(value, int)):
            # left out, the batch would be scaled and planned from a wrong size
            why = f"uses ${found[0][1]}, which the script computes when it runs" if found else "is not a whole number (a command the script runs?)"
            raise ConfigError(f"{key} = {value!r} {why}: give its value in the arguments")
        if found:
            del result.settings[key]
            result.skip(key, f"{value!r} uses ${found[0][1]}, which the script sets when it runs: give {key} yourself")
        elif any(PLACEHOLDER.fullmatch(t) for t in texts):
            del result.settings[key]
            result.skip(key, f"{value!r} is a placeholder of the script: give {key} yourself")


def convert(peer: str, args: list[str], processes: int | None = None) -> Conversion:
    """The conversion of `args` (a file or --key value arguments) from `peer`'s names; the result is validated as a
    vlmrl config (ConfigError names the key) before it is returned. `processes`: the GPUs the source ran on when it
    does not say (per-GPU batch sizes become vlmrl's global ones)."""

    if peer not in CONVERTERS:
        raise ConfigError(f"vlmrl convert --from {peer}: choose one of {', '.join(PEERS)}")
    source = read_source(args)
    result = CONVERTERS[peer](source)
    drop_unresolved(result)
    refuse_empty(peer, args, source, result)
    result.notes += _comment_after_continuation(args)
    if peer == "ms-swift":
        swift_batch_defaults(result, source, processes)
    if peer in PER_DEVICE_PEERS:
        scale_batches(result, source, processes)
    if result.settings.get("rollout.backend") == "vllm" and (processes or process_count(source)[0] or 1) > 1:
        result.notes.append("rollout.backend=vllm runs in one training process in this version: launched on several, it is refused")
    tree: dict[str, dict[str, Any]] = {}
    for key, value in result.settings.items():
        merge_key(tree, key, value, f"converted {key}")
    try:
        build_config(tree)  # every converted value must be a valid vlmrl value
    except ConfigError as e:
        unsure = next((n for n in result.notes if n.startswith("batch sizes: the source's per-GPU sizes as for 1")), None)
        if unsure and "generation batch" in str(e):  # per-GPU batches read as one process's: the process count is missing
            why = unsure.split("(", 1)[1].split(")")[0]
            raise ConfigError(f"{e}\n  (the source's batch sizes are per GPU and {why}: give vlmrl convert --processes N)") from None
        raise
    return result


def run_convert(peer: str, args: list[str], out_path: str, log=print, processes: int | None = None) -> int:
    """Write the converted YAML to `out_path` (never over an existing file) and list the keys left out."""
    target = Path(out_path)
    if target.exists():
        raise ConfigError(f"vlmrl convert: {target} exists; give another --output (vlmrl overwrites only what it wrote)")
    result = convert(peer, args, processes)
    header = f"# converted by `vlmrl convert --from {peer}` from {' '.join(args)}\n"
    target.write_text(header + yaml.safe_dump(result.tree(), sort_keys=False), encoding="utf-8")
    log(f"wrote {target}: {len(result.settings)} settings")
    for note in result.notes:
        log(f"  {note}")
    if result.unmapped:
        log(f"{len(result.unmapped)} keys have no vlmrl equivalent:")
        for key, why in result.unmapped.items():
            log(f"  {key}: {why}")
    return 0
