"""Moved to :mod:`deepnvme.tools.report`; kept so that old imports and ``python -m deepnvme.report`` work."""

import sys

from deepnvme.tools import report as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
elif __name__.startswith("deepnvme."):
    sys.modules[__name__] = _moved  # one module object under both names (attributes, monkeypatching)
