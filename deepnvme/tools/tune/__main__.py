"""``python -m deepnvme.tools.tune``."""

import sys

from deepnvme.tools.tune import main

sys.exit(main())
