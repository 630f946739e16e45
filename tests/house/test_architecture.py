"""The house rules a reviewer would otherwise check by eye, over `dbo/`, `workspace/` and
`scenarios/`: no import cycle, no module over 500 lines (the exceptions named, each with its
reason), no function over 60 (over 40 in the runtime core, comm, split and the workspace, the
code read beside nano-vllm's and DualPipe's), no private name of one first-party module used
from another; and over the whole tree: no `# type: ignore` in `dbo/sim/`, at most `FMT_SKIP_BUDGET`
`# fmt: skip` marks, each with its reason on the line above. And the CLI's layers: no verb
module (`scenarios.cli.VERBS`) is imported by another module of `scenarios/tools/` (what verbs
share lives in `scenarios.lib`), and no function below the tools (outside `scenarios/tools/` and
`scenarios/cli.py`) takes an argparse namespace. And the layers (`LAYERS`): every first-party
module sits in one room, and every import points down: a module imports its own room or a room
of a lower layer, never a room beside its own or above it; no module defines a module-level
`__getattr__` (a lazy import that hides an edge from this graph).

What counts:
- The import graph has an edge for every `import`/`from ... import` of a first-party module,
  wherever it stands: module level, under `if TYPE_CHECKING:`, inside a function. `from P
  import m` is an edge to the module `P.m` when there is one, else to `P`; the packages an
  import initialises on the way (`a` and `a.b` for `import a.b.c`) are not edges, as in
  grimp/import-linter.
- A function's length is `end_lineno - lineno + 1` of its `def` (decorators excluded); a
  nested function is measured on its own and also counts in its parent.
- A private name is one with a leading underscore that is not a dunder. Using another module's
  private name means `from X import _name` or `X._name` on a name bound to module X by an
  import. A private module (`dbo/_json.py`) is private to its package: importing it from inside
  that package is fine, from outside it is not. Attributes of objects other than modules
  (`device._tracks`) cannot be resolved statically and are not checked.
- `tests/` and `examples/` are outside these checks (tests reach into internals on purpose),
  except the two comment budgets, which count comments (not strings) in every `.py` file.
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dbo", "workspace", "scenarios")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
MAX_CORE_FUNCTION_LINES = 40
# The runtime core, comm, split and the workspace, each module or package by name (a package
# covers its modules); one that moves must be renamed here, or the rule would check less.
CORE_MODULES = (
    "dbo.runner",
    "dbo.ubatch_context",
    "dbo.ubatch_registry",
    "dbo.ubatch_runner",
    "dbo.ubatch_step",
    "dbo.ubatching",
    "dbo.streams",
    "dbo.devices",
    "dbo.errors",
    "dbo.workers",
    "dbo.sm_control",
    "dbo.comm",
    "dbo.split",
    "workspace",
)
# The modules still over MAX_MODULE_LINES, and why; one that gets under the limit must leave.
LONG_MODULES: dict[str, str] = {}
FMT_SKIP_BUDGET = 5  # a table laid out by hand may keep one, with its reason above it
COMMENT_ROOTS = ("dbo", "workspace", "scenarios", "tests", "examples")

# The layers, bottom first, each a few rooms side by side. A room is named by its modules: `m`
# is that module, `p.*` the package `p` and everything in it (the longest match decides). Read
# top down: scenarios use everything; the facade `dbo` re-exports the runtime, the analysis and
# the tools; the tools check a user's forward with all below; the EP communication, vLLM's V2
# model runner and the trace analysis each stand on the layers below; the split and the
# workspace on the runtime; the runtime on the simulator (its default device); the simulator on
# the interface it implements and the leaves everyone uses.
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    {
        "interface": (
            "dbo.streams",
            "dbo.checks",
            "dbo.errors",
            "dbo.frames",
            "dbo.switch_notes",
            "dbo.jsonsafe",
        ),
    },
    {"simulator": ("dbo.sim.*",)},
    {
        "runtime": (
            "dbo.devices",
            "dbo.ubatching",
            "dbo.ubatch_context",
            "dbo.ubatch_step",
            "dbo.ubatch_registry",
            "dbo.runner",
            "dbo.workers",
            "dbo.sm_control",
            "dbo.graph_dispatch",
            "dbo.fingerprint",
            "dbo.collective_calls",
        ),
    },
    {"split": ("dbo.split.*",), "workspace": ("workspace.*",)},
    {
        "comm": ("dbo.comm.*",),
        "model runner": ("dbo.ubatch_runner",),
        "analysis": ("dbo.analysis.*",),
    },
    {"tools": ("dbo.verification.*",)},
    {"facade": ("dbo",)},
    {"scenarios": ("scenarios.*",)},
)


@dataclass(frozen=True)
class Module:
    """One first-party source file, parsed."""

    name: str
    path: str  # relative to the root, as reports name it
    tree: ast.Module
    lines: int

    @property
    def package(self) -> str:
        """The package relative imports in this module start from."""
        return self.name if self.path.endswith("__init__.py") else self.name.rpartition(".")[0]


def load_modules(root: Path, packages: Iterable[str]) -> dict[str, Module]:
    """Every `.py` file under `root/<package>`, by dotted module name."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            text = path.read_text(encoding="utf-8")
            name, relative = ".".join(parts), path.relative_to(root).as_posix()
            modules[name] = Module(
                name, relative, ast.parse(text, relative), len(text.splitlines())
            )
    return modules


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _from_base(module: Module, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` reads from."""
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owning_module(dotted: str, modules: dict[str, Module]) -> str | None:
    """The longest prefix of `dotted` that is a first-party module (None: not first-party)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def imports_of(module: Module, modules: dict[str, Module]) -> Iterator[tuple[str, int]]:
    """(imported first-party module, line) for every import anywhere in `module`."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _owning_module(alias.name, modules)
                if target is not None:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            for alias in node.names:
                target = _owning_module(f"{base}.{alias.name}", modules)
                if target is not None:
                    yield target, node.lineno


def import_graph(modules: dict[str, Module]) -> dict[str, dict[str, int]]:
    """module -> {imported module: first line importing it}, self-imports left out."""
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, module in modules.items():
        for target, line in imports_of(module, modules):
            if target != name:
                graph[name].setdefault(target, line)
    return graph


def _strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's components, iteratively (the graph may be deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def _shortest_cycle(graph: dict[str, dict[str, int]], members: list[str]) -> list[str]:
    """A shortest cycle through the first of `members` (one strongly connected component)."""
    inside = set(members)
    start = members[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in graph[node]:
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if nxt in inside and nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{members} is not a cycle")


def import_cycles(modules: dict[str, Module]) -> list[str]:
    """One line per import cycle: its modules in order, each edge with the importing line."""
    graph = import_graph(modules)
    found = []
    for members in _strongly_connected(graph):
        if len(members) < 2:
            continue
        cycle = _shortest_cycle(graph, members)
        edges = ", ".join(
            f"{modules[a].path}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])
        )
        others = f" (component of {len(members)}: {', '.join(members)})"
        found.append(" -> ".join(cycle) + f": {edges}" + (others if len(members) > 2 else ""))
    return found


def long_modules(modules: dict[str, Module], limit: int = MAX_MODULE_LINES) -> list[str]:
    """Every module over `limit` lines."""
    return [f"{m.name}: {m.lines} lines" for m in modules.values() if m.lines > limit]


def comments(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment in a Python file (strings that look like one are not)."""
    text = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def marked(root: Path, folders: Iterable[str], mark: str) -> list[tuple[str, int]]:
    """(file, line) of every comment carrying `mark` under `root/<folder>`."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            found += [(relative, line) for line, text in comments(path) if mark in text]
    return found


def unexplained(root: Path, marks: Iterable[tuple[str, int]]) -> list[str]:
    """The marks with no comment on the line above to say why."""
    found = []
    for relative, line in marks:
        lines = (root / relative).read_text(encoding="utf-8").splitlines()
        if line < 2 or not lines[line - 2].lstrip().startswith("#"):
            found.append(f"{relative}:{line}")
    return found


def _functions(
    node: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield f"{prefix}{child.name}", child
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def long_functions(modules: dict[str, Module], limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function or method over `limit` lines, decorators excluded."""
    found = []
    for m in modules.values():
        for qualname, fn in _functions(m.tree):
            length = fn.end_lineno - fn.lineno + 1
            if length > limit:
                found.append(f"{m.name}.{qualname} (line {fn.lineno}): {length} lines")
    return found


def _module_bindings(module: Module, modules: dict[str, Module]) -> dict[str, str]:
    """Local names bound to first-party modules by any import in `module`."""
    bound = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is not None and alias.name in modules:
                    bound[alias.asname] = alias.name
                elif alias.asname is None and alias.name.split(".")[0] in modules:
                    bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
    return bound


def _private_module_use(importer: str, dotted: str) -> str | None:
    """Why importing module `dotted` from `importer` uses a private module (None: it does not)."""
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        owner = ".".join(parts[:i])
        if _is_private(part) and not (importer == owner or importer.startswith(owner + ".")):
            return f"private module {'.'.join(parts[: i + 1])} of {owner} used outside {owner}"
    return None


def _private_imports(module: Module, modules: dict[str, Module]) -> Iterator[tuple[int, str]]:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _owning_module(alias.name, modules) is not None:
                    why = _private_module_use(module.name, alias.name)
                    if why:
                        yield node.lineno, why
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            if base in modules or _owning_module(base, modules) is not None:
                why = _private_module_use(module.name, base)
                if why:
                    yield node.lineno, why
            for alias in node.names:
                dotted = f"{base}.{alias.name}"
                if dotted in modules:
                    why = _private_module_use(module.name, dotted)
                    if why:
                        yield node.lineno, why
                elif base in modules and _is_private(alias.name):
                    yield node.lineno, f"from {base} import {alias.name}"


def _resolve(node: ast.expr, bound: dict[str, str], modules: dict[str, Module]) -> str | None:
    """The first-party module an expression names (`x`, `x.y`), None when it names none."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = _resolve(node.value, bound, modules)
        if parent is not None and f"{parent}.{node.attr}" in modules:
            return f"{parent}.{node.attr}"
    return None


def _private_attributes(module: Module, modules: dict[str, Module]) -> Iterator[tuple[int, str]]:
    bound = _module_bindings(module, modules)
    for node in ast.walk(module.tree):
        if not (isinstance(node, ast.Attribute) and _is_private(node.attr)):
            continue
        owner = _resolve(node.value, bound, modules)
        if owner is None or owner == module.name:
            continue
        if f"{owner}.{node.attr}" in modules:
            why = _private_module_use(module.name, f"{owner}.{node.attr}")
            if why:
                yield node.lineno, why
        else:
            yield node.lineno, f"{owner}.{node.attr}"


def private_name_uses(modules: dict[str, Module]) -> list[str]:
    """Every use of another first-party module's private name (see the module docstring)."""
    found = []
    for m in modules.values():
        uses = sorted(set(_private_imports(m, modules)) | set(_private_attributes(m, modules)))
        found.extend(f"{m.name}:{line}: {what}" for line, what in uses)
    return found


def room_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(layer, room) of a module by the longest matching entry; None: in no room."""
    best: tuple[int, int, str] | None = None
    for layer, rooms in enumerate(layers):
        for room, entries in rooms.items():
            for entry in entries:
                package = entry.removesuffix(".*")
                hit = module == package or (
                    entry.endswith(".*") and module.startswith(package + ".")
                )
                if hit and (best is None or len(package) > best[0]):
                    best = (len(package), layer, room)
    return None if best is None else (best[1], best[2])


def unplaced_modules(modules: dict[str, Module], layers=LAYERS) -> list[str]:
    """Every module in no room of `layers`."""
    return [name for name in modules if room_of(name, layers) is None]


def imports_against_the_layers(modules: dict[str, Module], layers=LAYERS) -> list[str]:
    """Every import of a room beside the importer's or above it, with the importing line."""
    found = []
    for name, targets in import_graph(modules).items():
        here = room_of(name, layers)
        for target, line in targets.items():
            there = room_of(target, layers)
            if here is None or there is None or here[1] == there[1] or there[0] < here[0]:
                continue
            where = "beside" if there[0] == here[0] else "above"
            found.append(
                f"{modules[name].path}:{line}: {name} ({here[1]}) imports {target} "
                f"({there[1]}, {where} it)"
            )
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return load_modules(ROOT, PACKAGES)


# --------------------------------------------------------------------------------------------
# The tree


def test_the_import_graph_has_no_cycle(modules):
    cycles = import_cycles(modules)
    assert not cycles, "import cycle(s):\n" + "\n".join(cycles)


def test_every_module_sits_in_a_room_of_the_layers(modules):
    found = unplaced_modules(modules)
    assert not found, "modules in no room of LAYERS (place each one):\n" + "\n".join(found)


def test_every_import_points_down_the_layers(modules):
    found = imports_against_the_layers(modules)
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_no_module_hides_an_import_behind_a_module_getattr(modules):
    found = [
        m.path
        for m in modules.values()
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in m.tree.body)
    ]
    assert not found, f"module-level __getattr__ (import the names plainly): {found}"


def test_no_module_is_over_500_lines_but_the_named_exceptions(modules):
    found = [f for f in long_modules(modules) if f.split(":")[0] not in LONG_MODULES]
    assert not found, "modules over 500 lines:\n" + "\n".join(found)


def verb_modules(modules: dict[str, Module]) -> set[str]:
    """The tool module of every verb, read from the `Verb(name, help, module)` rows of
    `scenarios.cli.VERBS`."""
    found = set()
    for node in ast.walk(modules["scenarios.cli"].tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Verb":
            module = node.args[2]
            if isinstance(module, ast.Constant) and isinstance(module.value, str):
                found.add(f"scenarios.tools.{module.value}")
    return found


def tool_to_tool_imports(modules: dict[str, Module]) -> list[str]:
    """Every import of a verb module by another module under scenarios/tools."""
    verbs, graph = verb_modules(modules), import_graph(modules)
    found = []
    for name, targets in graph.items():
        if not name.startswith("scenarios.tools."):
            continue
        for target, line in targets.items():
            own = name == target or name.startswith(target + ".")  # a verb package's own parts
            if target in verbs and not own:
                found.append(f"{modules[name].path}:{line} imports the verb {target}")
    return found


def _namespace_annotation(node: ast.expr | None) -> bool:
    return node is not None and ast.unparse(node).split(".")[-1] in ("Namespace", "'Namespace'")


def namespace_parameters(modules: dict[str, Module]) -> list[str]:
    """Every function below the tools with a parameter annotated as an argparse namespace."""
    found = []
    for m in modules.values():
        if m.name.startswith("scenarios.tools") or m.name == "scenarios.cli":
            continue
        for qualname, fn in _functions(m.tree):
            every = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
            if any(_namespace_annotation(a.annotation) for a in every):
                found.append(f"{m.name}.{qualname} (line {fn.lineno})")
    return found


def test_no_tool_imports_another_tool(modules):
    assert len(verb_modules(modules)) >= 10, "the verbs were not found in scenarios.cli"
    found = tool_to_tool_imports(modules)
    assert not found, "verbs imported by other tools (share through scenarios.lib):\n" + "\n".join(
        found
    )


def test_no_function_below_the_tools_takes_an_argparse_namespace(modules):
    found = namespace_parameters(modules)
    assert not found, "argparse namespaces below the tools:\n" + "\n".join(found)


def test_every_named_long_module_is_still_long(modules):
    stale = [name for name in LONG_MODULES if modules[name].lines <= MAX_MODULE_LINES]
    assert not stale, f"no longer over {MAX_MODULE_LINES} lines, drop from LONG_MODULES: {stale}"


def test_no_type_ignore_in_the_simulator():
    found = marked(ROOT, ["dbo/sim"], "type: ignore")
    assert not found, f"# type: ignore in dbo/sim: {found}"


def test_fmt_skip_stays_within_its_budget_each_with_its_reason():
    found = marked(ROOT, COMMENT_ROOTS, "fmt: skip")
    assert len(found) <= FMT_SKIP_BUDGET, f"{len(found)} # fmt: skip (budget {FMT_SKIP_BUDGET})"
    assert not unexplained(ROOT, found), f"# fmt: skip without a reason above: {found}"


def test_no_function_is_over_60_lines(modules):
    found = long_functions(modules)
    assert not found, "functions over 60 lines:\n" + "\n".join(found)


def test_no_function_of_the_runtime_core_is_over_40_lines(modules):
    gone = [name for name in CORE_MODULES if name not in modules]
    assert not gone, f"CORE_MODULES names modules that are not there (moved?): {gone}"
    core = {
        name: m
        for name, m in modules.items()
        if any(name == c or name.startswith(c + ".") for c in CORE_MODULES)
    }
    found = long_functions(core, MAX_CORE_FUNCTION_LINES)
    assert not found, "runtime-core functions over 40 lines:\n" + "\n".join(found)


def test_no_module_uses_another_modules_private_name(modules):
    found = private_name_uses(modules)
    assert not found, "private names used across modules:\n" + "\n".join(found)


# --------------------------------------------------------------------------------------------
# The checks themselves, on small trees written here


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return load_modules(tmp_path, sorted({r.split("/")[0] for r in files}))


def test_a_cycle_through_a_type_checking_import_is_found_and_named(tmp_path):
    modules = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n"
            ),
            "pkg/c.py": "import pkg.a\n",
        },
    )
    (cycle,) = import_cycles(modules)
    assert cycle.startswith("pkg.a -> pkg.b -> pkg.a: ")
    assert "pkg/b.py:3 imports pkg.a" in cycle


def test_a_function_level_and_a_relative_import_close_a_cycle(tmp_path):
    modules = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "def f():\n    from . import b\n",
            "pkg/b.py": "from .a import f\n",
        },
    )
    assert len(import_cycles(modules)) == 1


def test_a_tree_whose_imports_point_one_way_has_no_cycle(tmp_path):
    modules = _tree(
        tmp_path,
        {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n", "pkg/b.py": "import os\n"},
    )
    assert import_cycles(modules) == []


def test_a_function_is_measured_from_its_def_line_without_decorators(tmp_path):
    fits = ["@dec", "@dec", "def fits():"] + [f"    x{i} = {i}" for i in range(59)]  # 60 lines
    too_long = ["class C:", "    def too_long(self):"] + [f"        x{i} = {i}" for i in range(60)]
    modules = _tree(
        tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "\n".join(fits + too_long) + "\n"}
    )
    assert long_functions(modules) == ["pkg.a.C.too_long (line 64): 61 lines"]


def test_a_module_over_the_line_limit_is_named(tmp_path):
    modules = _tree(tmp_path, {"pkg/__init__.py": "", "pkg/big.py": "x = 1\n" * 501})
    assert long_modules(modules) == ["pkg.big: 501 lines"]


def test_a_mark_is_found_in_comments_only_and_needs_a_reason_above(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg/a.py").write_text(
        'x = "# fmt: skip"\n'
        "y = [1,  2]  # fmt: skip\n"
        "# a table laid out by hand\n"
        "z = [1,  2]  # fmt: skip\n"
    )
    found = marked(tmp_path, ["pkg"], "fmt: skip")
    assert found == [("pkg/a.py", 2), ("pkg/a.py", 4)]
    assert unexplained(tmp_path, found) == ["pkg/a.py:2"]


def test_private_names_imported_or_read_from_another_module_are_found(tmp_path):
    modules = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "_hidden = 1\n__all__ = []\n",
            "pkg/_util.py": "x = 1\n",
            "pkg/b.py": (
                "from pkg.a import _hidden\nfrom pkg import a\nprint(a._hidden, a.__all__)\n"
                "from pkg import _util\n"
            ),
            "other/__init__.py": "",
            "other/c.py": "import pkg.a\nfrom pkg._util import x\nprint(pkg.a._hidden)\n",
        },
    )
    assert private_name_uses(modules) == [
        "other.c:2: private module pkg._util of pkg used outside pkg",
        "other.c:3: pkg.a._hidden",
        "pkg.b:1: from pkg.a import _hidden",
        "pkg.b:3: pkg.a._hidden",
    ]


def test_a_verb_imported_by_another_tool_and_a_namespace_below_the_tools_are_named(tmp_path):
    modules = _tree(
        tmp_path,
        {
            "scenarios/__init__.py": "",
            "scenarios/cli.py": 'VERBS = (Verb("a", "h", "a"), Verb("b", "h", "b"))\n',
            "scenarios/tools/__init__.py": "",
            "scenarios/tools/a.py": "from scenarios.tools import b\n",
            "scenarios/tools/b.py": "import argparse\ndef run(args: argparse.Namespace): ...\n",
            "scenarios/lib/__init__.py": "",
            "scenarios/lib/x.py": "import argparse\ndef f(args: argparse.Namespace): ...\n",
        },
    )
    assert tool_to_tool_imports(modules) == [
        "scenarios/tools/a.py:1 imports the verb scenarios.tools.b"
    ]
    assert namespace_parameters(modules) == ["scenarios.lib.x.f (line 2)"]


def test_an_import_up_or_beside_the_layers_and_a_module_in_no_room_are_named(tmp_path):
    layers = (
        {"low": ("pkg.low",)},
        {"left": ("pkg.left.*",), "right": ("pkg.right",)},
        {"top": ("pkg",)},
    )
    modules = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import left, low\n",
            "pkg/low.py": "def f():\n    from pkg.left import a\n",
            "pkg/left/__init__.py": "",
            "pkg/left/a.py": "from pkg import low\nfrom pkg.left import b\n",
            "pkg/left/b.py": "import pkg.right\n",
            "pkg/right.py": "import pkg.low\n",
            "pkg/stray.py": "",
        },
    )
    assert room_of("pkg.left.a", layers) == (1, "left")
    assert room_of("pkg", layers) == (2, "top")
    assert unplaced_modules(modules, layers) == ["pkg.stray"]
    assert sorted(imports_against_the_layers(modules, layers)) == [
        "pkg/left/b.py:1: pkg.left.b (left) imports pkg.right (right, beside it)",
        "pkg/low.py:2: pkg.low (low) imports pkg.left.a (left, above it)",
    ]
