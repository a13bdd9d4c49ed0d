"""A weight-normed network (``torch.nn.utils.parametrizations.weight_norm``, as HiFi-GAN's, EnCodec's and many TTS
models' convs) trained through a real Trainer: each magnitude (``original0``, ``out x 1 x 1``) on AdamW, updated
exactly as torch's AdamW updates it; each hidden direction (``original1``) on Muon, its update orthogonalised
exactly as Muon orthogonalises the kernel it is; the stem's and the head's directions on AdamW as the first batch
shows them; and a bare position table, only added, on AdamW."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from lightning_muon import MuonMixin
from lightning_muon.optim.defaults import PAIRED_ADAMW

from helpers import make_trainer, muon_factory, raw_optimizers

WN = "parametrizations.weight.original"


class Vocoder(L.LightningModule):
    """A 1-channel stem, two hidden convs and a Linear head, all weight-normed; a learned table added over time."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.stem = weight_norm(nn.Conv1d(1, 16, 5, padding=2))
            self.convs = nn.ModuleList([weight_norm(nn.Conv1d(16, 16, 3, padding=1)) for _ in range(2)])
            self.time = nn.Parameter(torch.randn(16, 12) * 0.1)  # (channels x time), added
            self.head = weight_norm(nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = F.leaky_relu(self.stem(x)) + self.time
        for conv in self.convs:
            h = h + F.leaky_relu(conv(h))
        return F.mse_loss(self.head(h.transpose(1, 2)).squeeze(-1), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 1, 12, generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, 0].roll(1, -1)), batch_size=8)


class MuonVocoder(MuonMixin, Vocoder):
    pass


PLACED = [
    [("hidden", [f"convs.0.{WN}1", f"convs.1.{WN}1"])],
    [("embeddings", ["time"]),
     ("input", [f"stem.{WN}1"]),
     ("head", ["head.bias", f"head.{WN}0", f"head.{WN}1"]),
     ("norms_and_biases", ["stem.bias", f"stem.{WN}0", "convs.0.bias", f"convs.0.{WN}0", "convs.1.bias",
                           f"convs.1.{WN}0"])],
]


def test_every_tensor_of_a_weight_normed_net_is_placed_and_updated_as_what_it_is(tmp_path):
    model = MuonVocoder(muon=muon_factory())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the gradients of the first update, from a twin (parametrized modules cannot be deep-copied)
    twin = Vocoder()
    batch = next(iter(twin.train_dataloader()))
    twin.log = lambda *a, **k: None
    twin.training_step(batch, 0).backward()
    grads = {n: p.grad for n, p in twin.named_parameters()}

    make_trainer(tmp_path, max_steps=1).fit(model)
    assert [[(g["name"], list(g["param_names"])) for g in o.param_groups] for o in raw_optimizers(model)] == PLACED
    routes = {r.name: r for r in model.muon_routing().routes}
    assert routes[f"convs.0.{WN}0"].reason == "not a matrix: weight norm's magnitude of `convs.0.weight` (16x1x1), " \
                                             "a scale per output"
    assert routes[f"convs.0.{WN}1"].reason == "3D kernel, orthogonalised as 16x48; weight norm's direction of " \
                                             "`convs.0.weight`"
    after = dict(model.named_parameters())

    # every magnitude, and the table, as torch's AdamW (the pair's, fused on CPU) would step it alone
    for name in [f"stem.{WN}0", f"convs.0.{WN}0", f"convs.1.{WN}0", f"head.{WN}0", "time", f"stem.{WN}1"]:
        reference = before[name].clone().requires_grad_()
        reference.grad = grads[name]
        torch.optim.AdamW([reference], lr=PAIRED_ADAMW.lr, betas=PAIRED_ADAMW.betas,
                          weight_decay=PAIRED_ADAMW.weight_decay, fused=True).step()
        assert torch.equal(after[name].detach(), reference.detach()), name

    # each hidden direction as Muon steps the conv kernel it is: its update orthogonalised as one 16x48 matrix
    for name in [f"convs.0.{WN}1", f"convs.1.{WN}1"]:
        reference = before[name].clone().requires_grad_()
        reference.grad = grads[name]
        muon = muon_factory()([reference])
        muon.step()
        assert torch.equal(after[name].detach(), reference.detach()), name
        # orthogonalised: the gradient's singular values spread over two orders of magnitude, the update's do not
        update = (before[name] * (1 - muon.param_groups[0]["lr"] * 0.01) - after[name].detach()).flatten(1)
        singular = torch.linalg.svdvals(update)
        spread = torch.linalg.svdvals(grads[name].flatten(1))
        assert spread.max() > 20 * spread.median()
        assert int(((singular > 0.6 * singular.median()) & (singular < 1.5 * singular.median())).sum()) >= 15
