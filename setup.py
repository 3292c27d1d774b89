"""deepnvme install: JIT-only by default; DS_BUILD_OPS / DS_BUILD_<OP> prebuild ops into deepnvme.ops.

    pip install .                                      # no C++ built now; ops compile on first load()
    DS_BUILD_OPS=1 pip install --no-build-isolation .  # every compatible op; others skipped, with why
    DS_BUILD_AIO=1 pip install --no-build-isolation .  # async_io only; fails if it cannot be built

Metadata lives in pyproject.toml; this file only decides the extensions and ships the C++ sources.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # the source tree's op_builder, not an installed one

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_CSRC_SUFFIXES = {".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh", ".inc", ".cu", ".cuh"}


def env_flag(name: str) -> bool | None:
    """Read a DS_BUILD_* variable: None when unset or empty, else a bool; anything else stops the build."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    sys.exit(f"deepnvme setup: {name}={raw!r} is not a boolean; use one of 0/1, true/false, yes/no, on/off")


def select_ops() -> tuple[list, dict[str, bool], dict | None]:
    """Decide which ops to prebuild: (extensions, installed_ops, torch_info)."""
    from op_builder import ALL_OPS, sanitize

    default = env_flag("DS_BUILD_OPS")
    wanted: dict[str, tuple[object, bool]] = {}
    for name, builder in ALL_OPS.items():
        own = env_flag(builder.BUILD_VAR) if builder.BUILD_VAR else None
        enabled = own if own is not None else bool(default)
        if enabled:
            wanted[name] = (builder, own is True)
    installed = {name: False for name in ALL_OPS}
    if not wanted:
        return [], installed, None
    if sanitize.selected():
        # A prebuilt op has the op's normal name: a sanitized one would be what every later run loads.
        sys.exit(f"deepnvme setup: {sanitize.ENV}={os.environ[sanitize.ENV]!r} applies to JIT builds only; "
                 "unset it to prebuild ops (see op_builder/sanitize.py)")
    try:
        import torch
    except ImportError:
        sys.exit("deepnvme setup: prebuilding ops (" + ", ".join(wanted) + ") needs torch at build time, "
                 "and it cannot be imported. Install torch first, then build with "
                 "`pip install --no-build-isolation .` (build isolation hides the installed torch).")
    extensions, failures = [], []
    for name, (builder, explicit) in wanted.items():
        if builder.is_compatible():
            extensions.append(builder.builder())
            installed[name] = True
            print(f"deepnvme setup: prebuilding {name} as {builder.absolute_name()}")
        elif explicit:
            failures.append(f"{builder.BUILD_VAR}=1 asks for {builder.error_log}")
        else:
            print(f"deepnvme setup: skipping incompatible {name} under DS_BUILD_OPS=1: {builder.error_log} "
                  f"(set {builder.BUILD_VAR}=0 to silence this)")
    if failures:
        # An op asked for by name must never be skipped silently: the install fails and says why.
        sys.exit("deepnvme setup: cannot prebuild the requested op(s):\n  " + "\n  ".join(failures))
    torch_info = {"version": torch.__version__, "cuda_version": torch.version.cuda}
    return extensions, installed, torch_info


def write_installed_ops(target: Path, installed: dict[str, bool], torch_info: dict | None) -> None:
    """deepnvme/_installed_ops.py: which ops are prebuilt, and for which torch (load() checks it)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(
        '"""Written by setup.py: the ops prebuilt into deepnvme.ops and the torch they were built for."""\n\n'
        f"installed_ops = {installed!r}\n"
        f"torch_info = {torch_info!r}\n")


EXTENSIONS, INSTALLED, TORCH_INFO = select_ops()


class BuildPy(build_py):
    """Ships csrc/ inside the package (deepnvme/_csrc) and records the prebuilt ops."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            # An editable install reads csrc/ from the tree; the record goes next to the tree's package.
            write_installed_ops(ROOT / "deepnvme" / "_installed_ops.py", INSTALLED, TORCH_INFO)
            return
        dest = Path(self.build_lib) / "deepnvme" / "_csrc"
        if dest.exists():
            shutil.rmtree(dest)
        for src in sorted((ROOT / "csrc").rglob("*")):
            if src.is_file() and src.suffix in _CSRC_SUFFIXES:
                out = dest / src.relative_to(ROOT / "csrc")
                out.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, out)
        write_installed_ops(Path(self.build_lib) / "deepnvme" / "_installed_ops.py", INSTALLED, TORCH_INFO)


cmdclass: dict[str, type] = {"build_py": BuildPy}
if EXTENSIONS:
    from torch.utils.cpp_extension import BuildExtension

    # ninja compiles the op's files in parallel; without it torch falls back to one file at a time.
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=shutil.which("ninja") is not None)

setup(ext_modules=EXTENSIONS, cmdclass=cmdclass)
