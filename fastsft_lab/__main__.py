"""``python -m fastsft_lab ...`` -> fastsft_lab.lab.cli."""

import sys

from .lab.cli import main

sys.exit(main())
