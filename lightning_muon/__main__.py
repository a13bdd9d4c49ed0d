"""``python -m lightning_muon``: the same command as ``lightning-muon``."""

from lightning_muon.commands.cli import main

if __name__ == "__main__":
    main()
