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
    assert "bash .ci/plain_stage.sh" in [line.strip() for line in ci] and "plain=$?" in ci
    assert any(line.startswith("[ ") and '"$plain" -eq 0' in line for line in ci)  # CI's exit status
    installs = [line for line in (ROOT / ".ci" / "plain_stage.sh").read_text().splitlines() if "/venv/bin/pip" in line]
    assert len(installs) == 1 and 'pip" install -q -e . 2>&1' in installs[0], installs  # `.` alone: no extras


def test_ci_runs_ruff_and_fails_with_it():
    """The lint is a stage like the others: `ruff check .` over the whole repo (pyproject.toml's rules), its exit
    code kept and in CI's exit status, its time printed."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    at = ci.index(".venv/bin/ruff check .")
    assert ci[at + 1] == "lint=$?" and any(line.startswith("[ ") and '"$lint" -eq 0' in line for line in ci)
    assert 'report "ruff check" "$lint" "$t_lint"' in ci


def test_ci_prints_each_stage_exit_code_and_time_alike():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'report() { echo "ci: $1 exit code $2 after $(( $(date +%s) - $3 )) s"; }' in ci
    stages = re.findall(r'^report "([^"]+)" "\$(\w+)" "\$(\w+)"$', ci, re.M)
    assert [name for name, _, _ in stages] == ["core suite", "ruff check", "sglang stage", "plain-install stage",
                                               "total"]
    own = [line for line in ci.splitlines() if "exit code" in line and not line.startswith(("#", "report() {"))]
    assert own == [], own  # no stage prints its exit code its own way besides


def test_a_per_test_timeout_applies_to_both_pytest_environments():
    """pyproject.toml's `timeout` is pytest-timeout's: the `test` extra installs it for the core suite, and the
    sglang stage installs the test extra's pytest-timeout pin (without it pytest only warns of an unknown option
    and nothing times out)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["pytest"]["ini_options"]["timeout"] > 0
    pin = [r for r in project["project"]["optional-dependencies"]["test"] if r.startswith("pytest-timeout")]
    assert pin == ["pytest-timeout==2.4.0"]
    assert "pytest-timeout" in (ROOT / ".ci" / "sglang_stage.sh").read_text()
