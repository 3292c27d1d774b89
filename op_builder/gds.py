"""The gds op: GPUDirect Storage (cuFile) I/O for CUDA tensors, on top of the async_io engine."""

from __future__ import annotations

import os
import shutil
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from . import probe
from .async_io import engine_defines, engine_ldflags, engine_probe_inputs, engine_sources
from .builder import CUDAOpBuilder, csrc_root

__all__ = ["GDSBuilder"]


class GDSBuilder(CUDAOpBuilder):
    """Builds ``gds_handle``: csrc/gds plus the async_io engine (without its Python binding)."""

    NAME = "gds"
    BUILD_VAR = "DS_BUILD_GDS"
    BUILTIN_SOURCES = True

    def _cufile(self) -> probe.CufileLocation:
        return probe.find_cufile()

    def sources(self) -> list[str]:
        gds = sorted(f"csrc/gds/{p.name}" for p in (csrc_root() / "gds").glob("*.cpp"))
        return gds + engine_sources(binding=False)

    def include_paths(self) -> list[str]:
        loc = self._cufile()
        extra = [loc.include_dir] if loc.include_dir else []
        dirs = ["csrc/aio", "csrc/gds", *self.cuda_include_dirs(), *extra]
        return list(dict.fromkeys(dirs))  # CUDA's include dir may also hold cufile.h

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), *engine_defines(self)]

    def extra_ldflags(self) -> list[str]:
        loc = self._cufile()
        cufile = [f"-L{loc.library_dir}", f"-Wl,-rpath,{loc.library_dir}"] if loc.library_dir else []
        return [*engine_ldflags(self), *cufile, loc.link_arg, *self.cuda_ldflags()]

    def requirements(self) -> list[probe.Capability]:
        return [*super().requirements(), probe.cufile()]

    def probe_inputs(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        headers, libs = engine_probe_inputs()
        loc = self._cufile()
        paths = [os.path.join(d, "cufile.h") for d in filter(None, [loc.include_dir])]
        return (*headers, "cufile.h"), (*libs, "cufile"), tuple(paths + [loc.library_dir or ""])

    def syntax_check_command(self, extra_include_dirs: Sequence[str] = ()) -> list[str]:
        """argv that compiles every gds source with ``-fsyntax-only`` against torch's headers, the CUDA
        headers and cufile.h. Works with a CPU-only torch: it needs headers, not a CUDA build."""
        import shlex

        from torch.utils.cpp_extension import include_paths as torch_includes

        cxx = shlex.split(os.environ.get("CXX", "").strip() or "c++")
        home = probe.cuda_home() or ("/usr/local/cuda" if Path("/usr/local/cuda").is_dir() else None)
        dirs = [str(self.src_path(p)) for p in ("csrc/aio", "csrc/gds")]
        dirs += [*map(str, extra_include_dirs)]
        loc = self._cufile()
        if loc.include_dir:
            dirs.append(loc.include_dir)
        system = [*torch_includes(), sysconfig.get_paths()["include"]]
        if home:
            system.append(os.path.join(home, "include"))
        defines = [a for a in self.cxx_args() if a.startswith("-D")]
        flags = [a for a in self.cxx_args() if not a.startswith(("-D", "-march", "-mcpu"))]
        return [shutil.which(cxx[0]) or cxx[0], *cxx[1:], "-fsyntax-only", "-std=c++20", *flags, *defines,
                f"-DTORCH_EXTENSION_NAME={self.name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                *(f"-I{d}" for d in dict.fromkeys(dirs)), *(f"-isystem{d}" for d in dict.fromkeys(system)),
                *(str(self.src_path(s)) for s in self.sources())]
