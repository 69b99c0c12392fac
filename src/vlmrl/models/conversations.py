"""Multi-turn SFT rows: a conversation's prompt (up to the turn after its last image) and its targets, with the loss on
assistant turns only.

A row with several turns (LLaVA-Instruct, ms-swift messages with answers; formats.py keeps them in
``_conversation``) is rendered with the model's own chat template. The prompt is every turn before the first
assistant turn that follows the last image (images must sit in the prompt, where the processor expands them); the
rest is the completion, cut into pieces at the template's own turn boundaries, found by rendering the growing
conversation: the text an assistant turn adds after its generation prompt is trained on, the user turns between
are not. A template that renders earlier turns differently once later turns follow (so the pieces do not line up)
is refused naming the row, never trained on a guess.
"""

from __future__ import annotations

import torch
from vlmrl.data.formats import prompt_messages_of
from vlmrl.models.processing import render_chat


class ConversationError(ValueError):
    """A conversation cannot be split into prompt and assistant targets (names the row)."""


def sft_view(processor, row: dict, num_images: int, num_videos: int = 0, system_prompt: str | None = None) -> dict:
    """`row` for SFT: a conversation row gets ``_messages`` = its prompt turns and ``_sft_pieces`` = [(text, trained)]
    of the rest; any other row is returned as it is (its target is data.sft_target)."""
    if not row.get("_conversation"):
        return row

    source = row.get("_source", "?")
    messages = prompt_messages_of({"_messages": row["_conversation"]}, num_images, num_videos, system_prompt)
    media = [i for i, m in enumerate(messages) if any(b["type"] in ("image", "video") for b in m["content"])]
    after = media[-1] if media else -1
    split = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and i > after), None)
    if split is None:
        raise ConversationError(f"{source}: no assistant turn after the last image: nothing to train on")
    prompt_text = render_chat(processor, messages[:split], add_generation_prompt=True)
    full = render_chat(processor, messages, add_generation_prompt=False)
    pieces, at = [], len(prompt_text)
    for j in range(split, len(messages)):
        if messages[j]["role"] != "assistant":
            continue
        start = len(render_chat(processor, messages[:j], add_generation_prompt=True))
        end_text = render_chat(processor, messages[: j + 1], add_generation_prompt=False)
        if not full.startswith(end_text) or start < at or not full.startswith(render_chat(processor, messages[:j], add_generation_prompt=True)):
            raise ConversationError(f"{source}: the chat template renders turn {j} differently once later turns follow; cannot tell its tokens apart")
        if start > at:
            pieces.append((full[at:start], False))
        pieces.append((full[start : len(end_text)], True))
        at = len(end_text)
    if at < len(full):
        pieces.append((full[at:], False))
    if not full.startswith(prompt_text):
        raise ConversationError(f"{source}: the chat template renders the prompt turns differently once answers follow")
    return {**row, "_messages": messages[:split], "_sft_pieces": pieces}


def target_tensors(tokenizer, rows: list[dict], target_text, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([N, T] target ids right padded, attention mask, loss mask): a conversation row's pieces (loss on the assistant
    pieces only), any other row's `target_text(row)` + EOS (loss on all of it)."""
    eos = tokenizer.eos_token_id
    seqs, trained = [], []
    for row in rows:
        if row.get("_sft_pieces"):
            ids, mask = [], []
            for text, on in row["_sft_pieces"]:
                piece = tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += piece
                mask += [int(on)] * len(piece)
        else:
            ids = tokenizer(target_text(row), add_special_tokens=False)["input_ids"] + [eos]
            mask = [1] * len(ids)
        seqs.append(ids)
        trained.append(mask)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    loss = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, trained)):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attention[i, : len(s)] = 1
        loss[i, : len(m)] = torch.tensor(m, dtype=torch.long)
    return ids.to(device), attention.to(device), loss.to(device)
