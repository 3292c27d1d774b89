"""``python -m deepnvme SUBCOMMAND``: the ``deepnvme`` command (see :mod:`deepnvme.tools.command`)."""

import sys

# Guarded: ds_io's spawned worker processes import this file as __mp_main__ and must not run a command again.
if __name__ == "__main__":
    from deepnvme.tools.command import main

    sys.exit(main())
