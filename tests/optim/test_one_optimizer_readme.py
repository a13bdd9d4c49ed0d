"""The "One optimizer" guide (docs/guides/one-optimizer.md), run as written: transformers' Trainer, the
automatic-optimization LightningModule, its LightningCLI config, the spec recipes and a schedule for each
algorithm."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_muon import MuonWithAdamW

from helpers import code_blocks


def blocks(language: str) -> list[str]:
    return code_blocks("guides/one-optimizer.md", language)


def run(block: str, name: str) -> dict:
    namespace: dict = {"__name__": "readme"}
    where = f"docs/guides/one-optimizer.md ({name})"
    exec(compile(block, where, "exec", dont_inherit=True), namespace)  # real annotations
    return namespace


def test_the_section_has_its_examples():
    python, yaml = blocks("python"), blocks("yaml")
    assert len(python) == 4 and len(yaml) == 1
    assert "optimizers=(optimizer, None)" in python[0] and "configure_optimizers" in python[1]
    assert "LambdaLR" in python[3]
    assert "instantiate_class(model, spec)" in python[2] and "class_path: lightning_muon.MuonWithAdamW" in yaml[0]


def test_transformers_trainer_example(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    namespace = run(blocks("python")[0], "transformers")
    trainer = namespace["trainer"]
    assert trainer.optimizer.optimizer is namespace["optimizer"]
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert trainer.state.global_step == 6 and losses[-1] < losses[0]
    adamw = {n for g in namespace["optimizer"].param_groups if g["algorithm"] == "adamw" for n in g["param_names"]}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= adamw


def test_automatic_optimization_example():
    torch.manual_seed(0)
    namespace = run(blocks("python")[1], "LightningModule")
    trainer = namespace["trainer"]
    (optimizer,) = [getattr(o, "optimizer", o) for o in trainer.optimizers]
    assert isinstance(optimizer, MuonWithAdamW) and trainer.global_step == 40
    assert optimizer.param_groups[0]["lr"] == 0.02 and optimizer.param_groups[1]["lr"] == 3e-3
    x, y = namespace["data"].tensors
    assert torch.nn.functional.cross_entropy(trainer.lightning_module.net(x), y).item() < 1.5  # from ln(16) = 2.77


def test_lightning_cli_config_example(tmp_path):
    from lightning.pytorch.cli import LightningCLI

    torch.manual_seed(0)
    namespace = run(blocks("python")[1].split("\ntrainer = ")[0], "LightningModule and data")
    config = tmp_path / "config.yaml"
    config.write_text(blocks("yaml")[0])
    cli = LightningCLI(
        namespace["Model"], save_config_callback=None,
        args=["fit", "--config", str(config), "--trainer.max_steps", "4", "--trainer.logger", "false",
              "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
              "--trainer.default_root_dir", str(tmp_path)],
    )
    (optimizer,) = [getattr(o, "optimizer", o) for o in cli.trainer.optimizers]
    assert isinstance(optimizer, MuonWithAdamW) and cli.trainer.global_step == 4
    assert cli.trainer.accumulate_grad_batches == 2 and cli.trainer.gradient_clip_val == 1.0
    muon, *adamw = optimizer.param_groups
    assert (muon["algorithm"], muon["lr"]) == ("muon", 0.02)
    assert {(g["algorithm"], g["lr"], g["weight_decay"]) for g in adamw} == {("adamw", 0.003, 0.01)}


def test_spec_examples():
    namespace = run(blocks("python")[2], "spec")
    optimizer, same = namespace["optimizer"], namespace["same"]
    assert isinstance(optimizer, MuonWithAdamW) and isinstance(same, MuonWithAdamW)
    for built in (optimizer, same):
        assert [(g["algorithm"], g["name"], g["lr"]) for g in built.param_groups] == [
            ("muon", "hidden", 0.02), ("adamw", "embeddings", 0.003), ("adamw", "head", 0.003),
            ("adamw", "norms_and_biases", 0.003),
        ]
        assert built.param_groups[0]["weight_decay"] == 0.01


class Lrs(L.Callback):
    """Every group's (algorithm, lr) as each update uses it, by update."""

    def __init__(self) -> None:
        self.updates: list[tuple[int, list[tuple[str, float]]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        groups = getattr(optimizer, "optimizer", optimizer).param_groups
        self.updates.append((trainer.global_step, [(g["algorithm"], g["lr"]) for g in groups]))


def test_a_schedule_for_each_algorithm_example():
    torch.manual_seed(0)
    namespace = run(blocks("python")[1].split("\ntrainer = ")[0], "LightningModule and data")
    exec(compile(blocks("python")[3], "docs/guides/one-optimizer.md (a schedule for each algorithm)", "exec",
                 dont_inherit=True), namespace)
    assert namespace["trainer"].global_step == 40
    lrs = Lrs()
    trainer = L.Trainer(max_steps=40, accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[lrs])
    trainer.fit(namespace["Scheduled"]())

    def by_hand(algorithm: str, k: int) -> float:  # 40 updates: Muon warmed up over 4, then the cosine
        if algorithm == "adamw":
            return 3e-3 * 0.5 ** (k // 10)
        return 0.02 * ((k + 1) / 4 if k < 4 else 0.5 * (1 + math.cos(math.pi * (k - 4) / (40 - 4))))

    assert [k for k, _ in lrs.updates] == list(range(40))  # once per update, not per batch
    assert {a for _, groups in lrs.updates for a, _ in groups} == {"muon", "adamw"}
    assert all(lr == by_hand(a, k) for k, groups in lrs.updates for a, lr in groups), lrs.updates
