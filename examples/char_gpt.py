"""A small byte-level GPT trained on the Python standard library's own sources, with Muon.

`GPT` is an ordinary nanoGPT-style LightningModule (its ``training_step``
returns the loss); `CharGPT` is the same model trained with Muon on its block
matrices and AdamW on the embeddings, norms and head, by one line:

    class CharGPT(MuonMixin, GPT): ...

The data (`StdlibTextDataModule`) are the bytes of this machine's standard
library, so nothing is downloaded. Tokens are bytes, so ``val_loss / ln 2`` is
bits per byte (``val_bpb``)::

    python -m lightning_muon.examples.char_gpt   # 300 steps on a laptop CPU in a minute or two
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import lightning as L
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_muon import MuonMixin
from lightning_muon.attention import QKLayout, QKProjection, record_qk
from lightning_muon.examples.text_data import StdlibTextDataModule

__all__ = [
    "GPT", "ByteLM", "CharGPT", "StdlibTextDataModule", "pretrained_weights", "result_line",
]

VOCAB_SIZE = 256  # bytes


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused ``qkv`` projection (q, then k, then v, ``n_head`` heads each),
    then an output projection ``proj``. Its `qk_layout` tells QK-Clip and ``split_heads`` where the heads are."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        q, k, v = (t.view(batch, time, self.n_head, channels // self.n_head).transpose(1, 2) for t in (q, k, v))
        record_qk(self, q, k, scale=(channels // self.n_head) ** -0.5, causal=True)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(y))

    def qk_layout(self) -> QKLayout:
        """Where the query, key and value heads are in ``qkv``'s rows (`lightning_muon.attention.QKLayout`)."""
        width = self.proj.in_features
        weight, bias = self.qkv.weight, self.qkv.bias
        q, k, v = (QKProjection(weight, bias, offset) for offset in (0, width, 2 * width))
        return QKLayout(q, k, num_heads=self.n_head, num_kv_heads=self.n_head, head_dim=width // self.n_head, value=v)


class MLP(nn.Module):
    """``fc`` (4x wider), GELU, ``proj`` back."""

    def __init__(self, n_embd: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ByteLM(L.LightningModule):
    """The steps of a byte-level language model (vocabulary 256) on ``(inputs, targets)`` windows of shape
    ``(batch, time)``, targets shifted by one: cross-entropy of ``forward``'s logits ``(batch, time, 256)``,
    logged as ``train_loss`` and, per validation epoch, ``val_loss`` and ``val_bpb`` (bits per byte,
    ``val_loss / ln 2``); a fit that ends well prints one line of them (`result_line`). `GPT`,
    `lightning_muon.examples.parallel_gpt.ParallelGPT`, `lightning_muon.examples.lora.LoraGPT` and
    `lightning_muon.examples.third_party.ThirdPartyLM` are ones."""

    def loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        logits = self(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self.loss(batch)
        self.log("val_loss", loss, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log("val_bpb", loss / math.log(2), on_epoch=True, sync_dist=True)

    def on_fit_end(self) -> None:
        """A fit that ended well has its result line (`result_line`), printed at `teardown`."""
        # fully_shard makes the module's class FSDP<its class>: the line names the model's own class
        self._result_line = result_line(self.trainer, type(self).__name__.removeprefix("FSDP"))

    def teardown(self, stage: str) -> None:
        """The result line, one plain ``print`` on rank zero, after every callback's teardown: by then tqdm's bar
        is closed (``self.print`` would write through it and be lost) and rich's live display has stopped (a line
        printed before would sit above its last frame)."""
        super().teardown(stage)
        line, self._result_line = getattr(self, "_result_line", ""), ""
        if stage == "fit" and line and self.trainer.is_global_zero:
            print(line, flush=True)


class GPT(ByteLM):
    """A nanoGPT-style byte-level language model (vocabulary 256).

    Batches are ``(inputs, targets)`` of shape ``(batch, time)``, targets
    shifted by one (as `StdlibTextDataModule` gives them). Logs ``train_loss``
    and, per validation epoch, ``val_loss`` and ``val_bpb`` (bits per byte,
    ``val_loss / ln 2``). On its own it trains with AdamW (lr 1e-3, betas
    (0.9, 0.95)) under automatic optimization; `CharGPT` is the Muon version.

    Args:
        n_layer: transformer blocks.
        n_head: attention heads per block (must divide ``n_embd``).
        n_embd: width of the residual stream.
        block_size: longest context in bytes (rows of the position embedding).
        dropout: dropout on attention weights and residual branches.
        tie_weights: share the token embedding with the output head
            (``lm_head.weight is wte.weight``).
        bias: biases in the Linear and LayerNorm layers.
        init_from: start from these weights instead of the random init: a Lightning checkpoint (its
            ``state_dict``) or a file saved by ``torch.save(model.state_dict(), path)``, of a model with the same
            arguments. Fine-tuning a pretrained model, e.g. ``benchmarks/finetune.py``. Not a saved
            hyperparameter: a checkpoint holds the weights themselves, so it loads without that file.
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        block_size: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = False,
        bias: bool = False,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_head must divide n_embd, got n_head={n_head} and n_embd={n_embd}")
        self.save_hyperparameters(ignore=["init_from"])
        self.block_size = block_size
        self.wte = nn.Embedding(VOCAB_SIZE, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, VOCAB_SIZE, bias=bias)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        if init_from is not None:
            self.load_state_dict(pretrained_weights(init_from))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(batch, time, 256)`` for byte indices ``idx`` of shape ``(batch, time)``."""
        time = idx.shape[1]
        if time > self.block_size:
            raise ValueError(f"sequence of {time} bytes is longer than block_size={self.block_size}")
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (FSDP2), shard every block and then the whole model."""
        if self.device_mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW on every parameter: used by `GPT` alone, never by `CharGPT` (the mixin brings its own pair)."""
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))


def pretrained_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """The state dict in ``path``: a Lightning checkpoint's ``state_dict``, or a plain ``torch.save``'d state
    dict. Tensors only (``weights_only``), loaded on the CPU."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"init_from={str(path)!r}: no such file (a Lightning checkpoint or a saved state_dict)")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    state = saved.get("state_dict", saved) if isinstance(saved, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, Tensor) for v in state.values()):
        raise ValueError(f"init_from={str(path)!r} holds no state dict (expected a Lightning checkpoint or a "
                         "file saved by torch.save(model.state_dict(), path))")
    return state


def result_line(trainer: L.Trainer, name: str) -> str:
    """``NAME: val_loss 1.7090, val_bpb 2.4655 after 300 steps; checkpoint and metrics in DIR``: the logger's
    directory and the checkpoint directory, relative to the working directory. A fit that ran no validation (a
    smoke run with ``--trainer.max_steps 2``) says so instead, with the flag that makes one run."""
    metrics = trainer.callback_metrics
    if "val_loss" in metrics:
        line = (f"{name}: val_loss {float(metrics['val_loss']):.4f}, val_bpb {float(metrics['val_bpb']):.4f} "
                f"after {trainer.global_step} steps")
    else:
        line = (f"{name}: trained {trainer.global_step} steps, no validation ran (add "
                f"--trainer.val_check_interval {trainer.global_step} for one at the end)")
    logs = _shown(trainer.log_dir) if trainer.logger is not None else None
    checkpoint = trainer.checkpoint_callback
    saved = _shown(getattr(checkpoint, "dirpath", None)) if checkpoint is not None else None
    if logs and saved and Path(saved).is_relative_to(logs):
        return f"{line}; checkpoint and metrics in {logs}"
    where = [f"metrics in {logs}"] if logs else []
    where += [f"checkpoints in {saved}"] if saved else []
    return f"{line}; {', '.join(where)}" if where else line


def _shown(path: str | os.PathLike | None) -> str | None:
    """``path`` relative to the working directory where it is inside it."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class CharGPT(MuonMixin, GPT):
    """`GPT` trained with Muon on the block matrices (``qkv``, ``proj``, ``fc``) and AdamW on the rest.

    Takes `GPT`'s arguments and `lightning_muon.MuonMixin`'s keyword-only
    optimizer arguments (``muon``, ``adamw``, ``lr_scheduler``, ...).
    """


def main() -> None:
    """Train `CharGPT` with its defaults for 300 steps on the CPU, then print the validation bits per byte."""
    torch.manual_seed(0)
    trainer = L.Trainer(accelerator="cpu", max_steps=300, logger=False, enable_checkpointing=False)
    trainer.fit(CharGPT(), datamodule=StdlibTextDataModule())


if __name__ == "__main__":
    main()
