"""Datasets shipped with rlsched as package data, so a recipe runs from a fresh install with no download.

- GSM8K (MIT, OpenAI): `GSM8K_TRAIN`, `GSM8K_TEST` (JSONL, `question` / `answer`); see gsm8k/README.md and
  gsm8k/LICENSE.
"""

from pathlib import Path

GSM8K_DIR = Path(__file__).resolve().parent / "gsm8k"
GSM8K_TRAIN = GSM8K_DIR / "train.jsonl"
GSM8K_TEST = GSM8K_DIR / "test.jsonl"
