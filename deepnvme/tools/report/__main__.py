"""``python -m deepnvme.tools.report``."""

import sys

from deepnvme.tools.report import main

sys.exit(main())
