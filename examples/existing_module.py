"""An existing LightningModule made Muon without touching it: Lightning's own demo Transformer.

``lightning.pytorch.demos.LightningTransformer`` is code we do not own. Its
``training_step`` returns the loss, so the Muon version is one line of bases;
everything else here only replaces what the demo would download (WikiText-2)
with offline bytes and adds a validation loss::

    class MuonLightningTransformer(MuonMixin, LightningTransformer): ...

Pass ``vocab_size=256`` (the data are bytes) and the data module to ``fit``:

    trainer.fit(MuonLightningTransformer(vocab_size=256), datamodule=StdlibWindowsDataModule())

The demo's own ``configure_optimizers`` (SGD) is replaced by the mixin's
pair, which it says once at fit start. Note that the demo's decoder is fed
the very targets it predicts (``forward(inputs, target)`` with a causal mask
that includes the diagonal), so its loss falls towards zero quickly and is not
a language-modelling number; `lightning_muon.examples.char_gpt` is the example for that.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_muon import MuonMixin
from lightning_muon.examples.text_data import StdlibTextDataModule

__all__ = ["MuonLightningTransformer", "StdlibWindowsDataModule"]


class MuonLightningTransformer(MuonMixin, LightningTransformer):
    """Lightning's demo ``LightningTransformer`` with Muon on its hidden matrices and AdamW on the rest.

    Takes the demo's ``vocab_size`` (use 256 with `StdlibWindowsDataModule`)
    and `lightning_muon.MuonMixin`'s keyword-only optimizer arguments
    (``muon``, ``adamw``, ``lr_scheduler``, ...).
    """

    def prepare_data(self) -> None:
        """Nothing to download: the data module brings the data (the demo fetches WikiText-2 here)."""

    def train_dataloader(self) -> DataLoader:
        """Refuse the demo's WikiText-2 loader, which would download; the data module's is used instead."""
        raise MisconfigurationException(
            "MuonLightningTransformer has no data of its own: pass one, e.g. "
            "trainer.fit(model, datamodule=StdlibWindowsDataModule())"
        )

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        # The demo's own loss; outside training the mixin runs training_step without backward or update.
        loss = self.training_step(batch, batch_idx)
        self.log("val_loss", loss, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("val_bpb", loss / math.log(2), on_epoch=True, sync_dist=True)


class StdlibWindowsDataModule(StdlibTextDataModule):
    """`StdlibTextDataModule` (`lightning_muon.examples.text_data`) with the demo's window length: 35 bytes, 20 windows
    a batch.

    Batches are ``(inputs, targets)`` of shape ``(batch_size, block_size)``,
    the pair ``LightningTransformer.forward(inputs, target)`` takes.

    Args:
        block_size: bytes per window.
        batch_size: windows per batch.
        kwargs: the other arguments of `lightning_muon.examples.text_data.StdlibTextDataModule`
            (``max_bytes``, ``val_fraction``, ``train_batches_per_epoch``,
            ``val_batches``, ``seed``, ``cache_dir``, ``source_dir``).
    """

    def __init__(self, block_size: int = 35, batch_size: int = 20, **kwargs: Any) -> None:
        super().__init__(block_size=block_size, batch_size=batch_size, **kwargs)
