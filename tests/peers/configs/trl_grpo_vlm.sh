# Keys and values of the Qwen2.5-VL-3B launch command in the docstring of TRL's examples/scripts/grpo_vlm.py
# (huggingface/trl @ f2cd577, 2026-07-24; the same flags as docs/source/grpo_trainer.md's VLM quick start), for
# `vlmrl convert --from trl`. The script itself picks the dataset and the rewards in Python.
accelerate launch \
    --config_file examples/accelerate_configs/deepspeed_zero3.yaml \
    examples/scripts/grpo_vlm.py \
    --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct \
    --output_dir grpo-Qwen2.5-VL-3B-Instruct \
    --learning_rate 1e-5 \
    --dtype bfloat16 \
    --max_completion_length 1024 \
    --use_vllm \
    --vllm_mode colocate \
    --use_peft \
    --lora_target_modules "q_proj", "v_proj" \
    --log_completions
