"""``python -m jaxdev ...``: the ``jaxdev`` command (every subcommand) without its script."""

import sys

from .cli._cli import main

if __name__ == "__main__":
    sys.exit(main())
