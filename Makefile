# Every target installs what it needs into .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint format profile serve bench tiny-model clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test,dev,sglang]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps sglang==0.5.23
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

profile: $(STAMP)
	$(PY) -m dspark_sglang.profile --quick

# Benchmarks write under docs/results/ (docs/bench.md, docs/results.md); not part of `test`.
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m dspark_sglang.bench.scheduler
	OMP_NUM_THREADS=1 $(PY) -m dspark_sglang.bench.planner
	OMP_NUM_THREADS=1 $(PY) -m dspark_sglang.bench.offline
	OMP_NUM_THREADS=1 $(PY) -m dspark_sglang.bench.sweep --step-logs build/bench_steps $(BENCH_ARGS)

HOST ?= 127.0.0.1
PORT ?= 30000

# One host: router + prefill + decode with the bundled model; prints the URL when ready.
serve: $(STAMP)
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m dspark_sglang.launch_server --role all \
		--host $(HOST) --port $(PORT) $(SERVE_ARGS)

TINY := build/tiny-model

# Reproduces the bundled target and drafters (about 3 h on 2 CPU cores; not part of `test`).
tiny-model: $(STAMP)
	$(PY) -m dspark_sglang.train corpus --out $(TINY)/corpus
	$(PY) -m dspark_sglang.train tokenizer --corpus $(TINY)/corpus --out $(TINY)/tokenizer
	$(PY) -m dspark_sglang.train target --corpus $(TINY)/corpus --tokenizer $(TINY)/tokenizer \
		--out dspark_sglang/assets/tiny-moe --steps 1200 --bf16 --threads 1 --max-minutes 35
	$(PY) -m dspark_sglang.train prompts --heldout $(TINY)/corpus/heldout.jsonl \
		--out dspark_sglang/assets/heldout_prompts.jsonl
	# Drafters in two stages: 24 min on 1,536 continuations sampled at T 0.7 / top-p 0.8 / top-k 20,
	# then 42 min more on 4,096 sampled at T = 1 (the evaluation's temperature).
	for k in dspark dflash; do \
		$(PY) -m dspark_sglang.train drafter --target dspark_sglang/assets/tiny-moe \
			--corpus $(TINY)/corpus/train.jsonl --samples $(TINY)/drafter_samples.jsonl \
			--num-samples 1536 --gen-temperature 0.7 --gen-top-p 0.8 --gen-top-k 20 \
			--out $(TINY)/drafters1/$$k --kind $$k \
			--steps 4000 --max-minutes 24 --threads 1 || exit 1; \
		$(PY) -m dspark_sglang.train drafter --target dspark_sglang/assets/tiny-moe \
			--corpus $(TINY)/corpus/train.jsonl --samples $(TINY)/drafter_samples_t1.jsonl \
			--num-samples 4096 --gen-seed 7 --out dspark_sglang/assets/drafters/$$k --kind $$k \
			--init-from $(TINY)/drafters1/$$k --steps 6000 --max-minutes 42 --lr 6e-4 \
			--threads 1 --seed 3 || exit 1; \
	done
	$(PY) -m dspark_sglang.calibrate --plot docs/results/sts_reliability.png

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
