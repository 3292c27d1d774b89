"""No import circles anywhere in the tree: deepnvme, op_builder and bench, read with ast (nothing imported).

Every import counts, including those inside functions (a lazy import still ties the two modules together),
except those under ``if TYPE_CHECKING:``. bench/ scripts import each other as top-level modules, so bench is
its own namespace. The doors must point one way: tools -> library modules -> deepnvme._core -> op_builder.
A library module reaches op_builder only through deepnvme._core, with two exceptions named in
LIBRARY_DOORS_TO_OP_BUILDER; the tools (deepnvme.tools) may import op_builder themselves (the report reads
the engine catalogue, probes and builders; ds_io and ds_nvme_tune the engine names). Modules and functions
stay small enough to read: no library module over MAX_MODULE_LINES, no function over MAX_FUNCTION_LINES.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("deepnvme", "op_builder")
SCRIPTS = ("bench",)
# The library modules that import op_builder other than through deepnvme._core: the package face (its lazy
# re-export of the op builders, for users) and deepnvme.defaults (the I/O core's tunables, documented there).
LIBRARY_DOORS_TO_OP_BUILDER = {"deepnvme", "deepnvme.defaults"}
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the packages (from the root) and the script folders (by stem)."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    for folder in SCRIPTS:
        for path in (root / folder).glob("*.py"):
            found[path.stem] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                stack.extend(child.orelse)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            stack.append(child)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                # `from pkg import sub` imports the submodule when there is one, else a name of pkg.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:  # `import a.b.c` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted; [] when none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circles_in_the_tree() -> None:
    assert cycles(import_graph(ROOT)) == []


def test_a_planted_circle_is_found(tmp_path: Path) -> None:
    """The same check on a small tree with one lazy circle (two modules) and one through a package face."""
    pkg = tmp_path / "deepnvme"
    (pkg / "moe").mkdir(parents=True)
    (tmp_path / "op_builder").mkdir()
    (tmp_path / "bench").mkdir()
    (pkg / "__init__.py").write_text("def __getattr__(name):\n    from deepnvme import io\n    return io\n")
    (pkg / "io.py").write_text("from deepnvme import AsyncIOBuilder\n")
    (pkg / "moe" / "__init__.py").write_text("")
    (pkg / "moe" / "train.py").write_text("def main():\n    from .trainer import run\n")
    (pkg / "moe" / "trainer.py").write_text("from deepnvme.moe.train import main\n")
    (tmp_path / "op_builder" / "__init__.py").write_text("from typing import TYPE_CHECKING\n"
                                                        "if TYPE_CHECKING:\n    import deepnvme.io\n")
    (tmp_path / "bench" / "a.py").write_text("import b\n")
    (tmp_path / "bench" / "b.py").write_text("from a import x\n")
    assert cycles(import_graph(tmp_path)) == [["a", "b"], ["deepnvme", "deepnvme.io"],
                                              ["deepnvme.moe.train", "deepnvme.moe.trainer"]]


def test_the_library_never_imports_the_tools_or_the_recipe() -> None:
    graph = import_graph(ROOT)
    # A package's __main__ is a launcher (python -m), not part of the library.
    library = [m for m in graph if m.startswith("deepnvme.") and not m.endswith(".__main__")
               and not m.startswith(("deepnvme.tools", "deepnvme.moe.recipe"))]
    wrong = {m: sorted(t for t in graph[m] if t.startswith(("deepnvme.tools", "deepnvme.moe.recipe")))
             for m in library}
    assert {m: t for m, t in wrong.items() if t} == {}
    core = {m: sorted(t for t in graph[m] if t.startswith("deepnvme") and not t.startswith("deepnvme._core"))
            for m in graph if m.startswith("deepnvme._core")}
    assert {m: t for m, t in core.items() if t} == {}  # the core stands on op_builder only


def test_the_op_is_loaded_through_one_door() -> None:
    """Of the library's modules only deepnvme._core.op imports the async_io builder (the package face
    re-exports the builders for users, lazily); nothing climbs back up through `from deepnvme import ...`."""
    graph = import_graph(ROOT)
    library = [m for m in graph if m.startswith("deepnvme.") and not m.endswith(".__main__")
               and not m.startswith(("deepnvme.tools", "deepnvme.moe.recipe"))]
    assert sorted(m for m in library if "op_builder.async_io" in graph[m] or "op_builder" in graph[m]) == [
        "deepnvme._core.op"]
    assert sorted(m for m in library if "deepnvme" in graph[m]) == []


def _is_tool(module: str) -> bool:
    """deepnvme.tools and the launchers (a package's __main__ runs a command, it is not library)."""
    return module.startswith("deepnvme.tools") or module.endswith("__main__")


def _op_builder_importers(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Library module -> the op_builder modules it imports, for those outside deepnvme._core that import any
    (the tools and launchers are not library)."""
    found = {m: sorted(t for t in graph[m] if t == "op_builder" or t.startswith("op_builder."))
             for m in graph if (m == "deepnvme" or m.startswith("deepnvme.")) and not _is_tool(m)
             and not m.startswith("deepnvme._core")}
    return {m: t for m, t in found.items() if t}


def test_the_library_reaches_op_builder_only_through_the_core() -> None:
    importers = _op_builder_importers(import_graph(ROOT))
    assert sorted(set(importers) - LIBRARY_DOORS_TO_OP_BUILDER) == []
    # The exceptions are real (a stale entry would let a new door in unnoticed under its name).
    assert sorted(importers) == sorted(LIBRARY_DOORS_TO_OP_BUILDER)


def test_a_library_module_importing_op_builder_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "deepnvme"
    for folder in (pkg / "_core", pkg / "tools", tmp_path / "op_builder", tmp_path / "bench"):
        folder.mkdir(parents=True)
    (tmp_path / "op_builder" / "__init__.py").write_text("")
    (tmp_path / "op_builder" / "atomic_file.py").write_text("")
    (pkg / "__init__.py").write_text("def __getattr__(name):\n    import op_builder\n")
    (pkg / "_core" / "__init__.py").write_text("")
    (pkg / "_core" / "files.py").write_text("from op_builder.atomic_file import commit\n")
    (pkg / "tools" / "__init__.py").write_text("")
    (pkg / "tools" / "report.py").write_text("from op_builder import atomic_file\n")
    (pkg / "save.py").write_text("def save():\n    from op_builder.atomic_file import commit\n")
    assert _op_builder_importers(import_graph(tmp_path)) == {"deepnvme": ["op_builder"],
                                                            "deepnvme.save": ["op_builder.atomic_file"]}


def _oversized(root: Path) -> list[str]:
    """Every library module over MAX_MODULE_LINES and function over MAX_FUNCTION_LINES:
    'path: N lines' or 'path:line name: N lines'."""
    found = []
    for path in sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        text = path.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            found.append(f"{rel}: {n} lines")
        for node in ast.walk(ast.parse(text, rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    return found


def test_no_library_module_or_function_is_oversized() -> None:
    assert _oversized(ROOT) == []


def test_an_oversized_module_and_function_are_found(tmp_path: Path) -> None:
    (tmp_path / "deepnvme" / "offload").mkdir(parents=True)
    (tmp_path / "op_builder").mkdir()
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "op_builder" / "big.py").write_text("\n" * MAX_MODULE_LINES + "x = 1\n")
    (tmp_path / "deepnvme" / "f.py").write_text(f"def f():\n{long_body}")
    (tmp_path / "deepnvme" / "offload" / "g.py").write_text(f"def g():\n{long_body}")
    assert _oversized(tmp_path) == [f"deepnvme/f.py:1 f: {MAX_FUNCTION_LINES + 1} lines",
                                    f"deepnvme/offload/g.py:1 g: {MAX_FUNCTION_LINES + 1} lines",
                                    f"op_builder/big.py: {MAX_MODULE_LINES + 1} lines"]
