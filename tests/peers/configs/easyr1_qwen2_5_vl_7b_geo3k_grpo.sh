# A copy of EasyR1's examples/qwen2_5_vl_7b_geo3k_grpo.sh (hiyouga/EasyR1 @ b44b311, 2026-07-30), for `vlmrl convert --from easyr1`:
# OmegaConf key=value overrides of config=examples/config.yaml (easyr1_config.yaml here), run from the checkout's root.
#!/bin/bash

set -x

MODEL_PATH=Qwen/Qwen2.5-VL-7B-Instruct  # replace it with your local file path

python3 -m verl.trainer.main \
    config=examples/config.yaml \
    data.train_files=hiyouga/geometry3k@train \
    data.val_files=hiyouga/geometry3k@test \
    worker.actor.model.model_path=${MODEL_PATH} \
    trainer.experiment_name=qwen2_5_vl_7b_geo_grpo \
    trainer.n_gpus_per_node=8
