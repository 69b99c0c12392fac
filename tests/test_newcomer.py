"""The newcomer path end to end on the tiny model: TRL / VLM-R1 rewards inside `train`, embedded-image datasets."""

import json
import textwrap

import pytest

from vlmrl.config import load_config
from vlmrl.data.tasks import make_count_task
from vlmrl.train import train

USER_REWARDS = textwrap.dedent("""
    import asyncio
    import json
    import re

    CALLS = "{calls}"


    def vlmr1_accuracy(completions, solution, **kwargs):
        contents = [completion[0]["content"] for completion in completions]
        out = []
        for content, sol in zip(contents, solution):
            m = re.search(r"<answer>(.*?)</answer>", content)
            out.append(1.0 if m and m.group(1).strip() == sol.strip() else 0.0)
        return out


    def trl_length(completions, completion_ids, trainer_state, **kwargs):
        with open(CALLS, "a") as f:
            f.write(json.dumps({{"step": trainer_state.global_step, "ids": completion_ids}}) + "\\n")
        return [len(ids) / 10 for ids in completion_ids]


    async def async_judge(prompts, completions, **kwargs):
        await asyncio.sleep(0)
        assert prompts[0][-1]["role"] == "user"
        return [0.5 for _ in completions]
""")


@pytest.fixture(scope="module")
def count_data(tmp_path_factory):
    return make_count_task(tmp_path_factory.mktemp("count"), n_train=16, n_test=4, seed=0, image_size=56)


def small_cfg(model_path, train_path, eval_path, out, *extra):
    return load_config(
        None,
        [
            f"model.name_or_path={model_path}",
            f"data.train_path={train_path}",
            f"data.eval_path={eval_path}",
            f"training.output_dir={out}",
            "training.max_steps=2",
            "rollout.num_generations=2",
            "training.per_device_train_batch_size=4",
            "rollout.max_completion_length=5",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "logging.report=false",
            "data.min_pixels=3136",
            "data.max_pixels=3136",
            "training.save_final_model=false",
            *extra,
        ],
    )


def test_trl_and_vlmr1_rewards_run_inside_train(tiny_qwen25vl, count_data, tmp_path):
    calls = tmp_path / "calls.jsonl"
    rewards_file = tmp_path / "user_rewards.py"
    rewards_file.write_text(USER_REWARDS.format(calls=calls))
    specs = ",".join(f"'{rewards_file}:{name}'" for name in ("vlmr1_accuracy", "trl_length", "async_judge"))
    out = tmp_path / "run"
    final = train(
        small_cfg(
            tiny_qwen25vl,
            count_data["train"],
            count_data["test"],
            out,
            f"algorithm.reward_funcs=[{specs}, accuracy]",
            "algorithm.completion_format=conversational",
        )
    )
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    # Two training steps (4 completions each), then the final evaluation (4 rows, step 0 = not training).
    assert [c["step"] for c in logged] == [1, 2, 0]
    assert [len(c["ids"]) for c in logged] == [4, 4, 4]
    assert all(1 <= len(ids) <= 5 for c in logged for ids in c["ids"])
    assert final["eval/async_judge"] == 0.5
    assert final["eval/vlmr1_accuracy"] == final["eval/accuracy"]  # the same judgement through both forms
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["rewards/trl_length/mean"] > 0 for m in metrics)


def embed_images(jsonl, out_parquet):
    """The count task rewritten as a hub-style parquet: a datasets.Image column holding the PNG bytes."""
    import datasets
    from PIL import Image

    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    images = [Image.open(jsonl.parent / r["image"]).convert("RGB") for r in rows]
    ds = datasets.Dataset.from_dict(
        {"image": images, "problem": [r["problem"] for r in rows], "solution": [str(r["solution"]) for r in rows]},
        features=datasets.Features({"image": datasets.Image(), "problem": datasets.Value("string"), "solution": datasets.Value("string")}),
    )
    ds.to_parquet(str(out_parquet))
    return out_parquet


def test_train_on_a_dataset_with_embedded_images(tiny_qwen25vl, count_data, tmp_path, monkeypatch):
    monkeypatch.setenv("VLMRL_CACHE", str(tmp_path / "cache"))
    train_set = embed_images(count_data["train"], tmp_path / "train.parquet")
    test_set = embed_images(count_data["test"], tmp_path / "test.parquet")
    out = tmp_path / "run"
    final = train(small_cfg(tiny_qwen25vl, train_set, test_set, out, "algorithm.reward_funcs=[accuracy, answer_format]", "logging.log_completions=1"))
    assert final["eval/num_samples"] == 4.0
    assert len(list((tmp_path / "cache" / "images").glob("*.png"))) == 20  # 16 train + 4 test images, spilled once each
