"""deepnvme's own weight store, the format: one aligned, contiguous blob per unit in one file, and a JSON
manifest. Read by own_read.py, written by own_write.py; the constants both sides must agree on live here.

Why a store of its own when safetensors checkpoints can be read in place: there a unit's tensors may be
spread over shards and lie at unaligned offsets, so a unit takes several requests with partial pages at
their edges; here a unit is one page-aligned request, and every blob and tensor carries a CRC-32
(deepnvme._core.crc) checked as it is read, so a damaged or replaced file is an error, not wrong output.

Layout of a store directory: `manifest.json` and `weights-<id>.bin`. In the file, each unit's tensors are
back to back (each at a multiple of 64 bytes) in one blob that starts at a page boundary; tensors outside
every unit form one more blob (unit ""). Tensors that are one tensor under several names (tied weights)
are written once and listed under each name. The manifest is replaced last and atomically
(deepnvme._core.files), after the weights file is complete and synced, so a store is either the old one
or the new one; the old weights file is then removed.
"""

from __future__ import annotations

import torch

MANIFEST = "manifest.json"
FORMAT = "deepnvme-weights"
VERSION = 1
TENSOR_ALIGN = 64
# The dtypes a manifest may name, by their name in it (torch's, without "torch."); the float8 and float4
# kinds of newer torch versions (which safetensors holds too) where this torch has them.
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn,
    torch.float8_e5m2, torch.complex64, torch.complex128,
    *(getattr(torch, n) for n in ("float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
      if hasattr(torch, n)))}


def dtype_name(dtype: torch.dtype) -> str:
    """The name a manifest gives `dtype` (a key of DTYPES); TypeError for a dtype a store cannot keep (it
    could not be read back), before anything is written."""
    name = str(dtype).removeprefix("torch.")
    if DTYPES.get(name) is not dtype:
        raise TypeError(f"dtype {dtype} cannot be kept in a deepnvme store; it keeps {sorted(DTYPES)}")
    return name
