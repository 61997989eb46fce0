"""``python -m alignopsd.engine <command> ...`` is the ``alignopsd`` console command."""

import sys

from .cli import main

sys.exit(main())
