"""Multi-turn SFT rows (conversations.py): the prompt ends after the last image, the loss is on assistant turns only."""

import pytest
import torch
from family_fixtures import ALL_FAMILY_FIXTURES

import peer_files
from vlmrl.models.conversations import ConversationError, sft_view, target_tensors
from vlmrl.models.processing import load_processor, render_chat

pytestmark = pytest.mark.integration


def turn(role, *parts):
    return {"role": role, "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}


CONVERSATION = [turn("user", None, "Q1?"), turn("assistant", "A1."), turn("user", "Q2?"), turn("assistant", "A2.")]


def test_pieces_and_mask_on_a_hand_made_qwen_conversation(tiny_qwen25vl):
    processor = load_processor(tiny_qwen25vl)
    view = sft_view(processor, {"_conversation": CONVERSATION, "_source": "d.jsonl:1"}, 1)
    assert [m["role"] for m in view["_messages"]] == ["user"]  # the prompt: the turns before the first answer
    assert view["_sft_pieces"] == [
        ("A1.<|im_end|>\n", True),
        ("<|im_start|>user\nQ2?<|im_end|>\n<|im_start|>assistant\n", False),
        ("A2.<|im_end|>\n", True),
    ]
    prompt = render_chat(processor, view["_messages"], add_generation_prompt=True)
    assert prompt + "".join(t for t, _ in view["_sft_pieces"]) == render_chat(processor, view["_messages"] + CONVERSATION[1:], False)
    tok = processor.tokenizer
    ids, attention, loss = target_tensors(tok, [view, {"solution": "3"}], lambda r: "<answer>3</answer>", "cpu")
    trained = tok.decode(ids[0][loss[0].bool()])
    assert trained == "A1.<|im_end|>\nA2.<|im_end|>\n"
    assert tok.decode(ids[0][(attention[0] - loss[0]).bool()]) == "<|im_start|>user\nQ2?<|im_end|>\n<|im_start|>assistant\n"
    # a plain row: its whole target + EOS is trained, as before
    n = int(attention[1].sum())
    assert torch.equal(loss[1], attention[1]) and tok.decode(ids[1][:n]) == "<answer>3</answer><|im_end|>"


def test_an_image_in_a_later_turn_moves_the_prompt_end(tiny_qwen25vl):
    processor = load_processor(tiny_qwen25vl)
    later = [turn("user", "Q1?"), turn("assistant", "A1."), turn("user", None, "Q2?"), turn("assistant", "A2.")]
    view = sft_view(processor, {"_conversation": later}, 1)
    assert [m["role"] for m in view["_messages"]] == ["user", "assistant", "user"]
    assert [t for t, on in view["_sft_pieces"] if on] == ["A2.<|im_end|>\n"]
    with pytest.raises(ConversationError, match="d.jsonl:3: no assistant turn after the last image"):
        sft_view(processor, {"_conversation": later[:3], "_source": "d.jsonl:3"}, 1)


@pytest.mark.parametrize("family", ALL_FAMILY_FIXTURES)
def test_every_family_template_trains_only_the_answers(family, request):
    processor = load_processor(request.getfixturevalue(family))
    view = sft_view(processor, {"_conversation": CONVERSATION}, 1)
    trained = "".join(t for t, on in view["_sft_pieces"] if on)
    skipped = "".join(t for t, on in view["_sft_pieces"] if not on)
    assert "A1." in trained and "A2." in trained and "Q2?" not in trained and "Q2?" in skipped


def test_sft_runs_on_llava_instruct_rows(tiny_qwen25vl, tmp_path):
    from vlmrl.cli import main

    data = peer_files.llava_instruct(tmp_path)
    args = [
        f"model.name_or_path={tiny_qwen25vl}",
        f"data.train_path={data}",
        f"data.image_root={tmp_path / 'images'}",
        f"training.output_dir={tmp_path / 'sft'}",
        "sft.steps=1",
        "sft.batch_size=2",
        "training.save_final_model=false",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
    ]
    assert main(["sft", *args]) == 0
