"""torch's own layers beyond Linear, attention and plain convolutions, routed and stepped as their structure says.

- A grouped convolution (``Conv{1,2,3}d(groups=g)``, and transposed: ``ConvTranspose2d(groups=g)``) is a stack of
  ``g`` matrices along dim 0, its groups': routed with those blocks, each group's kernel steps exactly as a separate
  convolution holding it would (first checked to compute the group's outputs, so the blocks are the layer's
  operators), bit for bit, on the batched and the unbatched (``ns_batch_bytes=0``) paths; a ``matrix_blocks``
  pattern keeps one whole (the routing before). Depthwise kernels likewise, each channel's filter alone.
- ``nn.LSTM``/``nn.GRU`` (and their cells) stack their gates in the rows of every ``weight_ih``/``weight_hh``: named
  as fused gates in the table and, by default (measured better), each gate's matrix steps exactly as a separate
  parameter; kept whole by a pattern, or where the Muon class cannot split (``torch.optim.Muon``).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_muon import Muon
from lightning_muon.routing import ADAMW, MUON, route_parameters, trace_roles

#: case -> (the grouped convolution, a separate convolution's class and keywords, the input's shape)
GROUPED = {
    "conv1d": (lambda: nn.Conv1d(8, 12, 5, groups=2), nn.Conv1d, {"kernel_size": 5}, (2, 8, 11)),
    "conv1d-tall": (lambda: nn.Conv1d(8, 24, 1, groups=2), nn.Conv1d, {"kernel_size": 1}, (2, 8, 7)),  # 12x4 each
    "conv2d": (lambda: nn.Conv2d(16, 16, 3, padding=1, groups=4), nn.Conv2d, {"kernel_size": 3, "padding": 1},
               (2, 16, 6, 6)),
    # a kernel whose groups cannot be viewed as one stack (channels last): its blocks go one by one
    "conv2d-channels-last": (lambda: nn.Conv2d(16, 16, 3, padding=1, groups=4).to(memory_format=torch.channels_last),
                             nn.Conv2d, {"kernel_size": 3, "padding": 1}, (2, 16, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(8, 8, 3, groups=2), nn.Conv3d, {"kernel_size": 3}, (2, 8, 4, 4, 4)),
    # weight in x out/groups x k x k: a group's block is its in/groups input channels' rows
    "transposed2d": (lambda: nn.ConvTranspose2d(16, 8, 4, stride=2, groups=4), nn.ConvTranspose2d,
                     {"kernel_size": 4, "stride": 2}, (2, 16, 3, 3)),
    "depthwise2d": (lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d, {"kernel_size": 3, "padding": 1},
                    (2, 8, 5, 5)),
}


def _separate(conv: nn.modules.conv._ConvNd, cls: type[nn.Module], kwargs: dict) -> list[nn.Module]:
    """``conv``'s groups as separate convolutions: group ``j`` reads input channels ``j*in/g`` on and writes output
    channels ``j*out/g`` on; its kernel is the ``j``-th block of ``conv.weight`` along dim 0."""
    g = conv.groups
    layers = []
    for j, block in enumerate(conv.weight.detach().chunk(g, dim=0)):
        layer = cls(conv.in_channels // g, conv.out_channels // g, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(block)
            layer.bias.copy_(conv.bias.detach().chunk(g)[j])
        layers.append(layer)
    return layers


@pytest.mark.parametrize("batch_bytes", [None, 0], ids=["batched", "unbatched"])
@pytest.mark.parametrize("case", list(GROUPED))
def test_each_group_steps_as_a_separate_convolution(case, batch_bytes):
    make, cls, kwargs, input_shape = GROUPED[case]
    torch.manual_seed(0)
    conv = make()
    separate = _separate(conv, cls, kwargs)
    x = torch.randn(input_shape)
    outputs = [layer(part) for layer, part in zip(separate, x.chunk(conv.groups, dim=1), strict=True)]
    torch.testing.assert_close(conv(x), torch.cat(outputs, dim=1))  # the blocks are the groups' operators

    routing = route_parameters(conv)
    (route,) = [r for r in routing.routes if r.name == "weight"]
    rows, cols = conv.weight.shape[0] // conv.groups, math.prod(conv.weight.shape[1:])
    assert route.optimizer == MUON and route.blocks == (rows,) * conv.groups
    assert route.reason.endswith(f"kernel of {conv.groups} groups; each group orthogonalised alone as {rows}x{cols}")
    settings = {"lr": 0.02, "weight_decay": 0.1, "ns_batch_bytes": batch_bytes}
    grouped = Muon(routing.muon_groups, **settings)
    apart = Muon([layer.weight for layer in separate], **settings)
    whole = nn.Parameter(conv.weight.detach().clone())
    flattened = Muon([whole], **settings)  # the routing before: one matrix across the groups
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        conv.weight.grad = torch.randn(conv.weight.shape, generator=g)
        whole.grad = conv.weight.grad.clone()
        for layer, block in zip(separate, conv.weight.grad.chunk(conv.groups, dim=0), strict=True):
            layer.weight.grad = block.clone()
        grouped.step()
        apart.step()
        flattened.step()
    assert torch.equal(conv.weight.detach(), torch.cat([layer.weight.detach() for layer in separate]))
    assert (conv.weight.detach() - whole.detach()).abs().max() > 1e-3


def test_the_table_names_the_groups_and_a_pattern_keeps_a_kernel_whole():
    model = nn.Sequential(nn.Conv2d(8, 64, 3), nn.Conv2d(64, 64, 3, groups=4), nn.Conv2d(64, 64, 3, groups=64),
                          nn.ConvTranspose2d(64, 32, 4, stride=2, groups=4))
    routes = {r.name: r for r in route_parameters(model).routes}
    assert (routes["0.weight"].reason, routes["0.weight"].blocks) == ("4D kernel, orthogonalised as 64x72", None)
    assert routes["1.weight"].reason == "4D kernel of 4 groups; each group orthogonalised alone as 16x144"
    assert routes["2.weight"].reason == "4D depthwise kernel of 64 groups; each group orthogonalised alone as 1x9"
    assert routes["3.weight"].reason == "4D kernel of 4 groups; each group orthogonalised alone as 16x128"
    kept = {r.name: r for r in route_parameters(model, matrix_blocks={"1.weight": None}).routes}["1.weight"]
    assert kept.blocks is None
    assert kept.reason == ("4D kernel of 4 groups; orthogonalised whole as 64x144, across its groups "
                           "(matrix_blocks '1.weight')")
    muon_group = route_parameters(model).muon_groups[0]
    assert muon_group["matrix_blocks"] == [None, [16] * 4, [1] * 64, [16] * 4]


def test_with_torch_muon_grouped_kernels_stay_on_adamw():
    """``torch.optim.Muon`` takes matrices only (``muon_nd=False``): a grouped kernel goes to AdamW like any other
    kernel, no blocks asked of it."""
    route = route_parameters(nn.Conv2d(8, 8, 3, groups=2), muon_nd=False).routes[0]
    assert (route.optimizer, route.blocks) == (ADAMW, None)


# ------------------------------------------------------------------ recurrent gates


class Recurrent(nn.Module):
    """An LSTM (2 layers, both directions, projected to 4), a GRU and the two cells, one after the other."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8)
        self.lstm = nn.LSTM(8, 12, num_layers=2, bidirectional=True, proj_size=4, batch_first=True)
        self.gru = nn.GRU(8, 6, batch_first=True)
        self.lstm_cell = nn.LSTMCell(6, 5)
        self.gru_cell = nn.GRUCell(5, 7)
        self.rnn = nn.RNN(7, 3, batch_first=True)
        self.head = nn.Linear(3, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, _ = self.lstm(self.embedding(tokens))
        x, _ = self.gru(x)
        x = self.gru_cell(self.lstm_cell(x[:, -1])[0])
        x, _ = self.rnn(x.unsqueeze(1))
        return self.head(x[:, -1])


#: parameter -> (what its blocks are, their sizes)
GATES = {
    **{f"lstm.weight_{kind}_l{layer}{direction}": ("LSTM gates i, f, g, o", (12,) * 4)
       for kind in ("ih", "hh") for layer in (0, 1) for direction in ("", "_reverse")},
    "gru.weight_ih_l0": ("GRU gates r, z, n", (6,) * 3), "gru.weight_hh_l0": ("GRU gates r, z, n", (6,) * 3),
    "lstm_cell.weight_ih": ("LSTM gates i, f, g, o", (5,) * 4),
    "lstm_cell.weight_hh": ("LSTM gates i, f, g, o", (5,) * 4),
    "gru_cell.weight_ih": ("GRU gates r, z, n", (7,) * 3), "gru_cell.weight_hh": ("GRU gates r, z, n", (7,) * 3),
}
#: One matrix each: the projection of an LSTM with proj_size, nn.RNN's.
SINGLE = [f"lstm.weight_hr_l{layer}{direction}" for layer in (0, 1) for direction in ("", "_reverse")] + [
    "rnn.weight_ih_l0", "rnn.weight_hh_l0"]


def test_recurrent_gates_are_split_by_default_and_named_in_the_table():
    """Each gate-stacked weight is split into its gates (measured better: ``benchmarks/torch_layers.py``) and the
    table says so; the single matrices stay single, the biases are biases."""
    torch.manual_seed(0)
    routing = route_parameters(Recurrent())
    routes = {r.name: r for r in routing.routes}
    for name, (what, sizes) in GATES.items():
        assert routes[name].optimizer == MUON and routes[name].blocks == sizes
        assert routes[name].reason == (f"hidden matrix; fused {what} {'+'.join(map(str, sizes))}: each gate "
                                       "orthogonalised alone (measured, benchmarks/torch_layers.py)")
        assert routes[name].reason in routing.plain_table()
    assert all((routes[name].reason, routes[name].blocks) == ("hidden matrix", None) for name in SINGLE)
    biases = [name for name in routes if ".bias_" in name]
    assert len(biases) == 16 and all((routes[n].group, routes[n].reason) == ("norms_and_biases", "bias")
                                     for n in biases)


def test_recurrent_gates_stay_whole_where_asked_or_where_the_muon_class_cannot_split():
    torch.manual_seed(0)
    kept = {r.name: r for r in route_parameters(Recurrent(), matrix_blocks={"gru.*": None}).routes}
    assert kept["gru.weight_hh_l0"].blocks is None
    assert kept["gru.weight_hh_l0"].reason == ("hidden matrix; fused GRU gates r, z, n 6+6+6, orthogonalised whole "
                                               "(matrix_blocks 'gru.*')")
    assert kept["lstm.weight_ih_l0"].blocks == (12,) * 4
    torch_muon = {r.name: r for r in route_parameters(Recurrent(), muon_nd=False).routes}
    assert all(torch_muon[name].blocks is None for name in GATES)
    assert torch_muon["lstm_cell.weight_ih"].reason == ("hidden matrix; fused LSTM gates i, f, g, o 5+5+5+5, "
                                                        "orthogonalised whole (torch.optim.Muon cannot split)")


def test_each_gate_steps_as_a_separate_matrix():
    """Three steps of every gate-stacked weight equal a Muon over the same matrices with each gate a separate
    parameter (same gradients), bit for bit; the single matrices step as before."""
    torch.manual_seed(0)
    model = Recurrent()
    routing = route_parameters(model)
    (group,) = routing.muon_groups
    pieces = {name: [nn.Parameter(b.detach().clone()) for b in p.split(list(sizes))] if sizes else
              [nn.Parameter(p.detach().clone())]
              for (name, p), sizes in zip(group["params"], group["matrix_blocks"], strict=True)}
    split = Muon(routing.muon_groups, lr=0.02, weight_decay=0.1)
    reference = Muon([p for ps in pieces.values() for p in ps], lr=0.02, weight_decay=0.1)
    fused = [nn.Parameter(p.detach().clone()) for _, p in group["params"]]
    whole = Muon(fused, lr=0.02, weight_decay=0.1)  # the routing before: each weight one matrix
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for (name, p), q in zip(group["params"], fused, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
            for piece, grad in zip(pieces[name], p.grad.split([q.shape[0] for q in pieces[name]]), strict=True):
                piece.grad = grad.clone()
        split.step()
        reference.step()
        whole.step()
    for (name, p), q in zip(group["params"], fused, strict=True):
        assert torch.equal(p.detach(), torch.cat([piece.detach() for piece in pieces[name]])), name
        if name in GATES:
            assert (p.detach() - q.detach()).abs().max() > 1e-3, name


def test_an_lstm_reading_the_batch_itself_has_its_input_side_on_adamw():
    """Fed one-hot bytes (no embedding), the LSTM's first layer reads the batch: its ``weight_ih_l0`` (both
    directions) is an input layer, found by the first batch through the recurrent op; the rest are hidden."""

    class OneHot(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(16, 8, num_layers=2, bidirectional=True, batch_first=True)
            self.head = nn.Linear(16, 16)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(nn.functional.one_hot(tokens, 16).float())[0])

    torch.manual_seed(0)
    model = OneHot()
    tokens = torch.randint(0, 16, (2, 5))

    def loss_of(batch):
        return nn.functional.cross_entropy(model(batch).flatten(0, 1), batch.flatten())

    routes = {r.name: r for r in route_parameters(model, graph=trace_roles(model, tokens, loss_of)).routes}
    inputs = {n for n, r in routes.items() if r.group == "input"}
    assert inputs == {"lstm.weight_ih_l0", "lstm.weight_ih_l0_reverse"}
    hidden = {n for n, r in routes.items() if r.optimizer == MUON}
    assert hidden == {"lstm.weight_hh_l0", "lstm.weight_hh_l0_reverse", "lstm.weight_ih_l1", "lstm.weight_hh_l1",
                      "lstm.weight_ih_l1_reverse", "lstm.weight_hh_l1_reverse"}
