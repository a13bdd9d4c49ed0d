"""A byte-level Llama-style GPT that Lightning's ``ModelParallelStrategy`` splits: tensor parallel, and in 2-D
FSDP2 over tensor parallel.

`ParallelGPT` is the shape of the model in Lightning's tensor-parallel tutorial (pre-norm blocks of causal
attention ``wq``/``wk``/``wv``/``wo`` and a SwiGLU feed-forward ``w1``/``w3``/``w2``, RMSNorm, no biases), as a
`lightning_muon.examples.char_gpt.ByteLM` on the same data as `CharGPT`
(`lightning_muon.examples.text_data.StdlibTextDataModule`: this machine's standard library sources, nothing
downloaded). Its ``configure_model`` reads ``self.device_mesh`` as the tutorial does (`parallelize`):

- ``tensor_parallel`` larger than 1: every block gets the tutorial plan (`TP_PLAN`): the attention and
  feed-forward projections become DTensors, ``ColwiseParallel`` (``Shard(0)``) for ``wq``, ``wk``, ``wv``,
  ``w1``, ``w3`` and ``RowwiseParallel`` (``Shard(1)``) for ``wo``, ``w2``; the embeddings, norms and head stay
  plain tensors;
- ``data_parallel`` larger than 1: ``fully_shard`` (FSDP2) over that mesh dimension, every block and then the
  whole model (Lightning's 2-D example).

`CharParallelGPT` is the Muon version, one line (``class CharParallelGPT(MuonMixin, ParallelGPT)``)::

    lightning-muon fit --config gpt_muon_tp.yaml   # TP(2): 2 CPU processes
    lightning-muon fit --config gpt_muon_2d.yaml   # dp=2 x tp=2: 4 CPU processes

Without a ``ModelParallelStrategy`` (one process, DDP) the model stays as built.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from torch.nn import functional as F

from lightning_muon import MuonMixin
from lightning_muon.attention import QKLayout, QKProjection, record_qk
from lightning_muon.examples.char_gpt import ByteLM
from lightning_muon.examples.text_data import StdlibTextDataModule

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TP_PLAN", "Block", "CharParallelGPT", "ParallelGPT", "StdlibTextDataModule", "parallelize"]

#: Lightning's tensor-parallel tutorial plan for one `Block`: the inputs of ``wq``, ``wk``, ``wv``, ``w1``, ``w3``
#: are replicated and their outputs sharded by feature (``Shard(0)`` weights), ``wo`` and ``w2`` take those shards
#: and all-reduce their outputs (``Shard(1)`` weights).
TP_PLAN: dict[str, ParallelStyle] = {
    "wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel(),
    "w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel(),
}


class Block(nn.Module):
    """``x + wo(attention(norm1(x)))``, then ``x + w2(silu(w1(h)) * w3(h))`` with ``h = norm2(x)``.

    The heads are read from the projections' output width (``head_dim`` each), so under tensor parallelism a
    rank computes the ``n_head / tp`` heads of its shard of ``wq``, ``wk``, ``wv`` with nothing to change.
    `lightning_muon.QKClip` finds its attention through ``qk_layout`` and the q and k its forward hands to
    `lightning_muon.attention.record_qk` (the adapter), under tensor parallelism too.
    """

    def __init__(self, n_embd: int, n_head: int, hidden: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.norm1, self.norm2 = nn.RMSNorm(n_embd), nn.RMSNorm(n_embd)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(n_embd, n_embd, bias=False) for _ in range(4))
        self.w1, self.w3 = nn.Linear(n_embd, hidden, bias=False), nn.Linear(n_embd, hidden, bias=False)
        self.w2 = nn.Linear(hidden, n_embd, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, time, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(batch, time, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        record_qk(self, q, k, scale=self.head_dim**-0.5, causal=True)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, time, -1)
        x = x + self.wo(attention)
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


    def qk_layout(self) -> QKLayout:
        """Where the query and key heads are, for `lightning_muon.QKClip` (all ``n_head`` of them: under tensor
        parallelism each rank holds and computes a block of them)."""
        query, key, value = QKProjection(self.wq.weight), QKProjection(self.wk.weight), QKProjection(self.wv.weight)
        return QKLayout(query, key, num_heads=self.n_head, num_kv_heads=self.n_head, head_dim=self.head_dim,
                        value=value)


class ParallelGPT(ByteLM):
    """A Llama-style byte-level language model whose blocks Lightning's ``ModelParallelStrategy`` parallelises.

    Batches, logs and the closing result line are `lightning_muon.examples.char_gpt.GPT`'s (``(inputs,
    targets)`` windows; ``train_loss``, ``val_loss``, ``val_bpb``). On its own it trains with AdamW (lr 1e-3);
    `CharParallelGPT` is the Muon version.

    Args:
        n_layer: transformer blocks.
        n_head: attention heads per block; must divide ``n_embd`` and, under tensor parallelism, be a multiple
            of the tensor-parallel size.
        n_embd: width of the residual stream.
        hidden: width of the SwiGLU feed-forward (``w1``, ``w3`` out, ``w2`` in); default ``3 * n_embd``
            (Llama's ``8/3 * n_embd`` rounded up). A multiple of the tensor-parallel size.
        block_size: longest context (rows of the learned position embedding ``wpe``).
        vocab_size: token ids are below it (256: bytes).
    """

    def __init__(
        self,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        hidden: int | None = None,
        block_size: int = 128,
        vocab_size: int = 256,
    ) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_head must divide n_embd, got n_head={n_head} and n_embd={n_embd}")
        self.save_hyperparameters()
        self.n_head, self.hidden, self.block_size = n_head, hidden or 3 * n_embd, block_size
        self.embedding = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, self.hidden) for _ in range(n_layer))
        self.norm = nn.RMSNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        for name, p in self.named_parameters():  # GPT-2's init: residual projections scaled by depth
            if p.ndim == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits ``(batch, time, vocab_size)`` for token ids ``idx`` of shape ``(batch, time)``."""
        time = idx.shape[1]
        if time > self.block_size:
            raise ValueError(f"sequence of {time} tokens is longer than block_size={self.block_size}")
        x = self.embedding(idx) + self.wpe(torch.arange(time, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy``: tensor parallel and FSDP2 as its device mesh says (`parallelize`)."""
        if self.device_mesh is None:  # one process, DDP
            return
        parallelize(self, self.device_mesh)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW on every parameter: used by `ParallelGPT` alone, never by `CharParallelGPT` (the mixin brings its
        own pair)."""
        return torch.optim.AdamW(self.parameters(), lr=1e-3, betas=(0.9, 0.95))


def parallelize(model: ParallelGPT, device_mesh: DeviceMesh) -> ParallelGPT:
    """Apply the parallelisms ``device_mesh`` asks for (its ``"tensor_parallel"`` and ``"data_parallel"``
    dimensions, as ``ModelParallelStrategy`` names them) to ``model``, in place; returns it. A second call is a
    no-op (Lightning may call ``configure_model`` again on a model it has already set up)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    if any(isinstance(p, DTensor) for p in model.parameters()):
        return model
    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    tp = tp_mesh.size()
    if tp > 1:
        if model.n_head % tp or model.hidden % tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must divide n_head={model.n_head} and hidden={model.hidden}: each rank "
                "holds whole heads and an equal slice of the feed-forward"
            )
        for block in model.blocks:
            parallelize_module(block, tp_mesh, TP_PLAN)
    if dp_mesh.size() > 1:  # 2-D (or FSDP2 alone): shard over the data-parallel dimension, blocks first
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


class CharParallelGPT(MuonMixin, ParallelGPT):
    """`ParallelGPT` trained with Muon on the block matrices (``wq``, ``wk``, ``wv``, ``wo``, ``w1``, ``w2``,
    ``w3``) and AdamW on the embeddings, norms and head.

    Takes `ParallelGPT`'s arguments and `lightning_muon.MuonMixin`'s keyword-only optimizer arguments
    (``muon``, ``adamw``, ``lr_scheduler``, ...). Under tensor parallelism on a 1-D mesh Muon orthogonalises
    each sharded matrix whole on one owner rank (owners spread over the ranks); in 2-D it falls back to every
    rank orthogonalising every whole matrix (said once at the first step).
    """
