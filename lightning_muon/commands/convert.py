"""``lightning-muon convert-checkpoint DIR OUT``: an FSDP2 distributed checkpoint as one file for one process or DDP."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from lightning_muon.lightning import consolidate


def main(argv: Sequence[str]) -> None:
    """Convert, and say how to resume from the result."""
    parser = argparse.ArgumentParser(
        prog="lightning-muon convert-checkpoint",
        description="Turn the checkpoint directory ModelParallelStrategy (FSDP2) saves into one file that a "
        "one-process or DDP fit resumes from (whole tensors; optimizer states by position; loops, schedulers and "
        "MuonMixin's routing record kept).",
    )
    parser.add_argument("directory", help="the distributed checkpoint (a directory with meta.pt and *.distcp)")
    parser.add_argument("out", help="the file to write, e.g. last.ckpt")
    args = parser.parse_args(list(argv))
    try:
        out = consolidate(args.directory, args.out)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {out}: resume with one process or DDP, e.g. lightning-muon fit --config C --ckpt_path {out}")
