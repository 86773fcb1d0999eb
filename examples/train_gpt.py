"""Train a tiny GPT-2 (built from a config: nothing downloaded) on ragged sequences; the same script under every strategy.

    python examples/train_gpt.py                                              # one device
    multigpu launch --strategy dp --devices cpu:2 examples/train_gpt.py       # threads, one process
    multigpu launch --strategy ddp --nproc-per-node 2 examples/train_gpt.py   # processes, gloo on CPU
    multigpu launch --strategy fsdp --nproc-per-node 2 examples/train_gpt.py  # processes, GPT2Block sharded

What a Hugging Face model brings, in one loop: padded batches of sequences of different lengths, a
causal-LM loss summed over the real tokens with ``session.backward(loss, num_items=tokens)`` (the
step follows the mean over every token of the global batch, as on one device), bf16, accumulate 4,
``GPT2Block`` recomputed in backward (and sharded under fsdp), a ``Checkpointer`` that resumes
exactly (``--ckpt DIR``; ``--stop-after N`` saves at step N and exits, a later run continues) and
evaluation through ``session.gather_for_metrics``. Needs ``pip install transformers``.

Options: --steps (optimizer steps), --precision, --accumulate, --batch-size (the global batch of
sequences), --save-losses out.json (per-step losses and the evaluation, written by the main process).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import multigpu
from multigpu.session import FSDPOptions, Session

VOCAB, PAD, IGNORE = 64, 0, -100


class CountingSequences(Dataset):
    """Sequences of 3-24 tokens that count up from a random start (mod the vocabulary): learnable, ragged."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 25, (count,), generator=generator)
        starts = torch.randint(1, VOCAB, (count,), generator=generator)
        self.items = [1 + (s + torch.arange(n)) % (VOCAB - 1) for s, n in zip(starts.tolist(), lengths.tolist())]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.items[index]


def pad_batch(sequences: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 where padded)."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), PAD)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def build_model() -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=PAD,
        eos_token_id=PAD,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,  # no dropout: every strategy's losses comparable
        use_cache=False,  # training: blocks recomputed in backward must not append to a key/value cache
    )
    torch.manual_seed(0)  # the same initial weights on every rank and strategy
    return GPT2LMHeadModel(config)


def token_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed next-token loss of the batch's real tokens, and their count."""
    output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])  # a ModelOutput
    logits, labels = output.logits[:, :-1].float(), batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return loss, (labels != IGNORE).sum()


def evaluate(session: Session, model: torch.nn.Module, dataset: Dataset) -> float:
    """Next-token accuracy over every token of ``dataset`` once, whatever the strategy."""
    loader = session.setup_dataloader(DataLoader(dataset, batch_size=8, shuffle=False, collate_fn=pad_batch))
    hits, counts = [], []
    with torch.no_grad():
        for batch in session.batches(loader):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            real = labels != IGNORE
            hits.append(session.gather_for_metrics(((logits.argmax(-1) == labels) & real).sum(1)))
            counts.append(session.gather_for_metrics(real.sum(1)))
    return float(torch.cat(hits).sum() / torch.cat(counts).sum())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="auto", help="single, dp, ddp, fsdp or auto")
    parser.add_argument("--precision", default="bf16", help="fp32, bf16 or fp16")
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--batch-size", type=int, default=8, help="global batch of sequences per micro-step")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps")
    parser.add_argument("--ckpt", default="", help="checkpoint folder: resume from it, save every step")
    parser.add_argument("--stop-after", type=int, default=0, help="save at this step and exit (0: never)")
    parser.add_argument("--save-losses", default="", help="write per-step losses and accuracy here (JSON)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    session_config = {
        "strategy": args.strategy,
        "precision": args.precision,
        "accumulate": args.accumulate,
        "activation_checkpointing": [GPT2Block],
        "fsdp": FSDPOptions(wrap=[GPT2Block]),
    }
    with Session(**session_config) as session:
        model = session.setup_model(build_model())
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        train = CountingSequences(256, seed=1)
        loader = session.setup_dataloader(
            DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=pad_batch)
        )
        checkpointer = multigpu.Checkpointer(folder=args.ckpt) if args.ckpt else None
        resumed = checkpointer.resume(model=model, optimizer=optimizer, loader=loader) if checkpointer else None
        step, losses = (resumed.step if resumed else 0), {}
        while step < args.steps:
            for batch in session.batches(loader):
                with session.micro_step(model):
                    loss, tokens = token_loss(model, batch)
                    session.backward(loss, num_items=tokens)
                if not session.should_step:
                    continue
                session.step(optimizer, max_grad_norm=1.0)
                step += 1
                losses[step] = session.window_loss  # the window's mean over every token on every rank
                session.print(f"step {step}: loss {losses[step]:.4f}")
                if checkpointer:  # at optimizer steps only: nothing of a window is in flight
                    checkpointer.save(step=step, model=model, optimizer=optimizer, loader=loader)
                if step in (args.steps, args.stop_after):
                    break
            if step == args.stop_after:
                return
        accuracy = evaluate(session, model, CountingSequences(37, seed=2))
        session.print(f"next-token accuracy {accuracy:.3f}")
        if args.save_losses and session.is_main_process:
            with open(args.save_losses, "w") as file:
                json.dump({"losses": losses, "accuracy": accuracy}, file)


if __name__ == "__main__":
    main()
