# Two entry points, each self-contained on a fresh machine:
#   make demo   - the main job
#   make test   - lint + the test suite
PY ?= python3
# The pinned torch (the CPU wheel on the machine) lives in .venv. Another torch, or an older diffusers/transformers
# stack, gets a venv of its own, never .venv: `make test-torch TORCH=2.11.0 [DIFFUSERS=0.35.2 TRANSFORMERS=4.57.6]`.
TORCH ?= 2.13.0
DIFFUSERS ?=
TRANSFORMERS ?=
ifeq ($(TORCH)|$(DIFFUSERS)|$(TRANSFORMERS),2.13.0||)
VENV := .venv
else
VENV := .venv-torch$(TORCH)$(if $(DIFFUSERS),-diffusers$(DIFFUSERS))$(if $(TRANSFORMERS),-transformers$(TRANSFORMERS))
endif
BIN := $(VENV)/bin
STAMP := $(VENV)/.torchfix-installed
PINS := torch==$(TORCH) $(if $(DIFFUSERS),diffusers==$(DIFFUSERS)) $(if $(TRANSFORMERS),transformers==$(TRANSFORMERS))

.PHONY: demo test test-quick test-torch test-matrix lint bench denoisers gpu-wheels gpu-check gpu-check-small clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first and pinned (the CPU wheel on the machine); then the project with its extras.
$(STAMP): $(BIN)/python setup.cfg pyproject.toml
	$(BIN)/python -m pip install -q torch==$(TORCH)
	$(BIN)/python -m pip uninstall -q -y torchfix 2>/dev/null || true  # a pre-rename install of this project (now torchfix-diffusion)
	$(BIN)/python -m pip install -q -e '.[dev]' $(PINS)
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

# The quick suite on another torch (and optionally diffusers/transformers), in its own venv:
#   make test-torch TORCH=2.11.0
#   make test-torch TORCH=2.8.0 DIFFUSERS=0.35.2 TRANSFORMERS=4.57.6
test-torch: test-quick

# The quick suite on every torch minor in setup.cfg's range, the oldest with the oldest diffusers/transformers claimed
# (each in its venv: ~4-8 GB and 5-8 minutes apiece on 2 cores). CI runs the pinned torch and the oldest stack.
MATRIX ?= 2.8.0:0.35.2:4.57.6 2.9.1 2.10.0 2.11.0 2.12.1 2.14.1
test-matrix: test-quick
	@set -e; for v in $(MATRIX); do \
	  t=$${v%%:*}; rest=$${v#$$t}; d=$$(echo $$rest | cut -d: -f2); r=$$(echo $$rest | cut -d: -f3); \
	  echo "== torch $$t $${d:+diffusers $$d }$${r:+transformers $$r}"; \
	  $(MAKE) --no-print-directory test-torch TORCH=$$t $${d:+DIFFUSERS=$$d} $${r:+TRANSFORMERS=$$r}; \
	done

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

# The GPU check (benchmarks/gpu.py): the quick suite, the kernel tests and a <= 6-minute benchmark on a lent GPU
# machine, whose image has torch but no diffusers and no network. Here: `make gpu-wheels` puts the wheels it lacks
# into .whl/ (carry it); on the device, from the repository root (timeout 600 s): `make gpu-check` (or the plain
# command at the top of benchmarks/gpu.py); `make gpu-check-small` is the CPU dry run with tiny models.
GPU_SITE ?= /tmp/site
gpu-wheels:
	bash benchmarks/gpu_wheels.sh

gpu-check:
	$(PY) -m pip install -q --no-index --no-deps --target $(GPU_SITE) .whl/*.whl
	PYTHONPATH=$(GPU_SITE):$(CURDIR) PYTHONUNBUFFERED=1 $(PY) benchmarks/gpu.py --out "$${OUT:-/tmp/gpu-check}" $(GPU_ARGS)

gpu-check-small: $(STAMP)
	$(BIN)/python benchmarks/gpu.py --small --out /tmp/gpu-check-small

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
