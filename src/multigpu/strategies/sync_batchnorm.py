"""Synchronized BatchNorm: batch statistics over the global batch, not each process's shard.

Under ddp/fsdp each process sees ``1/world_size`` of the batch, so plain BatchNorm normalizes
with noisier per-shard statistics than one device would. :func:`apply_sync_batchnorm` replaces
every ``BatchNorm1d/2d/3d`` so that training-mode statistics (and running statistics) are those of
the whole global batch, as one device computing BatchNorm on it would:

- on CUDA and XPU (the device types whose ``torch_sync_batchnorm`` says torch's layer runs there):
  torch's ``nn.SyncBatchNorm``;
- on CPU: torch's layer refuses to run (DDP raises "SyncBatchNorm layers only work with GPU
  modules"), so :class:`CPUSyncBatchNorm` does the same computation with collectives gloo has.

In eval mode, and without a process group of several ranks, both behave like plain BatchNorm.
The state-dict keys stay those of BatchNorm, so checkpoints load into the unconverted model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from multigpu.devices import get_device_type
from multigpu.runtime.collectives import issuing
from multigpu.runtime.world import in_process_group, world_size


def apply_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` with every BatchNorm layer synchronized over the default process group.

    Args:
        model: the bare model (before DDP/FSDP wrapping: DDP checks for SyncBatchNorm when built).
        device: the device the model trains on; decides torch's layer or :class:`CPUSyncBatchNorm`.

    Returns:
        The converted model (a new module only when ``model`` itself is a BatchNorm layer).
        Converting does not communicate; the layers' forward passes do (every rank must run them).

    Example:
        >>> net = apply_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(3)), torch.device("cpu"))
        >>> type(net[0]).__name__
        'CPUSyncBatchNorm'
    """
    if get_device_type(device).torch_sync_batchnorm:  # torch's layer runs there; its forward raises elsewhere
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return _convert(model)


def _convert(module: nn.Module) -> nn.Module:
    out = module
    if isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, CPUSyncBatchNorm)):
        out = CPUSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            bias=module.bias is not None if module.affine else True,
        )
        # The same parameter and buffer objects: the optimizer and a checkpoint see no difference.
        out.weight, out.bias = module.weight, module.bias
        out.running_mean, out.running_var = module.running_mean, module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, _convert(child))
    return out


class CPUSyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span every rank's batch; for devices torch's SyncBatchNorm refuses.

    Same arguments, parameters and buffers as ``nn.BatchNorm{1,2,3}d``; input ``[N, C, ...]``.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions [N, C, ...], got {input.dim()}D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as BatchNorm does
                factor = 1.0 / float(self.num_batches_tracked.item())
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        track = not self.training or self.track_running_stats
        running_mean = self.running_mean if track else None
        running_var = self.running_var if track else None
        if not (use_batch_stats and self.training and in_process_group() and world_size() > 1):
            return F.batch_norm(
                input, running_mean, running_var, self.weight, self.bias, use_batch_stats, factor, self.eps
            )
        out: torch.Tensor = _SyncBatchNorm.apply(
            input, self.weight, self.bias, running_mean, running_var, self.eps, factor
        )
        return out


class _SyncBatchNorm(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * weight + bias with mean and var over every rank's batch.

    Forward gathers each rank's per-channel count, mean and sum of squared deviations (one
    all-gather) and combines them with Chan's parallel formula, which stays accurate where
    ``E[x^2] - E[x]^2`` would cancel. Backward all-reduces the two per-channel sums the input
    gradient needs. Statistics are computed in float32 whatever the input dtype.
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
    ) -> torch.Tensor:
        channels = input.shape[1]
        x = input.transpose(0, 1).reshape(channels, -1).float()  # [C, samples]
        count = x.shape[1]
        local_mean = x.mean(dim=1) if count else x.new_zeros(channels)
        local_m2 = ((x - local_mean[:, None]) ** 2).sum(dim=1)
        stats = torch.cat([x.new_tensor([float(count)]), local_mean, local_m2])
        gathered = [torch.empty_like(stats) for _ in range(world_size())]
        with issuing("sync BatchNorm statistics (all-gather)", [stats]):
            dist.all_gather(gathered, stats)  # sync point: every rank's forward must reach it
        table = torch.stack(gathered)  # [ranks, 1 + 2C]
        counts, means, m2s = table[:, :1], table[:, 1 : 1 + channels], table[:, 1 + channels :]
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(f"expected more than 1 value per channel over all ranks when training, got {total:.0f}")
        mean = (counts * means).sum(dim=0) / total
        m2 = m2s.sum(dim=0) + (counts * (means - mean) ** 2).sum(dim=0)
        invstd = torch.rsqrt(m2 / total + eps)
        if running_mean is not None and running_var is not None:
            running_mean.mul_(1 - momentum).add_(momentum * mean.to(running_mean.dtype))
            unbiased = m2 / (total - 1)  # BatchNorm's running variance is the unbiased one
            running_var.mul_(1 - momentum).add_(momentum * unbiased.to(running_var.dtype))
        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total = total
        ctx.param_dtype = next((p.dtype for p in (weight, bias) if p is not None), input.dtype)
        shape = [1, channels] + [1] * (input.dim() - 2)
        y = (input.float() - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.float().view(shape)
        if bias is not None:
            y = y + bias.float().view(shape)
        return y.to(input.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        channels = input.shape[1]
        shape = [1, channels] + [1] * (input.dim() - 2)
        dims = [d for d in range(input.dim()) if d != 1]
        xhat = (input.float() - mean.view(shape)) * invstd.view(shape)
        dy = grad_out.float()
        sum_dy = dy.sum(dim=dims)
        sum_dy_xhat = (dy * xhat).sum(dim=dims)
        grad_weight = sum_dy_xhat.to(ctx.param_dtype) if ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(ctx.param_dtype) if ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            with issuing("sync BatchNorm gradient sums (all-reduce)", [sums]):
                dist.all_reduce(sums)  # sync point: the input gradient needs the global sums
            mean_dy, mean_dy_xhat = (sums / ctx.total).split(channels)
            scale = invstd if weight is None else invstd * weight.float()
            grad = (dy - mean_dy.view(shape) - xhat * mean_dy_xhat.view(shape)) * scale.view(shape)
            grad_input = grad.to(input.dtype)
        # The weight and bias gradients are this rank's share; DDP/FSDP reduce them like any other.
        return grad_input, grad_weight, grad_bias, None, None, None, None
