"""OpBuilder and its torch layers: what an op compiles, whether it can, and how it is loaded.

``load()`` takes, in order: the module already loaded in this process; a prebuilt ``deepnvme.ops.<name>_op``
whose recorded torch matches the running one (:mod:`.prebuilt`); a JIT build whose stamp still matches
(:mod:`.jit_cache`, imported straight from the ``.so``, no ninja, no compiler); and only then a JIT build.
This file holds the contract; the cache, the probes and the compiler diagnostics each live in their own.
Nothing here imports torch at module import time.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

from . import jit_cache, prebuilt, probe, sanitize
from .build_spec import BuildSpec
from .jit_cache import extensions_root
from .probe import Capability

__all__ = ["OpBuilder", "TorchCPUOpBuilder", "CUDAOpBuilder", "csrc_root", "extensions_root",
           "deepnvme_version"]

T = TypeVar("T")
_OPT_FLAGS = ["-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-g0"]  # -g0 beats the -g of Python's CFLAGS


# --------------------------------------------------------------------------------------------- locations
def csrc_root() -> Path:
    """The C++ sources: ``<repo>/csrc`` in a source tree or editable install, else ``deepnvme/_csrc``."""
    top = Path(__file__).resolve().parent.parent
    if (top / "csrc").is_dir() and (top / "deepnvme").is_dir():
        return top / "csrc"
    spec = importlib.util.find_spec("deepnvme")  # a top-level find_spec does not import the package
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            if (Path(loc) / "_csrc").is_dir():
                return Path(loc) / "_csrc"
    return top / "csrc"


def deepnvme_version() -> str:
    """deepnvme's version, read from deepnvme/_version.py without importing the package."""
    spec = importlib.util.find_spec("deepnvme")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        try:
            text = (Path(loc) / "_version.py").read_text()
        except OSError:
            continue
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)['\"]", text)
        if m:
            return m.group(1)
    return "0+unknown"


def _torch_capability() -> Capability:
    spec = importlib.util.find_spec("torch")  # presence only: importing torch here would cost seconds
    if spec is None:
        return Capability("torch", False, "", "torch is not installed",
                          "install torch first (https://pytorch.org/get-started/locally/)")
    return Capability("torch", True, str(Path(spec.origin or "").parent))


# --------------------------------------------------------------------------------------------- OpBuilder
class OpBuilder(ABC):
    """One compiled op: its sources and flags, whether this machine can build it, and how to load it.

    Subclasses set ``NAME`` and ``BUILD_VAR`` and implement :meth:`sources`. Relative paths are resolved
    against :meth:`source_root` (the folder of the subclass's module), so a plugin package ships its C++
    beside its Python; deepnvme's own builders resolve ``csrc/...`` against :func:`csrc_root`.
    """

    NAME: ClassVar[str] = ""
    BUILD_VAR: ClassVar[str] = ""
    #: deepnvme's own builders keep their sources under csrc/ (a plugin does not)
    BUILTIN_SOURCES: ClassVar[bool] = False
    #: one module per op name for the whole process, whichever builder instance loaded it
    _loaded_ops: ClassVar[dict[str, ModuleType]] = {}

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME
        if not self.name:
            raise TypeError(f"{type(self).__name__} must set NAME")
        self.jit_mode = False
        self.error_log: str | None = None
        # Probe outcomes this builder relied on; a warm load restores them from the stamp instead of
        # running the compiler again.
        self._probe_memo: dict[str, Any] = {}
        #: why this builder's last JIT load was not warm (what changed since the stamp), None when it was
        self.warm_miss: str | None = None

    # ---- the DeepSpeed contract -------------------------------------------------------------------------
    @abstractmethod
    def sources(self) -> list[str]:
        """C++ sources, absolute or relative to :meth:`source_root`."""

    def include_paths(self) -> list[str]:
        """Extra include directories (same resolution as sources)."""
        return []

    def cxx_args(self) -> list[str]:
        """Host compiler flags."""
        return []

    def nvcc_args(self) -> list[str]:
        """nvcc flags (only for ops with .cu sources)."""
        return []

    def extra_ldflags(self) -> list[str]:
        """Linker flags (-l, -L, -Wl,...): passed as link arguments, never as compile flags."""
        return []

    def absolute_name(self) -> str:
        """Import path of the prebuilt module."""
        return f"deepnvme.ops.{self.name}_op"

    def requirements(self) -> list[Capability]:
        """Every capability this op cannot be built without (runs probes; never called at import)."""
        caps = [probe.compiler(), probe.ninja(), _torch_capability()]
        missing = [s for s in self.sources() if not self.src_path(s).is_file()]
        if not self.sources() or missing:
            caps.append(Capability("sources", False, str(csrc_root() if self.BUILTIN_SOURCES else
                                                          self.source_root()),
                                   f"C++ sources missing: {', '.join(missing) or 'none listed'}",
                                   "reinstall deepnvme (the C++ sources travel inside the package)"))
        return caps

    def missing(self) -> list[Capability]:
        """The requirements that are not met."""
        return [c for c in self.requirements() if not c.ok]

    def is_compatible(self, verbose: bool = False) -> bool:
        """True when every requirement is met; otherwise ``error_log`` says why and how to fix it."""
        missing = self.missing()
        self.error_log = self._explain(missing) if missing else None
        if verbose and missing:
            print(f"[WARNING] {self.error_log}", file=sys.stderr)
        return not missing

    def load(self, verbose: bool = False) -> ModuleType:
        """The op's module: cached in-process, else prebuilt (matching torch), else JIT."""
        cached = OpBuilder._loaded_ops.get(self.name)
        if cached is not None:
            return cached
        # A prebuilt op is never sanitized: with DEEPNVME_SANITIZE set only a JIT build will do.
        module = None if sanitize.selected() else self._load_prebuilt()
        if module is None:
            module = self.jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module

    def jit_module_name(self) -> str:
        """Name of the JIT-built extension module, also the start of its build folder's name.
        Prefixed so it never is DeepSpeed's: both call the op ``async_io``; in a shared folder each tool
        rebuilt over the other's library, and in one process the second module of that name to load came
        back as the first one."""
        return f"deepnvme_{self.name}{sanitize.module_suffix()}"  # a sanitized build has a name of its own

    def jit_build_dir(self) -> Path:
        """This op's JIT build folder, one per source tree (see :func:`jit_cache.build_folder`)."""
        root = csrc_root() if self.BUILTIN_SOURCES else self.source_root()
        return jit_cache.build_folder(extensions_root(), self.jit_module_name(), root)

    def jit_load(self, verbose: bool = False) -> ModuleType:
        """Import the cached JIT build when its stamp matches; build it with torch/ninja otherwise.

        A warm load runs no compiler: the probes' inputs are compared by ``stat`` with the stamp's, and while
        they are unchanged the stamp's probe outcomes stand in for the probes. Otherwise :attr:`warm_miss`
        says what changed, and the build probes afresh."""
        self.jit_mode = True
        try:
            import torch  # noqa: F401 - the extension links against libtorch: load it first

            build_dir = self.jit_build_dir()
            fingerprint = self.probe_fingerprint()
            recorded, why = jit_cache.recorded_probes(build_dir, fingerprint)
            module = None
            if recorded is not None:
                self._probe_memo = recorded
                module, why = jit_cache.load_warm(self.build_spec(fingerprint), build_dir)
            self.warm_miss = why or None
            if module is None:
                self._probe_memo = {}  # the stamp's outcomes were for its own build: probe this one afresh
                missing = self.missing()
                if missing:
                    self.error_log = self._explain(missing)
                    raise RuntimeError(f"Unable to JIT-build {self.error_log}")
                module = jit_cache.build(self.build_spec(fingerprint), build_dir, verbose, why)
            OpBuilder._loaded_ops.setdefault(self.name, module)
            return module
        finally:
            self.jit_mode = False

    def build_spec(self, fingerprint: str | None = None) -> BuildSpec:
        """This op's JIT build as plain values, for :mod:`.jit_cache`: resolved sources and include folders,
        the JIT flags, and the probe outcomes they were computed from (runs the probes not yet known).
        ``fingerprint``: :meth:`probe_fingerprint`, when the caller has it already."""
        was, self.jit_mode = self.jit_mode, True
        try:
            return BuildSpec(
                name=self.name, module_name=self.jit_module_name(),
                origin=(type(self).__module__, type(self).__qualname__), version=deepnvme_version(),
                sources=tuple(str(self.src_path(s)) for s in self.sources()),
                include_dirs=tuple(str(self.src_path(p)) for p in self.include_paths()),
                cxx_flags=tuple(self.cxx_args()), ld_flags=tuple(self.extra_ldflags()),
                nvcc_flags=tuple(self.nvcc_args()) if self.with_cuda() else (), with_cuda=self.with_cuda(),
                fingerprint=self.probe_fingerprint() if fingerprint is None else fingerprint,
                probes=dict(self._probe_memo))
        finally:
            self.jit_mode = was

    def builder(self) -> Any:
        """The setuptools extension that prebuilds this op as :meth:`absolute_name` (portable flags)."""
        if sanitize.selected():
            # Installed under the op's normal name, a sanitized module would be loaded by every later run.
            raise ValueError(f"{sanitize.ENV}={os.environ[sanitize.ENV]!r} applies to JIT builds only: unset "
                             "it to prebuild ops (sanitized builds are loaded just in time, under a name of "
                             "their own)")
        from torch.utils.cpp_extension import CppExtension, CUDAExtension

        self.jit_mode = False
        cls = CUDAExtension if self.with_cuda() else CppExtension
        compile_args: dict[str, list[str]] = {"cxx": self.cxx_args()}
        if self.with_cuda():
            compile_args["nvcc"] = self.nvcc_args()
        return cls(name=self.absolute_name(), sources=[self._rel(self.src_path(s)) for s in self.sources()],
                   include_dirs=[str(self.src_path(p)) for p in self.include_paths()],
                   extra_compile_args=compile_args, extra_link_args=self.extra_ldflags())

    # ---- hooks beyond DeepSpeed's contract ------------------------------------------------------------
    def source_root(self) -> Path:
        """Folder relative source paths start from: the subclass's module folder."""
        return Path(inspect.getfile(type(self))).resolve().parent

    def src_path(self, path: str | os.PathLike[str]) -> Path:
        """Absolute path of a source or include entry."""
        p = Path(path)
        if p.is_absolute():
            return p
        if self.BUILTIN_SOURCES and p.parts and p.parts[0] == "csrc":
            return csrc_root().joinpath(*p.parts[1:])
        return self.source_root() / p

    def with_cuda(self) -> bool:
        """Whether the op links torch's CUDA libraries (CUDAExtension)."""
        return False

    def probe_inputs(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """(headers, libraries, extra paths) whose appearance or change alters this op's flags."""
        return (), (), ()

    def probe_fingerprint(self) -> str:
        """Stat-only digest of what this op's probes depend on (see :func:`probe.state_fingerprint`)."""
        headers, libraries, extra = self.probe_inputs()
        return probe.state_fingerprint(headers, libraries, extra) + "/" + probe.cpu_fingerprint()

    def capability(self, name: str, fn: Callable[[], Capability]) -> Capability:
        """Run (or recall) a probe whose outcome shapes sources or flags; remembered for the stamp."""
        return self._memo(name, fn)

    def arch_flags(self) -> list[str]:
        """``-march=native`` (or the ISA's spelling) for JIT builds only: prebuilt wheels stay portable."""
        if not self.jit_mode:
            return []
        return list(self._memo("arch", probe.native_arch_flags))

    def sanitize_compile_flags(self) -> list[str]:
        """``$DEEPNVME_SANITIZE``'s compiler flags, for JIT builds only: a prebuilt op has the normal name."""
        return sanitize.compile_flags() if self.jit_mode else []

    def sanitize_link_flags(self) -> list[str]:
        """``$DEEPNVME_SANITIZE``'s linker flags, for JIT builds only (see :meth:`sanitize_compile_flags`)."""
        return sanitize.link_flags() if self.jit_mode else []

    def jit_key(self) -> str:
        """sha256 over every input of this op's JIT build (see :func:`jit_cache.jit_key`)."""
        return jit_cache.jit_key(self.build_spec())

    # ---- internals ---------------------------------------------------------------------------------
    def _memo(self, name: str, fn: Callable[[], T]) -> T:
        if name not in self._probe_memo:
            self._probe_memo[name] = fn()
        return self._probe_memo[name]

    def _explain(self, missing: list[Capability]) -> str:
        parts = []
        for cap in missing:
            first = cap.reason.splitlines()[0] if cap.reason else "not available"
            parts.append(f"{cap.name}: {first}" + (f" -> fix: {cap.fix}" if cap.fix else ""))
        return f"op '{self.name}' cannot be built here: " + "; ".join(parts)

    def _rel(self, path: Path) -> str:
        # setuptools prefers sources relative to setup.py (the cwd of a build); keep others absolute.
        try:
            return os.path.relpath(path) if Path(os.path.relpath(path)).parts[0] != ".." else str(path)
        except ValueError:
            return str(path)

    def _load_prebuilt(self) -> ModuleType | None:
        installed, built = prebuilt.installed_record()
        if not installed.get(self.name):
            return None
        import torch

        mismatch = prebuilt.torch_mismatch(built, torch.__version__, torch.version.cuda)
        if mismatch:
            warnings.warn(f"deepnvme: the '{self.name}' op was {mismatch}; building it just in time instead",
                          RuntimeWarning, stacklevel=3)
            return None
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError as exc:
            warnings.warn(f"deepnvme: the prebuilt '{self.name}' op does not import ({exc}); "
                          "building it just in time instead", RuntimeWarning, stacklevel=3)
            return None


class TorchCPUOpBuilder(OpBuilder):
    """A host-only C++ op built against torch: -O3, hidden visibility, native arch only when JIT."""

    def cxx_args(self) -> list[str]:
        return [*_OPT_FLAGS, *self.arch_flags(), *self.sanitize_compile_flags()]

    def extra_ldflags(self) -> list[str]:
        return [*super().extra_ldflags(), *self.sanitize_link_flags()]


class CUDAOpBuilder(OpBuilder):
    """An op that links CUDA (runtime, and torch's CUDA libraries): needs a CUDA build of torch."""

    def requirements(self) -> list[Capability]:
        return [*super().requirements(), probe.cuda()]

    def with_cuda(self) -> bool:
        return True

    def cuda_include_dirs(self) -> list[str]:
        home = probe.cuda_home()
        return [os.path.join(home, "include")] if home else []

    def cuda_ldflags(self) -> list[str]:
        home = probe.cuda_home()
        if not home:
            return ["-lcudart"]
        candidates = (os.path.join(home, "lib64"), os.path.join(home, "lib"))
        libdir = next((d for d in candidates if os.path.isdir(d)), candidates[0])
        return [f"-L{libdir}", "-lcudart"]

    def include_paths(self) -> list[str]:
        return self.cuda_include_dirs()

    def cxx_args(self) -> list[str]:
        return [*_OPT_FLAGS, *self.arch_flags(), *self.sanitize_compile_flags()]

    def nvcc_args(self) -> list[str]:
        return ["-O3"]

    def extra_ldflags(self) -> list[str]:
        return [*self.cuda_ldflags(), *self.sanitize_link_flags()]
