"""``python -m torchfix`` is the ``torchfix`` command."""

import sys

from .cli import main

sys.exit(main())
