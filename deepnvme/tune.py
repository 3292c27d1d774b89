"""Moved to :mod:`deepnvme.tools.tune`; kept so that old imports and ``python -m deepnvme.tune`` work."""

import sys

from deepnvme.tools import tune as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
elif __name__.startswith("deepnvme."):
    sys.modules[__name__] = _moved  # one module object under both names (attributes, monkeypatching)
