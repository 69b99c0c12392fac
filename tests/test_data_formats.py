"""Peers' dataset layouts read as shipped (formats.py): detection, rows, image placement, and the guards."""

import json

import pytest

import peer_files
from vlmrl.data.errors import DataError
from vlmrl.data.rows import load_dataset_split
from vlmrl.data.formats import prompt_messages_of

pytestmark = pytest.mark.unit


def load(path, **kw):
    return load_dataset_split(path, limit_images=4, skip_bad_rows=False, **kw)


def kinds(messages):
    return [[b["type"] for b in m["content"]] for m in messages]


def test_trl_standard_prompt_column(tmp_path):
    rows, report = load(peer_files.trl_standard(tmp_path))
    assert report.format == "trl standard" and report.num_images == 4
    assert rows[0]["problem"] == peer_files.QUESTION and rows[0]["solution"] == "1" and rows[0]["source"] == "drawn"


def test_trl_conversational_keeps_system_turn_and_image_block(tmp_path):
    rows, report = load(peer_files.trl_conversational(tmp_path))
    assert report.format == "trl conversational" and report.num_images == 4
    messages = prompt_messages_of(rows[0], 1, 0, system_prompt="ignored: the row brings its own")
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"][0]["text"] == "Put the final answer in <answer></answer>."
    assert kinds(messages)[1] == ["image", "text"]
    assert rows[0]["solution"] == "$1$" and rows[0]["_conversational"]


def test_prompt_beside_problem_is_the_prompt(tmp_path):
    """TRL reads `prompt`; a `problem` column beside it is an extra column, not a replacement."""
    peer_files.draw(tmp_path / "a.png", 1)
    prompt = [{"role": "system", "content": "SYS"}, {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Q?"}]}]
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": prompt, "problem": "other", "image": "a.png", "solution": "1"}) + "\n")
    rows, _ = load(tmp_path / "d.jsonl")
    assert prompt_messages_of(rows[0], 1, 0)[0]["content"][0]["text"] == "SYS"
    assert rows[0]["problem"] == "other"  # the column itself is passed on to rewards unchanged


def test_vlm_r1_conversations_with_image_root(tmp_path):
    data, images = peer_files.vlm_r1(tmp_path)
    with pytest.raises(DataError, match="file not found"):  # relative to the JSONL's folder there is nothing
        load(data)
    rows, report = load(data, image_roots=[str(tmp_path / "elsewhere"), str(images)])
    assert report.format == "vlm-r1 conversations" and report.num_images == 4
    row = rows[0]
    assert row["problem"] == peer_files.QUESTION  # VLM-R1's loader drops the <image> text
    assert row["solution"] == "<answer> 1 </answer>"  # and wraps the answer turn in answer tags
    assert row["accu_reward_method"] == "default"
    assert row["image_path"] == [str(images / "train_0.png")]
    assert kinds(prompt_messages_of(row, 1, 0)) == [["image", "text"]]


def test_easyr1_parquet_with_embedded_images(tmp_path):
    rows, report = load(peer_files.easyr1(tmp_path / "data"), image_cache=tmp_path / "cache")
    assert report.format == "easyr1" and report.num_images == 4
    assert rows[2]["solution"] == "3" and rows[2]["answer"] == "3"
    assert kinds(prompt_messages_of(rows[0], 1, 0)) == [["image", "text"]]


def test_ms_swift_messages(tmp_path):
    rows, report = load(peer_files.ms_swift(tmp_path))
    assert report.format == "messages" and report.num_images == 4
    assert rows[0]["solution"] == "<answer>1</answer>" and rows[0]["problem"] == peer_files.QUESTION
    assert [m["role"] for m in prompt_messages_of(rows[0], 1, 0)] == ["system", "user"]


def test_llava_instruct_multi_turn(tmp_path):
    rows, report = load(peer_files.llava_instruct(tmp_path), image_roots=[str(tmp_path / "images")])
    assert report.format == "llava-instruct conversations"
    row = rows[1]
    assert row["solution"] == "White."  # the last assistant turn; the turns before it are the prompt
    assert [m["role"] for m in row["_messages"]] == ["user", "assistant", "user"]
    assert [m["role"] for m in row["_conversation"]] == ["user", "assistant", "user", "assistant"]
    assert kinds(row["_messages"])[0] == ["image", "text"]


def test_imagefolder_folder_and_its_metadata_file(tmp_path):
    folder = peer_files.imagefolder(tmp_path / "imgs")
    for path in (folder, folder / "metadata.jsonl"):
        rows, report = load(path)
        assert report.num_images == 4 and report.text_only_rows == 0, report.summary()
        assert report.format == "imagefolder (vlmrl columns)"
        assert rows[0]["images"] == [str(folder / "0.png")]


def test_columns_map_other_names(tmp_path):
    peer_files.draw(tmp_path / "a.png", 2)
    (tmp_path / "d.jsonl").write_text(json.dumps({"question": "Q?", "answer_text": "2", "picture": "a.png"}) + "\n")
    with pytest.raises(DataError, match="picture"):  # the image would be lost: refused, not trained text-only
        load(tmp_path / "d.jsonl")
    rows, report = load(tmp_path / "d.jsonl", columns={"problem": "question", "solution": "answer_text", "image": "picture"})
    assert (rows[0]["problem"], rows[0]["solution"], report.num_images) == ("Q?", "2", 1)
    assert rows[0]["question"] == "Q?"  # the original column stays for rewards


def test_metadata_renamed_would_lose_images_and_is_refused(tmp_path):
    folder = peer_files.imagefolder(tmp_path / "imgs")
    (folder / "metadata.jsonl").rename(folder / "rows.jsonl")
    with pytest.raises(DataError, match=r"rows.jsonl:1: column 'file_name' .* data.columns.image=file_name"):
        load(folder / "rows.jsonl")
    rows, report = load(folder / "rows.jsonl", columns={"image": "file_name"})
    assert report.num_images == 4


def test_two_prompt_columns_are_ambiguous(tmp_path):
    row = {"prompt": "a", "messages": [{"role": "user", "content": "b"}], "solution": "1"}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:1: ambiguous format: the row has both 'prompt' and 'messages'.*data.format to trl or messages"):
        load(tmp_path / "d.jsonl")
    rows, report = load(tmp_path / "d.jsonl", layout="messages")
    assert report.format == "messages" and rows[0]["problem"] == "b"


def test_rows_in_two_layouts_are_ambiguous(tmp_path):
    rows = [{"problem": "a", "solution": "1"}, {"messages": [{"role": "user", "content": "b"}], "solution": "1"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="rows are in two layouts"):
        load(tmp_path / "d.jsonl")


def test_placeholder_count_mismatch_is_a_bad_row(tmp_path):
    peer_files.draw(tmp_path / "a.png", 1)
    rows = [
        {"problem": "<image> and <image>: same?", "image": "a.png", "solution": "yes"},
        {"problem": "<image> ok", "image": "a.png", "solution": "1"},
        {"problem": "no placeholder", "image": "a.png", "solution": "1"},
    ]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"d.jsonl:1: prompt: found 2 <image> placeholders for 1 images"):
        load(tmp_path / "d.jsonl")
    kept, report = load_dataset_split(tmp_path / "d.jsonl", limit_images=4, skip_bad_rows=True)
    assert report.problem_counts == {"placeholder_mismatch": 1} and len(kept) == 2


def test_placeholders_place_images_where_they_stand():
    row = {"problem": "First <image> then <image> compare."}
    assert [b.get("text", b["type"]) for b in prompt_messages_of(row, 2, 0)[0]["content"]] == ["First ", "image", " then ", "image", " compare."]
    assert kinds(prompt_messages_of({"problem": "no placeholders"}, 2, 0)) == [["image", "image", "text"]]
    # limit_images keeps the first placeholders' images and drops the rest
    assert kinds(prompt_messages_of(row, 1, 0)) == [["text", "image", "text", "text"]]


def test_prompt_template_is_easyr1_format_prompt(tmp_path):
    path = peer_files.easyr1(tmp_path / "data")
    template = "{{ content | trim }} Put the answer in \\boxed{}."
    rows, _ = load(path, image_cache=tmp_path / "cache", prompt_template=template)
    content = prompt_messages_of(rows[0], 1, 0)[0]["content"]
    assert [b["type"] for b in content] == ["image", "text"]
    assert content[1]["text"] == peer_files.QUESTION + " Put the answer in \\boxed{}."
