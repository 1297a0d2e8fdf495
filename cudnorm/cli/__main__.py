"""``python -m cudnorm.cli``: the ``cudnorm`` command without the console script."""

import sys

from . import main

sys.exit(main())
