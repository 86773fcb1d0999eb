"""The single-process engine: scatter, replicate, parallel_apply, gather, DataParallel.

``scatter``, ``gather``, ``replicate``, ``parallel_apply`` and ``data_parallel`` are
torch.nn.parallel's functional primitives with its signatures, on any device
(:mod:`multigpu.parallel.functional`).
"""

from multigpu.parallel.data_parallel import DataParallel
from multigpu.parallel.functional import data_parallel, gather, parallel_apply, replicate, scatter

__all__ = ["DataParallel", "data_parallel", "gather", "parallel_apply", "replicate", "scatter"]
