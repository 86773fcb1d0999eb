"""The bottom layer: helpers every other package may use, importing none of them.

Not "the core" of multigpu (the engine is :mod:`multigpu.parallel`): the small, general pieces
that sit under it.

- :mod:`~multigpu.core.structure`: walk nested inputs and outputs once (``torch.utils._pytree``:
  tuples, lists, dicts, namedtuples, dataclasses, model-output classes) into leaves and a spec;
- :mod:`~multigpu.core.comm`: move tensors between replica devices (split, copy, broadcast, reduce-add);
- :mod:`~multigpu.core.listeners`: what an engine reports (phases of a step, replica scopes) and
  the listener set it reports to;
- :mod:`~multigpu.core.units`: bytes and times as a person reads them;
- :mod:`~multigpu.core.keys`: state-dict key prefixes (``module.``, ``_orig_mod.``), unwrapping, and
  DataParallel's state-dict hooks;
- :mod:`~multigpu.core.script`: run a Python file as ``__main__``;
- :mod:`~multigpu.core.version`: multigpu's installed version;
- :mod:`~multigpu.core.limits`: the forms and bounds of numbers users type (seconds, node counts),
  torch-free so the CLI's flags and the configs check alike.

Why a package of its own: the engine (``parallel/``) and the profiler (``profiling/``) both need
structure walking, tensor moves and the listener interface; the CLI and the launcher both run
scripts; reports, the planner and the CLI all print sizes. Kept here, below ``devices`` and
everything else, none of those packages imports another for them, and ``tests/test_layers.py``
keeps it that way. Modules here import only torch, the standard library and :mod:`multigpu.errors`.
"""
