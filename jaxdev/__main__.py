"""``python -m jaxdev``: the ``jaxdev`` command without the installed script.

``python -m jaxdev info``, ``python -m jaxdev launch -n 2 -- python train.py``
and every other subcommand behave as ``jaxdev ...`` does (see
:func:`jaxdev.cli._cli.main`).
"""

import sys

from .cli._cli import main

if __name__ == "__main__":
    sys.exit(main())
