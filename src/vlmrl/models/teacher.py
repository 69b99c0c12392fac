"""The frozen teacher of on-policy distillation (algorithm.teacher_path): loaded like the policy but never trained,
and refused unless it reads token ids as the policy does."""

from __future__ import annotations

import dataclasses

import torch

from vlmrl.config import Config
from vlmrl.models.loading import ModelLoadError


def tokenizer_mismatch(student_tokenizer, teacher_tokenizer) -> str | None:
    """Why the two tokenizers do not give the same ids to the same tokens, or None when they do (vocabulary and
    added tokens: get_vocab() maps every token, special ones included, to its id)."""
    student, teacher = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student == teacher:
        return None
    differ = sorted(t for t in set(student) | set(teacher) if student.get(t) != teacher.get(t))
    shown = ", ".join(repr(t) for t in differ[:3])
    return f"{len(student)} vs {len(teacher)} tokens, {len(differ)} with a different id or missing ({shown}{', ...' if len(differ) > 3 else ''})"


def output_vocab(model) -> int:
    """Rows of the model's LM head: the ids it can score (often more than the tokenizer's tokens: padded)."""
    return int(model.get_output_embeddings().weight.shape[0])


def check_teacher(student_tokenizer, teacher_tokenizer, student_vocab: int, teacher_vocab: int, student_path: str, teacher_path: str) -> None:
    """One-line ModelLoadError naming both folders when the teacher cannot score the student's tokens: another
    tokenizer (the same id would be another token), or an LM head smaller than the student's (a sampled id beyond it)."""
    why = tokenizer_mismatch(student_tokenizer, teacher_tokenizer)
    if why is not None:
        raise ModelLoadError(
            f"algorithm.teacher_path={teacher_path}: its tokenizer differs from the policy's ({student_path}): {why}; "
            "distillation compares log-probs of the same token ids, so the teacher needs the policy's tokenizer"
        )
    if teacher_vocab < student_vocab:
        raise ModelLoadError(
            f"algorithm.teacher_path={teacher_path}: its LM head scores {teacher_vocab} ids, fewer than the {student_vocab} "
            f"the policy ({student_path}) can sample; use a teacher whose vocabulary covers the policy's"
        )


def load_frozen(cfg: Config, device: torch.device, path: str):
    """(model, processor) of the folder `path` on `device`, frozen in eval mode: loaded as the policy is (its dtype
    and attention) without LoRA, checkpointing or partial freezing. The teacher and the reward judge (rewards/judge.py)."""
    from vlmrl.models.policy import load_policy

    frozen = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, use_lora=False, gradient_checkpointing=False, train_projector_only=False, freeze_vision_tower=False)
    )
    model, processor = load_policy(frozen, device, model_path=path)
    return model.eval().requires_grad_(False), processor


def load_teacher(cfg: Config, device: torch.device, student, student_processor):
    """(teacher model, its processor) from algorithm.teacher_path on `device`, frozen in eval mode (load_frozen), after
    check_teacher. None when teacher_path is unset."""
    path = cfg.algorithm.teacher_path
    if path is None:
        return None
    teacher, processor = load_frozen(cfg, device, path)
    check_teacher(student_processor.tokenizer, processor.tokenizer, output_vocab(student), output_vocab(teacher), cfg.model.name_or_path, path)
    return teacher, processor
