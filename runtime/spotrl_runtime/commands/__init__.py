"""Subcommands of the `spotrl` CLI, one module each (see ``spotrl_runtime.cli``)."""
