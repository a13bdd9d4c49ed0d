"""The Lightning side: `MuonMixin` (a thin facade) over its config, update loop, checkpoint check and
``_compat`` (every use of Lightning's private API, in one module).

Importing it sets up the ``lightning_muon`` logger (the optimizer's one line on which path a distributed run
takes) the way ``lightning.pytorch`` sets up its own: INFO, printed to stderr unless the root logger already
has a handler, in which case the records propagate to it.
"""

import logging

from lightning_muon.lightning.mixin import MuonMixin

_logger = logging.getLogger("lightning_muon")
if _logger.level == logging.NOTSET:
    _logger.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers() and not _logger.handlers:
    _logger.addHandler(logging.StreamHandler())
    _logger.propagate = False

__all__ = ["MuonMixin"]
