"""The worker entry point ``multigpu launch`` runs each ddp process through: the user's script, recorded.

``python -m multigpu.distributed._entry script.py [args]`` runs ``script.py`` as ``__main__``
(as ``python script.py [args]`` would: same ``sys.argv``, its folder first on ``sys.path``)
inside torch elastic's ``@record``, which writes an uncaught exception to the error file the
agent reads, and records the failure for the launcher (:mod:`multigpu.distributed.records`; a
Session records it earlier, before its process group closes). The launcher's failure summary then shows the failing rank and its traceback without
the user decorating anything. When the launcher asks for it, the process first binds to its share
of the node's cores (:mod:`multigpu.distributed.affinity`), before the script starts any thread.
"""

from __future__ import annotations

import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from multigpu.distributed import records, runtime
from multigpu.distributed.affinity import bind_to_core_share


@record
def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m multigpu.distributed._entry script.py [args]")
    script = sys.argv[1]
    env = runtime.read_launch_env()
    if env is not None and runtime.bind_cores_requested():
        bind_to_core_share(env.local_rank, env.local_world_size)
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            records.record(exc)
        raise
    except BaseException as exc:
        records.record(exc)  # a no-op when the Session already recorded it before closing its group
        raise


if __name__ == "__main__":
    main()
