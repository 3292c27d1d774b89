"""``python3 -m deepnvme.moe.recipe``: train the recipe's GPT (see :mod:`deepnvme.moe.recipe.cli`)."""

import sys

from deepnvme.moe.recipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
