"""Other libraries' models as examples (`lightning_muon.examples.third_party`), fine-tuning from saved weights
(`GPT(init_from=...)`), and the configs the tuned studies (``benchmarks/third_party.py``, ``finetune.py``) write:
each a real fit, or parsed by the real CLI."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from lightning_muon.examples.char_gpt import GPT, CharGPT
from lightning_muon.examples.digits_cnn import DigitsDataModule
from lightning_muon.examples.third_party import MuonThirdPartyDigits, MuonThirdPartyLM, ThirdPartyLM

from helpers import make_trainer, read_metrics

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
FAST_ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "betas": [0.9, 0.95]}}
#: What routing must put on AdamW in each family, by role (the rest of the 2D weights: Muon).
LM_ADAMW = {
    "llama": {"model.model.embed_tokens.weight", "model.lm_head.weight"},
    "gpt2": {"model.transformer.wte.weight", "model.transformer.wpe.weight"},  # the head is tied to wte
    "litgpt": {"model.transformer.wte.weight", "model.lm_head.weight"},
    # the router: a stack of gate vectors, one an expert; the expert stacks (3-D) are Muon's
    "qwen3_moe": {"model.model.embed_tokens.weight", "model.lm_head.weight", "model.model.layers.0.mlp.gate.weight"},
}


def names(optimizer: torch.optim.Optimizer) -> set[str]:
    return {n for g in optimizer.param_groups for n in g["param_names"]}


@pytest.mark.parametrize("family", list(LM_ADAMW))
@pytest.mark.filterwarnings("ignore:ThirdPartyLM.configure_optimizers")
def test_third_party_lm_trains_with_its_hidden_matrices_on_muon(tmp_path, family):
    if family == "litgpt" and importlib.util.find_spec("litgpt") is None:
        pytest.skip("litgpt is not installed (the README's test command installs it)")
    from lightning_muon.examples.char_gpt import StdlibTextDataModule

    torch.manual_seed(0)
    model = MuonThirdPartyLM(family=family, n_layer=1, n_head=2, n_embd=32, block_size=16, adamw=FAST_ADAMW)
    data = StdlibTextDataModule(max_bytes=120_000, block_size=16, batch_size=4, train_batches_per_epoch=4,
                                val_batches=2, cache_dir=str(tmp_path / "cache"))
    trainer = make_trainer(tmp_path, csv_dir=tmp_path / "logs", max_steps=4)
    trainer.fit(model, datamodule=data)

    muon, adamw = (o.optimizer for o in model.optimizers())
    matrices = {n for n, p in model.named_parameters() if p.ndim >= 2}
    assert names(muon) == matrices - LM_ADAMW[family]
    assert LM_ADAMW[family] <= names(adamw)
    if family == "gpt2":  # transformers' Conv1D stores in x out: its lr is scaled by the real shape
        layouts = {n: layout for g in muon.param_groups for n, layout in zip(g["param_names"], g["matrix_layouts"])}
        assert set(layouts.values()) == {"in_out"}
    if family == "qwen3_moe":  # 8 experts a stack, out x in: each expert orthogonalised alone
        layouts = {n: layout for g in muon.param_groups for n, layout in zip(g["param_names"], g["matrix_layouts"])}
        assert {n.split(".")[-1] for n, layout in layouts.items() if layout == "stack"} == {"gate_up_proj",
                                                                                          "down_proj"}
    val = [float(r["val_loss"]) for r in read_metrics(tmp_path / "logs") if r.get("val_loss")]
    assert len(val) == 1 and val[0] < math.log(256)


def test_third_party_lm_refuses_an_unknown_family():
    with pytest.raises(ValueError, match=r"family must be one of 'llama', 'gpt2', 'qwen3_moe', 'litgpt', got 'bert'"):
        ThirdPartyLM(family="bert")


@pytest.mark.filterwarnings("ignore:ThirdPartyDigits.configure_optimizers")
def test_third_party_resnet_routes_stem_and_classifier_to_adamw(tmp_path):
    torch.manual_seed(0)
    model = MuonThirdPartyDigits(hidden_sizes=(8, 16), embedding_size=8)
    trainer = make_trainer(tmp_path, csv_dir=tmp_path / "logs", max_steps=3, val_check_interval=3)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    muon, adamw = (o.optimizer for o in model.optimizers())
    kernels = {n for n, p in model.named_parameters() if p.ndim == 4}
    stem = "model.resnet.embedder.embedder.convolution.weight"
    assert names(muon) == kernels - {stem}
    assert {stem, "model.classifier.1.weight", "model.classifier.1.bias"} <= names(adamw)
    assert any(r.get("val_acc") for r in read_metrics(tmp_path / "logs"))


# ------------------------------------------------------------------------------------------ init_from


@pytest.mark.filterwarnings("ignore:GPT.configure_optimizers")
def test_gpt_init_from_a_lightning_checkpoint_or_a_state_dict(tmp_path):
    torch.manual_seed(0)
    source = CharGPT(n_layer=1, n_head=2, n_embd=32, block_size=16)
    trainer = make_trainer(tmp_path, max_steps=1)
    from lightning_muon.examples.char_gpt import StdlibTextDataModule

    trainer.fit(source, datamodule=StdlibTextDataModule(max_bytes=120_000, block_size=16, batch_size=4,
                                                        train_batches_per_epoch=1, val_batches=1,
                                                        cache_dir=str(tmp_path / "cache")))
    checkpoint = tmp_path / "pretrained.ckpt"
    trainer.save_checkpoint(checkpoint)
    state = tmp_path / "state.pt"
    torch.save(source.state_dict(), state)

    for path in (checkpoint, state):
        torch.manual_seed(1)  # another random init, replaced by the saved weights
        loaded = GPT(n_layer=1, n_head=2, n_embd=32, block_size=16, init_from=str(path))
        for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values(), strict=True):
            assert torch.equal(a, b), name
        assert "init_from" not in loaded.hparams  # a checkpoint of it holds the weights themselves


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_checkpoint_fine_tuned_from_a_file_loads_once_the_file_is_gone(tmp_path, monkeypatch):
    from lightning_muon.commands.lightning_cli import MuonCLI

    monkeypatch.chdir(tmp_path)
    torch.save(GPT(n_layer=1, n_embd=32, block_size=16).state_dict(), "pretrained.pt")
    cli = MuonCLI(args=[
        "fit", "--model", "lightning_muon.examples.char_gpt.CharGPT", "--model.n_layer=1", "--model.n_embd=32",
        "--model.block_size=16", "--model.init_from=pretrained.pt",
        "--data", "lightning_muon.examples.char_gpt.StdlibTextDataModule", "--data.block_size=16",
        "--data.batch_size=4", "--data.max_bytes=120000", "--data.train_batches_per_epoch=2", "--data.val_batches=1",
        f"--data.cache_dir={tmp_path / 'cache'}", "--trainer.max_steps=2", "--trainer.logger=false",
        "--trainer.enable_progress_bar=false", "--trainer.default_root_dir=out",
    ])
    checkpoint = cli.trainer.checkpoint_callback.best_model_path
    Path("pretrained.pt").unlink()
    loaded = CharGPT.load_from_checkpoint(checkpoint)
    for (name, a), b in zip(cli.model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_gpt_init_from_refuses_a_missing_file_or_one_without_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"init_from='.*nowhere.ckpt': no such file"):
        GPT(init_from=str(tmp_path / "nowhere.ckpt"))
    torch.save({"epoch": 3}, tmp_path / "not_weights.pt")
    with pytest.raises(ValueError, match="holds no state dict"):
        GPT(init_from=str(tmp_path / "not_weights.pt"))
    torch.save(GPT(n_layer=1, n_embd=32).state_dict(), tmp_path / "other_shape.pt")
    with pytest.raises(RuntimeError, match="size mismatch"):  # another model's weights: load_state_dict says so
        GPT(n_layer=1, n_embd=64, init_from=str(tmp_path / "other_shape.pt"))


# ----------------------------------------------------------------------------- the studies' configs


@pytest.fixture
def benchmark_modules(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield
    for name in ("third_party", "finetune", "muon_variants", "torch_layers", "_tuned", "_common", "_report"):
        sys.modules.pop(name, None)


@pytest.mark.usefixtures("benchmark_modules")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_studies_configs_build_through_the_real_cli(tmp_path):
    import finetune
    import muon_variants
    import third_party

    from lightning_muon.commands.lightning_cli import MuonCLI

    checkpoint = tmp_path / "pretrained.ckpt"  # as a Lightning checkpoint holds it: LoRA sides read the architecture
    torch.save({"state_dict": GPT().state_dict(), "hyper_parameters": dict(GPT().hparams)}, checkpoint)
    written = {f"{name}_{side}": third_party.config(spec, side == "muon", steps=5)
               for name, spec in third_party.MODELS.items() for side in ("muon", "adamw")
               if name != "litgpt" or importlib.util.find_spec("litgpt") is not None}
    written |= {name: finetune.side_config(name, checkpoint, steps=5) for name in finetune.SIDES}
    for key, (_, args) in third_party.VARIANTS.items():
        written[f"gpt2_{key}"] = third_party.config(third_party.MODELS["gpt2"], True, steps=5, **args)
    for study, spec in muon_variants.STUDIES.items():
        if study != "litgpt" or importlib.util.find_spec("litgpt") is not None:
            written |= {f"variants_{study}_{option}": muon_variants.config(spec["spec"], option, steps=5)
                        for option in spec["options"]}
    for name, config in written.items():
        path = third_party._tuned.write_config(tmp_path / f"{name}.yaml", config, "a test")
        cli = MuonCLI(args=["--config", str(path), "--trainer.logger=false"], run=False)
        muon = cli.model.hparams["muon"]
        if name.endswith("adamw"):
            assert muon is None, name
            continue
        muon_args = muon["init_args"]
        assert muon_args["ns_dtype"] in ("float32", "bfloat16", None), name  # None: the library's choice
        if name == "ft_muon_match":
            assert muon_args["adjust_lr_fn"] == "match_rms_adamw"
        if name.startswith("lora"):  # where the adapters go: both on Muon, or one moved to AdamW by a pattern
            adapters = {r.name.split(".")[-3]: r.optimizer for r in cli.model.muon_routing().routes}
            assert adapters == {"lora_A": "AdamW" if name == "lora_b_muon" else "Muon",
                                "lora_B": "AdamW" if name == "lora_a_muon" else "Muon"}, name
        if name == "gpt2_bf16_standard":
            assert muon_args["ns_gram_aspect"] is None
        if name == "gpt2_bf16_polar":
            assert muon_args["ns_coefficients"] == "polar_express"
        if name.endswith("_normuon"):
            assert muon_args["normuon_beta2"] == 0.95
        if name.endswith("_cautious"):
            assert muon_args["cautious_weight_decay"] is True
        if name.endswith("_split"):  # the fused projections the routing finds, each split into its blocks
            blocks = [r for r in cli.model.muon_routing().routes if r.blocks]
            assert blocks and cli.model.hparams["split_fused"] is True, name
        if name.endswith("_routers"):  # a user pattern puts the routers on Muon
            routers = {r.optimizer for r in cli.model.muon_routing().routes if r.name.endswith("mlp.gate.weight")}
            assert routers == {"Muon"}, name
        if "_aol4" in name:  # AOL Newton-Schulz at 4 steps, with Turbo-Muon's coefficients on the turbo side
            assert (muon_args["ns_precondition"], muon_args["ns_steps"]) == ("aol", 4), name
            assert (muon_args["ns_coefficients"] == "turbo_muon") is name.endswith("_turbo"), name
        if name.endswith("_split_heads"):  # the option: Llama's 4 query heads and 2 key/value heads, one block each
            blocks = {r.name.split(".")[-2]: list(r.blocks) for r in cli.model.muon_routing().routes if r.blocks}
            assert cli.model.hparams["split_heads"] is True, name
            assert blocks == {"q_proj": [32] * 4, "k_proj": [32] * 2, "v_proj": [32] * 2}, (name, blocks)
        elif name.endswith(("_projections", "_heads")):  # the fused q, k, v by hand: 3 blocks, or one a head
            blocks = {r.name: r.blocks for r in cli.model.muon_routing().routes if r.blocks}
            sizes = [128] * 3 if name.endswith("_projections") else [32] * 12
            assert blocks and all(list(b) == sizes for b in blocks.values()), (name, blocks)
    assert len(written) >= 37


@pytest.mark.usefixtures("benchmark_modules")
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_torch_layers_sides_route_as_they_say(tmp_path):
    """``benchmarks/torch_layers.py``'s sides, built through the real CLI: the depthwise kernels flattened, per group
    or on AdamW; the LSTM's gates fused or split."""
    import torch_layers

    from lightning_muon.commands.lightning_cli import MuonCLI

    expected = {"depthwise_flatten": ("Muon", None), "depthwise_groups": ("Muon", 32),
                "depthwise_adamw": ("AdamW", None), "lstm_fused": ("Muon", None), "lstm_split": ("Muon", 4)}
    for study, spec in torch_layers.STUDIES.items():
        for side in spec["sides"]:
            name = f"{study}_{side}"
            config = torch_layers.config(spec, side, 5)
            path = torch_layers._tuned.write_config(tmp_path / f"{name}.yaml", config, "a test")
            routes = {r.name: r for r in MuonCLI(args=["--config", str(path), "--trainer.logger=false"],
                                                 run=False).model.muon_routing().routes}
            route = routes["blocks.0.0.weight" if study == "depthwise" else "lstm.weight_hh_l1"]
            assert (str(route.optimizer), route.blocks and len(route.blocks)) == expected.pop(name), name
    assert expected == {}

