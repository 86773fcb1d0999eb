"""The single-process engine: scatter, replicate, parallel_apply, gather, DataParallel."""

from multigpu.parallel.data_parallel import DataParallel

__all__ = ["DataParallel"]
