"""Token-weighted losses: the gradient of the mean over every item of the global batch, not a mean of means.

``session.backward(loss, num_items=n)`` takes the SUM of this micro-batch's per-item losses (tokens,
samples) and its item count. A mean per micro-batch weighs a micro-batch of 3 tokens as much as
one of 300, so with ragged batches, accumulation or several ranks the step follows the wrong
gradient (transformers issues 34191 and 37766). One device over the whole global batch divides
the summed loss by the total count; this module makes every strategy do that:

- backward runs on the raw sum, so the gradients of a window add up to ``d(sum of item losses)``;
- at the optimizer step the window's ``[loss sum, item count]`` is all-reduced once (one
  two-number all-reduce per optimizer step, nothing per micro-step), and the gradients are
  multiplied by ``world_size / total``: DDP's all-reduce and FSDP's reduce-scatter *average* over
  the ``world_size`` processes, so each process's sum must count ``world_size`` times; dp and single
  (one process) sum, and their factor is ``1 / total``.

The summed loss over the summed count is the window's per-item mean over every rank, which the
Session reports as ``session.window_loss``.
"""

from __future__ import annotations

import numbers

import torch

from multigpu.errors import ConfigError
from multigpu.runtime import collectives


class ItemWindow:
    """One accumulation window's item count and loss sum, and whether its backwards were item-weighted."""

    def __init__(self) -> None:
        self.weighted: bool | None = None  # None: no backward yet in this window
        self._sums: torch.Tensor | None = None  # [loss sum, item count] on the loss's device, float64
        self.mean_loss: float | None = None  # the last settled window's per-item mean over every rank

    def record(self, loss: torch.Tensor, num_items: int | torch.Tensor | None) -> None:
        """Note one ``session.backward`` call; refuse mixing calls with and without ``num_items``.

        Raises:
            ConfigError: ``num_items`` given in a window whose earlier backward had none (or the
                reverse); ``num_items`` not a count; ``loss`` not a single number.
        """
        weighted = num_items is not None
        if self.weighted is not None and self.weighted != weighted:
            first, now = ("with", "without") if self.weighted else ("without", "with")
            raise ConfigError(
                f"session.backward(loss) was called {first} num_items earlier in this accumulation window and "
                f"{now} it now (num_items={num_items!r}): a window's losses must all be sums with their item "
                "counts (session.backward(loss_sum, num_items=n)) or all means (session.backward(loss)); "
                "pick one for the whole window"
            )
        self.weighted = weighted
        if num_items is None:
            return
        count = _count_tensor(num_items)
        if loss.numel() != 1:
            raise ConfigError(
                f"session.backward(loss, num_items={num_items!r}) got a loss of shape {tuple(loss.shape)}; pass "
                "the SUM of this micro-batch's per-item losses, one number, e.g. "
                "F.cross_entropy(logits, labels, reduction='sum')"
            )
        pair = torch.stack([loss.detach().reshape(()).to(torch.float64), count.to(loss.device, torch.float64)])
        self._sums = pair if self._sums is None else self._sums + pair

    def settle(self, world_size: int) -> float | None:
        """All-reduce the window's sums (every rank must call it); the gradient factor, None for no items.

        Returns:
            ``world_size / total items`` (what the averaged gradients must be multiplied by), or
            None when no rank saw an item in this window (there is no mean to step on).

        Raises:
            ConfigError: a negative total count.
        """
        sums = self._sums if self._sums is not None else torch.zeros(2, dtype=torch.float64)
        # note: a sync point across ranks, once per optimizer step (two numbers)
        loss_sum, total = collectives.reduce_value(sums, "sum").tolist()
        self.reset()
        if total < 0:
            raise ConfigError(
                f"the item counts of this window add up to {total:g} over every rank; num_items must count "
                "the items (tokens, samples) of each micro-batch, >= 0"
            )
        if total == 0:
            self.mean_loss = None
            return None
        self.mean_loss = loss_sum / total
        return world_size / total

    def reset(self) -> None:
        """Forget the window (after its step)."""
        self.weighted = None
        self._sums = None


def _count_tensor(num_items: int | torch.Tensor) -> torch.Tensor:
    if isinstance(num_items, torch.Tensor):
        if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
            raise ConfigError(
                f"num_items={num_items!r} must be one real number (a count): a 0-dim tensor such as "
                "attention_mask.sum(), or an int"
            )
        return num_items.detach().reshape(())  # left on its device: no sync until the step
    if isinstance(num_items, numbers.Integral) and not isinstance(num_items, bool) and num_items >= 0:
        return torch.tensor(float(num_items), dtype=torch.float64)
    raise ConfigError(
        f"num_items={num_items!r} must be the number of items (tokens, samples) of this micro-batch: an int "
        ">= 0 or a 0-dim tensor, e.g. num_items=int((labels != -100).sum())"
    )
