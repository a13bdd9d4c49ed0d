"""`lightning_muon.optim.norms`: norms, clipping and finiteness over a mix of plain tensors and DTensors on two
meshes (what tensor parallelism and 2-D training give the mixin), in this process on a one-rank gloo group: the
same numbers as over the whole tensors, where torch's own foreach kernels refuse the mix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_muon.optim import norms as _norms


@pytest.fixture
def two_meshes():
    """A one-rank process group (destroyed after the test: Muon follows the default group) and two meshes."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        yield mesh, mesh["tensor_parallel"]
    finally:
        dist.destroy_process_group()


def gradients(two_meshes):
    """Whole gradients, and the same as a plain tensor, a DTensor on the 1-D mesh and one on the 2-D mesh."""
    mesh, tp = two_meshes
    g = torch.Generator().manual_seed(0)
    whole = [torch.randn(4, 6, generator=g), torch.randn(6, 4, generator=g) * 3, torch.randn(5, generator=g)]
    mixed = [distribute_tensor(whole[0], mesh, [Shard(0), Shard(1)]), distribute_tensor(whole[1], tp, [Shard(1)]),
             whole[2].clone()]
    return whole, mixed


def test_torchs_own_norm_refuses_the_mix_ours_gives_the_whole_norm(two_meshes):
    whole, mixed = gradients(two_meshes)
    with pytest.raises(Exception, match=r"mixed torch\.Tensor and DTensor|same mesh"):
        torch.nn.utils.get_total_norm(mixed)
    for norm_type in (2.0, 1.0, float("inf")):
        expected = torch.nn.utils.get_total_norm(whole, norm_type)
        got = _norms.total_norm(mixed, norm_type)
        assert type(got) is torch.Tensor and torch.allclose(got, expected), norm_type
    assert [len(group) for group in _norms.by_mesh(mixed)] == [1, 1, 1]
    assert _norms.total_norm([]) == 0


def test_clipping_by_norm_and_by_value_and_the_finite_check_over_the_mix(two_meshes):
    whole, mixed = gradients(two_meshes)
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in mixed]
    for p, grad in zip(params, mixed):
        p.grad = grad.clone()
    norm = _norms.total_norm([p.grad for p in params])
    _norms.clip_with_norm_(params, 1.0, norm)
    scale = 1.0 / (torch.nn.utils.get_total_norm(whole) + 1e-6)
    for p, w in zip(params, whole):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert torch.allclose(grad, w * scale)
    assert torch.allclose(_norms.total_norm([p.grad for p in params]), torch.tensor(1.0), atol=1e-5)
    for p, grad in zip(params, mixed):
        p.grad = grad.clone()
    _norms.clip_value_(params, 0.5)
    for p, w in zip(params, whole):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert torch.equal(grad, w.clamp(-0.5, 0.5))
    assert all(_norms.is_finite(t) for t in mixed)
    bad = distribute_tensor(whole[0].clone().index_fill_(0, torch.tensor([2]), float("nan")), two_meshes[1],
                            [Shard(0)])
    assert not _norms.is_finite(bad) and not bool(torch.isfinite(_norms.total_norm([*mixed, bad])))
