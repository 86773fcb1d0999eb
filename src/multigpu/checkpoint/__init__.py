"""Checkpoints that load anywhere: clean keys, unwrapping, atomic saves, full training state."""

from multigpu.checkpoint.keys import clean_state_dict, unwrap

__all__ = ["clean_state_dict", "unwrap"]
