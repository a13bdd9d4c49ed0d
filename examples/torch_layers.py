"""torch's own layers beyond Linear, attention and plain convolutions, as small offline models: a
depthwise-separable CNN on scikit-learn's digits (grouped convolutions) and a byte-level LSTM on the standard
library's sources (recurrent gates). The routing's measurements of both are ``benchmarks/torch_layers.py``.

`SeparableCNN` and `CharLSTM` are ordinary LightningModules; `MuonSeparableCNN` and `MuonCharLSTM` train them with
Muon + AdamW by the routing's rules: each group of a grouped kernel orthogonalised alone, an LSTM's four gates
stacked in the rows of its ``weight_ih_l*``/``weight_hh_l*`` orthogonalised one gate at a time, as the table
says::

    lightning-muon inspect --config CONFIG   # a config whose model is one of these: the table
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_muon import MuonMixin
from lightning_muon.examples.char_gpt import VOCAB_SIZE, ByteLM
from lightning_muon.examples.digits_cnn import NUM_CLASSES, DigitsClassifier, DigitsDataModule, two_stages
from lightning_muon.examples.text_data import StdlibTextDataModule

__all__ = [
    "CharLSTM", "DigitsDataModule", "MuonCharLSTM", "MuonSeparableCNN", "SeparableCNN", "StdlibTextDataModule",
    "separable_block",
]


def separable_block(in_channels: int, out_channels: int, stride: int = 1, kernel_size: int = 3) -> nn.Sequential:
    """MobileNet's block: a depthwise ``kernel_size`` conv (``groups=in_channels``: one filter per channel), then a
    pointwise 1x1 conv mixing the channels, each followed by BatchNorm and ReLU (no conv biases: the norms have
    them)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, in_channels, kernel_size, stride=stride, padding=kernel_size // 2, groups=in_channels,
                  bias=False),
        nn.BatchNorm2d(in_channels),
        nn.ReLU(),
        nn.Conv2d(in_channels, out_channels, 1, bias=False),
        nn.BatchNorm2d(out_channels),
        nn.ReLU(),
    )


class SeparableCNN(DigitsClassifier):
    """A depthwise-separable CNN (MobileNet-style) on ``(batch, 1, 8, 8)`` digits: a ``stem`` conv (1 -> channels),
    depthwise-separable blocks (`separable_block`) in two stages (the second at stride 2 with twice the channels),
    global average pooling, a ``classifier`` Linear. Logs as `DigitsClassifier`; on its own it trains with AdamW
    (lr 3e-3).

    Args:
        channels: width of the stem and the first stage.
        blocks_per_stage: separable blocks in each stage.
    """

    def __init__(self, channels: int = 32, blocks_per_stage: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.stem_norm = nn.BatchNorm2d(channels)
        self.blocks = two_stages(channels, blocks_per_stage, separable_block)
        self.classifier = nn.Linear(2 * channels, NUM_CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        """Logits ``(batch, 10)`` for images ``(batch, 1, 8, 8)``."""
        x = F.relu(self.stem_norm(self.stem(images)))
        return self.classifier(self.blocks(x).mean(dim=(2, 3)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW on every parameter: used by `SeparableCNN` alone, never by `MuonSeparableCNN`."""
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class MuonSeparableCNN(MuonMixin, SeparableCNN):
    """`SeparableCNN` with Muon on its hidden kernels (each group of a depthwise kernel alone) and AdamW on the
    stem, the norms and the classifier."""


class CharLSTM(ByteLM):
    """A byte-level LSTM language model (vocabulary 256) on ``(inputs, targets)`` windows, as `ByteLM` logs them:
    an ``embedding``, an ``nn.LSTM`` of ``n_layer`` layers (its ``weight_ih_l*`` and ``weight_hh_l*`` each stack
    the four gates i, f, g, o in their rows), a ``head`` Linear. On its own it trains with AdamW (lr 3e-3).

    Args:
        n_embd: width of the byte embedding.
        hidden_size: the LSTM's hidden state.
        n_layer: LSTM layers.
    """

    def __init__(self, n_embd: int = 64, hidden_size: int = 128, n_layer: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embedding = nn.Embedding(VOCAB_SIZE, n_embd)
        self.lstm = nn.LSTM(n_embd, hidden_size, num_layers=n_layer, batch_first=True)
        self.head = nn.Linear(hidden_size, VOCAB_SIZE)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(batch, time, 256)`` for byte indices ``idx`` of shape ``(batch, time)``."""
        hidden, _ = self.lstm(self.embedding(idx))
        return self.head(hidden)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW on every parameter: used by `CharLSTM` alone, never by `MuonCharLSTM`."""
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


class MuonCharLSTM(MuonMixin, CharLSTM):
    """`CharLSTM` with Muon on the LSTM's matrices and AdamW on the embedding, the biases and the head."""
