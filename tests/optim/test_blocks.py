"""Fused projections orthogonalised per block (a param group's ``matrix_blocks``): each block of a fused tensor
steps exactly, bit for bit, as a separate parameter holding that block would, in every layout (a 2D weight with
unequal blocks as litgpt's ``qkv`` under grouped-query attention, ``in x out`` as GPT-2's ``c_attn``, stacks of
experts ``E x out x in`` and ``E x in x out`` as a fused ``gate_up_proj``, a grouped convolution's kernel); the
momentum buffer stays whole in the state; bad block sizes and sharded parameters are refused with the fix."""

from __future__ import annotations

import pytest
import torch

from lightning_muon import Muon

#: (layout, fused shape, block sizes, the dim the blocks split)
CASES = {
    "gqa-qkv": ("flatten", (64, 32), [32, 16, 16], 0),
    "conv1d-c_attn": ("in_out", (32, 96), [32, 32, 32], 1),
    "moe-gate_up": ("stack", (4, 48, 32), [24, 24], 1),
    "moe-gate_up-in_out": ("stack_in_out", (4, 32, 48), [24, 24], 2),
    "grouped-conv": ("flatten", (16, 4, 3, 3), [4, 4, 4, 4], 0),  # Conv2d(16, 16, 3, groups=4): 4x36 per group
}


#: The update rules a block must step under exactly as a separate parameter would.
RULES = {"nesterov": {"nesterov": True}, "plain": {"nesterov": False},
         "normuon-cautious": {"nesterov": True, "normuon_beta2": 0.95, "cautious_weight_decay": True}}


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("case", list(CASES))
def test_each_block_steps_as_a_separate_parameter(case, rule):
    layout, shape, sizes, dim = CASES[case]
    g = torch.Generator().manual_seed(0)
    fused = torch.nn.Parameter(torch.randn(shape, generator=g))
    separate = [torch.nn.Parameter(b.detach().clone()) for b in fused.split(sizes, dim=dim)]
    settings = {"lr": 0.02, "weight_decay": 0.1, **RULES[rule]}
    blocked = Muon([{"params": [fused], "matrix_layouts": [layout], "matrix_blocks": [sizes]}], **settings)
    apart = Muon([{"params": separate, "matrix_layouts": [layout] * len(separate)}], **settings)
    whole = Muon([{"params": [fused.detach().clone().requires_grad_()], "matrix_layouts": [layout]}], **settings)
    for _ in range(3):
        grad = torch.randn(shape, generator=g)
        fused.grad = grad.clone()
        whole.param_groups[0]["params"][0].grad = grad.clone()
        for p, block in zip(separate, grad.split(sizes, dim=dim), strict=True):
            p.grad = block.clone()
        blocked.step()
        apart.step()
        whole.step()
    assert torch.equal(fused.detach(), torch.cat([p.detach() for p in separate], dim=dim))
    buffer = blocked.state[fused]["momentum_buffer"]
    assert buffer.shape == fused.shape  # one buffer for the whole tensor, as without blocks
    assert torch.equal(buffer, torch.cat([apart.state[p]["momentum_buffer"] for p in separate], dim=dim))
    if "normuon_beta2" in settings:  # NorMuon's per-neuron second moment: whole in the state, split like the rows
        moment = blocked.state[fused]["normuon_second_moment"]
        parts = [apart.state[p]["normuon_second_moment"] for p in separate]
        assert torch.equal(moment, torch.cat(parts, dim=dim))
    # and the blocks are not the fused matrix: one matrix orthogonalised whole moves differently
    assert (fused.detach() - whole.param_groups[0]["params"][0].detach()).abs().max() > 1e-3


def _w(*shape):
    return torch.nn.Parameter(torch.randn(shape))


BLOCK_ERRORS = [
    ({"params": [_w(6, 4)], "matrix_blocks": [[3, 2]]}, r"matrix_blocks \[3, 2\] must be positive block sizes that "
     r"add up to its 6 output rows \(dim 0 for the layout 'flatten'\)"),
    ({"params": [_w(4, 6)], "matrix_layouts": ["in_out"], "matrix_blocks": [[2, 2]]},
     r"add up to its 6 output rows \(dim 1 for the layout 'in_out'\)"),
    ({"params": [_w(6, 4)], "matrix_blocks": [[6, 0]]}, r"must be positive block sizes"),
    ({"params": [_w(6, 4)], "matrix_blocks": [[3, 3], None]}, r"matrix_blocks must be a list with None or a list "
     r"of block sizes per parameter of the group \(1\)"),
]


@pytest.mark.parametrize(("group", "pattern"), BLOCK_ERRORS, ids=["sum", "in_out-sum", "zero", "length"])
def test_bad_blocks_are_refused_with_the_fix(group, pattern):
    with pytest.raises(ValueError, match=pattern):
        Muon([group])


def test_blocks_on_a_sharded_parameter_step_as_one_process(tmp_path):
    """Under FSDP2 or tensor parallelism (DTensor parameters) a parameter split into blocks is taken (it was refused
    before) and steps on its whole copy exactly as on one process, momentum sharded like the parameter (a one-rank
    mesh on CPU; two ranks: tests/optim/test_blocks_sharded.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        start, grad = torch.randn(6, 4), torch.randn(6, 4)
        p = torch.nn.Parameter(distribute_tensor(start.clone(), mesh, [Shard(0)]))
        q = torch.nn.Parameter(start.clone())
        opts = [Muon([{"params": [w], "matrix_blocks": [[4, 2]]}], lr=0.02, ns_dtype=torch.float32) for w in (p, q)]
        p.grad, q.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)]), grad.clone()
        for opt in opts:
            opt.step()
        assert torch.equal(p.full_tensor(), q.detach())
        assert isinstance(opts[0].state[p]["momentum_buffer"], DTensor)
        assert not torch.equal(q.detach(), start)
    finally:
        dist.destroy_process_group()


def _two_block_steps() -> tuple[list[torch.nn.Parameter], Muon]:
    """Every case's fused parameter, split into blocks, two steps on seeded gradients (the same on every rank):
    the parameters and the optimizer."""
    g = torch.Generator().manual_seed(0)
    params, groups = [], []
    for layout, shape, sizes, _ in CASES.values():
        params.append(torch.nn.Parameter(torch.randn(shape, generator=g)))
        groups.append({"params": [params[-1]], "matrix_layouts": [layout], "matrix_blocks": [sizes]})
    opt = Muon(groups, lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def _ddp_worker(rank: int, init_file: str, out: str) -> None:
    """Every case's fused parameter, split into blocks, stepped by a Muon that splits its Newton-Schulz work over
    two DDP ranks (the same gradients on both, as after DDP's all-reduce)."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    params, opt = _two_block_steps()
    torch.save({"params": [p.detach() for p in params], "path": opt.strategy.description,
                "sent": opt.last_exchange_bytes}, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.distributed
def test_blocks_under_ddp_split_equal_one_process(tmp_path):
    import torch.multiprocessing as mp

    from helpers import RANKS_START_METHOD

    mp.start_processes(_ddp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method=RANKS_START_METHOD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    params, _ = _two_block_steps()  # one process
    for r in ranks:
        assert r["path"].startswith("Newton-Schulz split over 2 DDP ranks (") and r["sent"] > 0
        torch.testing.assert_close(r["params"], [p.detach() for p in params], atol=1e-6, rtol=0)
    for got0, got1 in zip(ranks[0]["params"], ranks[1]["params"], strict=True):
        assert torch.equal(got0, got1)


def test_diagnostics_name_each_block_of_a_chosen_parameter():
    """A chosen fused parameter is diagnosed block by block, each as its separate parameter would be."""
    g = torch.Generator().manual_seed(0)
    fused, other = torch.nn.Parameter(torch.randn(64, 32, generator=g)), torch.nn.Parameter(torch.randn(16, 32))
    separate = [torch.nn.Parameter(b.detach().clone()) for b in fused.split([32, 16, 16])]
    opt = Muon([{"params": [("qkv", fused), ("other", other)], "matrix_blocks": [[32, 16, 16], None]}], lr=0.02)
    apart = Muon([{"params": [(f"qkv{k}", p) for k, p in enumerate(separate)]}], lr=0.02)
    fused.grad, other.grad = torch.randn(64, 32, generator=g), torch.randn(16, 32)
    for p, block in zip(separate, fused.grad.split([32, 16, 16]), strict=True):
        p.grad = block.clone()
    opt.record_diagnostics([fused])
    apart.record_diagnostics()
    opt.step()
    apart.step()
    assert [(d.name, d.shape) for d in opt.diagnostics] == [("qkv[0]", (32, 32)), ("qkv[1]", (16, 32)),
                                                            ("qkv[2]", (16, 32))]
    assert [d.name for d in apart.diagnostics] == ["qkv0", "qkv1", "qkv2"]
    for ours, theirs in zip(opt.diagnostics, apart.diagnostics, strict=True):
        assert torch.equal(ours.orthogonality_error, theirs.orthogonality_error)
        assert (ours.effective_lr, ours.update_rms) == (theirs.effective_lr, theirs.update_rms)


def test_equal_blocks_are_diagnosed_as_one_stack():
    """Equal blocks (a grouped convolution's groups) step as one stack of views: one diagnostic for the parameter,
    over all of its blocks, as for a stack of experts."""
    kernel = torch.nn.Parameter(torch.randn(8, 2, 3, 3))
    opt = Muon([{"params": [("conv", kernel)], "matrix_blocks": [[2, 2, 2, 2]]}], lr=0.02)
    kernel.grad = torch.randn(8, 2, 3, 3)
    opt.record_diagnostics()
    opt.step()
    assert [(d.name, d.shape) for d in opt.diagnostics] == [("conv", (8, 2, 3, 3))]


def test_the_effective_lr_of_a_split_parameter_is_its_first_block_s():
    """GPT-2's ``c_attn`` stored ``32 x 96`` (``in x out``): fused, sqrt(96 / 32) times the lr; split into three
    ``32 x 32`` blocks, each block's lr is the lr itself."""
    c_attn = torch.nn.Parameter(torch.randn(32, 96))
    fused = Muon([{"params": [c_attn], "matrix_layouts": ["in_out"]}], lr=0.02)
    split = Muon([{"params": [c_attn], "matrix_layouts": ["in_out"], "matrix_blocks": [[32, 32, 32]]}], lr=0.02)
    assert fused.effective_lr(c_attn) == pytest.approx(0.02 * 3**0.5)
    assert split.effective_lr(c_attn) == pytest.approx(0.02)
