"""The examples: offline data that is deterministic, routing that puts each layer where it belongs, real fits."""

from __future__ import annotations

import inspect
import json
import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_muon import Muon
from lightning_muon.examples import text_data
from lightning_muon.examples.char_gpt import GPT, CharGPT, StdlibTextDataModule
from lightning_muon.examples.digits_cnn import CNN, DigitsCNN, DigitsDataModule
from lightning_muon.examples.existing_module import MuonLightningTransformer, StdlibWindowsDataModule
from lightning_muon.examples.parallel_gpt import TP_PLAN, CharParallelGPT, ParallelGPT
from lightning_muon.examples.torch_layers import CharLSTM, SeparableCNN
from lightning_muon.routing import ADAMW, MUON, route_parameters

from helpers import make_trainer, read_metrics

EX = "lightning_muon.examples"
SMALL_CORPUS = 120_000  # bytes: the first few dozen stdlib files
UNCALLED = r"configure_optimizers will never be called"


def small_text(tmp_path: Path, **kwargs) -> StdlibTextDataModule:
    settings = {"max_bytes": SMALL_CORPUS, "block_size": 16, "batch_size": 4, "train_batches_per_epoch": 3,
                "val_batches": 2, "cache_dir": str(tmp_path / "cache")}
    return StdlibTextDataModule(**{**settings, **kwargs})


def ready(datamodule: L.LightningDataModule) -> L.LightningDataModule:
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


def trainer(tmp_path: Path, **kwargs) -> L.Trainer:
    """`helpers.make_trainer` logging to ``tmp_path / "logs"``, where `logged` reads."""
    return make_trainer(tmp_path, csv_dir=tmp_path / "logs", **kwargs)


def logged(tmp_path: Path, key: str) -> list[float]:
    """The values ``key`` was logged with, in order."""
    return [float(row[key]) for row in read_metrics(tmp_path / "logs") if row.get(key)]


# ------------------------------------------------------------------ text data


def test_corpus_is_the_sorted_stdlib_sources_without_tests_capped_and_separated(tmp_path):
    files = text_data.corpus_files(SMALL_CORPUS)
    assert files == text_data.corpus_files(SMALL_CORPUS)
    assert [rel for rel, _ in files] == sorted(rel for rel, _ in files)
    for rel, _ in files:
        assert rel.endswith(".py")
        assert not set(rel.split("/")[:-1]) & {"site-packages", "test", "tests"}, rel
    data = ready(small_text(tmp_path)).data
    assert data.dtype == torch.uint8 and len(data) == SMALL_CORPUS
    first = (text_data.stdlib_dir() / files[0][0]).read_bytes()
    assert bytes(data[: len(first) + len(text_data.SEPARATOR)].tolist()) == first + text_data.SEPARATOR


def test_corpus_is_deterministic_and_the_cache_file_is_reused(tmp_path, monkeypatch):
    one = ready(small_text(tmp_path / "one"))
    two = ready(small_text(tmp_path / "two"))  # built again from the files, independently
    assert torch.equal(one.data, two.data)
    (cached,) = (tmp_path / "one" / "cache").iterdir()
    stamp = cached.stat().st_mtime_ns

    def no_reading(*args, **kwargs):
        raise AssertionError("the corpus was read again instead of reusing the cache file")

    monkeypatch.setattr(text_data, "read_corpus", no_reading)
    again = ready(small_text(tmp_path / "one"))
    assert torch.equal(again.data, one.data)
    assert [p.name for p in (tmp_path / "one" / "cache").iterdir()] == [cached.name]
    assert cached.stat().st_mtime_ns == stamp
    monkeypatch.undo()
    bigger = text_data.corpus_path(tmp_path / "one" / "cache", SMALL_CORPUS + 1)
    assert bigger != cached  # the cap is part of the key


def test_corpus_in_memory_without_a_cache_dir_is_the_same(tmp_path):
    cached = ready(small_text(tmp_path))
    in_memory = ready(small_text(tmp_path, cache_dir=None))
    assert torch.equal(cached.data, in_memory.data)


def test_a_source_dir_under_stdlib_names_the_standard_librarys_directory_anywhere(tmp_path):
    assert text_data.source_root("{stdlib}/pydoc_data") == text_data.stdlib_dir() / "pydoc_data"
    assert text_data.source_root("{stdlib}") == text_data.source_root(None) == text_data.stdlib_dir()
    assert text_data.source_root(tmp_path) == tmp_path and text_data.source_root("{stdlibx}") == Path("{stdlibx}")
    english = ready(small_text(tmp_path, source_dir="{stdlib}/pydoc_data", max_bytes=50_000))
    topics = (text_data.stdlib_dir() / "pydoc_data" / "topics.py").read_bytes()  # the docs' English, as strings
    assert topics[:1000] in bytes(english.data.tolist())
    with pytest.raises(FileNotFoundError, match=r"source directory '.*nowhere' does not exist"):
        text_data.corpus_files(1000, "{stdlib}/nowhere")


def test_train_windows_are_deterministic_given_seed_and_epoch_and_from_the_head(tmp_path):
    dm = ready(small_text(tmp_path, seed=7))
    batches = list(dm.train_dataloader())
    assert len(batches) == 3
    assert all(x.shape == y.shape == (4, 16) and x.dtype == torch.long for x, y in batches)
    again = list(ready(small_text(tmp_path, seed=7)).train_dataloader())
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    other_seed = list(ready(small_text(tmp_path, seed=8)).train_dataloader())
    assert not torch.equal(batches[0][0], other_seed[0][0])

    loader = dm.train_dataloader()
    loader.sampler.set_epoch(1)
    epoch_1 = list(loader)
    assert not torch.equal(batches[0][0], epoch_1[0][0])
    loader.sampler.set_epoch(0)
    assert torch.equal(next(iter(loader))[0], batches[0][0])

    offsets = list(loader.sampler)
    windows = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in batches])
    for offset, window in zip(offsets, windows):
        assert offset + 17 <= dm.split  # training windows never reach into the validation tail
        assert torch.equal(window, dm.data[offset : offset + 17].long())


def test_val_windows_are_fixed_evenly_spaced_and_the_tail(tmp_path):
    dm = ready(small_text(tmp_path, val_fraction=0.1))
    assert dm.split == len(dm.data) - round(0.1 * len(dm.data))
    batches = list(dm.val_dataloader())
    assert len(batches) == 2 and all(x.shape == (4, 16) for x, _ in batches)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, dm.val_dataloader()))
    offsets = dm.val_dataloader().dataset.offsets
    assert offsets[0] == 0 and offsets[-1] == len(dm.data) - dm.split - 17
    gaps = offsets.diff()
    assert int(gaps.max() - gaps.min()) <= 1
    tail = dm.data[dm.split :]
    x, y = batches[0]
    assert torch.equal(x[0], tail[:16].long()) and torch.equal(y[0], tail[1:17].long())
    x, y = batches[-1]
    assert torch.equal(y[-1], tail[-16:].long())  # the last window ends at the corpus' last byte


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"block_size": 0}, "block_size must be an int >= 1"),
        ({"batch_size": 2.5}, "batch_size must be an int >= 1"),
        ({"val_fraction": 1.0}, r"val_fraction must be in \(0, 1\)"),
        ({"seed": -1}, "seed must be an int >= 0"),
    ],
)
def test_text_data_refuses_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        small_text(tmp_path, **kwargs)


def test_text_data_too_small_for_its_windows_says_what_to_change(tmp_path):
    with pytest.raises(ValueError, match="raise max_bytes or lower block_size"):
        ready(small_text(tmp_path, max_bytes=200, block_size=128))


# ------------------------------------------------------------------- routing


def gpt_block_matrices(n_layer: int) -> set[str]:
    kinds = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    return {f"blocks.{i}.{kind}.weight" for i in range(n_layer) for kind in kinds}


@pytest.mark.parametrize(("tie_weights", "bias"), [(False, False), (True, False), (True, True)])
def test_char_gpt_routes_blocks_to_muon_and_embeddings_head_norms_to_adamw(tie_weights, bias):
    model = CharGPT(tie_weights=tie_weights, bias=bias)
    routing = model.muon_routing()
    assert set(routing.names(MUON)) == gpt_block_matrices(4)
    norms = {f"blocks.{i}.{ln}.weight" for i in range(4) for ln in ("ln_1", "ln_2")} | {"ln_f.weight"}
    expected = {"wte.weight", "wpe.weight"} | norms
    if not tie_weights:
        expected.add("lm_head.weight")
    else:
        assert model.lm_head.weight is model.wte.weight  # one tensor, routed once (as the embedding)
    if bias:
        expected |= {name.replace(".weight", ".bias") for name in norms | gpt_block_matrices(4)} | {"lm_head.bias"}
    assert set(routing.names(ADAMW)) == expected
    groups = {group["name"]: {name for name, _ in group["params"]} for group in routing.groups(ADAMW)}
    assert groups["embeddings"] == {"wte.weight", "wpe.weight"}
    head = ({"lm_head.weight"} if not tie_weights else set()) | ({"lm_head.bias"} if bias else set())
    assert groups.get("head", set()) == head
    # The mixin adds nothing to routing: the plain module routes the same way.
    assert route_parameters(GPT(tie_weights=tie_weights, bias=bias)).routes == routing.routes


def test_parallel_gpt_routes_the_tutorial_plans_matrices_to_muon_and_the_plain_tensors_to_adamw():
    """What Lightning's tensor-parallel plan parallelises is exactly what Muon trains; what it leaves plain
    (embeddings, norms, head) is AdamW's."""
    routing = CharParallelGPT(n_layer=2).muon_routing()
    assert set(routing.names(MUON)) == {f"blocks.{i}.{name}.weight" for i in range(2) for name in TP_PLAN}
    groups = {group["name"]: {name for name, _ in group["params"]} for group in routing.groups(ADAMW)}
    norms = {f"blocks.{i}.norm{k}.weight" for i in range(2) for k in (1, 2)} | {"norm.weight"}
    assert groups == {"embeddings": {"embedding.weight", "wpe.weight"}, "head": {"lm_head.weight"},
                      "norms_and_biases": norms}
    assert route_parameters(ParallelGPT(n_layer=2)).routes == routing.routes
    assert ParallelGPT(n_embd=64).hidden == 192  # 3 x n_embd by default
    with pytest.raises(ValueError, match="n_head must divide n_embd, got n_head=3 and n_embd=64"):
        ParallelGPT(n_head=3, n_embd=64)


def test_digits_cnn_routes_stem_and_classifier_to_adamw_other_kernels_to_muon():
    model = DigitsCNN()
    routing = model.muon_routing()
    assert set(routing.names(MUON)) == {f"blocks.{i}.0.weight" for i in range(4)}
    reasons = {r.name: r.reason for r in routing.routes}
    assert set(routing.names(ADAMW)) == {"stem.weight", "classifier.weight", "classifier.bias"} | {
        n for n in reasons if "norm" in reasons[n]
    }
    assert reasons["stem.weight"] == "input layer (Conv2d on 1 input channel)"
    assert reasons["classifier.weight"] == "output head `classifier`"
    assert model.hparams["adamw_params"] == []
    json.dumps(dict(model.hparams))  # plain data
    # Named in muon_params, the stem is a (flattened 32 x 9) Muon matrix.
    assert "stem.weight" in DigitsCNN(muon_params=["stem.weight"]).muon_routing().names(MUON)


# ---------------------------------------------------------------- real fits


class FirstBatches(Callback):
    """The inputs of the first batch of every epoch."""

    def __init__(self) -> None:
        self.inputs: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self.inputs.append(batch[0].clone())


def tiny_gpt(cls: type[GPT], **kwargs) -> GPT:
    return cls(n_layer=2, n_head=2, n_embd=32, block_size=16, **kwargs)


#: AdamW as a YAML config gives it; a tiny model's embeddings and head want more than the default lr 3e-4.
FAST_ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 3e-3, "betas": [0.9, 0.95]}}


@pytest.mark.filterwarnings(f"ignore:GPT.{UNCALLED}")
def test_char_gpt_trains_logs_val_metrics_and_prints_a_summary(tmp_path, capsys):
    torch.manual_seed(0)
    model = tiny_gpt(CharGPT, adamw=FAST_ADAMW)
    fit = trainer(tmp_path, max_steps=12)
    fit.fit(model, datamodule=small_text(tmp_path, train_batches_per_epoch=12, batch_size=8))

    assert fit.global_step == 12
    muon, adamw = (o.optimizer for o in model.optimizers())
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    assert {n for g in muon.param_groups for n in g["param_names"]} == gpt_block_matrices(2)
    val_loss, val_bpb = logged(tmp_path, "val_loss"), logged(tmp_path, "val_bpb")
    assert len(val_loss) == len(val_bpb) == 1
    assert val_bpb[0] == pytest.approx(val_loss[0] / math.log(2), rel=1e-5)
    assert val_loss[0] < math.log(256) - 1.0  # it learnt something about Python source
    assert len(logged(tmp_path, "train_loss")) == 12
    assert f"CharGPT: val_loss {val_loss[0]:.4f}, val_bpb {val_bpb[0]:.4f} after 12 steps" in capsys.readouterr().out


def test_gpt_alone_trains_with_automatic_optimization_on_fresh_windows_each_epoch(tmp_path):
    torch.manual_seed(0)
    model = tiny_gpt(GPT)
    assert model.automatic_optimization
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batches = FirstBatches()
    dm = small_text(tmp_path)  # 3 batches an epoch
    fit = trainer(tmp_path, max_epochs=2, callbacks=[batches])
    fit.fit(model, datamodule=dm)

    assert fit.global_step == 6
    assert isinstance(fit.optimizers[0], torch.optim.AdamW)
    assert all(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert len(logged(tmp_path, "val_loss")) == 2
    # Lightning sets the sampler's epoch: epoch e draws from (seed, e), as a fresh loader does.
    assert not torch.equal(batches.inputs[0], batches.inputs[1])
    loader = dm.train_dataloader()
    for epoch, inputs in enumerate(batches.inputs):
        loader.sampler.set_epoch(epoch)
        assert torch.equal(next(iter(loader))[0], inputs)


@pytest.mark.filterwarnings(f"ignore:CNN.{UNCALLED}")
def test_digits_cnn_trains_tests_and_reloads_from_its_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = DigitsCNN(channels=16)
    fit = trainer(tmp_path, max_epochs=2)
    dm = DigitsDataModule()
    fit.fit(model, datamodule=dm)

    assert fit.global_step == 2 * math.ceil(1438 / 64)
    muon = model.optimizers()[0].optimizer
    assert {n for g in muon.param_groups for n in g["param_names"]} == {f"blocks.{i}.0.weight" for i in range(4)}
    assert len(logged(tmp_path, "val_acc")) == 2
    (result,) = fit.test(model, datamodule=dm, verbose=False)
    assert result["test_acc"] > 0.85
    assert logged(tmp_path, "test_acc") == [pytest.approx(result["test_acc"])]

    fit.save_checkpoint(tmp_path / "digits.ckpt")
    loaded = DigitsCNN.load_from_checkpoint(tmp_path / "digits.ckpt", weights_only=True)
    assert loaded.hparams == model.hparams
    assert loaded.muon_routing().routes == model.muon_routing().routes
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_digits_split_is_deterministic_and_images_are_unit_range():
    one, two = DigitsDataModule(seed=3), DigitsDataModule(seed=3)
    one.setup("fit"), two.setup("fit")
    assert len(one.train_set) == 1438 and len(one.val_set) == 359
    assert torch.equal(one.val_set.tensors[1], two.val_set.tensors[1])
    images = one.train_set.tensors[0]
    assert images.shape[1:] == (1, 8, 8) and images.min() == 0.0 and images.max() == 1.0
    other = DigitsDataModule(seed=4)
    other.setup("fit")
    assert not torch.equal(one.val_set.tensors[1], other.val_set.tensors[1])


def test_cnn_alone_trains_with_automatic_optimization(tmp_path):
    fit = trainer(tmp_path, max_epochs=1, limit_train_batches=5, limit_val_batches=1)
    fit.fit(CNN(channels=8), datamodule=DigitsDataModule())
    assert fit.global_step == 5
    assert len(logged(tmp_path, "val_acc")) == 1


def test_demo_transformer_trains_on_the_datamodule_and_never_downloads(tmp_path, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("the demo's WikiText-2 download was attempted")

    monkeypatch.setattr("lightning.pytorch.demos.transformer.WikiText2", no_download)
    torch.manual_seed(0)
    model = MuonLightningTransformer(vocab_size=256)
    dm = StdlibWindowsDataModule(max_bytes=SMALL_CORPUS, train_batches_per_epoch=8, val_batches=2,
                                 cache_dir=str(tmp_path / "cache"))
    fit = trainer(tmp_path, max_steps=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.fit(model, datamodule=dm)  # the model's own train_dataloader raises: the datamodule's was used
    # The parent's configure_optimizers is replaced at the mixin's default lrs: its SGD lr is dropped, warned once,
    # saying where to change it (a config that gives the lrs is told at INFO: the main job's test in commands/).
    replaced = [str(w.message) for w in caught if "configure_optimizers" in str(w.message)]
    assert len(replaced) == 1 and "Ignored: its lr (0.1) is not used" in replaced[0] and "parent_lr=True" in replaced[0]

    assert fit.global_step == 8
    assert dm.train_dataloader().batch_size == 20 and next(iter(dm.train_dataloader()))[0].shape == (20, 35)
    muon, adamw = ({n for g in o.optimizer.param_groups for n in g["param_names"]} for o in model.optimizers())
    assert "model.transformer.encoder.layers.0.linear1.weight" in muon
    assert {"model.decoder.weight", "model.embedding.weight"} <= adamw
    val_loss = logged(tmp_path, "val_loss")
    assert len(val_loss) == 1 and val_loss[0] < math.log(256)
    assert logged(tmp_path, "val_bpb") == [pytest.approx(val_loss[0] / math.log(2), rel=1e-5)]

    with pytest.raises(MisconfigurationException, match="datamodule=StdlibWindowsDataModule"):
        trainer(tmp_path / "alone", max_steps=1, logger=False).fit(MuonLightningTransformer(vocab_size=256))


# -------------------------------------------------------- the config surface

CONFIGURABLE = [GPT, ParallelGPT, CNN, SeparableCNN, CharLSTM, DigitsDataModule, StdlibTextDataModule,
                StdlibWindowsDataModule]


@pytest.mark.parametrize("cls", CONFIGURABLE, ids=lambda c: c.__name__)
def test_constructor_arguments_are_typed_defaulted_and_documented(cls):
    docstring = inspect.getdoc(cls)
    assert "Args:" in docstring, cls
    args_section = docstring.split("Args:", 1)[1]
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or parameter.kind is parameter.VAR_KEYWORD:
            continue
        assert parameter.annotation is not inspect.Parameter.empty, f"{cls.__name__}({name}) has no type hint"
        assert parameter.default is not inspect.Parameter.empty, f"{cls.__name__}({name}) has no default"
        assert f"{name}:" in args_section, f"{cls.__name__}({name}) is not in the Args section"


@pytest.mark.parametrize(
    ("model", "data", "extra"),
    [
        (f"{EX}.char_gpt.CharGPT", f"{EX}.char_gpt.StdlibTextDataModule", ["--model.tie_weights=true"]),
        (f"{EX}.char_gpt.GPT", f"{EX}.char_gpt.StdlibTextDataModule", []),
        (f"{EX}.parallel_gpt.CharParallelGPT", f"{EX}.char_gpt.StdlibTextDataModule", ["--model.n_layer=1"]),
        (f"{EX}.digits_cnn.DigitsCNN", f"{EX}.digits_cnn.DigitsDataModule", ["--model.channels=8"]),
        (f"{EX}.existing_module.MuonLightningTransformer", f"{EX}.existing_module.StdlibWindowsDataModule",
         ["--model.vocab_size=256"]),
    ],
)
def test_lightning_cli_builds_each_example_from_its_class_path(tmp_path, model, data, extra):
    from lightning.pytorch.cli import LightningCLI

    args = ["--model", model, "--data", data, "--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    if "Stdlib" in data:
        args.append(f"--data.cache_dir={tmp_path}")
    cli = LightningCLI(
        L.LightningModule, L.LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
        args=args + extra, run=False, save_config_callback=None,
    )
    assert f"{type(cli.model).__module__}.{type(cli.model).__name__}" == model
    assert type(cli.datamodule).__name__ == data.rsplit(".", 1)[1]
    if "DigitsCNN" in model:  # the stem is AdamW's as the input layer, with no pattern needed
        assert cli.model.hparams["adamw_params"] == []
        assert cli.model.muon_routing().routes[0].group == "input"
