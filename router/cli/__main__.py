"""``python -m router.cli``: the ``kvgrid`` command."""

import sys

from router.cli import main

sys.exit(main())
