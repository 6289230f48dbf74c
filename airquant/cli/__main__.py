"""``python -m airquant.cli``."""

import sys

from airquant.cli import main

if __name__ == "__main__":
    sys.exit(main())
