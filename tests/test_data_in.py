"""Issue 35, "Data in": what users of the peers meet first when they bring their own data.

1. data.skip_bad_rows=true must not abort the run it was meant to save (bad_rows.jsonl is vlmrl's file).
2. Multi-image rows as VLM-R1 / LLaVA ship them: ``"image": ["a.png", "b.png"]``.
3. Several data files with their own image folders (VLM-R1's --data_file_paths a:b --image_folders A:B).
4. Hub-style dataset folders, EasyR1's ``path::split`` on them, lists of data files, MM-EUREKA's rows.
5. EasyR1's reward gets the ``answer_key`` column as ground truth, as EasyR1's loader gives it.
"""

import json
import shutil

import pytest

from vlmrl import cli
from vlmrl.data.tasks import make_count_task


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=8, n_test=4, seed=0, image_size=56)


def run_args(model, train, out, *extra):
    return [
        f"model.name_or_path={model}",
        f"data.train_path={train}",
        f"training.output_dir={out}",
        "training.max_steps=1",
        "rollout.num_generations=2",
        "training.per_device_train_batch_size=4",
        "rollout.max_completion_length=3",
        "sft.projector_steps=0",
        "sft.steps=1",
        "sft.batch_size=4",
        "data.min_pixels=3136",
        "data.max_pixels=3136",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.report=false",
        *extra,
    ]


# ---------------------------------------------------------------- 1. skip_bad_rows
def with_bad_row(count_data, folder):
    """The count task's training rows plus one row without a solution (a bad row)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copytree(count_data["train"].parent / "images", folder / "images", dirs_exist_ok=True)
    lines = count_data["train"].read_text().splitlines()
    data = folder / "train.jsonl"
    data.write_text("\n".join([*lines, '{"problem": "no solution here"}']) + "\n")
    return data


@pytest.mark.parametrize("command", ["train", "sft"])
def test_skip_bad_rows_trains_and_lists_the_dropped_row(tiny_qwen25vl, count_data, tmp_path, capsys, command):
    data = with_bad_row(count_data, tmp_path / "data")
    out = tmp_path / "out"
    base = run_args(tiny_qwen25vl, data, out, "data.skip_bad_rows=true")
    assert cli.main(["check", *base]) == 0  # check lists the dropped rows too; the run then takes the folder
    assert cli.main([command, *base]) == 0, capsys.readouterr().err
    (record,) = [json.loads(x) for x in (out / "bad_rows.jsonl").read_text().splitlines()]
    assert record["source"] == f"{data}:9" and record["field"] == "solution"
    assert (out / "final").is_dir()
    # Starting over in the same folder: the earlier run (its bad_rows.jsonl included) is vlmrl's to delete.
    capsys.readouterr()
    assert cli.main([command, *base, "training.overwrite_output_dir=true"]) == 0, capsys.readouterr().err
    assert "deleted the earlier run" in capsys.readouterr().out
    (record,) = [json.loads(x) for x in (out / "bad_rows.jsonl").read_text().splitlines()]
    assert record["source"] == f"{data}:9"


def test_a_users_bad_rows_file_is_never_replaced(count_data, tmp_path, capsys):
    data = with_bad_row(count_data, tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    (out / "bad_rows.jsonl").write_text("my own notes\n")
    code = cli.main(["check", f"data.train_path={data}", f"training.output_dir={out}", "data.skip_bad_rows=true", "model.defaults=pretrained"])
    assert code == 2 and "bad_rows.jsonl, which vlmrl did not write" in capsys.readouterr().err
    assert (out / "bad_rows.jsonl").read_text() == "my own notes\n"


def test_the_data_loader_itself_never_replaces_a_users_bad_rows_file(count_data, tmp_path):
    from vlmrl.config import load_config
    from vlmrl.data.errors import DataError
    from vlmrl.run.datasets import load_datasets

    data = with_bad_row(count_data, tmp_path / "data")
    out = tmp_path / "out"
    out.mkdir()
    (out / "bad_rows.jsonl").write_text("my own notes\n")
    cfg = load_config(None, [f"data.train_path={data}", f"training.output_dir={out}", "data.skip_bad_rows=true"])
    with pytest.raises(DataError, match="holds bad_rows.jsonl, which vlmrl did not write"):
        load_datasets(cfg)
    assert (out / "bad_rows.jsonl").read_text() == "my own notes\n"


# ---------------------------------------------------------------- 2. multi-image `image` lists
GUI_QUESTION = "You are tasked with identifying any UI Interaction Defects using the user action and two screenshots (before and after the action)."


def gui_multi_image(folder, n=3):
    """VLM-R1's gui_multi-image.jsonl as published: `id`, `image` a list of two screenshots (relative to
    --image_folders), `conversations` with one human turn (no <image> placeholder) and one gpt turn."""
    from peer_files import draw

    images = folder / "images" / "gui_multi-image"
    rows = []
    for i in range(n):
        before, after = f"GOOGLE_APPS-{i}_1.png", f"GOOGLE_APPS-{i}_2.png"
        draw(images / before, 1)
        draw(images / after, 2)
        answer = "Operation No Response" if i % 2 else "Unexpected Task Result"
        rows.append(
            {"id": i + 1, "image": [before, after], "conversations": [{"from": "human", "value": GUI_QUESTION}, {"from": "gpt", "value": answer}]}
        )
    data = folder / "data_jsonl" / "gui_multi-image.jsonl"
    data.parent.mkdir(parents=True)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data, images


def test_vlm_r1_multi_image_rows_are_read_as_shipped(tmp_path):
    from vlmrl.data.formats import prompt_messages_of
    from vlmrl.data.rows import load_dataset_split

    data, images = gui_multi_image(tmp_path)
    rows, report = load_dataset_split(data, limit_images=None, skip_bad_rows=False, image_roots=[str(images)])
    assert report.format == "vlm-r1 conversations" and report.num_images == 6
    first = rows[0]
    # VLM-R1's loader: image_path = [join(image_folder, p) for p in image], both screenshots in order, before the text.
    assert first["images"] == [str(images / "GOOGLE_APPS-0_1.png"), str(images / "GOOGLE_APPS-0_2.png")]
    assert first["image_path"] == first["images"] and first["solution"] == "<answer> Unexpected Task Result </answer>"
    (turn,) = prompt_messages_of(first, 2, 0)
    assert [b["type"] for b in turn["content"]] == ["image", "image", "text"]


def test_an_image_list_mapped_with_data_columns_images(tmp_path):
    from vlmrl.data.rows import load_dataset_split

    data, images = gui_multi_image(tmp_path)
    rows, _ = load_dataset_split(data, limit_images=None, skip_bad_rows=False, image_roots=[str(images)], columns={"images": "image"})
    assert rows[1]["images"] == [str(images / "GOOGLE_APPS-1_1.png"), str(images / "GOOGLE_APPS-1_2.png")]
    # LLaVA / MoE-LLaVA JSON with a list under `image` and a `problem`/`solution` pair read the same way.
    llava = tmp_path / "llava.json"
    llava.write_text(json.dumps([{"image": ["images/gui_multi-image/GOOGLE_APPS-0_1.png"], "problem": "q", "solution": "a"}]))
    (row,), _ = load_dataset_split(llava, limit_images=None, skip_bad_rows=False)
    assert row["images"] == [str(images / "GOOGLE_APPS-0_1.png")]


def test_an_image_that_is_neither_a_path_nor_a_list_is_still_a_bad_row(tmp_path):
    from vlmrl.data.errors import DataError
    from vlmrl.data.rows import load_dataset_split

    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"image": 7, "problem": "q", "solution": "a"}) + "\n" + json.dumps({"image": ["a.png", 3], "problem": "q", "solution": "a"}) + "\n"
    )
    with pytest.raises(DataError) as e:
        load_dataset_split(data, limit_images=None, skip_bad_rows=False)
    assert f"{data}:1: image: expected a path string or a list of them, got int" in str(e.value)
    assert f"{data}:2: image: item 1 is int, expected a path string" in str(e.value)


# ---------------------------------------------------------------- 3. several data files, each with its image folder
def two_vlm_r1_files(folder):
    """Two VLM-R1 JSONL files whose rows both name `0001.png`, each relative to its own image folder (different
    pictures: 1 and 3 red squares), as --data_file_paths a:b --image_folders A:B trains them."""
    from peer_files import draw

    files, folders = [], []
    for name, count in (("a", 1), ("b", 3)):
        images = folder / f"images_{name}"
        draw(images / "0001.png", count)
        row = {"id": 1, "image": "0001.png", "conversations": [{"from": "human", "value": "<image>How many?"}, {"from": "gpt", "value": str(count)}]}
        data = folder / f"{name}.jsonl"
        data.write_text(json.dumps(row) + "\n")
        files.append(data)
        folders.append(images)
    return files, folders


def test_vlm_r1_data_files_keep_their_own_image_folders_after_convert(tmp_path):
    """VLM-R1's grpo_jsonl.py joins each file's image paths with the folder at the same position; the converted
    config must train every file, each row on the image VLM-R1 would load."""
    import yaml

    from vlmrl.config import load_config
    from vlmrl.run.datasets import load_datasets

    (a, b), (A, B) = two_vlm_r1_files(tmp_path)
    out = tmp_path / "run.yaml"
    launch = ["--data_file_paths", f"{a}:{b}", "--image_folders", f"{A}:{B}", "--model_name_or_path", "/models/x"]
    assert cli.main(["convert", "--from", "vlm-r1", "-o", str(out), *launch]) == 0
    settings = yaml.safe_load(out.read_text())["data"]
    assert settings["train_path"] == [str(a), str(b)] and settings["image_root"] == [str(A), str(B)]
    cfg = load_config(str(out), [f"training.output_dir={tmp_path / 'o'}", "model.name_or_path=embedded:tiny-qwen2.5-vl"])
    rows = load_datasets(cfg).train
    assert [(r["_source"], r["images"]) for r in rows] == [(f"{a}:1", [str(A / "0001.png")]), (f"{b}:1", [str(B / "0001.png")])]


def test_an_image_in_two_image_roots_is_refused_not_guessed(tmp_path, capsys):
    (a, _), (A, B) = two_vlm_r1_files(tmp_path)
    code = cli.main(["check", f"data.train_path={a}", f"data.image_root=[{A},{B}]", f"training.output_dir={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    # check's report lines (which rollout backend runs) come first; the refusal is one line, the last.
    assert code == 2 and "Traceback" not in err and sum(line.startswith("vlmrl check:") for line in err.splitlines()) == 1, err
    err = err.splitlines()[-1]
    assert f"{a}:1: image '0001.png' is in two data.image_root folders with different content ({A / '0001.png'} and {B / '0001.png'})" in err
    assert "data.train_path=[a.jsonl, b.jsonl] data.image_root=[A, B]" in err
    # The same bytes in both folders are the same image: nothing to guess.
    shutil.copy(A / "0001.png", B / "0001.png")
    assert cli.main(["check", f"data.train_path={a}", f"data.image_root=[{A},{B}]", f"training.output_dir={tmp_path / 'o'}"]) == 0


def test_several_data_files_with_a_different_number_of_image_folders_are_refused(tmp_path, capsys):
    (a, b), (A, B) = two_vlm_r1_files(tmp_path)
    code = cli.main(["check", f"data.train_path=[{a},{b}]", f"data.image_root=[{A},{B},{A}]", f"training.output_dir={tmp_path / 'o'}"])
    err = capsys.readouterr().err
    assert code == 2 and "data.image_root has 3 folders for the 2 data files of data.train_path" in err, err


def test_a_list_of_data_files_is_fingerprinted_and_guarded_like_one(tmp_path):
    from vlmrl.checkpoints.fingerprints import run_fingerprints
    from vlmrl.checkpoints.run_manifest import output_dir_problem
    from vlmrl.config import load_config

    (a, b), _ = two_vlm_r1_files(tmp_path)
    cfg = load_config(None, [f"data.train_path=[{a},{b}]", f"training.output_dir={tmp_path / 'out'}"])
    before = run_fingerprints(cfg)["data.train_path"]
    b.write_text(b.read_text().replace('"3"', '"4"'))  # the second file changed: a resume must notice
    assert run_fingerprints(cfg)["data.train_path"] != before
    inside = tmp_path / "out" / "c.jsonl"
    inside.parent.mkdir()
    inside.write_text(a.read_text())
    cfg = load_config(None, [f"data.train_path=[{a},{inside}]", f"training.output_dir={tmp_path / 'out'}"])
    assert output_dir_problem(cfg).startswith(f"data.train_path[1]={inside} lies inside training.output_dir")


# ---------------------------------------------------------------- 4. hub-style folders, file lists, MM-EUREKA rows
def geometry3k(folder):
    """A downloaded hub dataset as `huggingface-cli download hiyouga/geometry3k --repo-type dataset` leaves it:
    data/{train,validation,test}-00000-of-00001.parquet with embedded images, `problem` with <image>, `answer`; the
    rows also carry a `ground_truth` column (the choice letter) beside the numeric `answer`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from peer_files import draw

    (folder / "data").mkdir(parents=True)
    for split, n in (("train", 3), ("validation", 2), ("test", 2)):
        table = pa.table(
            {
                "images": [[{"bytes": draw(None, 1 + i), "path": None}] for i in range(n)],
                "problem": [f"<image>Find x. ({split} {i})" for i in range(n)],
                "answer": [f"{7 + i}.1" for i in range(n)],
                "ground_truth": ["B"] * n,
            }
        )
        pq.write_table(table, folder / "data" / f"{split}-00000-of-00001.parquet")
    (folder / "README.md").write_text("---\nconfigs: [...]\n---\n")
    return folder


def data_cfg(tmp_path, *extra):
    from vlmrl.config import load_config

    return load_config(None, [f"training.output_dir={tmp_path / 'out'}", *extra])


@pytest.mark.parametrize("notation", ["{d}", "{d}::train", "{d}@train", "{d}/data", "{d}/data::train"])
def test_a_downloaded_hub_dataset_folder_is_read_as_its_train_split(tmp_path, notation):
    from vlmrl.run.datasets import load_datasets

    folder = geometry3k(tmp_path / "geometry3k")
    cfg = data_cfg(tmp_path, "data.train_path=" + notation.format(d=folder), f"data.eval_path={folder}@test")
    data = load_datasets(cfg)
    assert [r["problem"] for r in data.train] == [f"<image>Find x. (train {i})" for i in range(3)]
    assert [r["problem"] for r in data.eval] == [f"<image>Find x. (test {i})" for i in range(2)]
    assert data.train[0]["_source"].startswith(str(folder / "data" / "train-00000-of-00001.parquet"))


def test_evaluation_on_a_hub_folder_names_its_split(tmp_path, capsys):
    folder = geometry3k(tmp_path / "geometry3k")
    code = cli.main(["check", f"data.train_path={folder}", f"data.eval_path={folder}", f"training.output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"{folder}: holds splits test, train, validation; pick one with {folder}::<split> (EasyR1: {folder}@<split>)" in err, err


def test_a_hub_id_without_a_local_folder_names_the_field_and_the_download(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["check", "data.train_path=hiyouga/math12k::train", f"training.output_dir={tmp_path / 'out'}"])
    lines = capsys.readouterr().err.strip().splitlines()
    line = lines[-1]  # after check's report lines (which rollout backend runs): the refusal, in one line
    assert sum(x.startswith("vlmrl check:") for x in lines) == 1 and "Traceback" not in "".join(lines)
    assert code == 2 and line.startswith("vlmrl check: data.train_path=hiyouga/math12k::train: hiyouga/math12k: no such file or folder"), line
    assert "nothing is downloaded at run time" in line
    assert "huggingface-cli download hiyouga/math12k --repo-type dataset --local-dir math12k" in line and "math12k::train" in line


def test_a_list_of_data_files_is_read_in_order(tmp_path):
    from vlmrl.run.datasets import load_datasets

    (a, b), (A, B) = two_vlm_r1_files(tmp_path)
    data = load_datasets(data_cfg(tmp_path, f"data.train_path=[{a},{b}]", f"data.image_root=[{A},{B}]"))
    assert [r["solution"] for r in data.train] == ["<answer> 1 </answer>", "<answer> 3 </answer>"]
    assert data.reports[0].startswith(f"train {a}, {b}: format vlm-r1 conversations: 2 of 2 rows kept")


def mm_eureka(folder, n=2):
    """MM-EUREKA's JSONL as its README gives it: `id`, `message` (the turns as a JSON string, the image inline as a
    file:// URI with an absolute path), `answer`."""
    from peer_files import draw

    rows = []
    for i in range(n):
        image = folder / "images" / f"{i}.jpg"
        draw(image, 1 + i)
        turns = [{"role": "user", "content": [{"type": "image", "image": f"file://{image}"}, {"type": "text", "text": "How many red squares?"}]}]
        rows.append({"id": str(i), "message": json.dumps(turns), "answer": str(1 + i)})
    data = folder / "mm_eureka.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_mm_eureka_rows_are_read_as_shipped(tmp_path, capsys):
    from vlmrl.data.formats import prompt_messages_of
    from vlmrl.data.rows import load_dataset_split

    data = mm_eureka(tmp_path)
    rows, report = load_dataset_split(data, limit_images=None, skip_bad_rows=False)
    assert report.format == "messages" and [r["solution"] for r in rows] == ["1", "2"]
    assert rows[1]["images"] == [str(tmp_path / "images" / "1.jpg")]
    (turn,) = prompt_messages_of(rows[1], 1, 0)
    assert turn["content"] == [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]
    assert cli.main(["check", f"data.train_path={data}", f"training.output_dir={tmp_path / 'out'}"]) == 0, capsys.readouterr().err


def test_a_message_column_of_plain_text_stays_an_extra_column(tmp_path):
    from vlmrl.data.rows import load_dataset_split

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "2+2?", "solution": "4", "message": "hello"}) + "\n")
    (row,), report = load_dataset_split(data, limit_images=None, skip_bad_rows=False)
    assert report.format == "vlmrl" and row["message"] == "hello" and row["problem"] == "2+2?"


# ---------------------------------------------------------------- 5. EasyR1's ground truth is its answer_key column
def test_easyr1_reward_grades_against_the_answer_column_as_easyr1_does(tmp_path, capsys):
    from pathlib import Path

    from vlmrl.rewards.combine import compute_rewards
    from vlmrl.rewards.scoring import load_reward_funcs, reward_columns
    from vlmrl.run.datasets import load_datasets

    folder = geometry3k(tmp_path / "geometry3k")
    reward = f"{Path(__file__).parent / 'peers' / 'easyr1_sequential.py'}:compute_score"  # ground_truth in response
    base = [f"data.train_path={folder}@train", f"algorithm.reward_funcs=[{reward}]"]

    def scores(*extra, texts):
        cfg = data_cfg(tmp_path, *base, *extra)
        rows = load_datasets(cfg).train[:2]
        funcs, weights = load_reward_funcs(cfg)
        _, per = compute_rewards(funcs, weights, ["q"] * 2, texts, reward_columns(rows, 1))
        return per["compute_score"]

    # EasyR1: ground_truth = example.pop(answer_key), answer_key "answer" -> "7.1", "8.1"; the data's "B" is not it.
    assert scores(texts=["x = 7.1", "x = 8.1"]) == [1.0, 1.0]
    assert scores(texts=["B", "B"]) == [0.0, 0.0]
    # EasyR1's data.answer_key=ground_truth (vlmrl convert writes it as data.columns.solution) picks that column.
    assert scores("data.columns.solution=ground_truth", texts=["B", "8.1"]) == [1.0, 0.0]
    assert cli.main(["check", *base, f"training.output_dir={tmp_path / 'out'}"]) == 0
    err = capsys.readouterr().err
    assert "ground_truth=answer: the 'answer' column, EasyR1's data.answer_key; the data's own 'ground_truth' column is not it" in err


# ---------------------------------------------------------------- small: row numbers count from 1 in every format
def test_the_second_row_is_row_2_in_jsonl_json_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from vlmrl.data.errors import DataError
    from vlmrl.data.rows import load_dataset_split

    rows = [{"problem": "p", "solution": "1"}, {"problem": "p", "solution": ""}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name, where in (("d.jsonl", ":2"), ("d.json", ":row 2"), ("d.parquet", ":row 2")):
        with pytest.raises(DataError) as e:
            load_dataset_split(tmp_path / name, limit_images=None, skip_bad_rows=False)
        assert f"{tmp_path / name}{where}: solution: empty" in str(e.value), str(e.value)


# ---------------------------------------------------------------- small: an ms-swift ORM missing its data columns
def test_an_ms_swift_orm_whose_columns_are_missing_names_them(tmp_path, capsys):
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "from swift.plugin import ORM\n\n\n"
        "class BoxIoU(ORM):\n"
        "    def __call__(self, completions, bbox, image_size, **kwargs):\n"
        "        return [0.0 for _ in completions]\n"
    )
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "p", "solution": "1", "source": "x"}) + "\n")
    code = cli.main(["check", f"data.train_path={data}", f"algorithm.reward_funcs=[{plugin}:BoxIoU]", f"training.output_dir={tmp_path / 'o'}"])
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert code == 2 and "it takes the data columns bbox, image_size as arguments, which these rows do not have" in line, line
    assert "(their columns: problem, solution, source, images, videos): add them to the data file" in line
    assert "peers.py" not in line  # vlmrl's own wrapper is not where the user looks


# ---------------------------------------------------------------- small: data.system_prompt makes TRL's chat prompt
def test_problem_rows_with_a_system_prompt_are_trls_conversational_prompts(tmp_path, capsys):
    """TRL's examples/scripts/grpo_vlm.py turns `problem` into [system SYSTEM_PROMPT, user problem] (make_conversation),
    so its rewards read completion[0]["content"]; vlmrl's equivalent is data.system_prompt on the same rows."""
    from vlmrl.rewards.protocol import reward_inputs

    reward = tmp_path / "rewards.py"
    reward.write_text(
        "def think_format_reward(completions, **kwargs):\n    return [1.0 if c[0]['content'].startswith('<think>') else 0.0 for c in completions]\n"
    )
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"problem": "What is 2+2?", "solution": "4"}) + "\n")
    base = [f"data.train_path={data}", f"algorithm.reward_funcs=[{reward}:think_format_reward]", f"training.output_dir={tmp_path / 'o'}"]
    assert cli.main(["check", *base, "data.system_prompt=Think first."]) == 0, capsys.readouterr().err
    assert "reward think_format_reward (TRL signature): gets prompts, completions (conversational)" in capsys.readouterr().err
    prompts, completions = reward_inputs([{"problem": "What is 2+2?", "solution": "4"}], ["<think>x</think>4"], 1, "auto", "Think first.")
    assert prompts[0][0] == {"role": "system", "content": [{"type": "text", "text": "Think first."}]}
    assert completions == [[{"role": "assistant", "content": "<think>x</think>4"}]]
    # Without a system prompt the same rows are TRL's standard (string) prompts, as before.
    assert reward_inputs([{"problem": "p", "solution": "4"}], ["4"], 1, "auto") == (["p"], ["4"])


def test_a_users_bad_rows_file_is_left_alone_when_no_row_is_dropped(count_data, tmp_path):
    from vlmrl.run.datasets import load_datasets

    out = tmp_path / "out"
    out.mkdir()
    (out / "bad_rows.jsonl").write_text("my own notes\n")
    load_datasets(data_cfg(tmp_path, f"data.train_path={count_data['train']}", "data.skip_bad_rows=true"))
    assert (out / "bad_rows.jsonl").read_text() == "my own notes\n"
