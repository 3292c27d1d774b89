"""Helpers for the op-builder tests: tiny plugin ops written to a temp dir, and fresh-process runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# A one-function extension that needs only Python.h: it compiles in well under a second, so the tests
# exercise the build machinery (keys, stamps, ninja, locks) without paying for torch's heavy headers.
TINY_CPP = r"""
#include <Python.h>
#include "tiny.h"
#define DN_CAT2(a, b) a##b
#define DN_CAT(a, b) DN_CAT2(a, b)
#define DN_STR2(x) #x
#define DN_STR(x) DN_STR2(x)
static PyObject *value(PyObject *, PyObject *) { return PyLong_FromLong(TINY_VALUE); }
static PyMethodDef methods[] = {{"value", value, METH_NOARGS, "the constant in tiny.h"},
                                {nullptr, nullptr, 0, nullptr}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, DN_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC DN_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
"""

PLUGIN_INIT = '''
"""A plugin op living outside deepnvme."""
from op_builder import TorchCPUOpBuilder


class {cls}(TorchCPUOpBuilder):
    NAME = "{name}"
    BUILD_VAR = "DS_BUILD_{upper}"

    def sources(self):
        return ["csrc/tiny.cpp"]

    def include_paths(self):
        return ["csrc"]

    def absolute_name(self):
        return "{pkg}.{name}_op"
'''


def write_plugin(root: Path, pkg: str = "tinyplug", name: str = "tiny_op_x", cls: str = "TinyBuilder",
                 value: int = 1) -> Path:
    """Create package ``pkg`` under ``root``: an OpBuilder subclass plus a one-function C++ source."""
    pdir = root / pkg
    (pdir / "csrc").mkdir(parents=True, exist_ok=True)
    (pdir / "__init__.py").write_text(PLUGIN_INIT.format(cls=cls, name=name, upper=name.upper(), pkg=pkg))
    (pdir / "csrc" / "tiny.cpp").write_text(TINY_CPP)
    set_value(root, value, pkg)
    return pdir


def load_script(op_name: str) -> str:
    """Child code that registers tinyplug's builder, loads op `op_name` and reports its value, module file
    and why the load was not warm (run_python's `result`)."""
    return f"""
import op_builder, tinyplug
op_builder.register(tinyplug.TinyBuilder)
b = op_builder.ALL_OPS[{op_name!r}]
mod = b.load()
result = {{"value": mod.value(), "file": mod.__file__, "warm_miss": b.warm_miss}}
"""


def set_value(root: Path, value: int, pkg: str = "tinyplug") -> None:
    """Change the constant in the plugin's header (a header-only edit must trigger a rebuild)."""
    (root / pkg / "csrc" / "tiny.h").write_text(f"#pragma once\n#define TINY_VALUE {value}\n")


def tiny_build_dir(ext: Path, root: Path, name: str, pkg: str = "tinyplug") -> Path:
    """Where a plugin op written by :func:`write_plugin` under ``root`` is JIT-built in ``ext``."""
    from op_builder.jit_cache import build_folder

    return build_folder(ext, f"deepnvme_{name}", root / pkg)


def write_entry_point(root: Path, dist: str, group: str, name: str, value: str) -> None:
    """A minimal installed distribution (``*.dist-info``) on ``root`` that exposes one entry point."""
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {value}\n")


# Run before the snippet: record every subprocess the snippet starts (a warm load must start none).
_SPY = """
import json as _json, subprocess as _sp, sys as _sys, time as _time
_calls = []
_orig = _sp.Popen.__init__
def _spy(self, *a, **k):
    _calls.append(str(a[0] if a else k.get("args")))
    return _orig(self, *a, **k)
_sp.Popen.__init__ = _spy
"""

_REPORT = """
_sys.stdout.write("\\nRESULT " + _json.dumps({"calls": _calls, "result": result,
    "cpp_extension": "torch.utils.cpp_extension" in _sys.modules}) + "\\n")
"""


def run_python(code: str, *, paths: list[Path] = (), env: dict[str, str] | None = None,
               cwd: Path | None = None, timeout: float = 600, python: str = sys.executable) -> dict[str, Any]:
    """Run ``code`` (which sets ``result``) in a fresh interpreter; return its RESULT record."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), str(REPO_ROOT)])
    script = _SPY + textwrap.dedent(code) + _REPORT
    proc = subprocess.run([python, "-c", script], capture_output=True, text=True, env=full_env,
                          cwd=str(cwd) if cwd else None, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"child failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-5000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    data = json.loads(line[len("RESULT "):])
    data["stderr"] = proc.stderr
    return data
