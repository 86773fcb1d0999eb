"""Name the parameters DDP says received no gradient, and the modules that own them.

DDP's error for a parameter the loss did not use ("Expected to have finished reduction in the prior
iteration...") lists them by *index* ("Parameter indices which did not receive grad for rank 0: 4 5")
unless ``TORCH_DISTRIBUTED_DEBUG`` is INFO or DETAIL (then by name, without their modules). The indices count the parameters DDP reduces in the
order it builds them (each module's own parameters that require a gradient, in ``named_modules`` order,
ignored ones left out, a shared parameter once), so :func:`unused_parameter_names` counts the same way and
names them without the debug mode's cost.

Example:
    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> unused_parameter_names(net, "Parameter indices which did not receive grad for rank 0: 2 3", set())
    ['1.weight (in 1: Linear)', '1.bias (in 1: Linear)']
"""

from __future__ import annotations

import re
from collections.abc import Collection

from torch import nn

_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+:\s*([\d ]+)")
_NAMES = re.compile(r"Parameters which did not receive grad for rank \d+:\s*([^\n]+)")  # under INFO/DETAIL


def unused_parameter_names(module: nn.Module, message: str, ignored: Collection[str]) -> list[str]:
    """The parameters DDP's ``message`` lists by index, as ``name (in module: Type)``; [] when it lists none.

    Args:
        module: the module DDP wraps (``ddp.module``).
        message: DDP's error text.
        ignored: the parameter names DDP was told to ignore (``ddp.parameters_to_ignore``).
    """
    found, named = _INDICES.search(message), _NAMES.search(message)
    if found is None and named is None:
        return []
    reduced: list[str] = []
    seen: set[int] = set()
    for module_name, owner in module.named_modules():
        for param_name, param in owner.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if not param.requires_grad or full in ignored or id(param) in seen:
                continue
            seen.add(id(param))
            reduced.append(f"{full} (in {module_name or 'the model'}: {type(owner).__name__})")
    if named is not None:  # torch named them (debug mode): add their modules, in DDP's order
        names = {n.strip() for n in named.group(1).split(",")}
        return [r for r in reduced if r.split(" ", 1)[0] in names]
    assert found is not None
    return [reduced[i] for i in (int(t) for t in found.group(1).split()) if i < len(reduced)]
