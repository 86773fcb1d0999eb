"""The script a zygote-forked worker runs in tests/launcher/test_fault_tolerant_zygote.py.

    python tests/launcher/zygote_worker.py OUT (exit=N | hold)

Writes ``OUT`` (JSON, whole: written aside, then renamed): its pid, parent, session, ``sys.argv``, ``__name__``,
the variable ``ZYGOTE_TEST_VALUE``, torch's thread count, a draw of Python's and numpy's generators and a helper's pid (``hold``: a child in a process
group of its own inside this session, as a DataLoader worker may make). Then exits with N, or sleeps until
killed (``hold``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.launching import fork_sleeper


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    helper = fork_sleeper(own_group=True) if mode == "hold" else None
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "sid": os.getsid(0),
        "argv": sys.argv,
        "name": __name__,
        "value": os.environ.get("ZYGOTE_TEST_VALUE"),
        "threads": torch.get_num_threads(),
        "draws": [random.random(), float(np.random.random())],
        "helper": helper,
    }
    Path(f"{out}.tmp").write_text(json.dumps(record))
    os.replace(f"{out}.tmp", out)
    if mode == "hold":
        time.sleep(300)
    raise SystemExit(int(mode.removeprefix("exit=")))


if __name__ == "__main__":
    main()
