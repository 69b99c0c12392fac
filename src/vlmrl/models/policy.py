"""The policy as the config says: the model from cfg.model (freezing / LoRA applied) and its processor, on a device."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from vlmrl.config import Config
from vlmrl.models.loading import load_model, require_complete_model_folder, resolve_model_path
from vlmrl.models.processing import load_processor
from vlmrl.models.weight_files import check_weight_files


def load_policy(cfg: Config, device: torch.device, model_path: str | None = None):
    """(model, processor) from cfg.model, on `device`, with freezing / LoRA applied."""
    path = resolve_model_path(model_path or cfg.model.name_or_path)
    if not cfg.model.allow_hub_download or Path(path).expanduser().exists():
        require_complete_model_folder(path)  # every missing piece named now, not a crash in step 1
        check_weight_files(path)  # a damaged safetensors header: one line, not a traceback from the load
    model_cfg = dataclasses.replace(cfg.model, name_or_path=path)
    with hf_progress_bars(cfg.logging.progress_bar):
        model = load_model(model_cfg).to(device)
    processor = load_processor(path, trust_remote_code=cfg.model.trust_remote_code, min_pixels=cfg.data.min_pixels, max_pixels=cfg.data.max_pixels)
    return model, processor


@contextlib.contextmanager
def hf_progress_bars(enabled: bool):
    """transformers' own progress bars (weight loading) follow logging.progress_bar, so that with it off stderr
    holds only warnings and errors."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if was and not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()
