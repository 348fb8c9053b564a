"""Import boundaries, checked from source with `ast` (nothing here imports the code it checks).

The layers exist so each side can run where it must: the control plane (rlsched.scheduling.policy) never touches an
accelerator (no jax, no ray, no workers), so it stays a pure, fast, testable decision function; the data
plane (workers/) never reaches up into the scheduler, so workers can be built and run without it; model
and GRPO code is Ray-free; and nothing imports the CLI, which is an entry point, not a library. Import
cycles are reported with the file:line of every edge that forms them, wherever an import sits: at module level,
inside a function, or under `if TYPE_CHECKING:` (two modules that need each other's names are one concept split
in two, whether the names are needed to run or to type-check).

rlsched/ is folders on floors (`FOLDERS`, lowest first): a module imports from its own folder and the floors
below it, never above, so each folder can be read knowing only what is under it. Each folder's __init__
docstring says the same in words.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlsched", "workers", "benchmarks")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the importing file
    target: str  # dotted module name imported (may be third-party)
    file: str  # path relative to the root, posix
    line: int
    typing_only: bool = False  # under `if TYPE_CHECKING:`: never runs, so no layer rule applies; a cycle still counts


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(node: ast.AST, typing_only: bool = False):
    """(node, typing_only) of every Import/ImportFrom anywhere in the tree; typing_only under the body of
    `if TYPE_CHECKING:`."""
    if _is_type_checking(node):
        for child in node.body:
            yield from _import_nodes(child, True)
        children = node.orelse
    else:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, typing_only
        children = ast.iter_child_nodes(node)
    for child in children:
        yield from _import_nodes(child, typing_only)


def scan(root: Path, packages) -> list[Import]:
    files = {_module_name(p.relative_to(root)): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    found: dict[Import, None] = {}
    for module, path in files.items():
        rel = path.relative_to(root).as_posix()
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node, typing_only in _import_nodes(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                found[Import(module, target, rel, node.lineno, typing_only)] = None
    return list(found)


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    stack = [start]
    while stack:
        for child in graph[stack.pop()] - seen:
            seen.add(child)
            stack.append(child)
    return seen


def _example_cycle(start: str, graph: dict[str, set[str]], members: set[str]) -> list[str]:
    """A shortest cycle through `start` inside one component (BFS back to start)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in prev:
                    prev[child] = node
                    nxt.append(child)
        frontier = nxt
    return [start]


def find_cycles(imports: list[Import], known: frozenset[frozenset[str]] = frozenset()) -> list[str]:
    """A report per set of modules that import one another (a strongly connected component), except the `known`."""
    modules = {i.importer for i in imports}
    edges = [i for i in imports if i.target in modules and i.target != i.importer]
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        graph[e.importer].add(e.target)
    reach = {m: _reachable(graph, m) for m in graph}
    # Strongly connected components of the modules that lie on a cycle (the graph is tiny: closure is fine).
    sccs = {frozenset(n for n in reach[m] if m in reach[n]) for m in graph if m in reach[m]}
    reports = []
    for members in sorted(sccs - known, key=sorted):
        comp = sorted(members)
        lines = [f"import cycle among {len(comp)} modules: {' -> '.join(_example_cycle(comp[0], graph, members))}"]
        for e in sorted(edges, key=lambda e: (e.file, e.line, e.target)):
            if e.importer in members and e.target in members:
                lines.append(f"  {e.file}:{e.line}: {e.importer} imports {e.target}"
                             + (" (under TYPE_CHECKING)" if e.typing_only else ""))
        reports.append("\n".join(lines))
    return reports


RULES = [  # (importers, forbidden targets, why); each entry also covers its submodules
    (("rlsched.scheduling.policy",), ("ray", "jax", "workers"), "the control-plane policy never touches a device"),
    (
        ("workers",),
        ("rlsched.scheduling", "rlsched.run", "rlsched.service", "rlsched.cli"),
        "the data plane never reaches up into the scheduler",
    ),
    (("workers.grpo", "workers.models"), ("ray",), "model and GRPO code is Ray-free"),
    (PACKAGES, ("rlsched.cli",), "nothing imports the CLI (it is an entry point)"),
]


def rule_violations(imports: list[Import]) -> list[str]:
    return [
        f"{i.file}:{i.line}: {i.importer} imports {i.target}: {text}"
        for i in sorted(imports, key=lambda i: (i.file, i.line, i.target))
        if not i.typing_only
        for importers, forbidden, text in RULES
        if _under(i.importer, *importers) and _under(i.target, *forbidden) and not _under(i.importer, *forbidden)
    ]


# rlsched's folders, lowest first: each imports only from itself and the folders before it. rlsched.cli sits on
# top of all of them (and RULES keeps everything else from importing it).
FOLDERS = ("base", "config", "rundir", "observe", "scheduling", "cluster", "run", "service")
TOP = ("rlsched", "rlsched.cli")  # the package itself and its entry point: the only modules outside a folder


def _folder(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "rlsched" and parts[1] in FOLDERS else None


def folder_violations(imports: list[Import]) -> list[str]:
    """Every import of rlsched that goes up a floor (or into no folder at all), as file:line."""
    order = " < ".join(FOLDERS)
    found = []
    for i in sorted(imports, key=lambda i: (i.file, i.line, i.target)):
        if i.typing_only or not _under(i.importer, "rlsched") or i.importer in TOP:
            continue
        src = _folder(i.importer)
        if src is None:
            found.append(f"{i.file}:{i.line}: {i.importer} is in no folder of rlsched/: move it into one of {FOLDERS}")
            continue
        if not _under(i.target, "rlsched") or i.target == "rlsched":
            continue
        dst = _folder(i.target)
        if dst is None or FOLDERS.index(dst) > FOLDERS.index(src):
            found.append(f"{i.file}:{i.line}: {i.importer} imports {i.target}: rlsched.{src} may import only its own "
                         f"folder and the ones below it ({order})")
    return found


# Circles known and being removed elsewhere: each entry names where it is fixed, and goes when that lands.
KNOWN_CYCLES: frozenset = frozenset()  # circles left on purpose: none


def test_no_import_cycles():
    cycles = find_cycles(scan(ROOT, PACKAGES), known=KNOWN_CYCLES)
    assert cycles == [], "\n" + "\n".join(cycles)


def test_layer_rules():
    violations = rule_violations(scan(ROOT, PACKAGES))
    assert violations == [], "\n" + "\n".join(violations)


def test_folders_import_only_downward():
    violations = folder_violations(scan(ROOT, PACKAGES))
    assert violations == [], "\n" + "\n".join(violations)


def test_every_folder_says_what_it_owns_and_may_import():
    for folder in FOLDERS:
        doc = ast.get_docstring(ast.parse((ROOT / "rlsched" / folder / "__init__.py").read_text()))
        assert doc and "May import:" in doc, f"rlsched/{folder}/__init__.py: a docstring saying what it owns and " \
                                              "a 'May import:' line"
    on_top = sorted(p.name for p in (ROOT / "rlsched").glob("*.py"))
    assert on_top == ["__init__.py", "cli.py"], f"rlsched/ holds only cli.py and folders, found {on_top}"


# --- tests of the checker, on fake trees -------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> list[Import]:
    for name in ("rlsched/__init__.py", "workers/__init__.py", "workers/models/__init__.py", *files):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files.get(name, ""))
    return scan(tmp_path, ["rlsched", "workers"])


def test_the_control_plane_imports_no_jax():
    """A task driver, the scheduler, the experiment and the CLI start no JAX when imported (a process that
    imports JAX on a TPU host may claim the chips; on GPU it starts an XLA pool over every core). Checked
    in a fresh interpreter, since this one has JAX already."""
    import subprocess
    import sys

    modules = ["rlsched.cli", "rlsched.run.experiment", "rlsched.run.task", "rlsched.run.phases",
               "rlsched.scheduling.scheduler", "rlsched.run.roles", "rlsched.cluster.ray_cluster",
               "rlsched.scheduling.memory", "rlsched.observe.timeline", "rlsched.observe.tracking",
               "rlsched.service.server", "rlsched.service.client"]
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing the control plane imported: {out.stdout.strip()}"



def test_role_processes_import_no_tokenizer_library():
    """An actor and a built-in engine load weights, never a tokenizer: what their __init__ imports brings in
    neither transformers nor torch (~1 s of CPU each, paid by every role process of every task at start and at
    every restart). Checked in a fresh interpreter; what the import of the role modules pulls in, then the
    names the roles' __init__ take."""
    import subprocess
    import sys

    code = ("import sys\nimport rlsched.run.roles, rlsched.cluster.compile_cache, rlsched.run.checkpoints\n"
            "import workers.actor\n"
            "from workers.models import init_model, load_pretrained\n"
            "from workers.rollout import make_engine\nimport workers.rollout.jax_sampler\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"a role process's imports brought in: {out.stdout.strip()}"

def test_module_level_cycle_is_reported_with_both_edges(tmp_path):
    imports = _tree(
        tmp_path, {"rlsched/a.py": "import os\nfrom rlsched import b\n", "rlsched/b.py": "import rlsched.a"}
    )
    (report,) = find_cycles(imports)
    assert "rlsched/a.py:2: rlsched.a imports rlsched.b" in report
    assert "rlsched/b.py:1: rlsched.b imports rlsched.a" in report
    assert "rlsched.a -> rlsched.b -> rlsched.a" in report


def test_function_level_import_cycle_is_found(tmp_path):
    imports = _tree(
        tmp_path, {"rlsched/c.py": "import rlsched.d\n", "rlsched/d.py": "def f():\n    from rlsched import c\n"}
    )
    (report,) = find_cycles(imports)
    assert "rlsched/d.py:2: rlsched.d imports rlsched.c" in report


def test_from_package_import_resolution(tmp_path):
    imports = _tree(
        tmp_path,
        {
            "rlsched/a.py": "from rlsched import b, helper\nfrom . import b\nfrom .b import thing\n",
            "rlsched/b.py": "",
            "workers/models/m.py": "from .. import grpo\nfrom ..rollout import base\nimport workers.grpo\n",
            "workers/grpo.py": "",
        },
    )
    got = {(i.file, i.line, i.target) for i in imports}
    assert got == {
        ("rlsched/a.py", 1, "rlsched.b"),
        ("rlsched/a.py", 1, "rlsched"),  # `helper` is not a module: the import is of the package
        ("rlsched/a.py", 2, "rlsched.b"),
        ("rlsched/a.py", 3, "rlsched.b"),
        ("workers/models/m.py", 1, "workers.grpo"),
        ("workers/models/m.py", 2, "workers.rollout"),
        ("workers/models/m.py", 3, "workers.grpo"),  # no implicit edge to the parent package `workers`
    }


def test_each_rule_violation_is_reported(tmp_path):
    imports = _tree(
        tmp_path,
        {
            "rlsched/scheduling/policy.py": "def pick():\n    import jax.numpy as jnp\n    return jnp\n",
            "rlsched/run/task.py": "",
            "rlsched/cli.py": "",
            "rlsched/z.py": "\nfrom rlsched import cli\n",
            "workers/x.py": "from rlsched.run.task import Task\n",
            "workers/models/m.py": "import ray\n",
            "workers/grpo.py": "try:\n    import ray.util\nexcept ImportError:\n    pass\n",
        },
    )
    violations = rule_violations(imports)
    expected = [
        "rlsched/scheduling/policy.py:2: rlsched.scheduling.policy imports jax.numpy: ",
        "rlsched/z.py:2: rlsched.z imports rlsched.cli: ",
        "workers/grpo.py:2: workers.grpo imports ray.util: ",
        "workers/models/m.py:1: workers.models.m imports ray: ",
        "workers/x.py:1: workers.x imports rlsched.run.task: ",
    ]
    assert len(violations) == len(expected), violations
    for prefix, message in zip(expected, violations, strict=True):
        assert message.startswith(prefix), (prefix, message)


def test_clean_tree_has_no_findings(tmp_path):
    imports = _tree(
        tmp_path,
        {
            "rlsched/scheduling/policy.py": "import math\n",
            "rlsched/scheduling/scheduler.py": "from rlsched.scheduling.policy import pick\nimport rlsched.base.units",
            "rlsched/base/units.py": "",
            "rlsched/cli.py": "import rlsched.scheduling.scheduler\nfrom workers import grpo\n",
            "workers/grpo.py": "import jax\nfrom workers.models import m\n",
            "workers/models/m.py": "import jax.numpy\n",
        },
    )
    assert imports and find_cycles(imports) == [] and rule_violations(imports) == [] == folder_violations(imports)


def test_type_checking_imports_obey_no_layer_rule_but_close_cycles(tmp_path):
    imports = _tree(
        tmp_path,
        {
            "rlsched/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlsched import f\n",
            "rlsched/f.py": "def g():\n    import rlsched.e\n",
            "rlsched/scheduling/policy.py": "import typing\nif typing.TYPE_CHECKING:\n    import jax\nelse:\n"
                                            "    import ray\n",
            "rlsched/observe/timeline.py": "import typing\nif typing.TYPE_CHECKING:\n"
                                           "    from rlsched.run import task\n",
            "rlsched/run/task.py": "",
        },
    )
    (report,) = find_cycles(imports)  # the shape of workers.actor <-> actor_cobatch before it was removed
    assert "rlsched/e.py:3: rlsched.e imports rlsched.f (under TYPE_CHECKING)" in report
    assert "rlsched/f.py:2: rlsched.f imports rlsched.e" in report
    assert find_cycles(imports, known=frozenset({frozenset({"rlsched.e", "rlsched.f"})})) == []
    assert [v.split(": ")[0] for v in rule_violations(imports)] == ["rlsched/scheduling/policy.py:5"]  # else runs
    assert [v.split(": ")[0] for v in folder_violations(imports) if "timeline" in v] == []  # a type, up a floor


def test_an_import_up_a_floor_is_reported_with_file_and_line(tmp_path):
    imports = _tree(
        tmp_path,
        {
            "rlsched/observe/timeline.py": "import json\n\ndef f():\n    from rlsched.run import task\n",
            "rlsched/run/task.py": "from rlsched.observe import timeline\nfrom rlsched.run import roles\n",
            "rlsched/run/roles.py": "",
            "rlsched/scheduling/policy.py": "from rlsched.cluster.ray_cluster import GROUP\n",
            "rlsched/cluster/ray_cluster.py": "",
            "rlsched/stray.py": "import os\n",
            "rlsched/cli.py": "from rlsched.service import server\n",
            "rlsched/service/server.py": "",
        },
    )
    violations = folder_violations(imports)
    assert [v.split(": ")[0] for v in violations] == [
        "rlsched/observe/timeline.py:4",  # observe imports run: up three floors, inside a function
        "rlsched/scheduling/policy.py:1",  # scheduling imports the cluster above it
        "rlsched/stray.py:1",  # a module outside every folder
    ], violations
    assert "rlsched.observe.timeline imports rlsched.run.task: rlsched.observe may import only" in violations[0]
    assert "is in no folder" in violations[2]
