"""The ``lightning`` / ``lightning-muon`` command: `cli` dispatches to one module per subcommand."""
