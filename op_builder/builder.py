"""OpBuilder and its torch layers: what an op compiles, whether it can, and how it is loaded.

``load()`` takes, in order: the module already loaded in this process; a prebuilt ``deepnvme.ops.<name>_op``
whose recorded torch matches the running one; a JIT build cached under ``TORCH_EXTENSIONS_DIR`` whose stamp
matches (imported straight from the ``.so``, no ninja, no compiler); and only then a torch/ninja JIT build.
Nothing here imports torch at module import time.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import os
import re
import shlex
import shutil
import sys
import sysconfig
import tempfile
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

from . import probe, sanitize
from .probe import Capability

__all__ = ["OpBuilder", "TorchCPUOpBuilder", "CUDAOpBuilder", "csrc_root", "extensions_root",
           "deepnvme_version"]

T = TypeVar("T")
STAMP_FILE = "deepnvme_stamp.json"
_STAMP_VERSION = 1
_OPT_FLAGS = ["-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-g0"]  # -g0 beats the -g of Python's CFLAGS
_HEADER_PACKAGES = {"libaio.h": "libaio-dev", "liburing.h": "liburing-dev", "Python.h": "python3-dev",
                    "cufile.h": "nvidia-cufile (pip) or the CUDA toolkit's GDS package",
                    "cuda_runtime.h": "the CUDA toolkit (set CUDA_HOME)"}


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


def _file_identity(path: Path) -> list[int] | None:
    """Size and modification time of a built library: a file replaced since the stamp was written (another
    build, a copy) no longer matches, so the fast path never imports a library it did not build."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def extensions_root() -> Path:
    """Root of JIT builds: ``$TORCH_EXTENSIONS_DIR``, else torch's per-user cache folder, named as torch
    names it (``~/.cache/torch_extensions/py311_cpu``), so both tools share one cache layout."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    import torch

    try:
        from torch import _appdirs

        base = _appdirs.user_cache_dir(appname="torch_extensions")
    except Exception:  # noqa: BLE001 - private torch module; fall back to the XDG rule it implements
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                            "torch_extensions")
    if getattr(torch.version, "hip", None):
        acc = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        acc = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        acc = "cpu"
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(os.path.realpath(base)) / f"{py}_{acc}"


def _torch_capability() -> Capability:
    spec = importlib.util.find_spec("torch")  # presence only: importing torch here would cost seconds
    if spec is None:
        return Capability("torch", False, "", "torch is not installed",
                          "install torch first (https://pytorch.org/get-started/locally/)")
    return Capability("torch", True, str(Path(spec.origin or "").parent))


def _compiler_identity() -> str:
    argv = shlex.split(os.environ.get("CXX", "").strip() or "c++")
    exe = shutil.which(argv[0]) if argv else None
    if not exe:
        return " ".join(argv)
    real = os.path.realpath(exe)
    st = os.stat(real)
    return f"{' '.join(argv)} -> {real}:{st.st_size}:{st.st_mtime_ns}"


def _import_extension(name: str, path: Path) -> ModuleType:
    """Import a compiled extension straight from its file (what torch does after a build)."""
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot make an import spec for {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _compiler_tail(text: str, n: int = 20) -> str:
    """The last lines that matter from a ninja/compiler log: drop ninja's long command echoes."""
    keep = [ln for ln in text.splitlines()
            if ln.strip() and not re.match(r"\s*\[\d+/\d+\]", ln)
            and not ln.startswith("ninja: build stopped")]
    return "\n".join(keep[-n:])


def _fix_for(log: str) -> str:
    m = re.search(r"fatal error: ([^:\s]+): No such file", log)
    if m:
        header = m.group(1)
        pkg = _HEADER_PACKAGES.get(header) or _HEADER_PACKAGES.get(os.path.basename(header))
        what = f"install {pkg}" if pkg else f"install the development package that provides {header}"
        return f"{what} (or add its directory with CFLAGS=-I<dir> and CPATH=<dir>)"
    m = re.search(r"cannot find -l:?(\S+)", log)
    if m:
        return (f"install the development package for lib{m.group(1).rstrip(':')} "
                "(or set LDFLAGS=-L<dir> / LIBRARY_PATH=<dir>)")
    if "undefined reference" in log or "undefined symbol" in log:
        return "a library is missing from the link: check extra_ldflags() (or set LDFLAGS)"
    return ("fix the error above; CXX selects the compiler, TORCH_EXTENSIONS_DIR the build folder, "
            "and load(verbose=True) shows every command")


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
        """Name of the JIT-built extension module, also its build folder under :func:`extensions_root`.
        Prefixed so it never is DeepSpeed's: both call the op ``async_io``; in a shared folder each tool
        rebuilt over the other's library, and in one process the second module of that name to load came
        back as the first one."""
        return f"deepnvme_{self.name}{sanitize.module_suffix()}"  # a sanitized build has a name of its own

    def jit_build_dir(self) -> Path:
        """This op's JIT build folder."""
        return extensions_root() / self.jit_module_name()

    def jit_load(self, verbose: bool = False) -> ModuleType:
        """Import the cached JIT build when its stamp matches; build it with torch/ninja otherwise."""
        self.jit_mode = True
        try:
            import torch  # noqa: F401 - the extension links against libtorch: load it first

            build_dir = self.jit_build_dir()
            stamp = self._read_stamp(build_dir)
            if stamp and stamp.get("fingerprint") == self.probe_fingerprint():
                self._probe_memo = self._restore_memo(stamp.get("probes", {}))
                library = build_dir / str(stamp.get("library", ""))
                if stamp.get("key") == self.jit_key() and _file_identity(library) == stamp.get("library_id"):
                    try:
                        module = _import_extension(str(stamp["module"]), library)
                    except ImportError:
                        pass  # e.g. a library it links moved away: rebuild below
                    else:
                        OpBuilder._loaded_ops.setdefault(self.name, module)
                        return module
            self._probe_memo = {}
            module = self._jit_build(build_dir, verbose)
            OpBuilder._loaded_ops.setdefault(self.name, module)
            return module
        finally:
            self.jit_mode = False

    def builder(self) -> Any:
        """The setuptools extension that prebuilds this op as :meth:`absolute_name` (portable flags)."""
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

    def jit_key(self) -> str:
        """sha256 over every input of the build: sources, headers under the include paths, flags, torch,
        Python ABI, compiler and deepnvme version."""
        import torch

        h = hashlib.sha256()

        def add(label: str, value: object) -> None:
            h.update(f"{label}={value!r}\n".encode())

        add("stamp", _STAMP_VERSION)
        add("deepnvme", deepnvme_version())
        add("op", (self.name, self.jit_module_name(), type(self).__module__, type(self).__qualname__))
        add("torch", (torch.__version__, torch.version.cuda, getattr(torch.version, "hip", None)))
        add("python", (sys.implementation.cache_tag, sysconfig.get_config_var("SOABI")))
        add("compiler", _compiler_identity())
        add("cxx", self.cxx_args())
        add("nvcc", self.nvcc_args() if self.with_cuda() else [])
        add("ld", self.extra_ldflags())
        includes = [self.src_path(p) for p in self.include_paths()]
        add("include", [str(p) for p in includes])
        add("with_cuda", self.with_cuda())
        files = {self.src_path(s) for s in self.sources()}
        for inc in includes:
            if inc.is_dir():
                files.update(p for p in inc.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for path in sorted(files):
            add("file", str(path))
            try:
                h.update(path.read_bytes())
            except OSError:
                add("missing", str(path))
        return h.hexdigest()

    # ---- internals ---------------------------------------------------------------------------------
    def _memo(self, name: str, fn: Callable[[], T]) -> T:
        if name not in self._probe_memo:
            self._probe_memo[name] = fn()
        return self._probe_memo[name]

    @staticmethod
    def _restore_memo(saved: dict[str, Any]) -> dict[str, Any]:
        memo: dict[str, Any] = {}
        for name, entry in saved.items():
            if isinstance(entry, dict) and entry.get("type") == "capability":
                memo[name] = Capability(**entry["value"])
            elif isinstance(entry, dict) and entry.get("type") == "list":
                memo[name] = list(entry["value"])
        return memo

    def _saved_memo(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in self._probe_memo.items():
            if isinstance(value, Capability):
                out[name] = {"type": "capability", "value": asdict(value)}
            elif isinstance(value, (list, tuple)):
                out[name] = {"type": "list", "value": list(value)}
        return out

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

    @staticmethod
    def _read_stamp(build_dir: Path) -> dict[str, Any] | None:
        try:
            data = json.loads((build_dir / STAMP_FILE).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _jit_build(self, build_dir: Path, verbose: bool) -> ModuleType:
        missing = self.missing()
        if missing:
            self.error_log = self._explain(missing)
            raise RuntimeError(f"Unable to JIT-build {self.error_log}")
        key = self.jit_key()  # before building: an edit made during the build must trigger the next one
        srcs = [str(self.src_path(s)) for s in self.sources()]
        incs = [str(self.src_path(p)) for p in self.include_paths()]
        cflags, ldflags = self.cxx_args(), self.extra_ldflags()
        build_dir.mkdir(parents=True, exist_ok=True)
        # A library replaced since our stamp was written is newer than every object, so ninja would keep it:
        # note it now and remove it under the lock, to force the relink.
        foreign: tuple[Path, list[int] | None] | None = None
        old = self._read_stamp(build_dir)
        if old and old.get("library"):
            lib = build_dir / str(old["library"])
            if lib.is_file() and _file_identity(lib) != old.get("library_id"):
                foreign = (lib, _file_identity(lib))
        # A stale stamp must not send another process to the fast path while this one relinks.
        (build_dir / STAMP_FILE).unlink(missing_ok=True)
        from torch.utils import cpp_extension

        # torch's own build lock is a plain file that a killed build leaves behind, and every later load
        # then waits on it forever. An flock dies with its holder: under it, torch's lock can only be stale.
        lock_fd = os.open(build_dir / ".deepnvme-build.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            if foreign and _file_identity(foreign[0]) == foreign[1]:
                foreign[0].unlink(missing_ok=True)
            with sanitize.compiler_environment():
                module = cpp_extension.load(
                    name=self.jit_module_name(), sources=srcs, extra_cflags=cflags, extra_ldflags=ldflags,
                    extra_cuda_cflags=self.nvcc_args() if self.with_cuda() else None,
                    extra_include_paths=incs, build_directory=str(build_dir), verbose=verbose,
                    with_cuda=True if self.with_cuda() else None)
        except Exception as exc:  # torch raises RuntimeError (build) or ImportError (load) with the log
            log = str(exc)
            if getattr(exc, "output", None):
                log += "\n" + (exc.output.decode(errors="replace") if isinstance(exc.output, bytes)
                               else str(exc.output))
            raise RuntimeError(
                f"Building op '{self.name}' failed.\nreason (compiler's last lines):\n{_compiler_tail(log)}\n"
                f"fix: {_fix_for(log)}\nbuild folder: {build_dir}") from exc
        else:
            # Under the lock: another process must not relink between our link and the identity we record.
            self._write_stamp(build_dir, key, module, {"sources": srcs, "cxx": cflags, "ld": ldflags,
                                                        "include": incs})
        finally:
            os.close(lock_fd)  # releases the flock
        return module

    def _write_stamp(self, build_dir: Path, key: str, module: ModuleType, flags: dict[str, Any]) -> None:
        library = Path(getattr(module, "__file__", "") or "")
        data = {"key": key, "fingerprint": self.probe_fingerprint(), "probes": self._saved_memo(),
                "module": module.__name__, "library": library.name, "library_id": _file_identity(library),
                "flags": flags}
        # Atomic replace: a concurrent reader sees the old stamp or the new one, never half of one.
        fd, tmp = tempfile.mkstemp(prefix=".stamp.", dir=build_dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
            os.replace(tmp, build_dir / STAMP_FILE)
        except OSError:
            Path(tmp).unlink(missing_ok=True)

    def _load_prebuilt(self) -> ModuleType | None:
        try:
            record = importlib.import_module("deepnvme._installed_ops")
        except ImportError:
            return None
        if not getattr(record, "installed_ops", {}).get(self.name):
            return None
        import torch

        info = getattr(record, "torch_info", None) or {}
        built = (info.get("version"), info.get("cuda_version"))
        running = (torch.__version__, torch.version.cuda)
        if built != running:
            warnings.warn(f"deepnvme: the prebuilt '{self.name}' op was built for torch {built[0]} "
                          f"(CUDA {built[1]}), but torch {running[0]} (CUDA {running[1]}) is running; "
                          "building it just in time instead", RuntimeWarning, stacklevel=3)
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
        return [*_OPT_FLAGS, *self.arch_flags(), *sanitize.compile_flags()]

    def extra_ldflags(self) -> list[str]:
        return [*super().extra_ldflags(), *sanitize.link_flags()]


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
        return [*_OPT_FLAGS, *self.arch_flags(), *sanitize.compile_flags()]

    def nvcc_args(self) -> list[str]:
        return ["-O3"]

    def extra_ldflags(self) -> list[str]:
        return [*self.cuda_ldflags(), *sanitize.link_flags()]
