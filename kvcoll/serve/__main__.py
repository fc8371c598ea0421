"""python -m kvcoll.serve DIR: see kvcoll.serve.cli."""

import sys

from .cli import main

sys.exit(main())
