"""transformers' ``Trainer`` with `MuonWithAdamW`: tiny randomly initialised Llama and GPT-2 models (never
downloaded), trained a few steps with gradient accumulation, through ``optimizers=(opt, None)`` and through
``optimizer_cls_and_kwargs``; the routing, a falling loss, and a checkpoint resume that ends on the very weights
of the uninterrupted run."""

from __future__ import annotations

import itertools
import warnings
from pathlib import Path

import pytest
import torch

from lightning_muon import MuonWithAdamW

transformers = pytest.importorskip("transformers")

VOCAB, LENGTH = 48, 16
STEPS, SAVE_AT = 6, 3
KWARGS = {"lr": 0.05, "adamw_lr": 1e-2, "weight_decay": 0.01}


def llama() -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=LENGTH,
    )
    return transformers.LlamaForCausalLM(config)


def gpt2() -> transformers.PreTrainedModel:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=LENGTH,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": llama, "gpt2": gpt2}
#: Parameters that must be AdamW's (embeddings and head), and some that must be Muon's, per model.
ADAMW_NAMES = {
    "llama": {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"},
    "gpt2": {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight"},
}
MUON_NAMES = {
    "llama": {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"},
    "gpt2": {"transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"},
}


class Sequences(torch.utils.data.Dataset):
    """Arithmetic progressions modulo the vocabulary: a pattern a tiny model learns in a few steps."""

    def __init__(self, count: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        start, stride = torch.randint(VOCAB, (count, 1), generator=g), torch.randint(1, 4, (count, 1), generator=g)
        self.ids = (start + stride * torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_model(kind: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return MODELS[kind]()


def train(kind: str, out: Path, *, by_class: bool = False, resume: Path | None = None, steps: int = STEPS):
    model = make_model(kind)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        save_strategy="steps", save_steps=SAVE_AT, logging_steps=1, use_cpu=True, report_to=[], seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    if by_class:
        setup = {"optimizer_cls_and_kwargs": (MuonWithAdamW, {"model": model, **KWARGS})}
    else:
        setup = {"optimizers": (MuonWithAdamW.from_model(model, **KWARGS), None)}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Sequences(), **setup)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notes about the CPU run
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return trainer


def unwrapped(optimizer) -> MuonWithAdamW:
    """The optimizer inside accelerate's ``AcceleratedOptimizer``."""
    inner = optimizer.optimizer
    assert isinstance(inner, MuonWithAdamW)
    return inner


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.slow  # 5-12 s each (transformers' first import: 6 s more)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_trainer_trains_routes_and_resumes_exactly(kind, tmp_path):
    through = train(kind, tmp_path / "through")
    optimizer = unwrapped(through.optimizer)
    names = {g["algorithm"]: set() for g in optimizer.param_groups}
    for group in optimizer.param_groups:
        names[group["algorithm"]].update(group["param_names"])
    assert ADAMW_NAMES[kind] <= names["adamw"] and MUON_NAMES[kind] <= names["muon"]
    assert not names["adamw"] & names["muon"]
    if kind == "gpt2":  # the head is tied to the token embedding: once, on AdamW
        assert "lm_head.weight" not in names["muon"] | names["adamw"]
        assert optimizer.param_groups[0]["matrix_layouts"][0] == "in_out"  # Conv1D weights, stored in x out
    steps = losses(through)
    assert len(steps) == STEPS and steps[-1] < 0.9 * steps[0], steps
    print(f"{kind}: loss {steps[0]:.4f} -> {steps[-1]:.4f} in {STEPS} steps")
    # the scheduler transformers made (linear decay) drove both algorithms' lrs
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0) and optimizer.param_groups[0]["initial_lr"] == 0.05

    resumed = train(kind, tmp_path / "resumed", resume=tmp_path / "through" / f"checkpoint-{SAVE_AT}")
    assert resumed.state.global_step == STEPS
    expected, got = through.model.state_dict(), resumed.model.state_dict()
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), f"{name}: {(expected[name] - got[name]).abs().max()}"
    assert losses(resumed) == steps  # the first SAVE_AT from the checkpoint's history, the rest run again


def test_optimizer_cls_and_kwargs_builds_it_from_the_model(tmp_path):
    by_class = train("gpt2", tmp_path / "by_class", by_class=True, steps=3)
    by_instance_model = make_model("gpt2")
    assert [g["param_names"] for g in unwrapped(by_class.optimizer).param_groups] == [
        g["param_names"] for g in MuonWithAdamW.from_model(by_instance_model).param_groups
    ]
    steps = losses(by_class)
    assert all(later < earlier for earlier, later in itertools.pairwise(steps)), steps


def test_transformers_own_param_groups_are_refused_with_the_fix(tmp_path):
    model = make_model("llama")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to=[])
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Sequences(8), optimizer_cls_and_kwargs=(MuonWithAdamW, KWARGS)
    )
    with pytest.raises(ValueError, match=r"no 'algorithm'.*optimizer_cls_and_kwargs=\(MuonWithAdamW, \{'model'"):
        trainer.create_optimizer()
