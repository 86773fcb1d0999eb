"""Save a first checkpoint, say so on stdout, then start a second, large save (the test kills us in it).

python save_until_killed.py {weights|state} FOLDER
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import multigpu.checkpoint as ckpt


def main(mode: str, folder: Path) -> None:
    model = nn.Linear(4096, 4096)  # 64 MiB of weights: the second save takes long enough to be caught
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(1.0)
    checkpointer = ckpt.Checkpointer(folder=folder, keep_last=2)
    save = (
        (lambda step: ckpt.save(model, folder / "model.safetensors"))
        if mode == "weights"
        else (lambda step: checkpointer.save(step=step, model=model))
    )
    save(1)
    print("saved 1", flush=True)
    with torch.no_grad():
        model.weight.fill_(2.0)
    save(2)
    print("saved 2", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
