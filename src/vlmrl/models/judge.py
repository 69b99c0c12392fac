"""The reward judge in-process (judge.model_path; rewards/judge.py has the reward and the served judge): loaded by
models.teacher.load_frozen on first use (frozen, eval mode, no grad), greedy, judge.batch_size requests per generate
call, judge.timeout_s as generate's max_time."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from vlmrl.config import Config, ConfigError
from vlmrl.models.loading import ModelLoadError, require_complete_model_folder
from vlmrl.models.logprobs import model_inputs
from vlmrl.models.processing import decode, encode_prompts, render_chat
from vlmrl.models.rollout import eos_token_ids, vision_token_ids
from vlmrl.models.teacher import load_frozen
from vlmrl.models.weight_files import check_expected_weights
from vlmrl.rewards.judge import JudgeRequest, Reply, chat_messages

_LOADED: dict[tuple[str, str], tuple[Any, Any]] = {}  # (folder, device) -> (model, processor): loaded once per process


def local_judge_on(device: torch.device) -> Callable[[Config], "LocalJudge"]:
    """rewards.scoring.load_reward_funcs' local_judge: the in-process judge of a config, on `device`."""
    return lambda cfg: LocalJudge(cfg, device)


def check_judge_folder(path: str, trust_remote_code: bool) -> None:
    """ConfigError naming judge.model_path unless it is a complete model folder with the weights its config needs."""
    if not Path(path).expanduser().is_dir():
        raise ConfigError(f"judge.model_path={path}: no such folder; point it at a model folder (vlmrl tiny writes one)")
    try:
        require_complete_model_folder(path)
        check_expected_weights(Path(path).expanduser(), trust_remote_code)
    except (ModelLoadError, OSError, ValueError) as e:
        raise ConfigError(f"judge.model_path={path}: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


class LocalJudge:
    """.replies(requests) -> one Reply per request: the judge's greedy text, or a failure when judge.timeout_s ran
    out before the row finished (the fallback score; never cached)."""

    def __init__(self, cfg: Config, device: torch.device):
        if device.type == "cuda" and device.index is None:  # one key per physical device in _LOADED
            device = torch.device("cuda", torch.cuda.current_device())
        self.cfg, self.j, self.device = cfg, cfg.judge, device
        check_judge_folder(self.j.model_path, cfg.model.trust_remote_code)

    def loaded(self):
        key = (str(self.j.model_path), str(self.device))
        if key not in _LOADED:
            try:
                _LOADED[key] = load_frozen(self.cfg, self.device, self.j.model_path)
            except (ModelLoadError, OSError, ValueError) as e:
                raise ConfigError(f"judge.model_path={self.j.model_path}: loading it failed: {_first_line(e)}") from None
        return _LOADED[key]

    def replies(self, requests: list[JudgeRequest]) -> list[Reply]:
        out: list[Reply] = []
        for start in range(0, len(requests), self.j.batch_size):
            out += self._generate(requests[start : start + self.j.batch_size])
        return out

    def _generate(self, requests: list[JudgeRequest]) -> list[Reply]:
        model, processor = self.loaded()
        texts = [render_chat(processor, chat_messages(r, lambda _: {"type": "image"}), add_generation_prompt=True) for r in requests]
        batch = {k: v.to(self.device) if hasattr(v, "to") else v for k, v in encode_prompts(processor, texts, [r.images for r in requests]).items()}
        eos = eos_token_ids(model, processor.tokenizer)
        pad = processor.tokenizer.pad_token_id if processor.tokenizer.pad_token_id is not None else eos[0]
        started = time.monotonic()
        with torch.no_grad():
            out = model.generate(
                **model_inputs(batch),
                do_sample=False,  # greedy: the same judgement on resume
                max_new_tokens=self.j.max_new_tokens,
                max_time=self.j.timeout_s,
                eos_token_id=eos,
                pad_token_id=pad,
                suppress_tokens=vision_token_ids(model) or None,
            )
        new = out[:, batch["input_ids"].shape[1] :]
        timed_out = time.monotonic() - started >= self.j.timeout_s
        replies = []
        for ids, text in zip(new.tolist(), decode(processor, new)):
            finished = any(t in eos for t in ids) or len(ids) >= self.j.max_new_tokens
            replies.append(Reply(text) if finished or not timed_out else Reply(failure=f"no reply within judge.timeout_s={self.j.timeout_s:g}"))
        return replies
