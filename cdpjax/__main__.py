"""`python -m cdpjax ...`: the `cdpjax` command, for where the console script is not on PATH
(a notebook's `!python -m cdpjax train ...`, a venv not activated)."""
import sys

from cdpjax.cli import main

if __name__ == "__main__":
    sys.exit(main())
