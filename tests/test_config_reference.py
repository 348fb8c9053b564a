"""docs/config.md is what `rlsched config --reference` prints now, and it names every field of the schema.

The schema is walked here on its own (pydantic's `model_fields`, in declared order), not through the renderer,
so a field the renderer skipped, or a docstring changed without regenerating the page, fails a test that says
which field and the command that regenerates the page.
"""

from __future__ import annotations

import difflib
import subprocess
import sys
from pathlib import Path
from typing import Literal, get_args, get_origin

import pytest
from pydantic import BaseModel, Field

from rlsched.config.reference import REGENERATE, UndocumentedField, render_reference
from rlsched.config.schema import ExperimentConfig, field_doc

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"


def _cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlsched.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


def _fields(model: type[BaseModel], path: str = ""):
    """(key path as written from the top of the YAML, model, field name, holds a section) of every field, depth first
    in declared order; `tasks[i]` for the entries of a list of sections."""
    for name, info in model.model_fields.items():
        key = f"{path}.{name}" if path else name
        ann, listed = info.annotation, get_origin(info.annotation) is list
        inner = get_args(ann)[0] if listed else ann
        section = isinstance(inner, type) and issubclass(inner, BaseModel)
        yield key, model, name, section
        if section:
            yield from _fields(inner, key + ("[i]" if listed else ""))


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_docs_config_md_is_what_the_command_prints_now():
    out = _cli("config", "--reference")
    assert out.returncode == 0, out.stderr
    assert DOC.is_file(), f"docs/config.md is missing; write it with: {REGENERATE}"
    written = DOC.read_text()
    diff = "".join(list(difflib.unified_diff(written.splitlines(True), out.stdout.splitlines(True),
                                             "docs/config.md", "rlsched config --reference"))[:60])
    assert written == out.stdout, f"docs/config.md is stale; regenerate it with: {REGENERATE}\n{diff}"


def test_every_field_of_the_schema_is_in_docs_config_md_in_schema_order():
    text = _flat(DOC.read_text())
    missing, last_at = [], {}
    for key, model, name, section in _fields(ExperimentConfig):
        entry = f"- **`{key}`**:"
        at = text.find(entry)
        if at < 0:
            missing.append(key)
            continue
        doc = field_doc(model, name)
        if doc and _flat(doc) not in text[at:]:
            missing.append(f"{key} (its docstring)")
        parent = key.rpartition(".")[0]
        assert at > last_at.get(parent, -1), f"{key} is out of the schema's order in docs/config.md"
        last_at[parent] = at
        if section:
            heading = f"## `{key}[i]`" if get_origin(model.model_fields[name].annotation) is list else f"## `{key}`"
            assert heading in text, f"docs/config.md has no heading {heading}"
    assert missing == [], f"not in docs/config.md: {missing}; regenerate it with: {REGENERATE}"


def test_every_field_has_a_docstring():
    # A field that holds a section is exempt: the section's own fields are what a user sets.
    undocumented = [key for key, model, name, section in _fields(ExperimentConfig)
                    if not section and not field_doc(model, name)]
    assert undocumented == [], (f"config fields without a docstring under them (rlsched/config/schema.py): "
                                f"{undocumented}; write one, then run: {REGENERATE}")


# --- the renderer on a small schema of its own, against hand-written Markdown ----------------------------------


class _Mesh(BaseModel):
    """A fake section's own docstring."""

    n: int = Field(2, ge=1, le=8)
    """Devices."""


class _Job(BaseModel):
    name: str
    """What it is
    called."""
    level: Literal["low", "high"] | None = None
    """How loud; null = quiet."""
    rate: float = Field(1e-3, gt=0, lt=1)
    """A rate."""
    tags: list[str] = Field(default_factory=list)
    """Labels."""
    mesh: _Mesh = Field(default_factory=_Mesh)


class _Root(BaseModel):
    jobs: list[_Job] = Field(min_length=1)
    """The jobs."""


class _Bare(BaseModel):
    documented: bool = True
    """This one has a docstring."""
    bare: int = 3


class _BareRoot(BaseModel):
    jobs: list[_Bare]
    """The jobs."""


def test_the_renderer_writes_key_type_default_constraints_and_docstring():
    text = render_reference(_Root)
    assert "Sections: `jobs[i]`, `jobs[i].mesh`.\n" in text
    expected = """\
## Top level

- **`jobs`**: section `jobs[i]`, one per entry (below); required; at least 1 item(s).

## `jobs[i]`

The jobs.

- **`jobs[i].name`**: `str`; required.

  What it is called.

- **`jobs[i].level`**: `str or null`; default `null`; one of `low`, `high`.

  How loud; null = quiet.

- **`jobs[i].rate`**: `float`; default `0.001`; > 0; < 1.

  A rate.

- **`jobs[i].tags`**: `list of str`; default `[]`.

  Labels.

- **`jobs[i].mesh`**: section `jobs[i].mesh` (below); optional.

## `jobs[i].mesh`

A fake section's own docstring.

- **`jobs[i].mesh.n`**: `int`; default `2`; >= 1; <= 8.

  Devices.
"""
    assert text.endswith(expected), text


def test_a_field_without_a_docstring_stops_the_renderer_naming_it():
    with pytest.raises(UndocumentedField, match=r"config field jobs\[i\]\.bare \(_Bare\.bare in .*\) has no "
                                                r"docstring; write one under it, then run `rlsched config"):
        render_reference(_BareRoot)


# --- the command in a real process -------------------------------------------------------------------------------


def test_out_writes_the_file_and_refuses_a_directory(tmp_path):
    target = tmp_path / "site" / "config.md"
    out = _cli("config", "--reference", "--out", str(target))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"wrote {target}\n"
    assert target.read_text() == render_reference()
    assert sorted(p.name for p in target.parent.iterdir()) == ["config.md"]  # no temporary file left beside it

    out = _cli("config", "--reference", "--out", str(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"error: --out {tmp_path} is a directory; name the Markdown file to "
                                               "write, e.g. docs/config.md"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


def test_config_without_reference_is_a_usage_error():
    from rlsched.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["config"])
    assert exit_.value.code == 2
