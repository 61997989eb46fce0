"""``python -m alignopsd.engine <command> ...`` is the ``alignopsd`` console command."""

import sys

from alignopsd.engine.commands.cli import main

sys.exit(main())
