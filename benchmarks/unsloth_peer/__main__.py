"""``python -m benchmarks.unsloth_peer {export,run,error-json,summary} ...`` (see cli.py)."""

import sys

from .cli import main

sys.exit(main())
