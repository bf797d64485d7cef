#!/usr/bin/env bash
# The wheels benchmarks/gpu.py needs on a lent GPU machine, which has torch, triton, transformers, wrapt, pytest,
# pytest-xdist and hypothesis but no diffusers, no DeepCache and no network: downloaded here into .whl/ (git ignores
# it; the run tool carries it with `carry: [".whl"]`), with .whl/COMMIT naming the commit they go with (the device's
# copy of the working tree has no .git).
#
#   bash benchmarks/gpu_wheels.sh            # PY=python3 to use another interpreter's pip
#
# Then on the device, from the repository root (see benchmarks/gpu.py):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
#       PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 benchmarks/gpu.py --out "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
rm -rf .whl
mkdir -p .whl
# The machine's Python is 3.12 on x86-64 Linux; pure-Python wheels, no dependencies (the machine has theirs).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 -d .whl diffusers==0.42.1 DeepCache==0.1.1 importlib_metadata
commit=$(git rev-parse HEAD)
changed=$(git status --porcelain --untracked-files=no | wc -l | tr -d ' ')
printf '{"commit": "%s", "uncommitted_files": %s}\n' "$commit" "$changed" > .whl/COMMIT
ls -l .whl
du -sh .whl
