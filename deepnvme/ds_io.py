"""Moved to :mod:`deepnvme.tools.ds_io`; kept so that old imports and ``python -m deepnvme.ds_io`` work."""

import sys

from deepnvme.tools import ds_io as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
elif __name__.startswith("deepnvme."):
    sys.modules[__name__] = _moved  # one module object under both names (attributes, monkeypatching)
