"""Names that moved keep working: deepnvme.files (now deepnvme.filesystem) warns and still gives its names,
deepnvme.serialization and deepnvme.checkpoint (now packages) give every name users, bench and tests import,
and a save or load switch set on deepnvme.serialization reaches the module that reads it."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import deepnvme
from deepnvme import filesystem, serialization
from deepnvme._core import archive_writer, saving
from deepnvme.serialization import archive_reader, prefetch


def test_the_old_files_module_warns_naming_the_new_one_and_gives_its_names() -> None:
    sys.modules.pop("deepnvme.files", None)
    try:
        with pytest.warns(DeprecationWarning, match=r"deepnvme\.filesystem"):
            old = importlib.import_module("deepnvme.files")
    finally:
        sys.modules.pop("deepnvme.files", None)
    from deepnvme._core.files import SeekableReader

    assert (old.fsync_path, old.mount_of, old.SeekableReader) == (filesystem.fsync_path, filesystem.mount_of,
                                                                 SeekableReader)


def test_the_library_imports_no_deprecated_path() -> None:
    """Importing the public modules, deepnvme's deprecation warnings as errors, in a fresh interpreter; save
    and load's package still imports no torch."""
    code = ("import warnings; warnings.filterwarnings('error', 'deepnvme', DeprecationWarning)\n"
            "import sys, deepnvme, deepnvme.serialization, deepnvme.filesystem\n"
            "assert 'torch' not in sys.modules, 'importing save/load imported torch'\n"
            "import deepnvme.io, deepnvme.defaults, deepnvme.checkpoint, deepnvme.moe.routing\n"
            "import deepnvme.tools.cli, deepnvme.tools.report.checks, deepnvme.tools.pagecache\n"
            "import deepnvme.tools.demo\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serialization_and_checkpoint_keep_their_names() -> None:
    from deepnvme.checkpoint import (  # noqa: F401
        ALIGNMENT,
        INLINE_BELOW,
        AioStorageReader,
        AioStorageWriter,
        checkpoint_files,
    )
    from deepnvme.serialization import STAGING_BYTES, TEMP_SUFFIX, CheckpointFormatError, load, save

    face = (deepnvme.save, deepnvme.load, deepnvme.CheckpointFormatError)
    assert face == (save, load, CheckpointFormatError)
    assert callable(save) and callable(load)  # the functions, not the modules saving/loading
    assert (STAGING_BYTES, TEMP_SUFFIX) == (saving.STAGING_BYTES, ".deepnvme-tmp")
    with pytest.raises(AttributeError, match="NO_SUCH_KNOB"):
        serialization.NO_SUCH_KNOB  # noqa: B018


@pytest.mark.parametrize(("name", "owner"), [("FILL_FRESH", prefetch), ("STAGE_PAYLOADS", prefetch),
                                             ("BATCH_BYTES", prefetch), ("STAGING_BYTES", saving),
                                             ("READ_CHUNK_BYTES", archive_reader),
                                             ("STORAGE_ALIGNMENT", archive_writer)])
def test_a_switch_set_on_serialization_is_set_where_it_is_read(monkeypatch: pytest.MonkeyPatch, name: str,
                                                               owner: object) -> None:
    before = getattr(owner, name)
    assert getattr(serialization, name) == before and name in dir(serialization)
    changed = not before if isinstance(before, bool) else before * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        setattr(serialization, name, changed)  # as the README says: serialization.FILL_FRESH = False
    try:
        assert getattr(owner, name) == changed and getattr(serialization, name) == changed
        assert name not in vars(serialization)  # no copy that could go stale
        monkeypatch.setattr(serialization, name, before)  # as the tests and bench set them
        assert getattr(owner, name) == before
    finally:
        monkeypatch.undo()  # its undo would set back the value it found, the changed one
        setattr(owner, name, before)
