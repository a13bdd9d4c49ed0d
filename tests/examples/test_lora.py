"""The LoRA recipe: pretrain with ``gpt_adamw.yaml``, fine-tune with ``gpt_lora_muon.yaml``, both through the
command from an empty directory; only the adapters train, the checkpoint loads back, and merging the adapters
gives the adapted model's outputs. And `LoraGPT`'s errors: each names its fix."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from lightning_muon.commands.cli import main
from lightning_muon.examples.char_gpt import GPT
from lightning_muon.routing import ADAMW, MUON

from helpers import code_blocks

peft = pytest.importorskip("peft")

from lightning_muon.examples.lora import LoraGPT, MuonLoraGPT  # noqa: E402  (after the skip: it needs peft)

TINY = ["--trainer.enable_progress_bar", "false", "--trainer.limit_val_batches", "1",
        "--data.init_args.batch_size", "4", "--data.init_args.block_size", "32", "--data.init_args.max_bytes",
        "200000"]
RESULT_LINE = (r"MuonLoraGPT: val_loss \d+\.\d{4}, val_bpb \d+\.\d{4} after 3 steps; "
               r"checkpoint and metrics in lightning_logs/gpt_lora_muon/version_0")


def adapted_name(name: str) -> str:
    """The name of a pretrained GPT's tensor inside `LoraGPT`: under PEFT's wrapper, and an adapted Linear's own
    weight as its ``base_layer``'s."""
    layer, _, kind = name.rpartition(".")
    adapted = layer.rsplit(".", 1)[-1] in ("qkv", "proj", "fc")
    return f"model.base_model.model.{layer}{'.base_layer' if adapted else ''}.{kind}"


def readme_recipe() -> list[list[str]]:
    """The fine-tuning guide's LoRA commands (docs/guides/fine-tuning.md), as argv lists without the program."""
    (block,) = code_blocks("guides/fine-tuning.md", "bash")
    commands = [line.partition("#")[0].split() for line in block.splitlines()]
    assert all(argv[0] == "lightning-muon" for argv in commands)
    return [argv[1:] for argv in commands]


@pytest.mark.slow
def test_the_lora_recipe_trains_only_the_adapters_and_its_checkpoint_loads_and_merges(tmp_path, monkeypatch, capsys):
    """The guide's two commands as written, shortened (3 updates; a 2-layer width-32 GPT pretrained 2 updates)."""
    pretrain, finetune = readme_recipe()
    monkeypatch.chdir(tmp_path)
    cache = ["--data.init_args.cache_dir", str(tmp_path / "cache")]
    small = ["--model.init_args.n_layer", "2", "--model.init_args.n_embd", "32", "--model.init_args.block_size", "32"]
    main([*pretrain, "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", *small, *TINY, *cache])
    (pretrained,) = Path("lightning_logs/gpt_adamw/version_0/checkpoints").glob("*.ckpt")
    written = Path(finetune[finetune.index("--model.init_from") + 1])
    assert written.parent == pretrained.parent and written.name == "epoch=0-step=300.ckpt"  # gpt_adamw's 300 steps
    finetune[finetune.index("--model.init_from") + 1] = str(pretrained)
    capsys.readouterr()

    main([*finetune, "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", *TINY, *cache])
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(RESULT_LINE, out[-1]), out[-5:]
    (adapted,) = Path("lightning_logs/gpt_lora_muon/version_0/checkpoints").glob("*.ckpt")

    # Only the adapters trained: every pretrained tensor is there bit for bit (the architecture came from the
    # pretrained checkpoint: 2 layers of width 32), and every lora_B (zero at the start) has moved.
    before = torch.load(pretrained, weights_only=True)["state_dict"]
    after = torch.load(adapted, weights_only=True)["state_dict"]
    assert all(torch.equal(after[adapted_name(n)], t) for n, t in before.items())
    lora = {n: t for n, t in after.items() if ".lora_" in n}
    assert len(lora) == 2 * 4 * 2 and set(after) == {adapted_name(n) for n in before} | set(lora)
    assert all(t.abs().sum() > 0 for n, t in lora.items() if ".lora_B." in n)

    # The checkpoint loads back, without the pretrained file, as the Muon module and as the plain one.
    pretrained.unlink()
    loaded = MuonLoraGPT.load_from_checkpoint(adapted, weights_only=True)
    plain = LoraGPT.load_from_checkpoint(adapted, weights_only=True)
    for module in (loaded, plain):
        state = module.state_dict()
        assert state.keys() == after.keys() and all(torch.equal(state[n], t) for n, t in after.items())
    assert loaded.hparams["base"]["n_layer"] == 2 and loaded.muon_routing().routes  # routed: a MuonLoraGPT

    # merge_and_unload() gives a plain GPT (the adapters folded into its weights) with the adapted outputs.
    loaded.eval()
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = loaded(idx)
        merged = loaded.model.merge_and_unload()
        assert type(merged) is GPT and not any(".lora_" in n for n, _ in merged.named_parameters())
        assert not torch.equal(merged.blocks[0].attn.qkv.weight, before["blocks.0.attn.qkv.weight"])
        torch.testing.assert_close(merged(idx), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def pretrained_file(tmp_path_factory) -> Path:
    """A tiny GPT saved as a Lightning checkpoint would hold it: its weights and hyperparameters."""
    torch.manual_seed(0)
    gpt = GPT(n_layer=1, n_head=2, n_embd=16, block_size=16)
    path = tmp_path_factory.mktemp("pretrained") / "gpt.ckpt"
    torch.save({"state_dict": gpt.state_dict(), "hyper_parameters": dict(gpt.hparams)}, path)
    return path


def test_lora_gpt_adapts_the_block_matrices_of_the_pretrained_gpt_and_freezes_the_rest(pretrained_file):
    model = MuonLoraGPT(init_from=str(pretrained_file), lora_rank=2)
    trainable = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {
        "model.base_model.model.blocks.0.attn.qkv.lora_A.default.weight": (2, 16),
        "model.base_model.model.blocks.0.attn.qkv.lora_B.default.weight": (48, 2),
        "model.base_model.model.blocks.0.attn.proj.lora_A.default.weight": (2, 16),
        "model.base_model.model.blocks.0.attn.proj.lora_B.default.weight": (16, 2),
        "model.base_model.model.blocks.0.mlp.fc.lora_A.default.weight": (2, 16),
        "model.base_model.model.blocks.0.mlp.fc.lora_B.default.weight": (64, 2),
        "model.base_model.model.blocks.0.mlp.proj.lora_A.default.weight": (2, 64),
        "model.base_model.model.blocks.0.mlp.proj.lora_B.default.weight": (16, 2),
    }
    saved = torch.load(pretrained_file, weights_only=True)["state_dict"]
    state = model.state_dict()
    assert all(torch.equal(state[adapted_name(n)], t) for n, t in saved.items())
    assert model.hparams["base"] == {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "dropout": 0.0,
                                     "tie_weights": False, "bias": False}
    assert "init_from" not in model.hparams
    # The default routing, as measured: lora_A on Muon, lora_B on AdamW; a pattern puts lora_B on Muon too.
    placed = {r.name: r.optimizer for r in model.muon_routing().routes}
    assert all(o == (ADAMW if ".lora_B." in n else MUON) for n, o in placed.items()) and len(placed) == 8
    both = MuonLoraGPT(init_from=str(pretrained_file), lora_rank=2, muon_params=["*lora_B*"])
    assert {r.optimizer for r in both.muon_routing().routes} == {MUON}


def test_lora_gpt_errors_name_the_fix(pretrained_file, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"fine-tunes a pretrained GPT: give init_from.*--model.init_from PATH"):
        LoraGPT()
    with pytest.raises(ValueError, match=r"lora_rank must be an int >= 1, got 0"):
        LoraGPT(init_from=str(pretrained_file), lora_rank=0)
    state_only = tmp_path / "state.pt"
    torch.save(GPT(n_layer=1, n_head=2, n_embd=16, block_size=16).state_dict(), state_only)
    with pytest.raises(ValueError, match=r"holds no GPT hyperparameters.*give the base model's arguments"):
        LoraGPT(init_from=str(state_only))
    base = {"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16}
    assert LoraGPT(init_from=str(state_only), base=base).hparams["base"] == base  # a state dict with base: fine
    with pytest.raises(FileNotFoundError, match=r"init_from='missing.ckpt': no such file"):
        LoraGPT(init_from="missing.ckpt")
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    with pytest.raises(ModuleNotFoundError, match=r'needs peft, which is not installed: pip install '
                                                  r'"lightning-muon\[examples\]"'):
        LoraGPT(init_from=str(pretrained_file))


def test_the_lora_config_without_init_from_stops_before_training_with_the_fix(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises((SystemExit, ValueError)) as raised:
        main(["fit", "--config", "gpt_lora_muon.yaml", "--trainer.fast_dev_run", "1"])
    said = str(raised.value) + capsys.readouterr().err
    assert said.strip() == ("lightning-muon: gpt_lora_muon.yaml needs --model.init_from: the checkpoint of the "
                            "pretraining step: lightning-muon fit --config gpt_adamw.yaml first, then "
                            "--model.init_from lightning_logs/gpt_adamw/version_0/checkpoints/epoch=0-step=300.ckpt")
    assert not Path("lightning_logs").exists()
