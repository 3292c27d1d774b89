"""The module paths deepnvme.offload had before it stood in floors, kept importable for a release.

`import deepnvme.offload.store` (and every other old path in MOVED) still works: the module it gives holds
the public names of the modules that took the old one's content, and importing it warns with a
DeprecationWarning naming the new path. One table here instead of a shim file per old path, so that
deepnvme/offload/ lists the floors only (and `store` never stands beside `stores`). deepnvme.offload.swap
and deepnvme.offload.stores need no entry: they are the swap and stores floors, which export what the old
modules did.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

PACKAGE = "deepnvme.offload"

#: old module (under deepnvme.offload) -> the modules now holding its names, the first one named in the
#: warning; a name is looked up in them in this order.
MOVED: dict[str, tuple[str, ...]] = {
    "bulk": ("infer.load",),
    "closing": ("swap.closing",),
    "expert_cache": ("experts.cache",),
    "expert_sets": ("experts.sets",),
    "expert_stream": ("experts.streamer", "experts.budget", "experts.fused"),
    "model_map": ("model.names", "model.units"),
    "optimizer": ("train.optimizer",),
    "ownstore": ("stores.own_read", "stores.own_format", "stores.own_write", "infer.prepare",
                 "stores.protocol"),
    "placeholder": ("model.placeholder",),
    "pool": ("swap.pool",),
    "preflight": ("swap.preflight",),
    "queues": ("swap.queues",),
    "safetensors_store": ("stores.safetensors_read",),
    "store": ("stores.protocol",),
    "stream": ("infer.weights", "infer.running"),
    "swapdir": ("swap.folders",),
}

#: Names that were private in an old module and that code outside deepnvme used; each now public.
RENAMED: dict[str, dict[str, str]] = {
    "expert_stream": {"_strided": "stack_views", "_Compact": "FewExperts", "_hooked_inside": "hooked_inside"},
    "model_map": {"_conversions": "conversions", "_plain": "plain_pattern", "_tensor_slots": "tensor_slots",
                  "_unit_modules": "unit_modules"},
    "stream": {"_ATTR": "STREAM_ATTR", "_streamer": "streamer_of", "_Streamer": "Streamer"},
}


def _public(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return list(names)


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `deepnvme.offload.<old>` for each old module in MOVED (after the ordinary finders, which find
    the new modules) and makes it: a module of the new modules' public names, plus RENAMED's."""

    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        head, _, old = fullname.rpartition(".")
        if head != PACKAGE or old not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # an ordinary module

    def exec_module(self, module: types.ModuleType) -> None:
        old = module.__name__.rpartition(".")[2]
        targets = [importlib.import_module(f"{PACKAGE}.{m}") for m in MOVED[old]]
        exported: list[str] = []
        for target in reversed(targets):  # the first module's names win
            for name in _public(target):
                setattr(module, name, getattr(target, name))
                exported.append(name)
        for name, new in RENAMED.get(old, {}).items():
            setattr(module, name, next(getattr(t, new) for t in targets if hasattr(t, new)))
        module.__all__ = sorted(set(exported))
        module.__doc__ = f"Deprecated: {module.__name__} moved to {targets[0].__name__}."
        floor = f"{PACKAGE}.{MOVED[old][0].partition('.')[0]}"
        warnings.warn(f"{module.__name__} is deprecated: import from {targets[0].__name__} (or from the "
                      f"floor's face, {floor})", DeprecationWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The stacklevel of the frame that imported the old path: the first one outside the import machinery
    and this file (so that the warning names the importing line, and shows where __main__ imports). The
    frames of importlib._bootstrap are not counted: warnings skips them itself."""
    level, frame = 1, sys._getframe(1)  # exec_module, the caller of warnings.warn

    def skipped_by_warnings(f: types.FrameType) -> bool:
        return "importlib" in f.f_code.co_filename and "_bootstrap" in f.f_code.co_filename

    while frame is not None and (frame.f_globals.get("__name__", "").partition(".")[0] == "importlib"
                                 or frame.f_code.co_filename == __file__):
        frame = frame.f_back
        if frame is not None and not skipped_by_warnings(frame):
            level += 1
    return level


def install() -> None:
    """Put the finder of the old paths at the end of sys.meta_path (once per process)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.append(_OldPaths())


def old_module(name: str) -> types.ModuleType:
    """deepnvme.offload.<name> for an old path read as an attribute of the package (imported, so warned)."""
    return importlib.import_module(f"{PACKAGE}.{name}")
