"""``lightning-muon compare``: fit configs, then plot and tabulate their validation loss by step and by time; with
``--sweep`` / ``--seeds``, each config's lr tuned and seeded first.

The package exports `main` (the subcommand) only. Its modules are the command's internals, not the library's
API (they may change between releases); ``benchmarks/`` and the tests import the pieces they use from the module
that defines them:

- `run`: the command (`main`), `tuned`: its ``--sweep`` / ``--seeds`` path;
- `fit`: one fit, in a subprocess; `runs`: a run read back from its logs;
- `report`: the one-run-per-config table; `plot`: the figures; `console`: where it prints;
- `sweep`: what a side sweeps; `tuning`: running the sweep and the seeds (`tuning.tune`), or reading them back;
  `aggregate`: a side's runs as the tuned tables and the verdict;
- ``--target``: `target` (the validation schedule near the target, each run's crossing of it, a side's steps over
  its seeds), `near_target` (the callback that follows the schedule in each fit), `target_report` (the tuned
  tables and the verdict against the target).
"""

from lightning_muon.commands.compare.run import main

__all__ = ["main"]
