"""deepnvme.offload stands in floors, read with ast like test_import_graph.py (nothing imported):

- every module of the package is in a floor, or is the package's face (__init__), its door to the rest of
  deepnvme (_doors) or its table of old module paths (_moved);
- a floor imports only the floors below it (train and infer, the users, stand side by side and import
  neither the other), and those through their faces only (`deepnvme.offload.swap`, never
  `deepnvme.offload.swap.pool`); no floor imports the package face or _moved;
- only the door imports the rest of deepnvme (or op_builder), and it imports deepnvme._core only (an
  exception goes in DOOR_EXCEPTIONS, with its reason);
- no name with a leading underscore is imported from another file (a private submodule of the importer's
  own package is its package's, and may be);
- no module over MAX_LINES lines, no function over MAX_FUNCTION lines; no two module names one letter
  apart, no name used by two modules (`store` beside `stores`, `swap/swap.py`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.layout.test_import_graph import ROOT, import_graph, import_nodes, module_files

PACKAGE = "deepnvme.offload"
#: Bottom first; floors of one rank stand side by side.
FLOORS: dict[str, int] = {"swap": 0, "stores": 1, "model": 2, "experts": 3, "train": 4, "infer": 4}
DOOR = f"{PACKAGE}._doors"
OUTSIDE_FLOORS = {PACKAGE, DOOR, f"{PACKAGE}._moved"}
#: What the door may import outside deepnvme._core, and why.
DOOR_EXCEPTIONS: dict[str, str] = {
    "deepnvme.checkpoint": "training offloaded on several ranks saves and resumes through torch's DCP with "
    "deepnvme's storage writer and reader, streamed from the drive",
    "deepnvme.moe.grouped": "a streamed deepnvme.moe layer computes its routed experts together exactly as "
    "the layer in memory does, so its outputs are the same bits",
}
MAX_LINES = 600
MAX_FUNCTION = 100


def _floor(module: str) -> str | None:
    """The floor of an offload module (None for those outside the floors)."""
    rest = module.removeprefix(PACKAGE + ".").split(".")
    return rest[0] if module not in OUTSIDE_FLOORS and rest[0] in FLOORS else None


def _offload_modules(root: Path) -> dict[str, Path]:
    return {m: p for m, p in module_files(root).items() if m == PACKAGE or m.startswith(PACKAGE + ".")}


def floor_violations(root: Path) -> list[str]:
    """Every way the offload package at `root` breaks the floors or the door, as readable lines."""
    graph = import_graph(root)
    modules = _offload_modules(root)
    out: list[str] = []
    for m in sorted(modules):
        floor = _floor(m)
        if floor is None and m not in OUTSIDE_FLOORS:
            out.append(f"{m}: in no floor ({', '.join(FLOORS)})")
        for t in sorted(graph[m]):
            if t == PACKAGE or t.startswith(PACKAGE + "."):
                if floor is None:
                    continue  # the face and the table stand above the floors
                if t in (PACKAGE, f"{PACKAGE}._moved"):
                    out.append(f"{m} imports {t}: a floor never climbs back to the package face")
                    continue
                other = _floor(t)
                if other is None or other == floor:
                    continue
                if FLOORS[other] >= FLOORS[floor]:
                    out.append(f"{m} ({floor}) imports {t} ({other}): a floor imports only floors below it")
                elif t != f"{PACKAGE}.{other}":
                    out.append(f"{m} imports {t}: another floor is used through its face, "
                               f"{PACKAGE}.{other}")
            elif t.startswith(("deepnvme", "op_builder")):
                if m != DOOR:
                    out.append(f"{m} imports {t}: offload reaches the rest of deepnvme through {DOOR} only")
                elif not t.startswith("deepnvme._core") and t not in DOOR_EXCEPTIONS:
                    out.append(f"{DOOR} imports {t}: the door opens onto deepnvme._core only")
    out += _private_imports(root, modules)
    out += _sizes(modules)
    out += _names(modules)
    return out


def _private_imports(root: Path, modules: dict[str, Path]) -> list[str]:
    everything = module_files(root)
    out = []
    for m, path in sorted(modules.items()):
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in import_nodes(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            if not node.module.startswith(("deepnvme", "op_builder")):
                continue
            for alias in node.names:
                own_submodule = node.module == package and f"{package}.{alias.name}" in everything
                if alias.name.startswith("_") and not own_submodule:
                    out.append(f"{m} imports the private name {alias.name} from {node.module}")
    return out


def _sizes(modules: dict[str, Path]) -> list[str]:
    out = []
    for m, path in sorted(modules.items()):
        text = path.read_text()
        if text.count("\n") > MAX_LINES:
            out.append(f"{m}: {text.count(chr(10))} lines, over {MAX_LINES}")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > MAX_FUNCTION:
                    out.append(f"{m}: {node.name} is {n} lines, over {MAX_FUNCTION}")
    return out


def _one_apart(a: str, b: str) -> bool:
    """Whether a and b differ by one letter added, removed or changed."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        return sum(x != y for x, y in zip(a, b)) == 1
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def _names(modules: dict[str, Path]) -> list[str]:
    by_name: dict[str, list[str]] = {}
    for m in modules:
        by_name.setdefault(m.rpartition(".")[2], []).append(m)
    out = [f"{', '.join(sorted(ms))}: one name for two modules" for ms in by_name.values() if len(ms) > 1]
    names = sorted(by_name)
    out += [f"{by_name[a][0]} and {by_name[b][0]}: names one letter apart"
            for i, a in enumerate(names) for b in names[i + 1:] if _one_apart(a, b)]
    return out


def test_offload_stands_in_floors_behind_one_door() -> None:
    assert floor_violations(ROOT) == []


def test_every_floor_is_there() -> None:
    """The test looks at the real package (a renamed floor would otherwise leave its rules unchecked)."""
    modules = _offload_modules(ROOT)
    assert {f"{PACKAGE}.{f}" for f in FLOORS} | OUTSIDE_FLOORS <= set(modules)


def test_each_kind_of_violation_is_found(tmp_path: Path) -> None:
    """The same check on a small tree that breaks each rule once."""
    files = {
        "__init__.py": "from deepnvme.offload.infer import run\n",
        "_doors.py": "from deepnvme._core.files import x\nfrom deepnvme.serialization import y\n",
        "_moved.py": "",
        "flat.py": "",  # in no floor
        "swap/__init__.py": "from deepnvme.offload.swap.pool import Pool\n",
        "swap/pool.py": "from deepnvme.offload.stores import Store\n",  # a lower floor imports a higher
        "stores/__init__.py": "",
        "stores/store.py": "from deepnvme.offload.swap.pool import _helper\n",  # a floor's module; private
        "model/__init__.py": "def f():\n    from deepnvme.moe.experts import Experts\n",  # past the door
        "model/stores.py": "",  # one name for two modules
        "experts/__init__.py": "from deepnvme.offload import SwapSpace\n",  # climbs to the face
        "train/__init__.py": "from deepnvme.offload.infer import run\n",  # sideways
        "infer/__init__.py": "def run():\n" + "    x = 1\n" * 101,  # a function over 100 lines
    }
    for name, text in files.items():
        path = tmp_path / "deepnvme" / "offload" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "deepnvme" / "__init__.py").write_text("")
    (tmp_path / "deepnvme" / "serialization.py").write_text("")
    (tmp_path / "deepnvme" / "moe").mkdir()
    (tmp_path / "deepnvme" / "moe" / "experts.py").write_text("")
    (tmp_path / "deepnvme" / "_core").mkdir()
    (tmp_path / "deepnvme" / "_core" / "files.py").write_text("")
    (tmp_path / "op_builder").mkdir()
    (tmp_path / "bench").mkdir()
    assert floor_violations(tmp_path) == [
        "deepnvme.offload._doors imports deepnvme.serialization: the door opens onto deepnvme._core only",
        "deepnvme.offload.experts imports deepnvme.offload: a floor never climbs back to the package face",
        "deepnvme.offload.flat: in no floor (swap, stores, model, experts, train, infer)",
        "deepnvme.offload.model imports deepnvme.moe.experts: offload reaches the rest of deepnvme through "
        "deepnvme.offload._doors only",
        "deepnvme.offload.stores.store imports deepnvme.offload.swap.pool: another floor is used through "
        "its face, deepnvme.offload.swap",
        "deepnvme.offload.swap.pool (swap) imports deepnvme.offload.stores (stores): a floor imports only "
        "floors below it",
        "deepnvme.offload.train (train) imports deepnvme.offload.infer (infer): a floor imports only floors "
        "below it",
        "deepnvme.offload.stores.store imports the private name _helper from deepnvme.offload.swap.pool",
        "deepnvme.offload.infer: run is 102 lines, over 100",
        "deepnvme.offload.model.stores, deepnvme.offload.stores: one name for two modules",
        "deepnvme.offload.stores.store and deepnvme.offload.model.stores: names one letter apart",
    ]
