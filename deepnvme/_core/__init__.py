"""deepnvme's private core: what the public modules (serialization, io, checkpoint, moe, offload) stand on.
Nothing here is public API. Used, never re-written: a public module that needs one of these facts imports it
from here.

- :mod:`.op`         the one door to the compiled ops (``aio_module()``, ``pin_memory_module()``,
                     ``moe_module()``), straight from op_builder
- :mod:`.aio_types`  typed Protocols of that op's module and its ``aio_handle``, for type checkers
- :mod:`.handles`    aio_handle settings: the recommended ones, their limits and their one check; new
                     handles and each thread's default handle
- :mod:`.memory`     the page size, page-aligned buffers, raw views of tensor memory
- :mod:`.direct`     the O_DIRECT writer (whole pages through a handle, partial pages buffered), its
                     openers and the one answer to "did the file system refuse O_DIRECT?"
- :mod:`.files`      atomic replace (op_builder.atomic_file's recipe, re-exported: the library's one door
                     to it, plus the rule that errors name the caller's path), opening regular files
                     only, and the seekable read-only stream torch's zip reader is handed
- :mod:`.zipformat`  the zip layout of torch's archives, read and written in one place
- :mod:`.saving`     ``deepnvme.save`` itself (deepnvme.serialization is its face): the temporary, the
                     handle, the atomic replace; here because offload writes torch-format files too
- :mod:`.archive_writer`  the stream torch.save writes into, with its CRC-32s
- :mod:`.interrupts` Ctrl-C inside torch's callbacks, found again under the error torch wraps it in
- :mod:`.errors`     the checkpoint format error and the "with path" wrapping of OSError
- :mod:`.crc`        zip's CRC-32 at the fastest speed this machine offers
- :mod:`.checks`     argument checks: TypeError for a wrong type, ValueError for a wrong value, both naming
                     the argument

Nothing here imports torch at import time, and nothing here imports a public deepnvme module: the doors
point one way, public modules -> ``_core`` -> ``op_builder``, and public modules reach ``op_builder`` only
through here (the package face's lazy builders and ``deepnvme.defaults`` excepted;
tests/layout/test_import_graph.py holds it).
"""
