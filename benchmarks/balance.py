"""Primary-device imbalance: standard DataParallel vs the balanced configuration.

    python benchmarks/balance.py [--steps 5] [--rounds 3]

A small language model whose output is large next to its activations (vocabulary 8,192,
sequence 64, global batch 32) on "cpu:2", trained with Adam:

* standard: nn.DataParallel semantics: outputs gathered on the primary, the loss computed there;
* balanced: ``loss_fn=`` (each replica computes its chunk's loss, only scalars travel) and
  ``chunk_sizes="auto"`` (chunks that equalise peak memory).

Peak memory per device comes from multigpu's allocation tracker (one step, measured after
warm-up); step time is the median over interleaved rounds. Targets (issue 3): standard
primary/other ratio >= 1.5, balanced <= 1.10, at no more than 5% extra step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

import multigpu
from multigpu.profiling.memory import DeviceMemory, track_memory

VOCAB, SEQ, BATCH, WIDTH = 8192, 64, 32, 128


class SmallLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.zeros(SEQ, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids) + self.pos))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(balanced: bool) -> tuple[Callable[[], None], nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    net = SmallLM()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    ids, labels = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))
    if balanced:
        model = multigpu.DataParallel(net, devices="cpu:2", loss_fn=lm_loss, chunk_sizes="auto")
    else:
        model = multigpu.DataParallel(net, devices="cpu:2")

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss = model(ids, target=labels) if balanced else lm_loss(model(ids), labels)
        loss.backward()
        optimizer.step()

    for _ in range(3):  # warm-up; the balanced run makes its plan here
        step()
    return step, model, optimizer


def measure(balanced: bool, steps: int) -> tuple[list[DeviceMemory], float]:
    step, model, optimizer = build(balanced)
    with track_memory(model, optimizer) as memory:
        step()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return memory.results(), statistics.median(times) * 1e3


def ratio(results: list[DeviceMemory]) -> float:
    return results[0].peak / max(m.peak for m in results[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    args = parser.parse_args()
    console = Console(width=110)
    memory: dict[str, list[DeviceMemory]] = {}
    times: dict[str, list[float]] = {"standard": [], "balanced": []}
    with console.status("measuring"):
        for _ in range(args.rounds):
            for name in times:
                memory[name], ms = measure(name == "balanced", args.steps)
                times[name].append(ms)
    ms = {name: statistics.median(v) for name, v in times.items()}
    table = Table(title=f"Small LM (vocab {VOCAB}, seq {SEQ}, batch {BATCH}) on cpu:2, Adam")
    for col in ("configuration", "cpu:0 peak MiB", "cpu:1 peak MiB", "primary/other", "ms/step", "time vs standard"):
        table.add_column(col, justify="left" if col == "configuration" else "right", no_wrap=True)
    for name, results in memory.items():
        table.add_row(
            name,
            f"{results[0].peak / 2**20:.1f}",
            f"{results[1].peak / 2**20:.1f}",
            f"{ratio(results):.2f}",
            f"{ms[name]:.0f}",
            f"{ms[name] / ms['standard']:.2f}",
        )
    console.print(table)
    console.print(
        f"standard primary/other = {ratio(memory['standard']):.2f} (target >= 1.5); "
        f"balanced = {ratio(memory['balanced']):.2f} (target <= 1.10); "
        f"balanced step time = {ms['balanced'] / ms['standard']:.2f}x standard (target <= 1.05)"
    )


if __name__ == "__main__":
    main()
