"""Multi-turn rollout: the continuous engine (pause, tool, resume from K/V) vs a naive loop of HF generate calls that
re-renders and re-processes the whole conversation each turn. Same tokens (asserted), wall time of each.

Tiny random Qwen2.5-VL (vlmrl.tiny_models.tiny), N prompts, greedy; every row's first turn is a scripted zoom call (the
engine's `force` hook, a LogitsProcessor in the naive loop: a random model never writes one), the second turn is the
model's own tokens up to --turn-tokens. CPU, fp32.

    PYTHONPATH=src python benchmarks/multiturn_rollout.py --prompts 8 --out benchmarks/results/multiturn_rollout_cpu.json
"""

import argparse
import json
import os
import tempfile
import time

import torch
from PIL import Image
from transformers import LogitsProcessor, LogitsProcessorList

from vlmrl.tiny_models.tiny import build_tiny_qwen25vl
from vlmrl.models.loading import load_model
from vlmrl.models.logprobs import model_inputs
from vlmrl.models.multiturn import TurnLimits, content_prefix, sample_multiturn, turn_end
from vlmrl.models.processing import encode_prompts, load_processor, render_chat
from vlmrl.models.rollout import eos_token_ids, vision_token_ids
from vlmrl.tools.environment import ToolEnvironment
from vlmrl.tools.registry import load_tools
from vlmrl.tools.render import chat_template_of, for_template, tool_role_mode
from vlmrl.tools.trajectory import images_of

CALL = '<tool_call>{"name": "zoom", "arguments": {"bbox_2d": [4, 4, 36, 28], "factor": 2}}</tool_call>'


class Forced(LogitsProcessor):
    def __init__(self, start: int, tokens: list[int]):
        self.start, self.tokens = start, tokens

    def __call__(self, input_ids, scores):
        j = input_ids.shape[1] - self.start
        if j < len(self.tokens):
            scores = torch.full_like(scores, float("-inf"))
            scores[:, self.tokens[j]] = 0.0
        return scores


def naive(model, processor, row, script, turn_tokens, eos):
    env = ToolEnvironment(load_tools(["zoom"]), max_turns=2)
    conversation, first = env.reset(row), None
    mode, prefix = tool_role_mode(chat_template_of(processor)), content_prefix(processor)
    for turn in range(2):
        batch = encode_prompts(processor, [render_chat(processor, conversation, True)], [images_of(conversation)])
        P = batch["input_ids"].shape[1]
        first = P if first is None else first
        out = model.generate(
            **model_inputs(batch),
            do_sample=False,
            max_new_tokens=turn_tokens,
            eos_token_id=eos,
            pad_token_id=processor.tokenizer.pad_token_id,
            suppress_tokens=vision_token_ids(model),
            logits_processor=LogitsProcessorList([Forced(P, script if turn == 0 else [])]),
        )
        new = out[0, P:].tolist()
        ended = [i for i, t in enumerate(new) if t in eos]
        new = new[: ended[0] + 1] if ended else new
        text = processor.tokenizer.decode(new[:-1] if ended else new, skip_special_tokens=False)
        observation, _, done = env.step(text)
        if done or not ended:
            return batch["input_ids"][0].tolist()[first:] + new
        conversation = conversation + [{"role": "assistant", "content": text[len(prefix) :] if text.startswith(prefix) else text}]
        conversation += for_template(observation, mode)
    return batch["input_ids"][0].tolist()[first:] + new


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--turn-tokens", type=int, default=120)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    folder = build_tiny_qwen25vl(tempfile.mkdtemp(prefix="mt-bench-"))
    cfg = argparse.Namespace(
        name_or_path=str(folder), dtype="float32", attn_implementation="sdpa", freeze_vision_tower=False, train_projector_only=False,
        use_lora=False, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=[], lora_vision=False, trust_remote_code=False,
        allow_hub_download=False, gradient_checkpointing=False,
    )  # fmt: skip
    model, processor = load_model(cfg).eval(), load_processor(str(folder))
    eos = eos_token_ids(model, processor.tokenizer)
    script = processor.tokenizer(content_prefix(processor) + CALL, add_special_tokens=False).input_ids + [turn_end(processor, eos)[0]]
    g = torch.Generator().manual_seed(1)
    rows = [
        {"prompt": f"read the number {i}", "image": Image.fromarray((torch.rand(40, 48, 3, generator=g) * 255).to(torch.uint8).numpy())}
        for i in range(args.prompts)
    ]
    with torch.no_grad():
        t0 = time.perf_counter()
        envs = [ToolEnvironment(load_tools(["zoom"]), max_turns=2) for _ in rows]
        prompts = [env.reset(row) for env, row in zip(envs, rows)]
        batch = encode_prompts(processor, [render_chat(processor, m, True) for m in prompts], [images_of(m) for m in prompts])
        out = sample_multiturn(
            model, processor, batch, envs, num_generations=1, do_sample=False, eos_ids=eos, pad_id=processor.tokenizer.pad_token_id,
            suppress_ids=vision_token_ids(model), limits=TurnLimits(max_turn_tokens=args.turn_tokens, max_total_tokens=4 * args.turn_tokens),
            force=lambda row, turn, j: script[j] if turn == 0 and j < len(script) else None,
        )  # fmt: skip
        engine_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reference = [naive(model, processor, row, script, args.turn_tokens, eos) for row in rows]
        naive_s = time.perf_counter() - t0
    same = all(out.ids[i, : int(out.attention_mask[i].sum())].tolist() == reference[i] for i in range(len(rows)))
    result = {
        "model": "tiny random Qwen2.5-VL (vlmrl.tiny_models.tiny)",
        "prompts": args.prompts,
        "turn_tokens": args.turn_tokens,
        "tokens_per_row_mean": float(out.attention_mask.sum(dim=1).float().mean()),
        "model_tokens_per_row_mean": float(out.loss_mask.sum(dim=1).float().mean()),
        "engine_s": round(engine_s, 3),
        "naive_hf_loop_s": round(naive_s, 3),
        "speedup": round(naive_s / engine_s, 2),
        "same_tokens": same,
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    assert same, "the engine's tokens differ from the naive loop's"


if __name__ == "__main__":
    main()
