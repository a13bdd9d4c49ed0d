"""Tensor parallelism under `MuonMixin` (Lightning's ``ModelParallelStrategy`` with ``parallelize_module``):
Lightning's tutorial plan makes the attention and feed-forward projections DTensors and leaves the embedding,
norms and head plain tensors. The mixin's global gradient norm, its clipping (by norm and by value), its
non-finite check and the weight health check run over that mix (`lightning_muon.optim.norms`): two ranks, and
four in 2-D (FSDP2 over tensor parallel), train as one process does, with the same first-batch routing (they used
to die in ``aten._foreach_norm``: "got mixed torch.Tensor and DTensor", or in 2-D on a mesh mismatch). Under TP(2)
the Newton-Schulz work is split over the ranks (owner ranks gather the colwise weights' row shards and the rowwise
weights' column shards), half each; in 2-D over all four (each rank's block of each matrix travels), a quarter
each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import tp_run

from lightning_muon.commands.cli import main

from helpers import read_metrics, run_ranks

#: As the FSDP2 tests: a shard-wise Newton-Schulz would be hundreds of times off it.
TOLERANCE = 1e-4


def run(out: Path, devices: int, *args: str) -> list[dict]:
    """Run tests/tp_run.py: one process in this one, several forked from the tests' fork server (`run_ranks`)."""
    if devices == 1:
        tp_run.main([str(out), "--devices", "1", *args])
        return [{**torch.load(out / "rank0.pt"), **torch.load(out / "roles0.pt")}]
    run_ranks(tp_run.main, [str(out), "--devices", str(devices), *args], devices)
    return [{**torch.load(out / f"rank{r}.pt"), **torch.load(out / f"roles{r}.pt")} for r in range(devices)]


def assert_as_one_process(single: dict, ranks: list[dict], *, all_seen: bool = True) -> None:
    """Every rank holds the one process's weights (within `TOLERANCE`), and its routing: the first batch's roles
    (output heads, input layers) are followed through the DTensor computation as through the plain one. With
    ``all_seen=False`` the matrices the trace saw may differ (FSDP2 over TP: the blocks' unsharded matrices are
    not seen, so structure calls them hidden, as the batch does)."""
    for rank in ranks:
        keys = ["seen", "heads", "inputs", "note"] if all_seen else ["heads", "inputs", "note"]
        if single["roles"] is not None:
            assert {k: rank["roles"][k] for k in keys} == {k: single["roles"][k] for k in keys}
        assert rank["groups"] == single["groups"]
        for name, p in single["params"].items():
            assert torch.equal(rank["params"][name], ranks[0]["params"][name]), name
            torch.testing.assert_close(rank["params"][name], p, atol=TOLERANCE, rtol=0, msg=name)


@pytest.mark.distributed
def test_the_tutorial_plan_with_clipping_trains_as_one_process(tmp_path):
    """Clipping by norm here; by value, and every norm over two meshes, in tests/optim/test_norms.py."""
    clip = ["--clip", "0.5", "--monitor"]
    (single,) = run(tmp_path / "one", 1, *clip)
    ranks = run(tmp_path / "tp", 2, *clip)
    assert ranks[0]["world"] == 2
    assert single["roles"]["heads"] == ["lm_head.weight"] and single["roles"]["inputs"] == ["embedding.weight"]
    assert_as_one_process(single, ranks)
    assert_split(single, ranks)
    # MuonMonitor's keys and numbers (lrs, orthogonality error of the updates, update RMS) are one process's
    one, tp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "tp")
    keys = [k for k in one[0] if k.startswith(("lr-", "muon/"))]
    assert "muon/orthogonality_error" in keys and list(tp[0]) == list(one[0]) and len(tp) == len(one) == 4
    for a, b in zip(one, tp):
        assert [float(a[k]) for k in keys] == pytest.approx([float(b[k]) for k in keys], rel=1e-5)


@pytest.mark.distributed
def test_qk_clip_measures_and_clips_the_sharded_heads_as_one_process(tmp_path):
    """QK-Clip on the example's attention (its ``qk_layout`` adapter): under TP(2) each rank measures the heads of
    its shard of ``wq``, and in 2-D its block of them on its half of the batch; the all-reduced maxima, the heads
    clipped and the weights (each rank scaling its own shard's rows) are one process's."""
    clip = ["--qk-clip", "0.055", "--monitor"]  # the tiny model's logits are 0.05-0.08: most updates clip
    (single,) = run(tmp_path / "one", 1, *clip)
    one = attention_rows(tmp_path / "one")
    keys = list(one[0])
    assert "attention/max_logit/blocks.1" in keys and len(one) == 4
    assert sum(float(row["attention/clipped_heads"]) for row in one) >= 4
    for name, devices, layout in (("tp", 2, []), ("2d", 4, ["--data-parallel", "2"])):
        ranks = run(tmp_path / name, devices, *clip, *layout)
        assert_as_one_process(single, ranks, all_seen=not layout)
        rows = attention_rows(tmp_path / name)
        assert len(rows) == 4 and list(rows[0]) == keys
        for a, b in zip(one, rows):
            assert [float(a[k]) for k in keys] == pytest.approx([float(b[k]) for k in keys], rel=1e-5)


def attention_rows(directory: Path) -> list[dict]:
    """QKClip's rows of the metrics file, its keys only."""
    rows = [row for row in read_metrics(directory) if row.get("attention/max_logit")]
    return [{k: v for k, v in row.items() if k.startswith("attention/")} for row in rows]


def assert_split(single: dict, ranks: list[dict]) -> None:
    """The Newton-Schulz work split over the tensor-parallel ranks (the strategy's own FLOP count of the last
    step): each rank's share within 1.2x of ``1 / world`` of one process's, all of it done once; every shard
    sent once to its owner and once back (float32: 2 x 4 bytes a matrix element, in all)."""
    world = len(ranks)
    assert single["strategy"]["kind"] == "local"
    total = single["strategy"]["ns_flops"]
    shares = [r["strategy"]["ns_flops"] / total for r in ranks]
    for r in ranks:
        assert (r["strategy"]["kind"], r["strategy"]["ranks"], r["strategy"]["fallback"]) == ("sharded", world, False)
    assert sum(shares) == pytest.approx(1.0)
    assert max(shares) <= 1.2 / world, shares
    assert sum(r["strategy"]["sent"] for r in ranks) == 2 * 4 * single["strategy"]["numel"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("rule", [[], ["--normuon"]], ids=["muon", "normuon"])
def test_two_dimensional_data_and_tensor_parallel_trains_as_one_process(tmp_path, rule):
    """dp=2 x tp=2 on 4 ranks: the projections are DTensors on the 2-D mesh (FSDP2 over TP: colwise weights
    ``(_StridedShard(0), Shard(0))``, rowwise ``(Shard(0), Shard(1))``), the embedding, norms and head DTensors
    on the data-parallel mesh alone; the norms and checks run over both meshes, and the Newton-Schulz work is
    split over the four ranks. NorMuon too: each owner's rows' statistics, each rank normalising its block."""
    clip = ["--clip", "0.5", *rule]
    (single,) = run(tmp_path / "one", 1, *clip)
    ranks = run(tmp_path / "2d", 4, "--data-parallel", "2", *clip)
    assert ranks[0]["world"] == 4
    assert_as_one_process(single, ranks, all_seen=False)
    assert_split(single, ranks)


@pytest.mark.slow
@pytest.mark.distributed
def test_split_heads_under_tensor_parallelism_trains_as_one_process(tmp_path):
    """``split_heads=True`` on the shipped parallel GPT: its colwise ``wq``, ``wk``, ``wv`` (4 heads of 8 rows,
    row shards of 16: each TP rank holds 2 of the heads) are each stepped as 4 blocks, one a head, on their owner
    rank, as one process steps them; ``wo`` (rowwise: its heads are its input columns) stays whole."""
    (single,) = run(tmp_path / "one", 1, "--split-heads")
    heads = {f"blocks.{i}.{w}.weight": [8] * 4 for i in range(2) for w in ("wq", "wk", "wv")}
    assert single["blocks"] == heads
    ranks = run(tmp_path / "tp", 2, "--split-heads")
    assert [r["blocks"] for r in ranks] == [heads, heads]
    assert_as_one_process(single, ranks)
    assert_split(single, ranks)


@pytest.mark.distributed
def test_every_parameter_a_dtensor_trains_as_one_process(tmp_path):
    """The plan with the embeddings, head and norms on the tensor-parallel mesh too (every parameter a DTensor),
    under `MuonMixin` and under `MuonWithAdamW`: TP(2) as one process, the work split as under the tutorial's."""
    for mode in ([], ["--one-optimizer"]):
        (single,) = run(tmp_path / "one", 1, *mode)
        ranks = run(tmp_path / "tp", 2, "--all-dtensor", *mode)
        assert_as_one_process(single, ranks)
        assert_split(single, ranks)


@pytest.mark.distributed
def test_muon_with_adamw_under_lightnings_own_loop_trains_as_one_process(tmp_path):
    """The one-optimizer way in, built in ``configure_optimizers`` from the parallelised parameters: TP(2), and
    dp=2 x tp=2 on 4 ranks, the Newton-Schulz work split as under the mixin."""
    (single,) = run(tmp_path / "one", 1, "--one-optimizer")
    assert [name for name, _ in single["groups"][0]] == ["hidden", "embeddings", "head", "norms_and_biases"]
    for ranks in (run(tmp_path / "tp", 2, "--one-optimizer"),
                  run(tmp_path / "2d", 4, "--one-optimizer", "--data-parallel", "2")):
        assert_as_one_process(single, ranks)
        assert_split(single, ranks)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("layout", [[], ["--data-parallel", "2"], ["--data-parallel", "2", "--blocks"],
                                    ["--split-heads"]], ids=["tp2", "dp2xtp2", "dp2xtp2-blocks", "tp2-heads"])
def test_a_tensor_parallel_checkpoint_resumes_exactly_and_converts_for_one_process(tmp_path, layout):
    """Lightning's distributed checkpoint directory (saved at an epoch's end) resumes TP(2), and dp=2 x tp=2 on 4
    ranks, bit for bit; its one-file conversion (`lightning-muon convert-checkpoint`) resumes one process to the
    same weights. Also with matrices split into row blocks (`tp_run.BLOCKS`), and per head (``split_heads``: the
    converted param groups hold each q, k, v's 4 heads)."""
    devices = 4 if "--data-parallel" in layout else 2
    blocks = [flag for flag in layout if flag in ("--blocks", "--split-heads")]
    epochs = [*layout, "--max-steps", "-1", "--max-epochs"]
    checkpoint = tmp_path / "checkpoints" / "epoch0.ckpt"  # kept by the uninterrupted run, at its first epoch's end
    straight = run(tmp_path / "straight", devices, *epochs, "2", "--save", str(tmp_path / "checkpoints"))
    resumed = run(tmp_path / "resumed", devices, *epochs, "2", "--ckpt", str(checkpoint))
    assert checkpoint.is_dir()
    for name, p in straight[0]["params"].items():
        assert torch.equal(resumed[0]["params"][name], p), name
    main(["convert-checkpoint", str(checkpoint), str(tmp_path / "one.ckpt")])
    converted = torch.load(tmp_path / "one.ckpt", weights_only=False)["optimizer_states"][0]["param_groups"]
    split = sorted(sizes for group in converted for sizes in group.get("matrix_blocks") or [] if sizes)
    expected = {"--blocks": [[8, 8, 8, 8]] * 2 + [[24, 40]] * 2,  # 2 layers' wo and w1
                "--split-heads": [[8, 8, 8, 8]] * 6}  # 2 layers' wq, wk, wv
    assert split == (expected[blocks[0]] if blocks else [])
    (one,) = run(tmp_path / "one", 1, "--max-steps", "-1", "--max-epochs", "2", "--ckpt", str(tmp_path / "one.ckpt"),
                 *blocks)
    for name, p in straight[0]["params"].items():
        torch.testing.assert_close(one["params"][name], p, atol=TOLERANCE, rtol=0, msg=name)
