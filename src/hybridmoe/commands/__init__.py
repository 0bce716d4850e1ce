"""Subcommands of the `hybridmoe` CLI, one module each (see hybridmoe.cli)."""
