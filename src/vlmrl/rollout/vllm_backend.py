"""rollout.backend=vllm, vllm_mode=colocate: a vLLM engine inside the training process samples the rollouts.

One engine per run, built from the run's model folder (its config, tokenizer and processor files; the weights it
loads are replaced by the trainer's before the first rollout). Every rollout:
  1. push: the trainer's weights go to vLLM (`reload_weights` through collective_rpc, in-process: on CPU the
     tensors cannot cross a process boundary), then vLLM's encoder cache is reset (else the next rollout with the
     same images reads vision features of the old weights, or misses: `Encoder cache miss`);
  2. probe: vLLM's log-probs of one fixed sequence (the run's first prompt, its image, a fixed answer) must equal
     the trainer's within PROBE_TOLERANCE, else the run stops in one line (a push that kept the old weights, or a
     weight name that did not map);
  3. sample: each prompt goes to vLLM as the chat text with one placeholder per image plus the images themselves
     (never pre-expanded), G completions from its own seed (the trainer's per-prompt seed); vision placeholder
     ids are never sampled (allowed_token_ids); the sampled tokens' log-probs come back as the behaviour
     log-probs (Completions.sampling_logps: the mismatch metrics and algorithm.rollout_correction use them);
  4. parity: every prompt vLLM built must be the trainer's prompt ids, token for token (parity.check_prompts).

vLLM reseeds the global RNGs and may change the torch thread count when it is built and when it runs; every call
here restores the trainer's (`trainer_state_kept`), so a run samples its data order and dropout as without vLLM.
vLLM is imported only here, only when rollout.backend=vllm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
from pathlib import Path

import numpy as np
import torch

from vlmrl.models.loading import resolve_model_path, unwrap
from vlmrl.models.processing import encode_prompts
from vlmrl.models.rollout import Completions, eos_token_ids, vision_token_ids
from vlmrl.rollout.base import SampleRequest
from vlmrl.rollout.parity import RolloutParityError, check_prompts, probe_mismatch
from vlmrl.run.datasets import row_prompt_inputs

# Largest |vLLM - trainer| log-prob of the probe sequence after a push: float32 agrees to ~1e-6 on CPU (measured
# 9.5e-7); bfloat16 kernels differ more between the two engines.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1}
PROBE_ANSWER = "<answer>1</answer>"  # the probe's fixed completion (any text the tokenizer encodes)


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


class VLLMRollout:
    """The colocated vLLM engine of one run (one process), and the trainer model it mirrors."""

    def __init__(self, cfg, model: torch.nn.Module, processor, log=print):
        self.cfg, self.model, self.processor, self.log = cfg, model, processor, log
        tokenizer = processor.tokenizer
        self.eos = eos_token_ids(model, tokenizer)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos[0]
        config = unwrap(model).config
        vocab = getattr(getattr(config, "text_config", None), "vocab_size", None) or config.vocab_size
        banned = set(vision_token_ids(model))
        self.allowed = [i for i in range(vocab) if i not in banned]  # vision placeholders are never sampled
        image_id = getattr(processor, "image_token_id", None)
        self.vision_ids = {"image": image_id} if isinstance(image_id, int) else {}
        self.dtype = next(unwrap(model).parameters()).dtype
        self.synced_step: int | None = None
        self.metrics: dict = {}  # the last rollout's vllm/* metrics (logged with its step)
        self.probe: dict | None = None
        self.llm = self._build()

    def _build(self):
        cfg, r = self.cfg, self.cfg.rollout
        folder = resolve_model_path(cfg.model.name_or_path)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: the weight push hands over tensors
        size = getattr(getattr(self.processor, "image_processor", None), "size", None)
        bounds = {k: v for k, v in (("shortest_edge", cfg.data.min_pixels), ("longest_edge", cfg.data.max_pixels)) if v is not None}
        mm_kwargs = {"size": {**_as_dict(size), **bounds}} if size is not None and bounds else None
        with trainer_state_kept():
            from vllm import LLM

            _register_in_process(folder)
            llm = LLM(
                model=folder,
                dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.dtype],
                seed=cfg.training.seed,
                enforce_eager=True,
                gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                max_model_len=_max_model_len(cfg),
                limit_mm_per_prompt={"image": cfg.data.limit_images, "video": 0},
                mm_processor_kwargs=mm_kwargs,
                # raw = log_softmax(logits), the trainer's quantity at temperature 1; otherwise after temperature
                logprobs_mode="raw_logprobs" if r.temperature == 1.0 else "processed_logprobs",
                # A prompt prefilled in chunks has its sampled token discarded, and vLLM then rewinds the request's
                # seeded generator, which a CPU generator cannot (`CPU Generator does not use offset`): whole prompts only.
                enable_chunked_prefill=False,
                trust_remote_code=cfg.model.trust_remote_code,
            )
        self.log(f"rollout: vLLM (colocated, in-process) built from {folder}, {str(self.dtype).removeprefix('torch.')}")
        return llm

    # ------------------------------------------------------------ weights
    def push_weights(self) -> float:
        """The trainer's weights into vLLM (module names; vLLM's own name mapper takes them), then the encoder cache
        reset. Returns the seconds it took."""
        import time

        start = time.perf_counter()
        weights = [(name, t.detach()) for name, t in unwrap(self.model).state_dict().items()]
        with trainer_state_kept(), torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
            self.llm.llm_engine.reset_encoder_cache()
        return time.perf_counter() - start

    def sync(self, step: int, rows: list[dict]) -> dict:
        """Push the weights once per step (before its rollout), then probe; returns vllm/* timings."""
        if self.synced_step == step:
            return {}
        seconds = self.push_weights()
        if self.probe is None:
            self.probe = self._probe_sequence(rows[0])
        worst = self.check_probe()
        self.synced_step = step
        return {"vllm/sync_seconds": seconds, "vllm/probe_max_abs_logp_diff": worst}

    def _probe_sequence(self, row: dict) -> dict:
        """The fixed probe: `row`'s prompt (text, images) and PROBE_ANSWER + EOS as the completion."""
        texts, images, _ = row_prompt_inputs(self.processor, [row], self.cfg)
        tokenizer = self.processor.tokenizer
        answer = tokenizer(PROBE_ANSWER, add_special_tokens=False)["input_ids"] + [self.eos[0]]
        return {"text": texts[0], "images": images[0], "answer": answer, "batch": encode_prompts(self.processor, texts, images)}

    def check_probe(self) -> float:
        """max |vLLM - trainer| log-prob over the probe's answer tokens; raises RolloutParityError past the tolerance."""
        from vllm import SamplingParams

        p = self.probe
        tokenizer = self.processor.tokenizer
        ids = tokenizer(p["text"], add_special_tokens=False)["input_ids"] + p["answer"]
        request = {"prompt_token_ids": ids, "multi_modal_data": {"image": p["images"]}} if p["images"] else {"prompt_token_ids": ids}
        with trainer_state_kept():
            out = self.llm.generate([request], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)[0]
        n = len(p["answer"])
        sampler = torch.tensor([entry[token].logprob for entry, token in zip(out.prompt_logprobs[-n:], p["answer"])])
        trainer = self._trainer_logps(p["batch"], p["answer"])
        low = self.cfg.training.bf16 or self.dtype != torch.float32  # the trainer's forward in bf16 autocast, or half weights
        problem = probe_mismatch(sampler, trainer, PROBE_TOLERANCE[torch.bfloat16] if low else PROBE_TOLERANCE[torch.float32])
        if problem is not None:
            raise RolloutParityError(problem)
        return float((sampler.double() - trainer.double()).abs().max())

    @torch.no_grad()
    def _trainer_logps(self, batch: dict, answer: list[int]) -> torch.Tensor:
        """[T] the trainer's log-probs of `answer` after `batch`'s one prompt (temperature 1, as vLLM's prompt log-probs)."""
        from vlmrl.models.multiturn import logps_for_rows
        from vlmrl.models.prefix import LogprobOptions

        device = next(self.model.parameters()).device
        opts = dataclasses.replace(LogprobOptions.from_config(self.cfg, device), temperature=1.0)
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        ids = torch.tensor([answer], device=device)
        was_training = self.model.training
        self.model.eval()
        try:
            with opts.autocast():
                out = logps_for_rows(self.model, batch, torch.zeros(1, dtype=torch.long, device=device), ids, torch.ones_like(ids), opts)
        finally:
            self.model.train(was_training)
        return out[0].float().cpu()

    # ------------------------------------------------------------ sampling
    def requests(self, texts: list[str], images: list[list]) -> list[dict]:
        """vLLM's inputs: each row's chat text (one placeholder per image, vLLM expands it) and its images."""
        return [{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": t} for t, imgs in zip(texts, images)]

    def sample(self, request: SampleRequest) -> Completions:
        """G completions of each row ([P*G, T] grouped by prompt); vllm/* metrics kept in self.metrics. The request's
        rows [P] with the trainer's encoded prompts [P, L], seeds [P] (one sampling stream per prompt), names [P]."""
        from vllm import SamplingParams

        step, rows, prompts, seeds, row_names = request.step, request.rows, request.prompts, request.seeds, request.names
        self.metrics = self.sync(step, rows)
        r = self.cfg.rollout
        texts, images, videos = row_prompt_inputs(self.processor, rows, self.cfg)
        if any(videos):
            raise RolloutParityError(f"{row_names[[bool(v) for v in videos].index(True)]}: rollout.backend=vllm samples image rows only (yet)")
        params = [
            SamplingParams(
                n=r.num_generations,
                max_tokens=r.max_completion_length,
                min_tokens=r.min_completion_length,
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k if r.top_k > 0 else -1,
                seed=seed,
                logprobs=0,  # the sampled token's log-prob
                stop_token_ids=self.eos,
                allowed_token_ids=self.allowed,
            )
            for seed in seeds
        ]
        with trainer_state_kept():
            outs = self.llm.generate(self.requests(texts, images), params, use_tqdm=False)
        check_prompts([o.prompt_token_ids for o in outs], prompts, self.vision_ids, row_names)
        return self.completions(outs)

    def completions(self, outs) -> Completions:
        """vLLM's RequestOutputs (P, n=G each) -> Completions [P*G, T], right-padded, with the sampled tokens' log-probs."""
        samples = [c for o in outs for c in o.outputs]
        width = max(1, max(len(c.token_ids) for c in samples))
        ids = torch.full((len(samples), width), self.pad, dtype=torch.long)
        logps = torch.zeros((len(samples), width), dtype=torch.float32)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        truncated = torch.zeros(len(samples), dtype=torch.bool)
        for i, c in enumerate(samples):
            n = len(c.token_ids)
            ids[i, :n] = torch.tensor(c.token_ids, dtype=torch.long)
            logps[i, :n] = torch.tensor([entry[token].logprob for entry, token in zip(c.logprobs, c.token_ids)])
            mask[i, :n] = 1
            truncated[i] = n == 0 or c.token_ids[-1] not in self.eos
        return Completions(ids=ids, mask=mask, truncated=truncated, sampling_logps=logps)


def _as_dict(size) -> dict:
    if size is None:
        return {}
    if dataclasses.is_dataclass(size):
        return {k: v for k, v in dataclasses.asdict(size).items() if v is not None}
    return {k: v for k, v in dict(size).items() if v is not None}


def _max_model_len(cfg) -> int | None:
    """rollout.vllm_max_model_length; else prompt budget + completion when data.max_prompt_length bounds prompts; else
    vLLM's default (the model's)."""
    if cfg.rollout.vllm_max_model_length is not None:
        return cfg.rollout.vllm_max_model_length
    if cfg.data.max_prompt_length is None:
        return None
    return cfg.data.max_prompt_length + cfg.rollout.max_completion_length


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
