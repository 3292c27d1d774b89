"""The child process of the checkpoint fuzz test: loads each file it is sent with stock torch (or DCP's
FileSystemReader) and with deepnvme, and reports both outcomes as one JSON line per request.

It runs apart so that a crash is seen as a crash and not as the test process dying, and under an address
space limit (RLIMIT_AS) a little above what it holds after start-up: a load that allocates far beyond the
file's size fails with MemoryError, which the test reports, instead of exhausting the machine.
"""

from __future__ import annotations

import hashlib
import io
import json
import resource
import sys
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

import deepnvme
from deepnvme.checkpoint import AioStorageReader

HEADROOM = 1 << 30  # bytes of address space a load may add: far above any fuzzed file's few hundred KiB


def describe(obj: Any, storages: dict[int, int]) -> Any:
    """A JSON description of a loaded object: tensors by dtype, shape, stride, offset, bytes and which
    storage (in order of first appearance) they live in, so that shared storage is compared too."""
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        address = storage.data_ptr() if storage.nbytes() else -len(storages) - 1  # empty ones share nothing
        key = storages.setdefault(address, len(storages))
        data = bytes(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())
        return ["tensor", str(obj.dtype), list(obj.shape), list(obj.stride()), obj.storage_offset(), key,
                hashlib.sha1(data).hexdigest()]
    if isinstance(obj, dict):
        return ["dict", [[repr(k), describe(v, storages)] for k, v in obj.items()]]
    if isinstance(obj, (list, tuple)):
        return [type(obj).__name__, [describe(v, storages) for v in obj]]
    if isinstance(obj, io.BytesIO):
        return ["bytes", obj.getvalue().hex()]
    return ["value", repr(obj)]


def outcome(call: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        return {"ok": describe(call(*args, **kwargs), {})}
    except CheckpointException as exc:  # DCP wraps each rank's error: report the rank's own
        inner = next(iter(exc.failures.values()))[0]
        return error(inner)
    except Exception as exc:  # noqa: BLE001 - every outcome is reported, the test judges it
        return error(exc)


def error(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "errno": getattr(exc, "errno", None), "filename": getattr(exc, "filename", None),
            "text": str(exc)[:500]}


def blank(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros(state.shape, dtype=state.dtype)
    if isinstance(state, dict):
        return {k: blank(v) for k, v in state.items()}
    if isinstance(state, io.BytesIO):
        return io.BytesIO()
    return state


def load_dcp(directory: str, reader: Any, template: Any) -> Any:
    if reader is AioStorageReader:
        reader(directory).read_metadata()  # its own errors unwrapped (DCP's load restates them as text)
    out = blank(template)
    dcp.load(out, storage_reader=reader(directory), no_dist=True)
    return out


def main() -> None:
    warnings.simplefilter("ignore")
    template = torch.load(sys.argv[1], weights_only=False) if len(sys.argv) > 1 else None
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, resource.RLIM_INFINITY))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        path = request["path"]
        if request["kind"] == "zip":
            stock = outcome(torch.load, path, weights_only=True)
            ours = outcome(deepnvme.load, path)
            unchecked = outcome(deepnvme.load, path, map_location="cpu", verify=False)
            print(json.dumps({"stock": stock, "ours": [ours, unchecked]}), flush=True)
        else:
            stock = outcome(load_dcp, path, FileSystemReader, template)
            ours = outcome(load_dcp, path, AioStorageReader, template)
            print(json.dumps({"stock": stock, "ours": [ours]}), flush=True)


if __name__ == "__main__":
    main()
