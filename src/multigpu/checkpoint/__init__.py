"""Checkpoints that load anywhere: clean keys, unwrapping, atomic saves, full training state."""

from multigpu.checkpoint.state import Checkpointer, Resumed
from multigpu.checkpoint.storages import find_latest
from multigpu.checkpoint.weights import load, save
from multigpu.core.keys import WRAPPER_PREFIXES, clean_state_dict, find_prefixes, strip_prefixes, unwrap

__all__ = [
    "WRAPPER_PREFIXES",
    "Checkpointer",
    "Resumed",
    "clean_state_dict",
    "find_latest",
    "find_prefixes",
    "load",
    "save",
    "strip_prefixes",
    "unwrap",
]
