"""A small CNN on scikit-learn's bundled 8x8 digits (offline, seconds on a CPU), with Muon on its conv kernels.

`CNN` is an ordinary LightningModule; `DigitsCNN` trains it with Muon on the
hidden conv kernels (each orthogonalised as the flattened
``out x in*kh*kw`` matrix) and AdamW on the stem conv, the norms and the
classifier, all by routing's own rules: the classifier is the output head, the
stem the input layer (it sees raw pixels, 9 inputs per output, and is
conventionally left to AdamW; ``muon_params=["stem.weight"]`` would put it on Muon).
"""

from __future__ import annotations

from collections.abc import Callable

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from lightning_muon import MuonMixin
from lightning_muon.examples._extras import sklearn_digits

__all__ = ["CNN", "DigitsCNN", "DigitsClassifier", "DigitsDataModule"]

NUM_CLASSES = 10


class DigitsDataModule(L.LightningDataModule):
    """scikit-learn's 1,797 8x8 handwritten digits, as ``(1, 8, 8)`` float images in [0, 1] and int64 labels.

    A seeded 80/20 split: the 20% held out is both the validation and the
    test set (the dataset is too small for three splits).

    Args:
        batch_size: images per batch.
        val_fraction: fraction of the images held out.
        seed: seed of the split (the same seed gives the same split).
    """

    def __init__(self, batch_size: int = 64, val_fraction: float = 0.2, seed: int = 0) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
        self.save_hyperparameters()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        digits = sklearn_digits()
        images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(self.seed))
        held_out = round(len(images) * self.val_fraction)
        train, val = order[held_out:], order[:held_out]
        self.train_set = TensorDataset(images[train], labels[train])
        self.val_set = TensorDataset(images[val], labels[val])

    def _split(self, dataset: TensorDataset | None) -> TensorDataset:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() has not run yet")
        return dataset

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(self._split(self.train_set), batch_size=self.batch_size, shuffle=True, generator=generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._split(self.val_set), batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self._split(self.val_set), batch_size=256)


def conv_block(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    """3x3 conv (no bias: the norm has one), BatchNorm, ReLU."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    )


def two_stages(channels: int, blocks_per_stage: int,
               block: Callable[[int, int, int], nn.Module]) -> nn.Sequential:
    """``blocks_per_stage`` blocks ``block(in_channels, out_channels, stride)`` at ``channels``, then as many at
    twice the channels, the first of them at stride 2 (8x8 maps, then 4x4)."""
    if channels < 1 or blocks_per_stage < 1:
        raise ValueError(f"channels and blocks_per_stage must be >= 1, got {channels!r} and {blocks_per_stage!r}")
    widths = [channels] * blocks_per_stage + [2 * channels] * blocks_per_stage
    strides = [1] * blocks_per_stage + [2] + [1] * (blocks_per_stage - 1)
    layers = zip([channels, *widths[:-1]], widths, strides, strict=True)
    return nn.Sequential(*(block(c_in, c_out, s) for c_in, c_out, s in layers))


class DigitsClassifier(L.LightningModule):
    """The steps of a 10-class classifier on ``(images, labels)`` batches: cross-entropy of ``forward``'s logits
    ``(batch, 10)``, logged as ``train_loss``, ``val_loss``, ``val_acc`` and ``test_acc`` (top-1 accuracy). `CNN`
    and `lightning_muon.examples.third_party.ThirdPartyDigits` are ones."""

    def __init__(self) -> None:
        super().__init__()
        self.val_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")  # the fraction right
        self.test_acc = MulticlassAccuracy(num_classes=NUM_CLASSES, average="micro")

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        logits = self(images)
        self.val_acc(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        images, labels = batch
        self.test_acc(self(images), labels)
        self.log("test_acc", self.test_acc)


class CNN(DigitsClassifier):
    """``stem`` conv (1 -> channels), conv blocks, global average pooling, ``classifier`` Linear.

    Batches are ``(images, labels)``; cross-entropy loss. Logs ``train_loss``,
    ``val_loss``, ``val_acc`` and ``test_acc`` (top-1 accuracy). On its own
    it trains with AdamW (lr 3e-3); `DigitsCNN` is the Muon version.

    Args:
        channels: width of the stem and the first stage; the second stage
            (stride 2, 4x4 maps) has twice as many.
        blocks_per_stage: conv blocks in each of the two stages.
        dropout: dropout before the classifier.
    """

    def __init__(self, channels: int = 32, blocks_per_stage: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.stem_norm = nn.BatchNorm2d(channels)
        self.blocks = two_stages(channels, blocks_per_stage, conv_block)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(2 * channels, NUM_CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        """Logits ``(batch, 10)`` for images ``(batch, 1, 8, 8)``."""
        x = F.relu(self.stem_norm(self.stem(images)))
        x = self.blocks(x).mean(dim=(2, 3))
        return self.classifier(self.dropout(x))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW on every parameter: used by `CNN` alone, never by `DigitsCNN` (the mixin brings its own pair)."""
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class DigitsCNN(MuonMixin, CNN):
    """`CNN` with Muon on the hidden conv kernels and AdamW on the stem, the norms and the classifier.

    Takes `CNN`'s arguments and `lightning_muon.MuonMixin`'s keyword-only
    optimizer arguments (``muon``, ``adamw``, ``lr_scheduler``, ...).
    """
