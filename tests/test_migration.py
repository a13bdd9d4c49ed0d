"""The migration page (docs/guides/migration.md): each before/after pair run on the page's model. The after trains
the same parameters with the same optimizer as the before; for Keller Jordan's `MuonWithAuxAdam` (re-written here
from the description on his public repository, KellerJordan/Muon) the after makes his updates: equal to 1e-6
with fp32 Newton-Schulz on both sides, close with bf16 as written; torch's split by hand likewise, in bf16."""

from __future__ import annotations

import copy
import functools
import types

import pytest
import torch
from torch import nn

import lightning_muon

from helpers import code_blocks, tiny_llama

PAGE = "guides/migration.md"
SETUP, KELLER_BEFORE, KELLER_AFTER, TORCH_BEFORE, TORCH_AFTER, TRAINER_BEFORE, TRAINER_AFTER = range(7)


def block(index: int) -> str:
    return code_blocks(PAGE)[index]


class AuxAdam(torch.optim.Optimizer):
    """Keller Jordan's ``SingleDeviceMuonWithAuxAdam`` as his repository describes it: groups flagged
    ``use_muon``; on those, momentum ``lerp``, the Nesterov ``lerp``, his quintic Newton-Schulz in ``ns_dtype``
    (bf16 in his code) on the matrix normalised by ``norm + 1e-7``, scaled by ``sqrt(max(1, rows / cols))``,
    decoupled weight decay; on the others Adam with bias correction, ``eps`` outside the root, decoupled decay."""

    ns_dtype = torch.bfloat16

    def __init__(self, param_groups):
        for group in param_groups:
            defaults = ({"lr": 0.02, "momentum": 0.95, "weight_decay": 0} if group["use_muon"] else
                        {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0})
            for key, value in defaults.items():
                group.setdefault(key, value)
        super().__init__(param_groups, {})

    def orthogonalise(self, update):
        a, b, c = 3.4445, -4.7750, 2.0315
        tall = update.size(0) > update.size(1)
        x = (update.T if tall else update).to(self.ns_dtype)
        x = x / (x.norm() + 1e-7)
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return (x.T if tall else x) * max(1, update.size(0) / update.size(1)) ** 0.5

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state, grad = self.state[p], p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"])
                if group["use_muon"]:
                    momentum = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    momentum.lerp_(grad, 1 - group["momentum"])
                    update = self.orthogonalise(grad.lerp(momentum, group["momentum"]).flatten(1))
                    p.add_(update.reshape(p.shape).to(p.dtype), alpha=-group["lr"])
                else:
                    if not state:
                        state.update(m=torch.zeros_like(p), v=torch.zeros_like(p), step=0)
                    state["step"] += 1
                    (beta1, beta2), t = group["betas"], state["step"]
                    state["m"].lerp_(grad, 1 - beta1)
                    state["v"].lerp_(grad.square(), 1 - beta2)
                    denominator = (state["v"] / (1 - beta2 ** t)).sqrt() + group["eps"]
                    p.add_(state["m"] / (1 - beta1 ** t) / denominator, alpha=-group["lr"])


@pytest.fixture
def page_model() -> nn.Module:
    torch.manual_seed(0)
    namespace: dict = {}
    exec(compile(block(SETUP), f"{PAGE} block {SETUP}", "exec"), namespace)
    return namespace["model"]


def run(index: int, model: nn.Module, **names) -> dict:
    namespace = {"torch": torch, "nn": nn, "model": model, **names}
    exec(compile(block(index), f"{PAGE} block {index}", "exec"), namespace)
    return namespace


def train(model: nn.Module, optimizers: list, steps: int = 5) -> float:
    idx = torch.randint(64, (16, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.roll(1, 1).flatten())
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        model.zero_grad()
    return loss.item()


def muon_params(optimizer) -> set[int]:
    """The ids of the parameters a Muon group of ``optimizer`` holds (`AuxAdam`'s ``use_muon`` ones; all of a
    Muon's)."""
    return {id(p) for g in optimizer.param_groups if g.get("use_muon", True) for p in g["params"]}


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 as written"])
def test_keller_jordan_s_optimizer_and_its_replacement_make_the_same_updates(ns_dtype, page_model, monkeypatch):
    monkeypatch.setattr(AuxAdam, "ns_dtype", ns_dtype)
    monkeypatch.setitem(__import__("sys").modules, "muon", types.SimpleNamespace(SingleDeviceMuonWithAuxAdam=AuxAdam))
    if ns_dtype == torch.float32:  # both sides in fp32, one matrix at a time: the arithmetic itself compared
        monkeypatch.setattr(lightning_muon, "MuonWithAdamW", functools.partial(
            lightning_muon.MuonWithAdamW, ns_dtype=torch.float32, ns_batch_bytes=0))
    before, after = page_model, copy.deepcopy(page_model)
    keller = run(KELLER_BEFORE, before)["optimizer"]
    ours = run(KELLER_AFTER, after)["optimizer"]
    routed = set(ours.routing.names("Muon"))
    by_hand = {name for name, p in before.named_parameters() if id(p) in muon_params(keller)}
    assert routed == by_hand == {"blocks.0.weight", "blocks.2.weight"}
    losses = train(before, [keller]), train(after, [ours])
    tolerance = 1e-6 if ns_dtype == torch.float32 else 5e-3
    assert max_difference(before, after) < tolerance, losses
    assert abs(losses[0] - losses[1]) < tolerance


def test_torch_s_split_by_hand_and_route_parameters_train_the_same_parameters_alike(page_model):
    before, after = page_model, copy.deepcopy(page_model)
    torch_side = run(TORCH_BEFORE, before)["optimizers"]
    ours = run(TORCH_AFTER, after)
    assert isinstance(torch_side[0], torch.optim.Muon) and isinstance(ours["optimizers"][0], lightning_muon.Muon)
    hand = {name for name, p in before.named_parameters() if id(p) in muon_params(torch_side[0])}
    assert set(ours["routing"].names("Muon")) == hand == {"blocks.0.weight", "blocks.2.weight"}
    losses = train(before, torch_side), train(after, ours["optimizers"])
    assert max_difference(before, after) < 5e-3, losses  # bf16 Newton-Schulz on both sides, batched on ours


@pytest.mark.slow
def test_the_transformers_trainer_pair_trains_with_the_optimizer_it_names(tmp_path):
    import transformers

    class Sequences(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            ids = (i + torch.arange(16)) % 64
            return {"input_ids": ids, "labels": ids}

    for index, optimizer_class in [(TRAINER_BEFORE, torch.optim.AdamW), (TRAINER_AFTER, lightning_muon.MuonWithAdamW)]:
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(index)), max_steps=2, use_cpu=True,
                                              report_to=[], per_device_train_batch_size=4, disable_tqdm=True)
        trainer = run(index, None, llama=tiny_llama(), args=args, data=Sequences())["trainer"]
        result = trainer.train()
        assert type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer) \
            is optimizer_class
        assert result.global_step == 2 and result.training_loss == result.training_loss  # ran, and not NaN
