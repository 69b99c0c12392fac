# The launch line of VLM-R1's run_scripts/run_grpo_rec.sh (its published example), for `vlmrl convert --from vlm-r1`.
data_paths="/data/vlm-r1/refcoco_train.jsonl:/data/vlm-r1/refcocop_train.jsonl:/data/vlm-r1/refcocog_train.jsonl"
image_folders="/data/coco:/data/coco:/data/coco"
model_path="/models/Qwen2.5-VL-3B-Instruct"
is_reward_customized_from_vlm_module=True
EXP_NAME="Qwen2.5-VL-3B-Instruct-rec"
TASK_TYPE="rec"

torchrun --nproc_per_node="8" \
    --nnodes="1" \
    --node_rank="0" \
    --master_addr="127.0.0.1" \
    --master_port="12349" \
  src/open_r1/grpo_jsonl.py \
    --use_vllm False \
    --output_dir checkpoints/rl/${EXP_NAME} \
    --resume_from_checkpoint True \
    --model_name_or_path $model_path \
    --data_file_paths $data_paths \
    --image_folders $image_folders \
    --is_reward_customized_from_vlm_module $is_reward_customized_from_vlm_module \
    --task_type $TASK_TYPE \
    --per_device_train_batch_size 8 \
    --gradient_accumulation_steps 2 \
    --gradient_checkpointing true \
    --logging_steps 1 \
    --num_train_epochs 2 \
    --bf16 \
    --attn_implementation flash_attention_2 \
    --run_name ${EXP_NAME} \
    --data_seed 42 \
    --save_steps 100 \
    --num_generations 8 \
    --max_completion_length 2048 \
    --reward_funcs accuracy format \
    --beta 0.04 \
    --report_to wandb \
    --dataset-name this_is_not_used \
    --deepspeed local_scripts/zero3.json
