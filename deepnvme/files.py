"""Deprecated: ``deepnvme.files`` is now :mod:`deepnvme.filesystem` (``fsync_path``, ``mount_of``).

Kept importable for one release. Its third name, ``SeekableReader``, was the library's own stream for torch's
zip reader and now lives in the private core (``deepnvme._core.files``); it is re-exported here only for
code that imported it from this path.
"""

from __future__ import annotations

import warnings

from deepnvme._core.files import SeekableReader
from deepnvme.filesystem import fsync_path, mount_of

__all__ = ["SeekableReader", "fsync_path", "mount_of"]

warnings.warn("deepnvme.files is deprecated: import fsync_path and mount_of from deepnvme.filesystem",
              DeprecationWarning, stacklevel=2)
