"""Muon on 2 ranks: Newton-Schulz time and step time per rank, work split across ranks vs repeated on each.

Two CPU processes (gloo, one thread each, so the two ranks do not fight over
the 2 cores) hold the same GPT-2-small hidden matrices (12 layers of 2304x768,
768x768, 3072x768, 768x3072) and the same gradients, laid out two ways:

- **DDP** (replicated parameters, as DDP leaves them after its all-reduce):
  ``split_ns=True`` (each rank orthogonalises its FLOP-balanced share, then an
  all-gather of the updates) against ``split_ns=False`` (every rank
  orthogonalises every matrix, like ``torch.optim.Muon``).
- **FSDP2** (DTensor row shards on a 2-rank mesh, as ``fully_shard`` leaves
  them): ``split_ns=True`` (each matrix to one owner rank and its rows back, two
  all-to-alls) against ``split_ns=False`` (every rank gathers and orthogonalises
  every whole matrix).

The modes take turns step by step. Reported per rank: the median step time, the
median time inside Newton-Schulz (the work being split), and the bytes the rank
sent, against the bytes of the (fp32) Muon parameters.

The split at 2-64 ranks is computed, not timed (``--plan``, no processes): the
code's own buckets for GPT-2-small and a ~1B model (24 layers of width 2048) at
the accelerator default of ``ns_batch_bytes`` (256 MiB), and the code's own owner
plan (`lightning_muon.optim._plan.plan_jobs`, owners per parameter) against the
plan before it (owners per bucket): what the DDP all-gather sends over the
minimum (every update once) and the busiest rank's Newton-Schulz FLOPs over the
mean.

    python benchmarks/distributed.py            # GPT-2-small, 3 timed steps per mode
    python benchmarks/distributed.py --quick    # width-128 matrices, seconds
    python benchmarks/distributed.py --plan     # the computed split only, a second
    python benchmarks/distributed.py --agreement  # step time with and without the gradient agreement
    python benchmarks/distributed.py --tensor-parallel --write  # TP(2) and dp=2 x tp=2: work and bytes per rank

``--agreement`` times, on 2 gloo ranks and the width-128 matrices, a DDP split step with the
agreement on which parameters have gradients (one all-reduce of a CPU tensor, no device sync)
and without it (every rank trusting its own flags), and the agreement alone. On a GPU the point is
the device sync the old path made (``.tolist()`` of a device tensor waits for all queued work),
which a CPU cannot show.

``--tensor-parallel`` counts, not times, what Muon does under tensor parallelism: the example model
`lightning_muon.examples.parallel_gpt.ParallelGPT` at GPT-2-small's size (12 layers, width 768, SwiGLU 3072), laid
out by its own ``parallelize`` (Lightning's tutorial plan over the ``tensor_parallel`` mesh dim, and for 2-D
``fully_shard`` over ``data_parallel``) on gloo CPU ranks, gradients from one small batch, one Muon step over the
block matrices. Per rank, from the strategy's own accounting (``Muon.strategy``, and the chosen strategy's
``ns_flops`` and ``exchanged_bytes``): the Newton-Schulz FLOPs against one process's over the same matrices (the
same step without a process group), and the bytes sent against the minimum of the owner exchange (every matrix
element once to its owner and once back, in the exchange dtype). With ``--write`` it goes to
``benchmarks/results/distributed_tp.md`` and its own ``benchmarks/RESULTS.md`` section.

Prints the table; with ``--write`` also writes ``benchmarks/results/distributed.md`` (and its
``benchmarks/RESULTS.md`` section).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.table import Table

import lightning_muon.optim._update as muon_module
from lightning_muon import Muon
from lightning_muon.optim._plan import Job, assign_owners, balance, exchange_rounds, plan_jobs, round_bytes
from lightning_muon.optim._strategies import EXCHANGE_ROUND_BYTES
from lightning_muon.optim.groups import DEFAULT_BATCH_BYTES_ACCELERATOR, ns_dtype

import _common
import _report

WORLD = 2
MODES = {  # name -> (layout, split_ns)
    "DDP, split_ns=False (every rank does all)": ("ddp", False),
    "DDP, split_ns=True (each rank a share)": ("ddp", True),
    "FSDP2, split_ns=False (every rank gathers all)": ("fsdp2", False),
    "FSDP2, split_ns=True (owner ranks)": ("fsdp2", True),
}


def timed_newton_schulz(seconds: list[float]):
    """`zeropower_via_newtonschulz` as Muon calls it, adding the time of every call to ``seconds[0]``."""
    inner = muon_module.zeropower_via_newtonschulz

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[0] += time.perf_counter() - start

    return timed


def worker(rank: int, layers: int, width: int, repeats: int, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)  # the same matrices and gradients on every rank, as after DDP's all-reduce
    initial = [torch.randn(s) * 0.02 for s in _common.hidden_shapes(layers, width)]
    grads = [torch.randn(s) for s in _common.hidden_shapes(layers, width)]
    ns_seconds = [0.0]
    muon_module.zeropower_via_newtonschulz = timed_newton_schulz(ns_seconds)
    optimizers, results = {}, {}
    for name, (layout, split) in MODES.items():
        place = (lambda x: distribute_tensor(x, mesh, [Shard(0)])) if layout == "fsdp2" else (lambda x: x)
        params = [torch.nn.Parameter(place(x.clone())) for x in initial]
        for p, g in zip(params, grads):
            p.grad = place(g.clone())
        optimizers[name] = Muon(params, lr=0.02, momentum=0.95, weight_decay=0.01, split_ns=split)
        optimizers[name].step()  # warm-up
        results[name] = {"step": [], "ns": [], "sent": 0}
    for _ in range(repeats):
        for name, optimizer in optimizers.items():
            dist.barrier()
            ns_seconds[0] = 0.0
            start = time.perf_counter()
            optimizer.step()
            results[name]["step"].append(time.perf_counter() - start)
            results[name]["ns"].append(ns_seconds[0])
            results[name]["sent"] = optimizer.last_exchange_bytes
    param_bytes = sum(x.numel() * x.element_size() for x in initial)
    torch.save({"results": results, "param_bytes": param_bytes}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


#: The computed split: (name, GPT layers, width, world sizes).
PLANNED = (("GPT-2-small", 12, 768, (2, 4, 8)), ("~1B", 24, 2048, (2, 4, 8, 64)))
#: The computed FSDP2 exchange memory: (name, GPT layers, width, world sizes).
SHARDED = (("GPT-2-small", 12, 768, (8,)), ("~1B", 24, 2048, (8, 64)), ("~7B", 32, 4096, (8, 64)))


def accelerator_buckets(layers: int, width: int) -> list[muon_module.Bucket]:
    """Muon's buckets of one step over the GPT hidden matrices at the accelerator default of ``ns_batch_bytes``,
    built by the code as a DDP step builds them (meta tensors: no memory)."""
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in _common.hidden_shapes(layers, width)]
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer = Muon(params, ns_batch_bytes=DEFAULT_BATCH_BYTES_ACCELERATOR)
    return muon_module.collect_buckets(optimizer.param_groups, optimizer.state, [True] * len(params),
                                       whole_dtensors=False, synced=True, named=False)


def per_bucket_jobs(buckets: list[muon_module.Bucket], world_size: int) -> list[Job]:
    """The plan before owners went per parameter: each bucket one job, buckets FLOP-balanced over the ranks."""
    owners = assign_owners([b.flops for b in buckets], world_size)
    return [Job(b, owner, tuple(range(len(bucket.params)))) for b, (bucket, owner) in enumerate(zip(buckets, owners))]


def plan_report() -> tuple[list[str], Table]:
    """The computed split, as lines (``W=8 accelerator-default: bytes/minimum X.XX, NS max/mean Y.YY``) and a table."""
    table = Table(title="Split of Newton-Schulz work, computed from the code's buckets at the accelerator default "
                        f"(ns_batch_bytes {DEFAULT_BATCH_BYTES_ACCELERATOR >> 20} MiB, bf16)")
    for column in ("model", "W", "plan", "jobs", "idle ranks", "all-gather bytes / minimum", "NS max / mean",
                   "all-gather buffers per rank"):
        table.add_column(column, justify="left" if column in ("model", "plan") else "right")
    lines = []
    for name, layers, width, worlds in PLANNED:
        buckets = accelerator_buckets(layers, width)
        matrices = sum(len(b.params) for b in buckets)
        for label, planner in (("per bucket (before)", per_bucket_jobs), ("per parameter (now)", plan_jobs)):
            lines.append(f"{name} ({layers} x {width}, {matrices} matrices, {len(buckets)} buckets), "
                         f"owners {label}:")
            for world in worlds:
                jobs = planner(buckets, world)
                shares = balance(buckets, jobs, world)
                ratios = f"bytes/minimum {shares.bytes_over_minimum:.2f}, NS max/mean {shares.flops_max_over_mean:.2f}"
                lines.append(f"  W={world} accelerator-default: {ratios}")
                idle = sum(1 for f in shares.flops if f == 0)
                # A send buffer and one receive buffer per rank, each as wide as the largest share.
                buffers = (world + 1) * max(shares.bytes)
                table.add_row(name, str(world), label, str(len(jobs)), str(idle),
                              f"{shares.bytes_over_minimum:.2f}", f"{shares.flops_max_over_mean:.2f}",
                              f"{buffers / 2**30:.2f} GiB")
    return lines, table


def fsdp2_memory_report() -> tuple[list[str], Table]:
    """The FSDP2 exchange buffers per rank, computed: the whole model in one exchange, buffers allocated every
    step (before), against rounds of at most `EXCHANGE_ROUND_BYTES` per buffer through kept buffers (now)."""
    table = Table(title="FSDP2 exchange buffers per rank, computed from the code's buckets and rounds "
                        f"(accelerator default, bf16; round limit {EXCHANGE_ROUND_BYTES >> 20} MiB)")
    for column in ("model", "W", "largest buffer, one exchange (before)", "rounds (now)", "largest buffer (now)",
                   "kept between steps (now)"):
        table.add_column(column, justify="left" if column == "model" else "right")
    lines = []
    for name, layers, width, worlds in SHARDED:
        buckets = accelerator_buckets(layers, width)
        for world in worlds:
            before = max(round_bytes(buckets, per_bucket_jobs(buckets, world), world))
            rounds = exchange_rounds(buckets, plan_jobs(buckets, world), world, EXCHANGE_ROUND_BYTES)
            sizes = [round_bytes(buckets, jobs, world) for jobs in rounds]  # (whole, rows) of each round
            largest = max(max(size) for size in sizes)
            # Send and receive hold either side of a round; stacks the owner's whole matrices.
            kept = 2 * largest + max(whole for whole, _ in sizes)
            plural = "s" if len(rounds) != 1 else ""
            lines.append(f"FSDP2 W={world} {name}: largest exchange buffer {before / 2**20:,.0f} MiB (one exchange, "
                         f"fresh each step) -> {largest / 2**20:,.0f} MiB in {len(rounds)} round{plural} "
                         f"({kept / 2**20:,.0f} MiB kept)")
            table.add_row(name, str(world), f"{before / 2**20:,.0f} MiB", str(len(rounds)),
                          f"{largest / 2**20:,.0f} MiB", f"{kept / 2**20:,.0f} MiB")
    return lines, table


def agreement_worker(rank: int, repeats: int, init_file: str, out: str) -> None:
    """Times split DDP steps with and without the gradient agreement (modes taking turns), and the agreement
    alone; saves the medians."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    shapes = _common.hidden_shapes(4, 128)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape)
    optimizer = Muon(params, lr=0.02, momentum=0.95, weight_decay=0.01)
    optimizer.step()  # warm-up; chooses the strategy (and its agreement)
    strategy = optimizer._choice.chosen
    agree = strategy.agree
    times: dict[str, list[float]] = {"with agreement": [], "without": [], "agreement alone": []}
    flags = [True] * len(params)
    for _ in range(repeats):
        for mode in ("with agreement", "without"):
            strategy.agree = agree if mode == "with agreement" else (lambda flags, device: flags)  # type: ignore
            dist.barrier()
            start = time.perf_counter()
            optimizer.step()
            times[mode].append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        agree(flags, params[0].device)
        times["agreement alone"].append(time.perf_counter() - start)
    torch.save({mode: statistics.median(t) for mode, t in times.items()}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def agreement_report(repeats: int) -> Table:
    """Median step and agreement times per rank (2 gloo ranks, width-128 matrices)."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(agreement_worker, args=(repeats, os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    table = Table(title=f"Gradient agreement, {WORLD} CPU processes (gloo, 1 thread each), width-128 matrices, "
                        f"{repeats} steps per mode (median)")
    table.add_column("mode")
    table.add_column("ms (rank 0 / 1)", justify="right")
    for mode in ranks[0]:
        table.add_row(mode, " / ".join(f"{1e3 * r[mode]:.3f}" for r in ranks))
    return table


#: The tensor-parallel layouts ``--tensor-parallel`` counts: (name, data-parallel size, tensor-parallel size,
#: split_ns).
TENSOR_PARALLEL = (
    ("TP(2), split_ns=True", 1, 2, True),
    ("TP(2), split_ns=False", 1, 2, False),
    ("dp=2 x tp=2 (FSDP2 over TP), split_ns=True", 2, 2, True),
    ("dp=2 x tp=2 (FSDP2 over TP), split_ns=False", 2, 2, False),
)
#: `ParallelGPT` at GPT-2-small's size: 12 blocks of wq, wk, wv, wo (768 x 768), w1, w3 (3072 x 768), w2 (768 x 3072).
TP_MODEL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "hidden": 3072, "block_size": 32}


def tp_model_and_muon(split_ns: bool, device_mesh=None):
    """The model (seed 0, so every rank builds the same), laid out by its own `parallelize` over ``device_mesh``
    (none: one process), its block matrices' gradients from one batch of 2 x 32 bytes, and a `Muon` over them."""
    from torch.nn import functional as F

    from lightning_muon.examples.parallel_gpt import ParallelGPT, parallelize

    torch.manual_seed(0)
    model = ParallelGPT(**TP_MODEL)
    if device_mesh is not None:
        parallelize(model, device_mesh)
    tokens = torch.randint(256, (2, TP_MODEL["block_size"] + 1), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    matrices = [p for name, p in model.named_parameters() if name.startswith("blocks.") and p.ndim == 2]
    return matrices, Muon(matrices, lr=0.02, momentum=0.95, weight_decay=0.01, split_ns=split_ns)


def counted_step(muon: Muon, matrices: list[torch.Tensor]) -> dict:
    """One step of ``muon``; what its strategy counted (private counters: no public API) and where it ran."""
    muon.step()
    chosen = muon._choice.chosen
    info = muon.strategy
    return {"kind": info.kind, "fallback": info.fallback, "ranks": info.ranks, "ns_flops": chosen.ns_flops,
            "sent": chosen.exchanged_bytes, "numel": sum(p.numel() for p in matrices),
            "param_bytes": sum(p.numel() * p.element_size() for p in matrices),
            "ns_bytes": ns_dtype(muon.param_groups[0]).itemsize}


def tp_worker(rank: int, world: int, data_parallel: int, split_ns: bool, init_file: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (data_parallel, world // data_parallel),
                            mesh_dim_names=("data_parallel", "tensor_parallel"))  # as ModelParallelStrategy's
    matrices, muon = tp_model_and_muon(split_ns, mesh)
    torch.save(counted_step(muon, matrices), f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def tensor_parallel_report() -> tuple[Table, dict]:
    """The table of ``--tensor-parallel`` and the counts behind it (one process's, then each layout's ranks)."""
    torch.set_num_threads(1)
    matrices, muon = tp_model_and_muon(split_ns=True)
    single = counted_step(muon, matrices)
    counts: dict = {"one process": [single]}
    for name, data_parallel, tensor_parallel, split_ns in TENSOR_PARALLEL:
        world = data_parallel * tensor_parallel
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(tp_worker, args=(world, data_parallel, split_ns, os.path.join(tmp, "init"), tmp), nprocs=world,
                     join=True)
            counts[name] = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    table = Table(title="Muon under tensor parallelism: Newton-Schulz FLOPs and bytes per rank, counted by the "
                        "strategy (ParallelGPT at GPT-2-small's size, one step)")
    for column in ("layout", "Muon's path", "NS FLOPs per rank / one process's", "max", "bytes sent, all ranks",
                   "/ minimum"):
        table.add_column(column, justify="left" if column in ("layout", "Muon's path") else "right")
    total = single["ns_flops"]
    for name, ranks in counts.items():
        first = ranks[0]
        if first["kind"] == "sharded":
            path = f"sharded: owner exchange over {first['ranks']} ranks"
        elif first["fallback"]:
            path = "local, fallback: every rank all of it"
        elif name == "one process":
            path = "local: this process all of it"
        else:
            path = "local: every rank all of it"
        shares = [r["ns_flops"] / total for r in ranks]
        sent = sum(r["sent"] for r in ranks)
        minimum = 2 * first["numel"] * first["ns_bytes"]  # every element to its owner and back, once
        if name == "one process":
            bytes_cells = ["0", ""]
        elif first["kind"] == "sharded":
            bytes_cells = [f"{sent:,}", f"{sent / minimum:.2f}"]
        else:  # DTensor.full_tensor's all-gathers, which Muon does not count
            bytes_cells = ["not counted", "fallback" if first["fallback"] else ""]
        table.add_row(name, path, " / ".join(f"{x:.2f}" for x in shares), f"{max(shares):.2f}", *bytes_cells)
    return table, counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="width-128 matrices instead of GPT-2-small")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--plan", action="store_true",
                        help="print only the computed split at 2-64 ranks (no processes, about a second)")
    parser.add_argument("--agreement", action="store_true",
                        help="time only a step with and without the gradient agreement (2 ranks, width-128)")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="count only the Newton-Schulz work and bytes per rank under TP(2) and dp=2 x tp=2 "
                             "(2 and 4 gloo ranks, GPT-2-small-sized ParallelGPT; --write: results/distributed_tp.md)")
    parser.add_argument("--write", action="store_true",
                        help="write benchmarks/results/distributed.md and its RESULTS.md section (else: print)")
    args = parser.parse_args(argv)
    console = _common.console(160)
    plan_lines, plan_table = plan_report()
    memory_lines, memory_table = fsdp2_memory_report()
    if args.plan:
        console.print("\n".join(plan_lines + memory_lines))
        return
    if args.agreement:
        console.print(agreement_report(args.repeats or 200))
        return
    if args.tensor_parallel:
        tensor_parallel(console, argv, args.write)
        return
    layers, width, name = (4, 128, "width-128") if args.quick else (12, 768, "GPT-2-small")
    repeats = args.repeats or (20 if args.quick else 3)

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(worker, args=(layers, width, repeats, init_file, tmp), nprocs=WORLD, join=True)
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]

    table = Table(title=f"Muon per rank, {WORLD} CPU processes (gloo, 1 thread each), {name} hidden matrices")
    columns = ("mode", "step ms (rank 0 / 1)", "step ratio", "NS ms (rank 0 / 1)", "NS ratio", "bytes sent",
               "of param bytes")
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right")
    param_bytes = ranks[0]["param_bytes"]
    median = {
        (mode, what): [statistics.median(r["results"][mode][what]) for r in ranks]
        for mode in MODES
        for what in ("step", "ns")
    }
    for mode, (layout, split) in MODES.items():
        peer = next(m for m, (lay, s) in MODES.items() if lay == layout and not s)  # the same layout, not split
        sent = sum(r["results"][mode]["sent"] for r in ranks)
        cells = []
        for what in ("step", "ns"):  # a step waits for the slower rank: ratios compare the slower ranks
            cells += [" / ".join(f"{1e3 * t:.0f}" for t in median[mode, what]),
                      f"{max(median[mode, what]) / max(median[peer, what]):.2f}"]
        if layout == "fsdp2" and not split:  # DTensor.full_tensor's all-gathers, which Muon does not count
            table.add_row(mode, *cells, "not counted", "")
        else:
            table.add_row(mode, *cells, f"{sent:,}", f"{sent / param_bytes:.2f}")
    console.print(table)
    console.print(plan_table)
    console.print(memory_table)
    details = f"{_common.machine(threads=1)} per rank; {repeats} timed steps per mode (median), modes taking turns"
    console.print(details)
    if args.write:
        notes = (
            "Ratios are against the same layout with `split_ns=False`, comparing the slower rank of each mode "
            "(a step waits for it). NS ms is the time inside Newton-Schulz only; a step also updates every "
            "momentum buffer and parameter (DDP: every rank all of them, by design: Lightning checkpoints "
            "rank 0; FSDP2: each rank its shards) and exchanges the updates. Bytes are what all ranks sent "
            "together (bf16 updates): DDP's all-gather carries each rank's share once; FSDP2's two all-to-alls "
            "carry every shard to its owner and every result back (self-sends included). FSDP2 with "
            "`split_ns=False` gathers each matrix with `DTensor.full_tensor()` on every rank (fp32, not counted "
            "by Muon): each rank receives every other rank's shards.\n"
        )
        notes += (
            "\nThe second table is computed, not timed (`python benchmarks/distributed.py --plan` prints it as "
            "lines): Muon's own buckets of the GPT hidden matrices at the accelerator default of `ns_batch_bytes` "
            "and its own owner plan, owners per parameter (now) against owners per bucket (before). The all-gather "
            "pads every rank's share to the largest, so it sends `W x max share`; the minimum is every update once. "
            "Buffers: the send buffer and the W receive buffers DDP keeps between steps. The third table is "
            "computed too: under FSDP2 the largest exchange buffer of a rank when the whole model is exchanged at "
            "once (owners per bucket, buffers allocated every step: before) and when the exchanges run in rounds "
            "of at most the limit (now), through three buffers kept between steps (send, receive, stacks).\n"
        )
        path = _report.write("distributed", "Distributed Newton-Schulz", _report.command("distributed.py", argv),
                             details, [table, plan_table, memory_table], notes)
        console.print(f"wrote {path}")


def tensor_parallel(console, argv: list[str] | None, write: bool) -> None:
    """``--tensor-parallel``: print the counts, and with ``write`` record them."""
    table, counts = tensor_parallel_report()
    console.print(table)
    single = counts["one process"][0]
    details = (f"{_common.machine(threads=1)} per rank; {single['numel']:,} Muon matrix elements (fp32, "
               f"{single['param_bytes']:,} bytes), Newton-Schulz in the default bf16: "
               f"{single['ns_flops'] / 1e9:.1f} GFLOP a step on one process")
    console.print(details)
    if not write:
        return
    notes = (
        "Counted, not timed: each rank's own strategy (`Muon.strategy` says the path; the chosen strategy's "
        "`ns_flops` and `exchanged_bytes` are its counts of the step), against one process stepping the same "
        "matrices (`LocalStep`, every FLOP). NS FLOPs per rank are listed rank by rank (rank 0 / 1 / ...). "
        "Bytes are what all ranks sent together in Muon's two all-to-alls (every shard to its matrix's owner, every "
        "result back, in bf16), self-sends included; the minimum is every Muon matrix element sent once to its "
        "owner and once back (2 x 2 bytes an element). Under TP(2) the colwise weights (`Shard(0)`) travel as row "
        "shards and the rowwise ones (`Shard(1)`) as column shards; each matrix is orthogonalised whole on one "
        "rank, owners balanced by FLOPs over the parameters.\n\n"
        "2-D (dp=2 x tp=2, `fully_shard` over tensor parallel: placements `(_StridedShard(0), Shard(0))` for the "
        "colwise weights and `(Shard(0), Shard(1))` for the rowwise ones, on the 2-D mesh): the owner exchange runs "
        "over all 4 ranks, each sending its block of each matrix (a quarter of its rows or columns, as DTensor "
        "computes the shard) to the matrix's owner and getting its block of the result back. `split_ns=False` "
        "is the repetition on purpose, the peer of each split row, and what 2-D fell back to before: every rank "
        "gathers (`DTensor.full_tensor()`, fp32, not counted by Muon) and orthogonalises every whole matrix.\n"
    )
    path = _report.write("distributed_tp", "Distributed Newton-Schulz under tensor parallelism",
                         _report.command("distributed.py", argv), details, [table], notes)
    console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
