"""The README and docs/ point only at what exists, and the repository cites no document outside itself.

Pure file reading, no imports of rlsched: every relative link (and its #anchor) in README.md and docs/*.md resolves,
every repo path named in backticks exists, every `python -m MODULE` is a module of the repo, every `rlsched WORD`
shown in code is a subcommand the CLI defines, and no file names a design or notes document that a clone lacks.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The top-level folders and files of the repository: a backticked path that starts with one of these is a repo path.
REPO_PREFIXES = ("rlsched/", "workers/", "benchmarks/", "configs/", "tests/", "docs/", ".ci/")
REPO_FILES = ("README.md", "pyproject.toml")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INLINE = re.compile(r"`((?:[^`\n]|\n(?!\n))+)`")  # a code span may wrap onto the next line, not past a blank one
PATH_TOKEN = re.compile(r"[\w./-]+")
# Written split so that this file does not name them itself.
OUTSIDE = ("DESIGN" + ".md", "FIELD" + "_NOTES", "../" + "shared")
SKIP_DIRS = {".git", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", ".jax_cache", "node_modules", "build",
             "dist"}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ".json", ".jsonl"}


def _prose(text: str) -> str:
    """The page without its fenced code blocks (links and paths there are examples, not references)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), re.M)
    return {_slug(h) for h in headings}


def _subcommands() -> set[str]:
    cli = (ROOT / "rlsched" / "cli.py").read_text()
    passthrough = re.search(r"PASSTHROUGH = \{(.*?)\}", cli, re.S)  # subcommands that run a benchmark module
    return set(re.findall(r"""add_parser\(\s*["']([\w-]+)["']""", cli)) | set(
        re.findall(r"""["']([\w-]+)["']\s*:""", passthrough.group(1) if passthrough else ""))


def test_pages_exist():
    names = {p.name for p in PAGES}
    for name in ("design.md", "service.md", "sharding.md", "hosts.md", "models.md", "sglang.md", "faults.md",
                 "performance.md", "security.md", "config.md"):
        assert name in names, f"docs/{name} is missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_backticked_repo_path_exists(page: Path):
    missing = []
    for span in INLINE.findall(_prose(page.read_text())):
        for token in PATH_TOKEN.findall(span):
            token = token.rstrip(".,;:")
            if (token.startswith(REPO_PREFIXES) or token in REPO_FILES) and not (ROOT / token).exists():
                missing.append(token)
    assert not missing, f"{page.relative_to(ROOT)} names files the repository does not have: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_and_subcommand_shown_exists(page: Path):
    text = page.read_text()
    code = "\n".join(INLINE.findall(_prose(text)) + FENCE.findall(text))
    wrong = []
    for module in re.findall(r"python -m ([\w.]+)", code):
        if module == "pytest":
            continue
        base = ROOT / module.replace(".", "/")
        if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
            wrong.append(f"python -m {module}")
    subcommands = _subcommands()
    # A command, not prose in a comment: at a line's start (after a `$ ` prompt), after `/`, `(` or `&& `.
    for word in re.findall(r"(?:^[ \t]*(?:\$ )?|[/(]|&& )rlsched ([a-z][\w-]*)", code, re.M):
        if word not in subcommands:
            wrong.append(f"rlsched {word}")
    assert not wrong, f"{page.relative_to(ROOT)} shows commands that do not exist: {wrong}"


def test_subcommands_are_read_from_the_cli():
    assert {"demo", "train", "plan", "check", "up", "submit", "down"} <= _subcommands()


def test_no_file_cites_a_document_outside_the_repository():
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv") and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder) / name
            if path.suffix not in TEXT_SUFFIXES and name not in ("run",):
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for needle in OUTSIDE:
                for n, line in enumerate(text.splitlines(), 1):
                    if needle in line:
                        found.append(f"{path.relative_to(ROOT)}:{n}: {needle}")
    assert not found, "cite docs/ instead (docs/design.md, or the page that holds the point):\n" + "\n".join(found)
