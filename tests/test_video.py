"""Video rows: frame sampling, Qwen-VL temporal patches against the model's own image processor, per-video slicing
of a batch, the shared-prefix path against the naive one (values, gradients, greedy rollout, one vision pass per
prompt), row validation, and GRPO / SFT end to end on video rows."""

import json

import numpy as np
import pytest
import torch
from test_logprobs import LENGTHS, LOOSE_GRADS, assert_grads_close, completions, images, loss_and_grads, model_cfg
from video_files import write_frames, write_mp4

from vlmrl.data.errors import DataError
from vlmrl.data.media import ImageCache
from vlmrl.data.validation import validate_rows
from vlmrl.models.logprobs import completion_logps
from vlmrl.models.loading import load_model, unwrap
from vlmrl.models.prefix import completion_logps_prefix
from vlmrl.models.processing import build_prompt, encode_prompts, load_processor, select_rows
from vlmrl.models.rollout import generate
from vlmrl.data.media import load_video
from vlmrl.data.video import qwen_video_patches, sample_indices, video_header


@pytest.mark.unit
def test_sample_indices_by_hand():
    # 10 frames at 5 fps = 2 s; 2 fps -> 4 frames, evenly spaced over 0..9.
    assert sample_indices(10, 5.0, 2.0, max_frames=16) == [0, 3, 6, 9]
    assert sample_indices(10, 5.0, 2.0, max_frames=2) == [0, 9]  # max_frames caps
    assert sample_indices(100, 25.0, 2.0, max_frames=5) == [0, 33, 66, 99]  # rounded down to an even count
    assert sample_indices(3, 30.0, 2.0, max_frames=16) == [0, 2]  # at least one temporal patch
    assert sample_indices(1, 30.0, 2.0, max_frames=16) == [0]  # shorter than a patch: all of it
    assert sample_indices(6, None, 2.0, max_frames=16) == list(range(6))  # unknown rate: every frame
    assert sample_indices(0, 5.0, 2.0, max_frames=16) == []


@pytest.mark.unit
def test_video_file_and_frame_list(tmp_path):
    path = write_mp4(tmp_path / "a.mp4", frames=10, size=(64, 48), rate=5)
    assert video_header(str(path))[0] == 10
    video = load_video(str(path), max_frames=16, fps=2.0, min_pixels=None, max_pixels=32 * 24)
    assert len(video.frames) == 4 and {f.size for f in video.frames} == {(32, 24)}  # downscaled under the cap
    assert video.sampled_fps == pytest.approx(2.0) and video.seconds_per_patch == pytest.approx(1.0)
    frames = write_frames(tmp_path / "frames", frames=6)
    listed = load_video(frames, max_frames=4, fps=2.0, min_pixels=None, max_pixels=56 * 56)
    assert len(listed.frames) == 4 and listed.seconds_per_patch == pytest.approx(2 / (4 / 3.0))


@pytest.mark.unit
def test_video_cache_hits_and_stays_in_budget(tmp_path):
    paths = [str(write_mp4(tmp_path / f"v{i}.mp4", seed=i)) for i in range(3)]
    one_video = 4 * 64 * 48 * 3
    cache = ImageCache(budget_bytes=2 * one_video)  # room for two decoded videos
    first = load_video(paths[0], max_frames=16, fps=2.0, min_pixels=None, max_pixels=10**6, cache=cache)
    assert load_video(paths[0], max_frames=16, fps=2.0, min_pixels=None, max_pixels=10**6, cache=cache) is first
    assert cache.hits == 1
    for p in paths:
        load_video(p, max_frames=16, fps=2.0, min_pixels=None, max_pixels=10**6, cache=cache)
    assert cache.bytes <= cache.budget_bytes and cache.evictions >= 1 and len(cache) == 2


VIDEO_FAMILIES = ["tiny_qwen2vl", "tiny_qwen25vl", "tiny_qwen3vl", "tiny_qwen3vl_moe", "tiny_qwen35", "tiny_qwen35_moe"]


@pytest.fixture(scope="module", params=VIDEO_FAMILIES)
def qwen(request):
    path = request.getfixturevalue(request.param)
    return request.param, load_model(model_cfg(path)).eval(), load_processor(path)


def test_temporal_patches_match_the_image_processor(qwen):
    """A video of two copies of frame A is image A (the image processor repeats a frame over the temporal patch);
    a video [A, B] holds A in the first temporal slot and B in the second."""
    _, _, processor = qwen
    ip = processor.image_processor
    a, b = images(np.random.default_rng(0), 2)
    same, grid = qwen_video_patches([a, a], ip)
    as_image = ip(images=[a], return_tensors="pt")
    assert torch.equal(same, as_image["pixel_values"]) and grid == as_image["image_grid_thw"][0].tolist()
    mixed, _ = qwen_video_patches([a, b], ip)
    tp, pp = ip.temporal_patch_size, ip.patch_size**2
    slots = mixed.reshape(mixed.shape[0], -1, tp, pp)
    image_b = ip(images=[b], return_tensors="pt")["pixel_values"].reshape(mixed.shape[0], -1, tp, pp)
    assert torch.equal(slots[:, :, 0], as_image["pixel_values"].reshape(mixed.shape[0], -1, tp, pp)[:, :, 0])
    assert torch.equal(slots[:, :, 1], image_b[:, :, 0])


def test_qwen3_prompts_carry_patch_timestamps(qwen, tmp_path):
    """Qwen3-VL / Qwen3.5 (as transformers' Qwen3VLProcessor writes it): `<t seconds>` and a vision start/end pair
    around each temporal patch, t the mean time of its two frames; Qwen2-VL / 2.5-VL: one run of video tokens."""
    name, model, processor = qwen
    video = load_video(str(write_mp4(tmp_path / "t.mp4", frames=10, rate=5)), max_frames=4, fps=2.0, min_pixels=None, max_pixels=56 * 56)
    assert video.frame_seconds == (0.0, 0.6, 1.2, 1.8) and video.patch_timestamps() == pytest.approx([0.3, 1.5])
    batch = encode_prompts(processor, [build_prompt(processor, "what?", 0, None, 1)], [[]], [[video]])
    text = processor.tokenizer.decode(batch["input_ids"][0])
    grid = batch["video_grid_thw"][0]
    per_patch = int(grid[1:].prod()) // processor.image_processor.merge_size**2
    if "qwen3" in name:
        one_patch = "<|vision_start|>" + "<|video_pad|>" * per_patch + "<|vision_end|>"
        assert "<0.3 seconds>" + one_patch + "<1.5 seconds>" + one_patch in text
    else:
        assert "<|vision_start|>" + "<|video_pad|>" * (per_patch * int(grid[0])) + "<|vision_end|>" in text
        assert "seconds>" not in text


def _video_batch(processor, tmp_path, seed=0):
    """Three prompts: a video; an image and a video; two videos (a file and a frame list)."""
    rng = np.random.default_rng(seed)
    v1 = load_video(str(write_mp4(tmp_path / f"a{seed}.mp4", seed=seed)), max_frames=4, fps=2.0, min_pixels=None, max_pixels=56 * 56)
    v2 = load_video(write_frames(tmp_path / f"f{seed}", frames=4, seed=seed), max_frames=4, fps=2.0, min_pixels=None, max_pixels=56 * 56)
    rows = [([], [v1]), (images(rng, 1), [v2]), ([], [v2, v1])]
    texts = [build_prompt(processor, "what happens?", len(im), None, len(vs)) for im, vs in rows]
    return encode_prompts(processor, texts, [im for im, _ in rows], [vs for _, vs in rows]), rows


def test_select_rows_slices_videos_per_row(qwen, tmp_path):
    """Rows picked (and repeated) from a batch carry their own videos: the same tensors as encoding them alone."""
    _, _, processor = qwen
    batch, rows = _video_batch(processor, tmp_path)
    for pick in ([2], [1, 1], [2, 0]):
        picked = select_rows(batch, pick)
        texts = [build_prompt(processor, "what happens?", len(rows[i][0]), None, len(rows[i][1])) for i in pick]
        alone = encode_prompts(processor, texts, [rows[i][0] for i in pick], [rows[i][1] for i in pick])
        for key in ("pixel_values_videos", "video_grid_thw", "videos_per_row"):
            assert torch.equal(picked[key], alone[key]), (pick, key)


class visual_patch_counter:  # noqa: N801 - a context manager
    """Patches (image and video) that go through the vision tower."""

    def __init__(self, model):
        self.visual, self.patches = unwrap(model).model.visual, 0

    def _hook(self, module, args, kwargs):
        self.patches += (args[0] if args else kwargs["hidden_states"]).shape[0]

    def __enter__(self):
        self._handle = self.visual.register_forward_pre_hook(self._hook, with_kwargs=True)
        return self

    def __exit__(self, *exc):
        self._handle.remove()


@pytest.mark.integration
def test_shared_prefix_on_video_rows_equals_naive(qwen, tmp_path):
    """Values and every gradient (vision tower included) equal to the naive path; each prompt's video goes through
    the vision tower once instead of once per row; greedy rollout equals HF generate token for token."""
    name, model, processor = qwen
    batch, _ = _video_batch(processor, tmp_path, seed=1)
    rows = torch.arange(3).repeat_interleave(2)
    ids, mask = completions(processor, LENGTHS)
    with visual_patch_counter(model) as naive_count:
        naive, g_naive = loss_and_grads(model, lambda: (completion_logps(model, select_rows(batch, rows), ids, mask), mask))
    with visual_patch_counter(model) as prefix_count:
        fast, g_fast = loss_and_grads(model, lambda: (completion_logps_prefix(model, batch, rows, ids, mask), mask))
    torch.testing.assert_close(fast * mask, naive * mask, rtol=1e-5, atol=1e-5)
    # Qwen3.5's decay parameters (LOOSE_GRADS), and with these longer video prompts also the projection that feeds
    # the decay gate (in_proj_a: 5.5e-4 of its scale): the same cancelling sums of the chunked delta rule.
    assert_grads_close(g_naive, g_fast, loose={**LOOSE_GRADS, "linear_attn.in_proj_a": 2e-3})
    n_patches = batch["pixel_values_videos"].shape[0] + batch["pixel_values"].shape[0]
    assert prefix_count.patches == n_patches and naive_count.patches == 2 * n_patches
    hf = generate(model, processor.tokenizer, batch, num_generations=1, max_new_tokens=10, shared_prefix=False, do_sample=False)
    ours = generate(model, processor.tokenizer, batch, num_generations=1, max_new_tokens=10, shared_prefix=True, do_sample=False)
    assert torch.equal(ours.ids, hf.ids) and ours.ids.shape[1] > 1


@pytest.mark.unit
def test_bad_video_rows_name_row_and_field(tmp_path):
    good = str(write_mp4(tmp_path / "ok.mp4"))
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all" * 10)
    rows = [
        {"problem": "p", "solution": "1", "video": good},
        {"problem": "p", "solution": "1", "video": "missing.mp4"},
        {"problem": "p", "solution": "1", "video": "broken.mp4"},
        {"problem": "p", "solution": "1", "video": "clip.gif"},
        {"problem": "p", "solution": "1", "video": good, "videos": [good]},
        {"problem": "p", "solution": "1", "video": ["frame.png"]},
    ]
    with pytest.raises(DataError) as info:
        validate_rows(rows, tmp_path, limit_images=4, skip_bad_rows=False, name="train.jsonl")
    text = str(info.value)
    expected = [(2, "file not found"), (3, "cannot read video"), (4, "is not a video file"), (5, "both 'video' and 'videos'"), (6, "file not found")]
    for i, reason in expected:
        assert f"train.jsonl:row {i}" in text and reason in text, (i, reason)
    assert "row 1:" not in text
    kept, report = validate_rows(rows, tmp_path, limit_images=4, skip_bad_rows=True, name="train.jsonl")
    assert len(kept) == 1 and kept[0]["videos"] == [good] and report.skipped_rows == 5


def _video_task(tmp_path, n=8):
    """A jsonl of video rows (files and frame lists) whose answer is the number of frames files hold."""
    rows = []
    for i in range(n):
        if i % 2:
            video = write_frames(tmp_path / f"frames{i}", frames=4, seed=i)
        else:
            video = str(write_mp4(tmp_path / f"clip{i}.mp4", frames=6 + i, seed=i))
        rows.append({"problem": "How many shapes move?", "solution": str(i % 3), "video": video})
    path = tmp_path / "videos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.integration
@pytest.mark.parametrize("family", ["tiny_qwen2vl", "tiny_qwen25vl", "tiny_qwen3vl", "tiny_qwen35", "tiny_internvl", "tiny_llava_onevision"])
def test_grpo_and_sft_on_video_rows(family, request, tmp_path):
    """`vlmrl train` (LoRA, beta > 0) and `vlmrl sft` on a data file of video rows: both finish and move weights."""
    from vlmrl.cli import main

    model = request.getfixturevalue(family)
    data = _video_task(tmp_path)
    common = [f"model.name_or_path={model}", f"data.train_path={data}", "data.eval_path=", "data.max_frames=4", "data.video_max_pixels=3136"]
    common += ["logging.progress_bar=false", "logging.tensorboard=false", "logging.report=false"]
    grpo = [f"training.output_dir={tmp_path / 'grpo'}", "training.max_steps=2", "rollout.num_generations=2", "training.per_device_train_batch_size=4"]
    grpo += ["rollout.max_completion_length=4", "model.use_lora=true", "algorithm.beta=0.05", "algorithm.reward_funcs=[accuracy]"]
    assert main(["train", *common, *grpo]) == 0
    metrics = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if "loss" in m]) == 2
    assert main(["sft", *common, f"training.output_dir={tmp_path / 'sft'}", "sft.projector_steps=1", "sft.steps=1", "sft.batch_size=2"]) == 0
    assert (tmp_path / "sft" / "final" / "model.safetensors").exists()


def _cli_args(model, tmp_path) -> list[str]:
    """A 4-row video data file (written under tmp_path) and the CLI settings that point a run at it."""
    data = _video_task(tmp_path, n=4)
    return [f"model.name_or_path={model}", f"data.train_path={data}", "data.eval_path=", f"training.output_dir={tmp_path / 'out'}"]


@pytest.mark.integration
def test_video_rows_on_a_family_without_video_refused(tiny_llava, tmp_path, capsys):
    from vlmrl.cli import main

    assert main(["train", *_cli_args(tiny_llava, tmp_path), "training.max_steps=1", "logging.progress_bar=false"]) == 2
    err = capsys.readouterr().err
    assert "video" in err and "Traceback" not in err


@pytest.mark.integration
def test_internvl_takes_a_video_as_one_tile_per_frame(tiny_internvl, tmp_path):
    """InternVL (as transformers' InternVLProcessor does): each frame is one tile after a `FrameK: ` line, after the
    row's images; rows slice per frame; the shared prefix equals the naive path on video rows."""
    model, processor = load_model(model_cfg(tiny_internvl)).eval(), load_processor(tiny_internvl)
    video = load_video(str(write_mp4(tmp_path / "v.mp4", frames=10, rate=5)), max_frames=4, fps=2.0, min_pixels=None, max_pixels=56 * 56)
    picture = images(np.random.default_rng(0), 1, size=80)
    texts = [build_prompt(processor, "what?", 1, None, 1), build_prompt(processor, "and?", 0, None, 1)]
    batch = encode_prompts(processor, texts, [picture, []], [[video], [video]])
    frame = "<img>" + "<IMG_CONTEXT>" * processor.image_seq_length + "</img>"
    text = processor.tokenizer.decode(batch["input_ids"][1])
    assert "\n".join(f"Frame{i + 1}: {frame}" for i in range(4)) in text and "<video>" not in text
    assert batch["images_per_row"].tolist() == [5, 4] and batch["image_num_patches"].tolist()[-8:] == [1] * 8
    rows = torch.tensor([0, 0, 1, 1, 1, 0])
    ids, mask = completions(processor, LENGTHS)
    with torch.no_grad():
        naive = completion_logps(model, select_rows(batch, rows), ids, mask)
        fast = completion_logps_prefix(model, batch, rows, ids, mask)
        alone = completion_logps(model, select_rows(batch, [1]), ids[2:3], mask[2:3])
    torch.testing.assert_close(fast * mask, naive * mask, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(naive[2:3] * mask[2:3], alone * mask[2:3], rtol=1e-4, atol=1e-5)


@pytest.mark.integration
def test_onevision_video_rows(tiny_llava_onevision, tmp_path):
    """LLaVA-OneVision: exactly data.max_frames frames per video (one frame count per batch), frames x pooled patches +
    1 <video> tokens per video (what transformers' processor writes; the model checks it against its features), and
    the shared prefix equal to the naive path on video rows."""
    model, processor = load_model(model_cfg(tiny_llava_onevision)).eval(), load_processor(tiny_llava_onevision)
    clip = str(write_mp4(tmp_path / "v.mp4", frames=3, rate=5))
    video = load_video(clip, max_frames=4, fps=2.0, min_pixels=None, max_pixels=56 * 56, exact_frames=True)
    assert len(video.frames) == 4  # a 3-frame clip: frames repeat to the fixed count
    picture = images(np.random.default_rng(0), 1, size=80)
    texts = [build_prompt(processor, "what?", 1, None, 1), build_prompt(processor, "and?", 0, None, 1)]
    batch = encode_prompts(processor, texts, [picture, []], [[video], [video]])
    side = processor.image_processor.size["height"] // model.config.vision_config.patch_size
    per_video = 4 * (-(-side // 2)) ** 2 + 1
    assert (batch["input_ids"] == model.config.video_token_id).sum(1).tolist() == [per_video, per_video]
    assert batch["pixel_values_videos"].shape[:2] == (2, 4)
    rows = torch.tensor([0, 0, 1, 1, 1, 0])
    ids, mask = completions(processor, LENGTHS)
    with torch.no_grad():
        naive = completion_logps(model, select_rows(batch, rows), ids, mask)
        fast = completion_logps_prefix(model, batch, rows, ids, mask)
    torch.testing.assert_close(fast * mask, naive * mask, rtol=1e-5, atol=1e-5)


@pytest.mark.integration
def test_run_on_video_rows_plans_from_the_data(tiny_qwen25vl, tmp_path):
    """The run's planner line before loading the data assumes one image per prompt; once the rows show videos, the
    prediction is made again with one data.max_frames-frame video per prompt (more vision tokens: a larger peak)."""
    from vlmrl.config import load_config
    from vlmrl.plan.planner import data_shape_of
    from vlmrl.train import train

    data = _video_task(tmp_path)
    lines = []
    cfg = load_config(
        None,
        [f"model.name_or_path={tiny_qwen25vl}", f"data.train_path={data}", "data.eval_path=", f"training.output_dir={tmp_path / 'run'}"]
        + ["training.max_steps=1", "rollout.num_generations=2", "training.per_device_train_batch_size=4", "data.max_frames=4"]
        + ["rollout.max_completion_length=4", "logging.progress_bar=false", "algorithm.reward_funcs=[accuracy]"],
    )
    train(cfg, log=lines.append)
    predicted = [x for x in lines if x.startswith("planner: ")]
    assert len(predicted) >= 2 and "from the data (0 images per prompt, a 4-frame video)" in predicted[1], predicted
    from vlmrl.plan.planner import plan_for_config

    video = plan_for_config(cfg, images_per_prompt=0, video_frames=4).workload
    assert video["video_frames"] == 4 and video["prompt_tokens"] != plan_for_config(cfg).workload["prompt_tokens"]
    assert data_shape_of([{"images": ["a", "b"]}, {"images": []}], 4, 16) == {"images_per_prompt": 2}
    assert data_shape_of([{"images": ["a"]}], 4, 16) == {}


@pytest.mark.integration
def test_check_plans_video_rows_from_the_data(tiny_qwen25vl, tmp_path, capsys):
    """`vlmrl check` on video rows: the planner's verdict is made for one data.max_frames-frame video per prompt."""
    from vlmrl.cli import main

    assert main(["check", *_cli_args(tiny_qwen25vl, tmp_path), "data.max_frames=6", "algorithm.reward_funcs=[accuracy]"]) == 0
    err = capsys.readouterr().err
    assert "planned from the data (0 images per prompt, a 6-frame video)" in err, err


@pytest.mark.unit
def test_frame_files_keep_the_decompression_bomb_guard(tmp_path):
    """A frame given as an image file is refused from its header over data.max_image_pixels, like any image."""
    frames = write_frames(tmp_path / "frames", frames=2, size=(64, 64))
    with pytest.raises(DataError, match="max_image_pixels"):
        load_video(frames, max_frames=2, fps=2.0, min_pixels=None, max_pixels=56 * 56, max_image_pixels=32 * 32)
    assert len(load_video(frames, max_frames=2, fps=2.0, min_pixels=None, max_pixels=56 * 56, max_image_pixels=64 * 64).frames) == 2
