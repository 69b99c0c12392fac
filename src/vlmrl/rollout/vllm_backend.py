"""rollout.backend=vllm: the trainer's side of a vLLM engine, colocated in the training process
(rollout.vllm_mode=colocate: vllm_engine.LocalEngine here) or in a rollout server (vllm_mode=server:
client.RemoteEngine, `vlmrl rollout-server`). The same four things every rollout, in both modes:
  1. push: the trainer's weights go to vLLM (in-process, or over the weight process group to the server), which then
     empties its encoder and prefix caches (results of the old weights);
  2. probe: vLLM's log-probs of one fixed sequence (the run's first prompt, its image, a fixed answer) must equal
     the trainer's within PROBE_TOLERANCE, else the run stops in one line (a push that kept the old weights, or a
     weight name that did not map);
  3. sample: each prompt goes to vLLM as the chat text with one placeholder per image plus the images themselves
     (never pre-expanded), G completions from its own seed (the trainer's per-prompt seed); vision placeholder
     ids are never sampled (allowed_token_ids); the sampled tokens' log-probs come back as the behaviour
     log-probs (Completions.sampling_logps: the mismatch metrics and algorithm.rollout_correction use them);
  4. parity: every prompt vLLM built must be the trainer's prompt ids, token for token (parity.check_prompts).

A colocated vLLM reseeds the global RNGs and may change the torch thread count; every call into it restores the
trainer's (vllm_engine.trainer_state_kept). vLLM is imported only where the engine runs.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from vlmrl.models.loading import resolve_model_path, unwrap
from vlmrl.models.prefix import row_seed
from vlmrl.models.processing import encode_prompts
from vlmrl.models.rollout import Completions, eos_token_ids, vision_token_ids
from vlmrl.rollout.base import SampleRequest
from vlmrl.rollout.parity import RolloutParityError, check_prompts, probe_mismatch
from vlmrl.rollout.vllm_tools import ToolRollouts
from vlmrl.rollout.weights import pushed_weights
from vlmrl.run.datasets import row_prompt_inputs

# Largest |vLLM - trainer| log-prob of the probe sequence after a push: float32 agrees to ~1e-6 on CPU (measured
# 9.5e-7); bfloat16 kernels differ more between the two engines.
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.1}
PROBE_ANSWER = "<answer>1</answer>"  # the probe's fixed completion (any text the tokenizer encodes)


def group_seed(prompt_seed: int, n: int) -> int:
    """The seed vLLM gets for one prompt's n samples. vLLM seeds sample i of an n-sample request with seed + i
    (vllm/v1/engine/parallel_sampling.py), and the trainer's prompt seeds are consecutive (engine/collectives.
    prompt_seed: step * 100003 + position): passed as they are, prompt p's sample i and prompt p+1's sample i-1 drew
    from the same stream (8 prompts x G 8 = 64 samples from 15 streams). A splitmix64 of the prompt seed
    (models/prefix.row_seed) puts the groups' n consecutive seeds far apart."""
    return row_seed(prompt_seed, 0) % (2**63 - n)  # seed + n - 1 still fits in int64


def sampling_params(r, seeds: list[int], eos: list[int]) -> list[dict]:
    """One vLLM sampling-parameter dict (vllm_engine.SAMPLING_KEYS) per prompt seed [P], from the run's rollout config."""
    return [
        {
            "n": r.num_generations,
            "max_tokens": r.max_completion_length,
            "min_tokens": r.min_completion_length,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_k": r.top_k if r.top_k > 0 else -1,
            "seed": group_seed(seed, r.num_generations),
            "logprobs": 0,  # the sampled token's log-prob
            "stop_token_ids": eos,
        }
        for seed in seeds
    ]


def answer_logps(model, batch: dict, ids: torch.Tensor, opts) -> torch.Tensor:
    """[1, T] `model`'s log-probs of the answer ids [1, T] after `batch`'s one prompt (the probe's trainer side)."""
    from vlmrl.models.multiturn import logps_for_rows

    return logps_for_rows(model, batch, torch.zeros(1, dtype=torch.long, device=ids.device), ids, torch.ones_like(ids), opts)


def greedy_params(r, rows: int, eos: list[int]) -> list[dict]:
    """The evaluation's vLLM sampling parameters, one dict per row: one greedy completion (temperature 0: the argmax
    over the allowed tokens, as the in-process decoders' greedy decoding), up to rollout.max_completion_length."""
    return [{"n": 1, "max_tokens": r.max_completion_length, "temperature": 0.0, "seed": 0, "logprobs": 0, "stop_token_ids": eos}] * rows


@dataclasses.dataclass
class VLLMGreedy:
    """One evaluation's greedy decoder through vLLM (rollout/base.Evaluator): the trainer's weights are pushed and
    probed at its first batch (the update since the last rollout changed them), once per evaluation."""

    rollout: VLLMRollout
    key: tuple  # the sync key of this evaluation (VLLMRollout.sync): one push for all its batches

    def greedy(self, rows: list[dict], prompts: dict, names: list[str]) -> Completions:
        """[P, T] one greedy completion per row; every prompt vLLM built checked against the trainer's [P, L]."""
        v = self.rollout
        synced = v.sync(self.key, rows)
        if synced:
            v.log(
                f"evaluation: greedy decoding through vLLM (weights pushed in {synced['vllm/sync_seconds']:.2f} s, "
                f"probe max |diff| {synced['vllm/probe_max_abs_logp_diff']:.2g})"
            )
        texts, images, videos = row_prompt_inputs(v.processor, rows, v.cfg)
        if any(videos):
            raise RolloutParityError(f"{names[[bool(x) for x in videos].index(True)]}: rollout.backend=vllm evaluates image rows only (yet)")
        outs = v.engine.generate(v.requests(texts, images), greedy_params(v.cfg.rollout, len(rows), v.eos))
        check_prompts([o["prompt_token_ids"] for o in outs], prompts, v.vision_ids, names)
        return v.completions(outs)


class VLLMRollout:
    """The vLLM engine of one training process (colocated, one per DDP process; or a server), and the trainer model
    it mirrors."""

    def __init__(self, cfg, model: torch.nn.Module, processor, log=print, gathered=None, call=None):
        """`gathered`: a context-manager factory inside which the model's parameters are whole (the training engine's
        gathered_for_generation: FSDP2 shards all-gathered; None: they always are). `call(fn, *args)`: runs
        fn(model, *args) through the training engine's root module (distributed.Distributed.call; None: directly)."""
        self.cfg, self.model, self.processor, self.log = cfg, model, processor, log
        self.gathered = gathered or contextlib.nullcontext
        self.call = call or (lambda fn, *args: fn(self.model, *args))
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
        self.synced_step: object = None  # the key of the last push: a step, or ("eval", n) for an evaluation
        self.evaluations = 0
        self.metrics: dict = {}  # the last rollout's vllm/* metrics (logged with its step)
        self.probe: dict | None = None
        self.engine = self._build()

    @property
    def llm(self):
        """The colocated vllm.LLM (colocate mode only)."""
        return self.engine.llm

    def _build(self):
        from vlmrl.rollout.vllm_engine import engine_options

        cfg, r = self.cfg, self.cfg.rollout
        options = engine_options(cfg, self.processor, self.dtype, self.allowed)
        if r.vllm_mode == "server":
            from vlmrl.rollout.client import connect_servers

            device = next(unwrap(self.model).parameters()).device
            engine = connect_servers(r, options, "nccl" if device.type == "cuda" else "gloo")
            self.log(f"rollout: vLLM server at {engine.address} ({engine.folder}), {options['dtype']}; weights over {engine.backend}")
            return engine
        from vlmrl.rollout.vllm_engine import LocalEngine

        folder = resolve_model_path(cfg.model.name_or_path)
        engine = LocalEngine(folder, options, r.vllm_gpu_memory_utilization)
        self.log(f"rollout: vLLM (colocated, in-process) built from {folder}, {options['dtype']}")
        return engine

    # ------------------------------------------------------------ weights
    def push_weights(self) -> float:
        """The trainer's weights into vLLM (the base model's names, LoRA merged: weights.pushed_weights; vLLM's own
        name mapper takes them); returns the seconds."""
        with torch.no_grad():
            return self.engine.push(pushed_weights(self.model))

    def sync(self, step, rows: list[dict]) -> dict:
        """Push the weights once per step (before its rollout; `step` the sync key, ("eval", n) for an evaluation),
        then probe; returns vllm/* timings."""
        if self.synced_step == step:
            return {}
        if self.probe is None:
            self.probe = self._probe_sequence(rows[0])
        with self.gathered():  # every process at once (each pushes to its own engine)
            seconds = self.push_weights()
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
        p = self.probe
        tokenizer = self.processor.tokenizer
        ids = tokenizer(p["text"], add_special_tokens=False)["input_ids"] + p["answer"]
        trainer = self._trainer_logps(p["batch"], p["answer"])
        low = self.cfg.training.bf16 or self.dtype != torch.float32  # the trainer's forward in bf16 autocast, or half weights
        worst = 0.0
        engines = getattr(self.engine, "engines", [self.engine])  # several servers in data parallel: each one probed
        for engine in engines:
            sampler = torch.tensor(engine.prompt_logprobs(ids, p["images"], len(p["answer"])))
            problem = probe_mismatch(sampler, trainer, PROBE_TOLERANCE[torch.bfloat16] if low else PROBE_TOLERANCE[torch.float32])
            if problem is not None:
                raise RolloutParityError(f"{problem} (the rollout server at {engine.address})" if len(engines) > 1 else problem)
            worst = max(worst, float((sampler.double() - trainer.double()).abs().max()))
        return worst

    @torch.no_grad()
    def _trainer_logps(self, batch: dict, answer: list[int]) -> torch.Tensor:
        """[T] the trainer's log-probs of `answer` after `batch`'s one prompt (temperature 1, as vLLM's prompt log-probs)."""
        from vlmrl.models.prefix import LogprobOptions

        device = next(self.model.parameters()).device
        opts = dataclasses.replace(LogprobOptions.from_config(self.cfg, device), temperature=1.0)
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        ids = torch.tensor([answer], device=device)
        was_training = self.model.training
        self.model.eval()
        try:
            with opts.autocast():
                out = self.call(answer_logps, batch, ids, opts)  # through the training engine's root (FSDP2: its hooks)
        finally:
            self.model.train(was_training)
        return out[0].float().cpu()

    def evaluator(self, model: torch.nn.Module, opts) -> VLLMGreedy:
        """The greedy decoder of one evaluation (evaluate.evaluate): vLLM on the weights of the trained model, which is
        `model` (FSDP2: gathered around the push); `opts` unused (vLLM's own kernels)."""
        self.evaluations += 1
        return VLLMGreedy(self, ("eval", self.evaluations))

    # ------------------------------------------------------------ sampling
    def requests(self, texts: list[str], images: list[list]) -> list[dict]:
        """vLLM's inputs: each row's chat text (one placeholder per image, vLLM expands it) and its images."""
        return [{"prompt": t, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": t} for t, imgs in zip(texts, images)]

    def sample(self, request: SampleRequest) -> Completions:
        """G completions of each row ([P*G, T] grouped by prompt); vllm/* metrics kept in self.metrics. The request's
        rows [P] with the trainer's encoded prompts [P, L], seeds [P] (one sampling stream per prompt), names [P]."""
        step, rows, prompts, seeds, row_names = request.step, request.rows, request.prompts, request.seeds, request.names
        self.metrics = self.sync(step, rows)
        texts, images, videos = row_prompt_inputs(self.processor, rows, self.cfg)
        if any(videos):
            raise RolloutParityError(f"{row_names[[bool(v) for v in videos].index(True)]}: rollout.backend=vllm samples image rows only (yet)")
        if self.cfg.multiturn:  # tools: turn by turn (vllm_tools.py), every turn's prompt checked there
            return ToolRollouts(self, rows, prompts, seeds, row_names).run()
        params = sampling_params(self.cfg.rollout, seeds, self.eos)
        outs = self.engine.generate(self.requests(texts, images), params)
        check_prompts([o["prompt_token_ids"] for o in outs], prompts, self.vision_ids, row_names)
        return self.completions(outs)

    def completions(self, outs: list[dict]) -> Completions:
        """The engine's outputs (P, G samples each) -> Completions [P*G, T], right-padded, with the sampled tokens'
        log-probs."""
        samples = [c for o in outs for c in o["samples"]]
        width = max(1, max(len(c["token_ids"]) for c in samples))
        ids = torch.full((len(samples), width), self.pad, dtype=torch.long)
        logps = torch.zeros((len(samples), width), dtype=torch.float32)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        truncated = torch.zeros(len(samples), dtype=torch.bool)
        for i, c in enumerate(samples):
            n = len(c["token_ids"])
            ids[i, :n] = torch.tensor(c["token_ids"], dtype=torch.long)
            logps[i, :n] = torch.tensor(c["logprobs"], dtype=torch.float32)
            mask[i, :n] = 1
            truncated[i] = n == 0 or c["token_ids"][-1] not in self.eos
        return Completions(ids=ids, mask=mask, truncated=truncated, sampling_logps=logps)
