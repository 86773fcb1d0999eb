"""The worker entry point ``multigpu launch`` runs each ddp process through: the user's script, recorded.

``python -m multigpu.distributed._entry script.py [args]`` runs ``script.py`` as ``__main__``
(as ``python script.py [args]`` would: same ``sys.argv``, its folder first on ``sys.path``)
inside torch elastic's ``@record``, which writes an uncaught exception to the error file the
agent reads. The launcher's failure summary then shows the failing rank and its traceback without
the user decorating anything.
"""

from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m multigpu.distributed._entry script.py [args]")
    script = sys.argv[1]
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
