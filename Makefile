# make test / make demo bootstrap .venv themselves (Python 3.11, CPU torch first, then the package).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# reinstall (and rebuild the csrc extension) when the build inputs change
BUILD_INPUTS := setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/*.cu csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu)

export OMP_NUM_THREADS ?= 1

.PHONY: .venv test test-quick demo layout-demo lint clean

.venv: $(STAMP)

$(STAMP): $(BUILD_INPUTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	# torch first, pinned: the CPU wheel on local disk, so no dependency can pull a CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	$(PY) -m pip install -q --no-deps sglang==0.5.21  # source for the SGLang contract tests (TEST_PIN)
	# SGLang's pure-Python import-time dependencies (pins as sglang 0.5.21 lists them; none needs
	# CUDA): its real modules import on CPU in tests/*/test_sglang_real.py (docs/rollout.md)
	$(PY) -m pip install -q orjson psutil pybase64 msgspec "pyzmq>=25.1.2" ipython aiohttp dill \
		sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf openai==2.6.1 partial_json_parser \
		uvloop setproctitle triton
	touch $@

lint: .venv
	$(PY) -m ruff check .

test: .venv lint
	$(PY) -m pytest

# the developers' inner loop (docs/architecture.md), not a CI substitute: ruff, the unit tests
# not marked slow, and one 2-rank PPO smoke (two GRPO runs on DP 2 compared step for step)
test-quick: .venv lint
	$(PY) -m pytest -q -m "not slow" tests/unit --file-durations=5
	$(PY) -m pytest -q tests/distributed/test_on_policy.py --file-durations=0

# SFT warm start, then PPO with a critic (ALGO=grpo: GRPO) on 4 gloo ranks, tp 2 x pp 2, gen tp 1
# ASYNC=k (1, 2): a 5th rank generates apart (parallel.placement=split) up to k steps ahead
# (rollout.async_steps=k)
ALGO ?= gae
ASYNC ?= 0
DEMO_ASYNC_0 := --nproc-per-node 4
DEMO_ASYNC_1 := --nproc-per-node 5 parallel.placement=split parallel.gen.world=1 rollout.async_steps=1 \
	trainer.experiment_name=demo_async
DEMO_ASYNC_2 := --nproc-per-node 5 parallel.placement=split parallel.gen.world=1 rollout.async_steps=2 \
	trainer.experiment_name=demo_async2
# TOOLS=1: multi-turn rollouts with the calculator tool (configs/demo_tools.yaml, GRPO, 2 ranks)
# MOE=1: a tiny Qwen3-MoE (8 experts, top-2) trained with GRPO at expert parallelism 2 on 2 ranks
TOOLS ?= 0
MOE ?= 0
demo: .venv
ifeq ($(TOOLS),1)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 -m hybridrl.demo --config configs/demo_tools.yaml
else ifeq ($(MOE),1)
	$(VENV)/bin/torchrun --standalone --nproc-per-node 2 -m hybridrl.train --config configs/demo_moe.yaml
else
	$(VENV)/bin/torchrun --standalone $(word 1,$(DEMO_ASYNC_$(ASYNC))) $(word 2,$(DEMO_ASYNC_$(ASYNC))) \
		-m hybridrl.demo --config configs/demo.yaml algorithm.adv_estimator=$(ALGO) \
		$(wordlist 3,99,$(DEMO_ASYNC_$(ASYNC)))
endif

# the layouts of a 256-GPU job, then every group built on 8 real gloo ranks
layout-demo: .venv
	$(VENV)/bin/hybridrl layout --world 256 --tp 8 --pp 4 --gen-tp 4 --gen-pp 1
	$(VENV)/bin/torchrun --standalone --nproc-per-node 8 -m hybridrl.parallel.show \
		--tp 2 --pp 2 --gen-tp 1 --gen-pp 2

clean:
	rm -rf $(VENV) build *.egg-info hybridrl/*.so

# the benchmark suite: every table with both sides and the ratio, figures written into
# docs/benchmarks.md (BENCH_ARGS: e.g. --quick, --only reshard, --no-write)
.PHONY: bench
bench: .venv
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)
