"""``python -m fastsft_lab ...`` -> fastsft_lab.cli."""

import sys

from .cli import main

sys.exit(main())
