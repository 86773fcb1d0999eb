"""``python -m multigpu`` is the ``multigpu`` command."""

import sys

from multigpu.cli.main import main

sys.exit(main())
