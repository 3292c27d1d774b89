"""ds_report's gathering: the environment, the op table, the probes and the engine verdict (no output)."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deepnvme._version import __version__
from op_builder import engines as catalogue
from op_builder.cuda import cuda_home, nvcc_version
from op_builder.prebuilt import installed_record, torch_mismatch

from .checks import (
    SHM_WANTED,
    check_memlock,
    check_moe_experts,
    check_o_direct,
    check_plain_tensors,
    shm_size,
)
from .model import Finding, OpRow, Report

__all__ = ["engines_finding", "gather", "gather_environment", "gather_ops", "gather_probes"]


def _capture(argv: Sequence[str], timeout: float = 5.0) -> str | None:
    """Run a short command and return its stdout, or None when it is missing, fails or hangs."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _from_probe(key: str, label: str, cap: Any) -> Finding:
    """Turn an op_builder.probe.Capability into a Finding, tolerating missing fields from older probes."""
    return Finding(
        key=key,
        label=label,
        ok=bool(getattr(cap, "ok", False)),
        detail=str(getattr(cap, "detail", "") or ""),
        reason=str(getattr(cap, "reason", "") or ""),
        fix=str(getattr(cap, "fix", "") or ""),
    )


def _run_probe(key: str, label: str, func: Callable[[], Any]) -> Finding:
    """Call one probe; a probe that raises is itself a finding, not a crash of the whole report."""
    try:
        return _from_probe(key, label, func())
    except Exception as exc:  # noqa: BLE001 - any probe failure must still leave a readable report
        return Finding(
            key,
            label,
            False,
            "probe failed",
            f"{type(exc).__name__}: {exc}",
            "report this as a deepnvme bug, with the output of deepnvme report --json",
        )



# ----------------------------------------------------------------------------------------------------
# Environment (no `import torch`: reading torch's metadata is much faster and enough for the report)


def _torch_info() -> dict[str, Any]:
    """Torch's install path, version and CUDA version, without importing torch unless it already is."""
    mod = sys.modules.get("torch")
    if mod is not None and hasattr(mod, "version"):
        return {"path": list(mod.__path__), "version": mod.__version__, "cuda": mod.version.cuda}
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {"path": None, "version": None, "cuda": None}
    paths = list(spec.submodule_search_locations)
    info: dict[str, Any] = {"path": paths, "version": None, "cuda": None}
    # torch/version.py is generated as plain constant assignments; read them without executing anything.
    try:
        tree = ast.parse(Path(paths[0], "version.py").read_text())
        for node in tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
            value = getattr(node, "value", None)
            if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
                if target.id == "__version__":
                    info["version"] = value.value
                elif target.id == "cuda":
                    info["cuda"] = value.value
    except (OSError, SyntaxError):
        pass
    if info["version"] is None:
        try:
            info["version"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            pass
    return info



def _git_describe(pkg_dir: Path) -> tuple[str, str]:
    """(short hash, branch) when deepnvme runs from a git checkout; ('unknown', 'unknown') otherwise."""
    root = pkg_dir.parent
    if not (root / ".git").exists():
        return "unknown", "unknown"
    sha = _capture(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], timeout=2)
    branch = _capture(["git", "-C", str(root), "rev-parse", "--abbrev-ref", "HEAD"], timeout=2)
    return (sha or "unknown").strip(), (branch or "unknown").strip()


def _major_minor(version: str | None) -> str | None:
    """'2.13.0+cpu' -> '2.13'; prebuilt ops are tied to torch's major.minor ABI."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{match.group(1)}.{match.group(2)}" if match else None


def gather_environment(torch: dict[str, Any], torch_built: dict[str, Any] | None) -> dict[str, Any]:
    """The general environment block, in DeepSpeed's order, keyed for JSON."""
    pkg_dir = Path(__file__).resolve().parents[2]  # deepnvme/ (this file is deepnvme/tools/report/)
    sha, branch = _git_describe(pkg_dir)
    env: dict[str, Any] = {
        "torch_install_path": torch["path"],
        "torch_version": torch["version"],
        "deepnvme_install_path": [str(pkg_dir)],
        "deepnvme_info": f"{__version__}, {sha}, {branch}",
    }
    if torch["cuda"]:
        env["torch_cuda_version"] = torch["cuda"]
    home = cuda_home()  # op_builder's lookup, the one its CUDA probe and the gds build use
    nvcc = nvcc_version(home) if home else ""
    if nvcc:
        env["nvcc_version"] = nvcc
    elif torch["cuda"]:
        env["nvcc_version"] = None
    if torch_built and torch_built.get("version"):
        built = f"torch {_major_minor(str(torch_built['version'])) or torch_built['version']}"
        cuda_built = torch_built.get("cuda_version")
        if cuda_built and str(cuda_built) not in ("0.0", "None"):
            built += f", cuda {cuda_built}"
        env["deepnvme_wheel_compiled_w"] = built
    else:
        env["deepnvme_wheel_compiled_w"] = None
    shm_text, shm_bytes = shm_size()
    env["shm_size"] = shm_text
    env["shm_size_bytes"] = shm_bytes
    return env


# Text labels for the environment keys, in display order; JSON keeps the snake_case keys.

# ----------------------------------------------------------------------------------------------------
# Ops and probes


def _op_reason(builder: Any) -> str:
    """The builder's own account of why it is not compatible, wherever this op_builder keeps it."""
    for attr in ("incompatible_reason", "error_log", "reason"):
        value = getattr(builder, attr, None)
        if callable(value):
            try:
                value = value()
            except Exception:  # noqa: BLE001 - a reason we cannot read is simply absent
                value = None
        if value:
            return str(value).strip()
    return ""


def gather_ops(
    all_ops: dict[str, Any],
    installed: dict[str, Any],
    torch: dict[str, Any],
    torch_built: dict[str, Any] | None,
) -> list[OpRow]:
    """One row per registered op: prebuilt for this torch?, compatible for a JIT build?, and why not."""
    rows = []
    mismatch = torch_mismatch(torch_built, torch["version"], torch["cuda"])
    for name, builder in all_ops.items():
        reason = ""
        try:
            compatible = bool(builder.is_compatible(verbose=False))
        except Exception as exc:  # noqa: BLE001 - a plugin's broken probe shows as [NO], not a traceback
            compatible, reason = False, f"is_compatible raised {type(exc).__name__}: {exc}"
        if not compatible and not reason:
            reason = _op_reason(builder) or "not compatible (the builder gave no reason)"
        is_installed = bool(installed.get(name))
        if is_installed and mismatch:
            # The rule OpBuilder.load() applies: a prebuilt op for another torch/CUDA is JIT-built instead.
            is_installed = False
            reason = "; ".join(filter(None, [f"{mismatch}: load() JIT compiles instead", reason]))
        rows.append(OpRow(name, is_installed, compatible, reason))
    return rows


def _engine_probe_specs() -> list[tuple[str, str, str]]:
    """(key, label, op_builder.probe function) of every engine library and run-time probe, library order
    as ds_report has always shown them (libaio, liburing, io_uring runtime)."""
    libs = sorted((e for e in catalogue.ENGINES if e.needs_library), key=lambda e: e.probe)
    specs = [(e.probe, e.probe, e.probe) for e in libs]
    specs += [(e.runtime_probe, f"{e.name} runtime", e.runtime_probe) for e in libs if e.runtime_probe]
    return specs


def gather_probes() -> tuple[dict[str, Finding], str | None]:
    """Run op_builder's probes concurrently (compile-and-link checks); error text if op_builder is absent."""
    specs = [("compiler", "compiler", "compiler"), ("ninja", "ninja", "ninja"), *_engine_probe_specs(),
             ("cuda", "CUDA", "cuda"), ("cufile", "cuFile (GDS)", "cufile")]
    try:
        probe = importlib.import_module("op_builder.probe")
    except Exception as exc:  # noqa: BLE001 - the report must still explain a broken install
        why = f"op_builder.probe cannot be imported: {type(exc).__name__}: {exc}"
        fix = "reinstall deepnvme (pip install .) so that op_builder is importable"
        return {key: Finding(key, label, False, "unknown", why, fix) for key, label, _ in specs}, why

    def one(spec: tuple[str, str, str]) -> Finding:
        key, label, func = spec
        return _run_probe(key, label, getattr(probe, func))

    # Probes spend their time in the compiler, so threads overlap them; each is cached for the op table after.
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        found = list(pool.map(one, specs))
    return {f.key: f for f in found}, None


def _engine_verdict(engine: catalogue.Engine, probes: dict[str, Finding]) -> tuple[bool, str, str]:
    """(usable, why not, fix) for one engine from its library probe and run-time probe, if it has them."""
    if not engine.needs_library:
        return True, "", ""
    lib = probes[engine.probe]
    if not lib.ok:
        return False, lib.reason or "unavailable", lib.fix
    runtime = probes.get(engine.runtime_probe) if engine.runtime_probe else None
    if runtime is not None and not runtime.ok:
        return False, runtime.reason or "unavailable", runtime.fix
    return True, "", ""


def engines_finding(usable: bool, probes: dict[str, Finding], async_reason: str) -> tuple[Finding, list[str]]:
    """Which async_io engines this machine will run (from the engine catalogue); posix threads needs only
    the op itself."""
    key, label = "async_io_engines", "async_io engines"
    if not usable:
        return Finding(
            key,
            label,
            False,
            "none: async_io can neither be loaded prebuilt nor JIT compiled",
            async_reason or "async_io is not compatible",
            probes["compiler"].fix or probes["ninja"].fix or "install a C++ compiler and ninja",
        ), []
    engines, shown, missing, fixes = [], [], [], []
    for engine in catalogue.real_engines():
        ok, why, fix = _engine_verdict(engine, probes)
        if ok:
            engines.append(engine.name)
            shown.append(engine.name if engine.needs_library else f"{engine.name} threads")
        else:
            missing.append(f"{engine.name} ({why})")
            fixes.append(fix)
    detail = ", ".join(shown) + f"; auto picks {engines[0]}"
    if not missing:
        return Finding(key, label, True, detail), engines
    reason = "missing " + "; ".join(missing)
    if len(engines) == 1:
        reason += (
            "; async_io still works through its posix thread engine (pread/pwrite on worker threads), "
            "slower than a kernel queue"
        )
    return Finding(key, label, True, detail, reason, "; ".join(filter(None, fixes))), engines


def gather(directory: str) -> Report:
    """Collect the whole report; runs probes (compile checks) but never compiles an op."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        probes_job = pool.submit(gather_probes)
        o_direct = check_o_direct(directory)
        torch = _torch_info()
        installed, torch_built = installed_record()
        environment = gather_environment(torch, torch_built)
        probes, import_error = probes_job.result()

    rows: list[OpRow] = []
    if import_error is None:
        try:
            all_ops = dict(importlib.import_module("op_builder").ALL_OPS)
        except Exception as exc:  # noqa: BLE001 - a broken plugin entry point must not hide the rest
            import_error = f"op_builder.ALL_OPS failed: {type(exc).__name__}: {exc}"
            all_ops = {}
        rows = gather_ops(all_ops, installed, torch, torch_built)
    aio = next((r for r in rows if r.name == "async_io"), None)
    usable = aio is not None and (aio.installed or aio.compatible)
    aio_reason = import_error or (aio.reason if aio else "async_io is not registered in op_builder.ALL_OPS")
    engines, engine_list = engines_finding(usable, probes, aio_reason)

    capabilities = [
        probes["compiler"],
        probes["ninja"],
        *(probes[key] for key, _, _ in _engine_probe_specs()),
        o_direct,
        check_memlock(),
        check_plain_tensors(),
        check_moe_experts(),
        probes["cuda"],
        probes["cufile"],
        engines,
    ]
    env_warnings = []
    if environment["shm_size_bytes"] is not None and environment["shm_size_bytes"] < SHM_WANTED:
        env_warnings.append(
            "/dev/shm is smaller than 512 MB; in Docker start the container with --shm-size=1g"
        )
    return Report(
        ninja=probes["ninja"],
        ops=rows,
        environment=environment,
        env_warnings=env_warnings,
        capabilities=capabilities,
        async_io_usable=usable,
        engines=engine_list,
    )
