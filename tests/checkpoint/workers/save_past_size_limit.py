"""Save small checkpoints, then set a file-size limit (RLIMIT_FSIZE) and try large saves past it.

python save_past_size_limit.py FOLDER LIMIT_BYTES

Prints ``refused: <message>`` for each large save refused (a Checkpointer step, a safetensors file,
a torch file); the test checks the messages and that the small checkpoints are whole. The limit is
set here, in a process of its own, so the test process never runs under it.
"""

from __future__ import annotations

import resource
import signal
import sys
from pathlib import Path

from torch import nn

import multigpu.checkpoint as ckpt
from multigpu.errors import CheckpointError


def main(folder: Path, limit: int) -> None:
    checkpointer = ckpt.Checkpointer(folder=folder, keep_last=2)
    small = nn.Linear(512, 512)  # 1 MiB
    small.weight.data.fill_(1.0)
    checkpointer.save(step=1, model=small)
    ckpt.save(small, folder / "weights.safetensors")
    ckpt.save(small, folder / "weights.pt")
    # Writes past the limit fail with EFBIG once SIGXFSZ (which would kill us) is ignored.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    big = nn.Linear(512, 4096)  # 8 MiB
    for save in (
        lambda: checkpointer.save(step=2, model=big),
        lambda: ckpt.save(big, folder / "weights.safetensors"),
        lambda: ckpt.save(big, folder / "weights.pt"),
    ):
        try:
            save()
            print("saved", flush=True)
        except CheckpointError as exc:
            print(f"refused: {exc}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
