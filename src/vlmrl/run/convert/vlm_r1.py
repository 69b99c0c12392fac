"""VLM-R1's launch line (TRL's keys plus its own arguments and environment variables) as a vlmrl config."""

from __future__ import annotations

from typing import Any


from vlmrl.run.convert.common import Conversion, convert_environment
from vlmrl.run.convert.trl import convert_trl_algorithm, convert_trl_keys
from vlmrl.run.convert.vllm import vllm_gpu_notes, convert_vllm


def from_vlm_r1(source: dict[str, Any]) -> Conversion:
    out = Conversion()
    paths = [p for p in str(source.get("data_file_paths") or "").split(":") if p]
    folders = [f for f in str(source.get("image_folders") or "").split(":") if f]
    if paths:
        out.set("data.train_path", paths if len(paths) > 1 else paths[0])
    # VLM-R1 joins each data file's image paths with the folder at the same position (grpo_jsonl.py): a list in the
    # same order keeps that pairing; one folder for all files stays one folder.
    if folders and (len(folders) == len(paths) or len(set(folders)) == 1):
        out.set("data.image_root", folders if len(set(folders)) > 1 else folders[0])
    elif folders:
        out.skip(
            "image_folders",
            f"{len(folders)} folders for {len(paths)} data files (VLM-R1 refuses this too): give one per data file in data.image_root",
        )
    if source.get("reward_funcs") is not None:
        out.skip(
            "reward_funcs",
            f"VLM-R1's {source['reward_funcs']} are functions in its grpo_jsonl.py: put them in a file and name them, e.g. "
            "algorithm.reward_funcs=[my_rewards.py:accuracy_reward, my_rewards.py:format_reward] (vlmrl's own 'accuracy' / 'format' differ)",
        )
    for key, why in {
        "reward_method": "a per-file accu_reward_method: set it as a column of the data (VLM-R1's loader adds 'default')",
        "task_type": "VLM-R1 picks its question template by task: write the question into the data or data.prompt_template",
        "is_reward_customized_from_vlm_module": "VLM-R1's module-specific rewards: name the function in algorithm.reward_funcs",
        "val_split_ratio": "give a held-out file as data.eval_path",
        "max_anyres_num": "InternVL tiling is the processor's own setting",
        "arrow_cache_dir": "rows are read directly; embedded images are cached under $VLMRL_CACHE",
    }.items():
        if key in source:
            out.skip(key, why)
    handled = {"data_file_paths", "image_folders", "reward_funcs", "reward_method", "task_type", "is_reward_customized_from_vlm_module"}
    handled |= convert_environment(source, out) | convert_trl_algorithm(source, out)
    handled |= convert_vllm(source, out, "trl")
    convert_trl_keys(source, out, handled | {"val_split_ratio", "max_anyres_num", "arrow_cache_dir"})
    vllm_gpu_notes(out)
    return out
