"""The ``lightning`` / ``lightning-muon`` command: `main` (`cli` dispatches to one module per subcommand).

The command line is the interface; of the modules here only `main` is an API, for code that runs the command
(``main(["fit", "--config", "gpt_muon.yaml"])``). Every module is the command's internals.
"""

from lightning_muon.commands.cli import main

__all__ = ["main"]
