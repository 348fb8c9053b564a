"""Promises the repository makes about itself: the Quickstart and CI agree, the layout exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quickstart_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1]
    block = re.search(r"```(?:bash)?\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_quickstart_is_exactly_two_commands_and_ci_runs_the_second():
    commands = _quickstart_commands()
    assert len(commands) == 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci.splitlines()
    assert "rlsched demo" in commands[0]


def test_promised_layout_exists():
    for name in ("pyproject.toml", "rlsched", "workers", "configs", "benchmarks", "tests", "README.md", ".ci/run"):
        assert (ROOT / name).exists(), name


def test_ci_runs_the_plain_install_stage_and_fails_with_it():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash .ci/plain_stage.sh" in ci and "plain=$?" in ci
    assert any(line.startswith("[ ") and '"$plain" -eq 0' in line for line in ci)  # the last line: CI's exit status
    installs = [line for line in (ROOT / ".ci" / "plain_stage.sh").read_text().splitlines() if "/venv/bin/pip" in line]
    assert len(installs) == 1 and 'pip" install -q -e . 2>&1' in installs[0], installs  # `.` alone: no extras
