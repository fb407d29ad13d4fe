"""``python -m bench.scheduling``: see :mod:`bench.scheduling`."""

import sys

from bench.scheduling import main

sys.exit(main())
