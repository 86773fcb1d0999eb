"""The bottom layer: small pieces several packages share, importing none of them.

- :mod:`~multigpu.core.structure`: walk nested inputs and outputs (tuples, lists, dicts,
  namedtuples, dataclasses);
- :mod:`~multigpu.core.comm`: move tensors between replica devices (scatter, broadcast, reduce-add);
- :mod:`~multigpu.core.listeners`: what an engine reports (phases of a step, replica scopes) and
  the listener set it reports to;
- :mod:`~multigpu.core.script`: run a Python file as ``__main__``.

Why a package of its own: the engine (``parallel/``) and the profiler (``profiling/``) both need
structure walking, tensor moves and the listener interface; the CLI and the launcher both run
scripts. Kept here, below ``devices`` and everything else, none of those packages imports
another for them, and ``tests/test_layers.py`` keeps it that way. Modules here import only torch,
the standard library and :mod:`multigpu.errors`.
"""
