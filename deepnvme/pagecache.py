"""Moved to :mod:`deepnvme.tools.pagecache` (a tools helper); this name keeps old imports working."""

import sys

from deepnvme.tools import pagecache as _moved

sys.modules[__name__] = _moved  # one module object under both names (attributes, monkeypatching)
