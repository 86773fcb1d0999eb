"""multigpu's installed version, read from the package metadata on demand.

Here rather than in ``multigpu/__init__.py`` so that a module that reports versions (the profiler's
environment table) asks the bottom layer instead of importing the package that imports it.
"""

from __future__ import annotations


def installed_version() -> str:
    """The version pip installed, or a sentence saying the source tree was never installed."""
    from importlib.metadata import PackageNotFoundError, version  # ~0.1 s to import: only when asked

    try:
        return version("multigpu")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (not installed; pip install -e .)"
