#!/usr/bin/env bash
# CI stage: the sglang-jax rollout backend on Python 3.12 (sglang-jax 0.0.2 requires >= 3.12).
# Builds .venv312 with the `sglang` extra (no torch: see pyproject.toml) and runs every sglang-marked
# test (the adapter and its shims, then GRPO training with sglang-jax engines under the scheduler).
# pytest's exit code 5 (no tests collected) fails the stage like any other non-zero code.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"  # prepare: build the environment only; all (default): build if needed, then run the tests
case "$mode" in prepare|all) ;; *) echo "usage: $0 [prepare|all]" >&2; exit 2 ;; esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 JAX_PLATFORMS=cpu

# python3.12 on PATH, else pyenv's 3.12.x (a pyenv shim without 3.12 selected fails the check).
py=""
for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
    py="$candidate"; break
  fi
done
if [ -z "$py" ]; then
  echo "sglang stage: no Python 3.12 interpreter found (python3.12, or pyenv's 3.12.x)" >&2
  exit 1
fi

t0=$(date +%s)
[ -x .venv312/bin/python ] || "$py" -m venv .venv312
# pip's "Location ... is ignored" lines are this machine's index configuration, not our problem.
quiet() { grep -v ' is ignored: ' || true; }
# The dependencies first (rlsched's own, the `sglang` extra, and pytest, pytest-timeout and hypothesis from the
# `test` extra, read from pyproject.toml, markers kept), so `.ci/run` can build this environment while the core
# suite runs; the project itself (an editable install writes into the source tree) only after, by the `test` step.
# pytest-timeout is needed here as in the core: pyproject.toml's `timeout` option is its, and applies to both.
mapfile -t reqs < <("$py" -c 'import re, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]
runner = [r for r in p["optional-dependencies"]["test"] if re.match(r"(pytest|pytest-timeout|hypothesis)\b", r)]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["sglang"] + runner))')
.venv312/bin/pip install -q "${reqs[@]}" 2>&1 | quiet
if [ "$mode" = prepare ]; then
  echo "sglang stage: dependencies ready in $(( $(date +%s) - t0 )) s"
  exit 0
fi
.venv312/bin/pip install -q --no-deps -e . 2>&1 | quiet
.venv312/bin/python -c 'import sgl_jax, importlib.metadata as m; print("sglang-jax", m.version("sglang-jax"))'
if .venv312/bin/python -c 'import torch' 2>/dev/null; then
  echo "sglang stage: torch is installed in .venv312; the sglang extra must not pull it" >&2
  exit 1
fi
t1=$(date +%s)
echo "sglang stage: environment ready in $((t1 - t0)) s"

rc=0
# The sglang tests live in tests/test_sglang_*.py (other test modules import torch, which this env lacks).
.venv312/bin/python -m pytest -q -m sglang tests/test_sglang_*.py || rc=$?
t2=$(date +%s)
echo "sglang stage: tests took $((t2 - t1)) s (total $((t2 - t0)) s)"
if [ "$rc" -eq 5 ]; then
  echo "sglang stage: pytest collected no sglang tests (exit 5): failing" >&2
  exit 1
fi
exit "$rc"
