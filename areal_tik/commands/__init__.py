"""The ``areal-tik`` subcommands that need no AReaL: ``generate``, ``check``, ``prepare-model``.

Each module exposes ``add_arguments(parser)`` and ``main(args) -> int`` and is one row of
``areal_tik.cli.COMMANDS``.
"""
