"""Moved to :mod:`deepnvme.tools.sizes` (a tools helper); this name keeps old imports working."""

import sys

from deepnvme.tools import sizes as _moved

sys.modules[__name__] = _moved  # one module object under both names (attributes, monkeypatching)
