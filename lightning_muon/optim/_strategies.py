"""Where Muon's Newton-Schulz work runs: on every rank, split over DDP ranks, or on FSDP2 owner ranks.

Every strategy is a `Strategy`; `lightning_muon.optim._choice` picks one of three, from the parameters and the
process group (the default one, or an explicit ``process_group`` / ``device_mesh`` given to `lightning_muon.Muon`),
and says which:

- `LocalStep`: one process, or every rank doing all the work (``split_ns=False``,
  and DTensor layouts the owner exchange does not know, whose matrices are gathered
  whole: a fallback, said in a rank-zero warning);
- `ReplicatedStep` (DDP): each rank orthogonalises a FLOP-balanced share of the
  matrices, the results are all-gathered, every rank applies every update;
- `ShardedStep` (FSDP2, DTensors ``Shard(0)`` on a 1-D mesh; tensor parallelism,
  ``Shard(0)`` and ``Shard(1)`` on a 1-D mesh; HSDP, ``(Replicate(), Shard(0))`` on
  a 2-D mesh, within each replica's shard group): each matrix's row (or column)
  shards go to an owner rank, which orthogonalises the whole matrices and sends
  every rank back its rows (or columns). FSDP2 over tensor parallelism (2-D
  placements that shard on both mesh dims) the same way over every rank of the
  mesh, each holding a block of each matrix.

The two distributed ones are `DistributedStep`s: they hold their `World` (which ranks share the work) from
construction on. Owners are assigned per parameter, each bucket cut into one job per owner
(`lightning_muon.optim._plan`), so the split does not depend on ``ns_batch_bytes``.

Each strategy owns its owners, exchange buffers, byte count and diagnostics;
all of them use the maths of `lightning_muon.optim._update`, and call a group's update rules
(`lightning_muon.optim.rules`) without naming any.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_muon.optim import _update
from lightning_muon.optim._bucket import Bucket, Chooser, ParamDiagnostics
from lightning_muon.optim._collectives import (
    Agreement,
    ExchangeBuffers,
    World,
    all_gather_results,
    gather_to_owners,
    make_agreement,
    scatter_from_owners,
)
from lightning_muon.optim._plan import (
    Job,
    PlanCache,
    assign_owners,
    exchange_rounds,
    in_bucket_order,
    plan_jobs,
)
from lightning_muon.optim.groups import matrices_in, matrix_shape
from lightning_muon.optim.norms import any_rank
from lightning_muon.optim.rules import UpdateRule, rules_for

#: The most bytes one FSDP2 exchange buffer holds per rank by default (a round of exchanges stays within it,
#: see `lightning_muon.optim._plan.exchange_rounds`): large enough for all-to-alls at full bandwidth and for
#: batched Newton-Schulz calls that gain nothing from growing further, small next to an accelerator's memory.
EXCHANGE_ROUND_BYTES = 64 << 20

#: What a step on one process says it does.
ALONE = "Newton-Schulz runs on this process alone"

#: The three paths, one word each (`Strategy.kind`): this process does all the work, the ranks split replicated
#: matrices (DDP), or owner ranks orthogonalise sharded ones (FSDP2, HSDP).
Kind = Literal["local", "replicated", "sharded"]


class Strategy(ABC):
    """How a Muon step runs: which parameters step (`buckets`), then momentum, Newton-Schulz and apply (`run`)."""

    #: The path, in one word.
    kind: ClassVar[Kind]
    #: Sharded matrices are orthogonalised one at a time, each gathered whole.
    whole_dtensors: ClassVar[bool] = True
    #: Ranks exchange work, so every rank must build the same buckets (`_update.collect_buckets`).
    synced: ClassVar[bool] = False
    #: A DTensor parameter split into blocks steps on an owner rank (`step_owned_blocks`) where it can.
    owner_blocks: ClassVar[bool] = False

    def __init__(self, description: str, *, fallback: bool = False, complete_state: bool = False) -> None:
        #: Which path the run takes, a clause for the rank-zero line of `_choice.choose_strategy`.
        self.description = description
        #: Whether that path is a fallback that repeats the Newton-Schulz work on every rank.
        self.fallback = fallback
        #: Every parameter needs a momentum buffer from the first step on (DTensor parameters: a distributed
        #: checkpoint of FSDP2 resumes only when it has a state for every parameter).
        self.complete_state = complete_state
        #: Bytes this rank sent in the last step's exchanges.
        self.exchanged_bytes = 0
        #: Newton-Schulz FLOPs this rank ran in the last step, as the planner counts them (`Bucket.flops`): what
        #: splitting the work divides between the ranks.
        self.ns_flops = 0

    def agree(self, flags: list[bool], device: torch.device) -> list[bool]:
        """``flags`` (one per parameter: has it a gradient?) as every rank that takes part sees them: here,
        ``flags`` itself (no other rank)."""
        return flags

    def buckets(self, param_groups: list[dict[str, Any]], state: Any, named: bool) -> list[Bucket]:
        """The buckets of a step: every parameter with a gradient (on any rank that takes part), momentum
        buffers and update-rule state created in the optimizer's ``state``; ``named``: with the parameters' names
        (diagnostics)."""
        every = [p for group in param_groups for p in group["params"]]
        has_grad = [p.grad is not None for p in every]
        if every:
            has_grad = self.agree(has_grad, every[0].device)
        return _update.collect_buckets(
            param_groups, state, has_grad, whole_dtensors=self.whole_dtensors, synced=self.synced, named=named,
            complete=self.complete_state, owner_blocks=self.owner_blocks and not named,
        )

    @abstractmethod
    def run(self, buckets: Sequence[Bucket], diagnose: Chooser | None) -> list[ParamDiagnostics]:
        """Momentum, Newton-Schulz and apply for every bucket; the diagnostics of the matrices ``diagnose``
        chooses (none without it)."""


class LocalStep(Strategy):
    """Every bucket orthogonalised here, bucket by bucket (DTensors gathered whole on every rank)."""

    kind = "local"

    def __init__(self, description: str = ALONE, *, fallback: bool = False, complete_state: bool = False) -> None:
        super().__init__(description, fallback=fallback, complete_state=complete_state)

    def run(self, buckets: Sequence[Bucket], diagnose: Chooser | None) -> list[ParamDiagnostics]:
        self.ns_flops = sum(bucket.flops for bucket in buckets)
        return step_here(buckets, diagnose)


def step_here(buckets: Sequence[Bucket], diagnose: Chooser | None) -> list[ParamDiagnostics]:
    """Every bucket orthogonalised and applied on this rank; blocks of DTensor parameters stepped on their whole
    copies (`_update.gather_whole`) and each rank's shard written back. The diagnostics ``diagnose`` chooses."""
    diagnostics: list[ParamDiagnostics] = []
    chooser = None if diagnose is None else _update.whole_chooser(buckets, diagnose)
    # Call by call (a bucket, or one with its transposed twin: `ns_batches`), so a matrix's buffer and
    # gradient are still in cache for its whole update (on CPU, sweeping every buffer first and
    # orthogonalising afterwards measured slower).
    for batch in _update.ns_batches(buckets):
        chosen = [buckets[j] for j in batch]
        results = _update.orthogonalise_buckets(chosen, [_update.momentum(b) for b in chosen])
        for bucket, orthogonal in zip(chosen, results, strict=True):
            _update.apply(bucket, orthogonal)
            if chooser is not None:
                diagnostics += _update.record(bucket, orthogonal, chooser)
    _update.write_back(buckets)
    return diagnostics


class DistributedStep(Strategy):
    """A step whose Newton-Schulz work the ranks of a `World` share: they agree on which parameters have
    gradients, plan alike who orthogonalises what, and exchange the results."""

    synced = True

    def __init__(self, world: World, agreement: Agreement, description: str, *, complete_state: bool) -> None:
        super().__init__(description, complete_state=complete_state)
        #: The ranks that share the work.
        self.world = world
        #: Where they agree (`agree`): on a CPU tensor wherever the backend allows, so no device sync.
        self.agreement = agreement
        #: The exchange buffers, kept between steps.
        self.buffers = ExchangeBuffers()

    def agree(self, flags: list[bool], device: torch.device) -> list[bool]:
        """``flags`` ORed over the world's ranks, so that every rank builds the same buckets. ``device``: the
        parameters' device, used only where the backend cannot all-reduce a CPU tensor (see
        `lightning_muon.optim._collectives.agreement_path`)."""
        return any_rank(flags, self.agreement.device or device, self.agreement.group)


class ReplicatedStep(DistributedStep):
    """DDP: each rank orthogonalises its share of the matrices; the results are all-gathered; all apply all.

    Every rank keeps every momentum buffer (Lightning checkpoints rank 0), so parameters stay identical.
    """

    kind = "replicated"

    def __init__(self, world: World) -> None:
        ranks = f"{world.size} DDP ranks" + ("" if world.group is None else " of the given process group")
        super().__init__(
            world,
            make_agreement(world.group),
            f"Newton-Schulz split over {ranks} (each orthogonalises a FLOP-balanced share of the matrices, the "
            "updates are all-gathered)",
            complete_state=False,
        )
        self._plans: PlanCache[list[Job]] = PlanCache()

    def run(self, buckets: Sequence[Bucket], diagnose: Chooser | None) -> list[ParamDiagnostics]:
        if not buckets:  # the same on every rank: which parameters have gradients was agreed
            return []
        size, rank = self.world.size, self.world.rank
        jobs = self._plans.get(buckets, lambda: plan_jobs(buckets, size))
        parts = [buckets[job.bucket].subset(job.indices) for job in jobs]
        local = {}
        for j, (job, part) in enumerate(zip(jobs, parts, strict=True)):
            if job.owner == rank:
                local[j] = _update.orthogonalise_buckets([part], [_update.momentum(part)])[0]
        self.ns_flops = sum(part.flops for job, part in zip(jobs, parts, strict=True) if job.owner == rank)
        # Every rank keeps every momentum buffer; only the owner needs the update itself.
        mine = {job.bucket: set(job.indices) for job in jobs if job.owner == rank}
        for b, bucket in enumerate(buckets):
            others = [i for i in range(len(bucket.params)) if i not in mine.get(b, ())]
            if others:
                _update.advance_momentum(bucket.subset(others))
        device = buckets[0].params[0].device
        layouts = [part.exchange_layout for part in parts]
        owners = [job.owner for job in jobs]
        gathered = all_gather_results(local, owners, layouts, self.world, device, self.buffers)
        self.exchanged_bytes = int(sum(t.numel() * t.element_size() for ts in local.values() for t in ts))
        diagnostics: list[ParamDiagnostics] = []
        for bucket, orthogonal in zip(buckets, in_bucket_order(buckets, jobs, gathered), strict=True):
            _update.apply(bucket, orthogonal)
            if diagnose is not None:
                diagnostics += _update.record(bucket, orthogonal, diagnose)
        return diagnostics


class ShardedStep(DistributedStep):
    """FSDP2: each job's row shards go to its owner rank, which orthogonalises the whole matrices and
    sends every rank back its rows of the result; every rank applies its own rows. Momentum stays sharded.
    Tensor parallelism on a 1-D mesh the same way: a rowwise weight (``Shard(1)``) is a row-sharded matrix
    transposed, its columns travel instead of its rows (``columns``: some do, said in the description), and
    the owner orthogonalises the whole matrix as stored, batched with its job's other same-shape matrices
    whichever way they are cut. FSDP2 over tensor parallelism (a 2-D `World`) too: each rank's block of a
    matrix (rows of its columns, or columns of its rows) travels to the owner, and comes back.

    The exchanges run in rounds (`lightning_muon.optim._plan.exchange_rounds`, every owner busy in each):
    every exchange buffer holds at most ``max(round_bytes, P)`` bytes per rank, ``P`` about one parameter's
    matrices in ``ns_dtype`` (for a parameter larger than the limit), through three buffers kept between
    steps (send, receive, stacks), so the exchange memory is bounded by the round, not the model. At the
    peak of a round a rank holds those three, the owner's Newton-Schulz results (as large as its stacks)
    and the round's momentum updates of its rows (in the gradients' dtype): about ``4 * round_bytes`` plus
    those updates, where one exchange of the whole model allocated its share (``~12 bytes per Muon
    parameter / world``) afresh every step.
    """

    kind = "sharded"
    whole_dtensors = False
    owner_blocks = True

    def __init__(self, world: World, *, round_bytes: int = EXCHANGE_ROUND_BYTES, columns: bool = False) -> None:
        where, what = f"{world.size} ranks", "tensor-parallel" if columns else "FSDP2"
        if world.mesh_dims == 2:
            where, what = f"the {world.size} ranks of the 2-D mesh", "FSDP2 x tensor-parallel"
        elif world.replicas > 1:
            where = f"the {world.size} ranks of the mesh's shard dim, repeated by each of its {world.replicas} replicas"
        # HSDP: the replicas agree too (their flags are the same), so over the whole job where the mesh spans it.
        spans = world.replicas > 1 and world.size * world.replicas == dist.get_world_size()
        super().__init__(
            world,
            make_agreement(None if spans else world.group),
            f"Newton-Schulz on {what} owner ranks: {where} (each matrix's "
            f"shards go to one owner and its {'rows or columns come' if columns else 'rows come'} back, in rounds "
            f"of at most {round_bytes / 2**20:g} MiB per exchange buffer)",
            complete_state=True,
        )
        #: Most bytes one exchange buffer holds in a round.
        self.round_bytes = round_bytes
        self._plans: PlanCache[list[list[Job]]] = PlanCache()
        #: Rounds of exchanges the last step took.
        self.rounds = 0
        #: Bytes of the largest exchange buffer the last step needed (at most `round_bytes`, or one parameter).
        self.largest_buffer = 0

    def run(self, buckets: Sequence[Bucket], diagnose: Chooser | None) -> list[ParamDiagnostics]:
        self.exchanged_bytes = self.buffers.largest = 0
        self.rounds = self.largest_buffer = self.ns_flops = 0
        # DTensor parameters split into blocks: each on an owner rank, which splits it (`step_owned_blocks`); or
        # (plain buckets of whole copies) on every rank, as on one process.
        owned = [bucket for bucket in buckets if bucket.blocks]
        for chunk in _chunks(owned, self.round_bytes * self.world.size):  # rounds: about round_bytes a rank
            sent, flops = step_owned_blocks(chunk, self.world)
            self.exchanged_bytes, self.ns_flops = self.exchanged_bytes + sent, self.ns_flops + flops
        gathered = [bucket for bucket in buckets if bucket.gathered]
        self.ns_flops += sum(bucket.flops for bucket in gathered)
        diagnostics = step_here(gathered, diagnose) if gathered else []
        rest = [bucket for bucket in buckets if not (bucket.gathered or bucket.blocks)]
        return self._run_sharded(rest, diagnose) + diagnostics

    def _run_sharded(self, buckets: Sequence[Bucket], diagnose: Chooser | None) -> list[ParamDiagnostics]:
        """`run` of the buckets of DTensors: the owner exchange."""
        if not buckets:  # the same on every rank: which parameters have gradients was agreed
            return []
        # The local shards (views: in-place updates reach the DTensors) do all the elementwise work.
        local = [bucket.local() for bucket in buckets]
        size, limit = self.world.size, self.round_bytes
        rounds = self._plans.get(
            buckets, lambda: exchange_rounds(buckets, plan_jobs(buckets, size), size, limit), limit
        )
        chosen = {} if diagnose is None else _chosen_rows(buckets, diagnose)
        values = torch.zeros(len(chosen), 2, device=local[0].params[0].device)
        for jobs in rounds:
            results = self._round(buckets, local, jobs)
            if chosen:
                _measure_into(values, chosen, buckets, jobs, results)
        self.rounds, self.largest_buffer = len(rounds), self.buffers.largest
        if diagnose is None:
            return []
        # Owners measured the whole updates they computed; one all-reduce gives every rank every number.
        dist.all_reduce(values, group=self.world.group)
        return [
            ParamDiagnostics(buckets[b].names[i], tuple(buckets[b].params[i].shape), buckets[b].effective_lr, *row)
            for (b, i), row in zip(chosen, values, strict=True)
        ]

    def _round(self, buckets: Sequence[Bucket], local: Sequence[Bucket], jobs: Sequence[Job]) -> dict[int, Tensor]:
        """One round: momentum of the round's rows, shards to their owners, Newton-Schulz there, rows back,
        apply. Returns the whole results this rank computed, by the index of their job in ``jobs``."""
        touched: dict[int, list[int]] = {}  # bucket -> its positions in this round: one foreach call per bucket
        for job in jobs:
            touched.setdefault(job.bucket, []).extend(job.indices)
        parts = {b: (sorted(ix), local[b].subset(sorted(ix))) for b, ix in touched.items()}
        update_of: dict[tuple[int, int], Tensor] = {}
        for b, (ix, part) in parts.items():
            update_of.update(zip([(b, i) for i in ix], _update.momentum(part), strict=True))
        shards = [[update_of[job.bucket, i] for i in job.indices] for job in jobs]
        owners = [job.owner for job in jobs]
        layouts = [buckets[job.bucket].subset(job.indices).exchange_layout for job in jobs]
        whole = gather_to_owners(shards, owners, layouts, self.world, self.buffers)
        results = {j: _update.orthogonalise(buckets[jobs[j].bucket].settings, stack) for j, stack in whole.items()}
        self.ns_flops += sum(buckets[jobs[j].bucket].subset(jobs[j].indices).flops for j in whole)
        device = local[0].params[0].device
        statistics = self._rule_statistics(buckets, jobs, results, device)
        mine = scatter_from_owners(results, owners, layouts, self.world, device, self.buffers)
        self.exchanged_bytes += sum(
            s.numel() * layout.dtype.itemsize for ss, layout in zip(shards, layouts, strict=True) for s in ss
        ) + sum(r.numel() * r.element_size() for r in results.values())
        rows_of: dict[tuple[int, int], Tensor] = {}
        for job, got in zip(jobs, mine, strict=True):
            rows_of.update(zip([(job.bucket, i) for i in job.indices], got, strict=True))
        for b, (ix, part) in parts.items():  # each rank applies its own rows, the rules with the whole ones' statistics
            given = {key: [of[b, i] for i in ix] for key, of in statistics.items() if (b, ix[0]) in of}
            _update.apply_shards(part, [rows_of[b, i] for i in ix], given, [buckets[b].params[i] for i in ix])
        return results

    def _rule_statistics(self, buckets: Sequence[Bucket], jobs: Sequence[Job], results: dict[int, Tensor],
                         device: torch.device) -> dict[str, dict[tuple[int, int], tuple[Tensor, ...]]]:
        """What the update rules of the round's matrices need of the whole ones (`UpdateRule.statistics`: a
        row's mean square needs its whole row, a rescale the whole matrix), by rule key and ``(bucket,
        position)``: each owner computes them on the whole results it holds, and one all-reduce (the others
        adding zeros: exact) gives every rank all of them. Empty when no rule of the round needs any (no
        exchange)."""
        spans: list[tuple[int, UpdateRule, int, Bucket, list]] = []  # job, rule, first value, its part, shapes
        total = 0
        for j, job in enumerate(jobs):
            part = None  # the job's parameters' part of the bucket, taken once
            for rule in rules_for(buckets[job.bucket].group):
                part = buckets[job.bucket].subset(job.indices) if part is None else part
                shapes = rule.statistics_shapes(part)
                if shapes:
                    spans.append((j, rule, total, part, shapes))
                    total += sum(math.prod(shape) for per_param in shapes for shape in per_param)
        if not spans:
            return {}
        flat = torch.zeros(total, dtype=torch.float32, device=device)
        for j, rule, start, part, _ in spans:
            if j in results:
                whole = list(results[j].reshape(len(part.params), part.per_param, *part.shape).unbind(0))
                values = torch.cat([t.flatten() for per_param in rule.statistics(part, whole) for t in per_param])
                flat[start : start + len(values)] = values
        dist.all_reduce(flat, group=self.world.group)
        statistics: dict[str, dict[tuple[int, int], tuple[Tensor, ...]]] = {}
        for j, rule, start, _, shapes in spans:
            for i, per_param in zip(jobs[j].indices, shapes, strict=True):
                got = []
                for shape in per_param:
                    got.append(flat[start : start + math.prod(shape)].reshape(shape))
                    start += math.prod(shape)
                statistics.setdefault(rule.key, {})[jobs[j].bucket, i] = tuple(got)
        return statistics


def step_owned_blocks(buckets: Sequence[Bucket], world: World) -> tuple[int, int]:
    """Step DTensor parameters split into blocks (`Bucket.blocks`, one a bucket, ``"flatten"`` layout) on owner
    ranks, exactly as one process steps their blocks: every rank advances its shard's momentum and sends it to the
    parameter's owner; the owner splits the whole update into its blocks (equal ones as one stack), orthogonalises
    them and runs the group's rules on them (their state plain, whole on every rank: the owner's shared after by one
    all-reduce); every rank gets its part of the result back and applies it block by block, each with its own lr.
    Returns the bytes this rank sent and the Newton-Schulz FLOPs it ran."""
    # Newton-Schulz FLOPs of each parameter, counted block by block; owners as every sharded job's (the same on
    # every rank).
    costs = [sum(b._replace(shape=(size, b.shape[1])).flops for size in b.blocks or ()) for b in buckets]
    owners = assign_owners(costs, world.size)
    local = [bucket.local() for bucket in buckets]
    updates = [[_update.momentum(part)[0]] for part in local]
    sending = [bucket.exchange_layout for bucket in buckets]
    whole = gather_to_owners(updates, owners, sending, world)
    returning = [layout._replace(dtype=_ruled_dtype(bucket)) for bucket, layout in zip(buckets, sending, strict=True)]
    results = {j: _owner_update(buckets[j], stack[0]).to(returning[j].dtype).unsqueeze(0)
               for j, stack in whole.items()}
    _share_rule_state(buckets, owners, world)
    device = local[0].params[0].device
    mine = scatter_from_owners(results, owners, returning, world, device)
    for j, (bucket, part) in enumerate(zip(buckets, local, strict=True)):
        _apply_blocks(bucket, part, mine[j][0], returning[j].parts(0, world.size)[world.rank][0])
    sent = sum(u[0].numel() * layout.dtype.itemsize for u, layout in zip(updates, sending, strict=True))
    sent += sum(r.numel() * r.element_size() for r in results.values())
    return sent, sum(cost for cost, owner in zip(costs, owners, strict=True) if owner == world.rank)


def _chunks(buckets: Sequence[Bucket], limit: int) -> list[list[Bucket]]:
    """``buckets`` in order, cut into runs of at most ``limit`` bytes of whole updates (`Bucket.exchange_layout`;
    a larger bucket alone)."""
    chunks: list[list[Bucket]] = []
    used = limit
    for bucket in buckets:
        nbytes = bucket.exchange_layout.nbytes
        if used + nbytes > limit:
            chunks.append([])
            used = 0
        chunks[-1].append(bucket)
        used += nbytes
    return chunks


def _ruled_dtype(bucket: Bucket) -> torch.dtype:
    """The dtype an owner's update travels back in: float32 where a rule changes the update (a rule's float32
    result travels exactly), the Newton-Schulz dtype where none does (as one process applies it)."""
    changed = any(type(rule).update is not UpdateRule.update for rule in rules_for(bucket.group))
    return torch.float32 if changed else bucket.settings.ns_dtype


def _block_bucket(bucket: Bucket, tensors: Sequence[Tensor], states: Mapping[str, Sequence[Tensor]]) -> list[Bucket]:
    """The one-process buckets of a parameter's blocks, from whole ``tensors`` shaped as the parameter (the update in
    the params', grads' and buffers' places) and its rules' whole state: equal blocks as one stack, else each
    block its own bucket."""
    keys = list(states)
    whole = [*tensors, *(states[key][0] for key in keys)]
    stacked, pieces = _update.block_pieces(whole, "flatten", bucket.blocks, exact=bucket.settings.exact)
    layout = "stack" if stacked else "flatten"
    blocks = []
    for piece in pieces:
        shape = tuple(piece[0].shape)
        blocks.append(bucket._replace(
            params=[piece[0]], grads=[piece[1]], bufs=[piece[2]], shape=matrix_shape(shape, layout), layout=layout,
            per_param=matrices_in(shape, layout), states={key: [t] for key, t in zip(keys, piece[3:], strict=True)},
            blocks=None,
        ))
    return blocks


def _owner_update(bucket: Bucket, update: Tensor) -> Tensor:
    """On the owner: the whole update ``(rows, cols)`` split into the parameter's blocks, each orthogonalised and
    changed by the group's rules as one process's would be, put together again as ``(rows, cols)``."""
    shaped = update.reshape(bucket.params[0].shape)
    results = []
    for block in _block_bucket(bucket, [shaped] * 3, bucket.states):
        stack = block.params[0].reshape(-1, *block.shape)
        orthogonal = list(_update.orthogonalise(block.settings, stack).unbind(0))
        if block.per_param > 1:
            orthogonal = [torch.stack(orthogonal)]
        ruled = _update.rule_updates(block, orthogonal, rules_for(block.group))
        results.append(ruled[0].reshape(-1, update.shape[-1]))
    return torch.cat(results)


def _share_rule_state(buckets: Sequence[Bucket], owners: Sequence[int], world: World) -> None:
    """Every rank takes the rules' state its owner advanced (plain tensors, whole on every rank): one all-reduce to
    which the other ranks add zeros (exact)."""
    by_dtype: dict[torch.dtype, list[tuple[Tensor, bool]]] = {}
    for j, bucket in enumerate(buckets):
        for tensors in bucket.states.values():
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append((t, owners[j] == world.rank))
    for states in by_dtype.values():  # one all-reduce a dtype
        flat = torch.cat([(t if owned else torch.zeros_like(t)).flatten() for t, owned in states])
        dist.all_reduce(flat, group=world.group)
        start = 0
        for t, _ in states:
            t.copy_(flat[start : start + t.numel()].view(t.shape))
            start += t.numel()


def _apply_blocks(bucket: Bucket, part: Bucket, update: Tensor, rows: slice) -> None:
    """Apply this rank's part of a parameter's whole update (``update``: its ``rows`` of the whole matrix, and the
    columns it holds) block by block, each block's rows with that block's lr, as one process applies them."""
    param = part.params[0].view(update.shape)
    start, first = 0, rows.start or 0
    for size in bucket.blocks or ():
        low, high = max(start, first) - first, min(start + size, first + len(update)) - first
        start += size
        if high <= low:
            continue
        block = bucket._replace(params=[param[low:high]], shape=(size, update.shape[1]), layout="flatten",
                                per_param=1, states={}, blocks=None)
        _update.apply(block, [update[low:high]], ruled=True)


def _chosen_rows(buckets: Sequence[Bucket], diagnose: Chooser) -> dict[tuple[int, int], int]:
    """``(bucket, position) -> row`` of every diagnosed parameter, in bucket order (as on one process)."""
    chosen = [(b, i) for b, bucket in enumerate(buckets) for i, p in enumerate(bucket.params) if diagnose(p)]
    return {key: row for row, key in enumerate(chosen)}


def _measure_into(
    values: Tensor,
    chosen: dict[tuple[int, int], int],
    buckets: Sequence[Bucket],
    jobs: Sequence[Job],
    results: dict[int, Tensor],
) -> None:
    """Write the orthogonality error and update RMS of the diagnosed matrices among ``results`` (whole, by job)
    into their rows of ``values``."""
    for j, stack in results.items():
        job = jobs[j]
        picked = [k for k, i in enumerate(job.indices) if (job.bucket, i) in chosen]
        if picked:
            errors, rms = _update.measure(stack[picked], buckets[job.bucket].effective_lr)
            rows = [chosen[job.bucket, job.indices[k]] for k in picked]
            values[rows] = torch.stack([errors, rms], dim=1)
