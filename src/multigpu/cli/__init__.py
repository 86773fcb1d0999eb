"""The ``multigpu`` command line: one module per subcommand, discovered by name.

A subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``; dropping such a module into this folder adds the subcommand.
"""
