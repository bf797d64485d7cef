# Two entry points, each self-contained on a fresh machine:
#   make demo   - the main job
#   make test   - lint + the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.torchfix-installed

.PHONY: demo test test-quick lint bench denoisers clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first and pinned (the CPU wheel on the machine); then the project with its extras.
$(STAMP): $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip uninstall -q -y torchfix 2>/dev/null || true  # a pre-rename install of this project (now torchfix-diffusion)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/torchfix demo

lint: $(STAMP)
	$(BIN)/ruff check torchfix torchfix_pytest.py torchfix_diffusion.py tests benchmarks examples comfyui-torchfix

# Two workers (pytest-xdist), one torch thread each: the tests are many small models, so two processes finish in
# about half the time of one on two cores. TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) tests

# The quick part (about a third of the time): no compiles, no subprocesses, no ComfyUI sampler (tests/conftest.py
# marks those slow). For a change to the guards, the cache's logic or wrap; `make test` before pushing.
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests

# The denoisers the cache benchmark measures on (three image models and a video one), trained here on
# scikit-learn's digits (~1 CPU-hour);
# checkpoints go to $${TORCHFIX_CACHE:-~/.cache/torchfix}/denoisers, outside git.
denoisers: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/train_denoisers.py

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/caches.py
	$(BIN)/python benchmarks/families.py
	$(BIN)/python benchmarks/guard_overhead.py
	$(BIN)/python benchmarks/deepcache.py
	$(BIN)/python benchmarks/transformer_cache.py
	$(BIN)/python benchmarks/kernels.py
	$(BIN)/python benchmarks/scaling.py
	$(BIN)/python benchmarks/memory.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
