"""One script run both as plain ddp (2N processes) and as 2 fault-tolerant replica groups of N processes, for
tests/launcher/test_fault_tolerant_step_cases.py: the groups' weights after each step must be plain ddp's ranks'.

    multigpu launch --strategy ddp [--fault-tolerant --replicas 2] --nproc-per-node N \
        tests/launcher/ft_step_cases_worker.py OUT_DIR CASE STEPS

CASE (comma-separated flags):
- ``unused``: the first half of the processes (ddp ranks, or the first group's) uses one branch of the model,
  the second half the other (``find_unused_parameters``): a parameter has a gradient in one group only;
- ``keep_grads``: ``zero_grad(set_to_none=False)`` between steps;
- ``accumulate``: 3 micro-steps a step;
- ``frozen``: the first layer's weight does not require a gradient;
- ``fp16_hook``: the script's own DDP comm hook (``DDPOptions(comm_hook="fp16")``);
- ``small``: DDP buckets of about 100 bytes (one per parameter or two);
- ``odd``: a global batch of 10 (5 a replica) and a dataset of 53 samples (a short last batch).

Writes ``OUT_DIR/replica<i>.jsonl`` (``i``: the process among every group's): one line per ``session.step``: committed, global_step, the weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from multigpu.session import Session
from multigpu.strategies import DDPOptions


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.branches = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])
        self.which: int | None = None  # the branch this replica takes (None: both)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        taken = self.branches if self.which is None else [self.branches[self.which]]
        return sum(branch(h) for branch in taken)  # type: ignore[return-value]


def main() -> None:
    out, case, total = Path(sys.argv[1]), set(sys.argv[2].split(",")), int(sys.argv[3])
    torch.manual_seed(0)
    n = 53 if "odd" in case else 96
    data = torch.utils.data.TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
    accumulate = 3 if "accumulate" in case else 1
    hook = "fp16" if "fp16_hook" in case else None
    ddp = DDPOptions(
        find_unused_parameters="unused" in case, comm_hook=hook, bucket_cap_mb=1e-4 if "small" in case else 25.0
    )
    with Session(strategy="ddp", ddp=ddp, accumulate=accumulate) as session:
        torch.manual_seed(1)
        net = TwoBranches()
        if "frozen" in case:
            net.trunk.weight.requires_grad_(False)
        shard = session._data_shard()  # this process among every group's (ddp: its rank)
        replica = shard.rank
        net.which = 2 * shard.rank // shard.world_size if "unused" in case else None  # by halves of the processes
        model = session.setup_model(net)
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        loader = session.build_loader(data, batch_size=10 if "odd" in case else 16)  # the global batch
        with (out / f"replica{replica}.jsonl").open("a") as log:
            while session.global_step < total:
                for x, y in session.batches(loader):
                    with session.micro_step(model):
                        session.backward(nn.functional.mse_loss(model(x), y))
                    committed = session.step(optimizer)
                    if "keep_grads" in case:
                        optimizer.zero_grad(set_to_none=False)
                    weights = [float(v) for v in nn.utils.parameters_to_vector(model.parameters()).detach()]
                    record = {"committed": committed, "global_step": session.global_step, "weights": weights}
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                    if session.global_step >= total:
                        break


if __name__ == "__main__":
    main()
