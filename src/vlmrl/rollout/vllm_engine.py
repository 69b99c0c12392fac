"""The vLLM engine itself, where vLLM runs: inside the training process (rollout.vllm_mode=colocate) or inside a
rollout server (`vlmrl rollout-server`, rollout.vllm_mode=server). It knows nothing of the trainer: it is built from a
model folder and the run's engine options (`engine_options`, plain JSON values so a server gets the same), takes
weights, and answers two requests in plain lists (the same in both modes):
  - generate: vLLM's prompt inputs (chat text or token ids, images) and one sampling-parameter dict each ->
    [{"prompt_token_ids": [...], "samples": [{"token_ids": [...], "logprobs": [...]}, ...]}, ...] (with
    "prompt_logprobs" where asked);
  - prompt_logprobs: the log-probs of a sequence's last n tokens (the probe after a push).
vLLM is imported only here, only when it runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from pathlib import Path

import numpy as np
import torch

SAMPLING_KEYS = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "logprobs", "prompt_logprobs", "stop_token_ids")


@contextlib.contextmanager
def trainer_state_kept():
    """Restore the torch / numpy / Python RNG states, the torch thread count and torch.set_num_threads itself on the
    way out: vLLM's CPU worker reseeds the RNGs and replaces torch.set_num_threads, process-wide, by a function that
    only warns (its threads are bound to cores), which would leave the trainer unable to set its own."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def engine_options(cfg, processor, dtype: torch.dtype, allowed: list[int]) -> dict:
    """What a run's vLLM engine is built with, as JSON values (a server compares them with the engine it holds)."""
    size = getattr(getattr(processor, "image_processor", None), "size", None)
    bounds = {k: v for k, v in (("shortest_edge", cfg.data.min_pixels), ("longest_edge", cfg.data.max_pixels)) if v is not None}
    return {
        "dtype": {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype],
        "seed": cfg.training.seed,
        "max_model_len": max_model_len(cfg),
        "limit_images": cfg.data.limit_images,
        "mm_processor_kwargs": {"size": {**_as_dict(size), **bounds}} if size is not None and bounds else None,
        # raw = log_softmax(logits), the trainer's quantity at temperature 1; otherwise after temperature
        "logprobs_mode": "raw_logprobs" if cfg.rollout.temperature == 1.0 else "processed_logprobs",
        "trust_remote_code": cfg.model.trust_remote_code,
        "allowed_token_ids": allowed,
    }


class LocalEngine:
    """One in-process vLLM engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: on CPU, tensors sent to vLLM's own process
    arrive as lists and leave layers on the meta device)."""

    def __init__(self, folder: str, options: dict, memory_share: float):
        self.folder, self.options = folder, options
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        with trainer_state_kept():
            from vllm import LLM

            _register_in_process(folder)
            self.llm = LLM(
                model=folder,
                dtype=options["dtype"],
                seed=options["seed"],
                enforce_eager=True,
                gpu_memory_utilization=memory_share,
                max_model_len=options["max_model_len"],
                limit_mm_per_prompt={"image": options["limit_images"], "video": 0},
                mm_processor_kwargs=options["mm_processor_kwargs"],
                logprobs_mode=options["logprobs_mode"],
                # A prompt prefilled in chunks has its sampled token discarded, and vLLM then rewinds the request's
                # seeded generator, which a CPU generator cannot (`CPU Generator does not use offset`): whole prompts only.
                enable_chunked_prefill=False,
                trust_remote_code=options["trust_remote_code"],
            )

    def push(self, weights: list[tuple[str, torch.Tensor]]) -> float:
        """New weights (module names; vLLM's own name mapper takes them), then the caches that hold results of the
        old ones emptied: the encoder cache (else `Encoder cache miss`, or old vision features) and the prefix cache
        (else a prompt seen before is continued from key/values of the old weights). Returns the seconds it took."""
        start = time.perf_counter()
        with trainer_state_kept(), torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            self.llm.llm_engine.reset_encoder_cache()
            self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def prompt_logprobs(self, ids: list[int], images: list, n: int) -> list[float]:
        """The log-probs of the last n of `ids` (temperature 1), with `images` for the prompt's placeholders."""
        from vllm import SamplingParams

        request = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else {"prompt_token_ids": ids}
        with trainer_state_kept():
            out = self.llm.generate([request], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)[0]
        return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[-n:], ids[-n:])]

    def generate(self, requests: list[dict], params: list[dict]) -> list[dict]:
        """vLLM's prompt inputs (`{"prompt": chat text with one placeholder per image, "multi_modal_data": {"image":
        [...]}}`: vLLM expands the placeholders) and one sampling-parameter dict (SAMPLING_KEYS) each; vision
        placeholder ids are never sampled (the options' allowed_token_ids)."""
        from vllm import SamplingParams

        allowed = self.options["allowed_token_ids"]
        sampling = [SamplingParams(**{k: p[k] for k in SAMPLING_KEYS if k in p}, allowed_token_ids=allowed) for p in params]
        with trainer_state_kept():
            outs = self.llm.generate(requests, sampling, use_tqdm=False)
        return [
            {
                "prompt_token_ids": list(o.prompt_token_ids),
                "samples": [{"token_ids": list(c.token_ids), "logprobs": [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)]} for c in o.outputs],
                # asked with prompt_logprobs=0 (a tool rollout's scripted tokens): each prompt token's, None for the first
                **(
                    {"prompt_logprobs": [None if e is None else e[t].logprob for e, t in zip(o.prompt_logprobs, o.prompt_token_ids)]}
                    if o.prompt_logprobs
                    else {}
                ),
            }
            for o in outs
        ]


def max_model_len(cfg) -> int | None:
    """rollout.vllm_max_model_length; else prompt budget + completion when data.max_prompt_length bounds prompts; else
    vLLM's default (the model's)."""
    if cfg.rollout.vllm_max_model_length is not None:
        return cfg.rollout.vllm_max_model_length
    if cfg.data.max_prompt_length is None:
        return None
    return cfg.data.max_prompt_length + cfg.rollout.max_completion_length


def _as_dict(size) -> dict:
    import dataclasses

    if size is None:
        return {}
    if dataclasses.is_dataclass(size):
        return {k: v for k, v in dataclasses.asdict(size).items() if v is not None}
    return {k: v for k, v in dict(size).items() if v is not None}


def _register_in_process(folder: str) -> None:
    """Register the folder's architectures with vLLM as classes imported in this process: vLLM otherwise inspects a
    model class in a fresh interpreter (`python -m vllm.model_executor.models.registry`), which imports
    transformers before anything of vlmrl runs and so fails on the registry's torchvision (vlmrl/_torchvision.py)."""
    from vllm import ModelRegistry

    architectures = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    for arch in architectures:
        lazy = ModelRegistry.models.get(arch)
        if lazy is not None and hasattr(lazy, "load_model_cls") and not hasattr(lazy, "model_cls"):
            ModelRegistry.register_model(arch, lazy.load_model_cls())
