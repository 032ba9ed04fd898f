"""The plan's sizes: ONE all-gather of a fixed-size int64 vector per rank and ONE host copy of it -- the plan's
host sync. It carries this rank's validation header (``validation.py``) and its per (chunk, destination) send
row and pair counts; every rank reads everyone's, so it knows its send AND receive split sizes (host ints, as
``all_to_all_single`` needs) and every rank raises the same error for bad input anywhere in the group.
Launching the exchange (``launch_exchange``) and waiting for it (``receive_header_and_counts``) are two
calls, so that a caller can queue GPU work between them: the host then waits while that work runs.

Shape legend (as ``send_side.py``): H = ``validation.HEADER_LEN`` header fields; the counts are sized for
``validation.MAX_CHUNKS`` chunks, so ranks that pass different ``num_chunks`` still exchange equal sizes (the
header check then raises instead of a collective size mismatch): W = 2 * MAX_CHUNKS * P columns, row counts at
c * P + destination, pair counts at ``PAIR_BASE(P)`` + c * P + destination.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import validation as V
from .comm import all_gather, all_gather_into, group_size
from .send_side import SendSide


def pair_base(world_size: int) -> int:
    """Column of the first pair count in the counts part [P, W] of the exchange."""
    return V.MAX_CHUNKS * world_size


@dataclass
class SplitSizes:
    """Host split sizes [N][P] of this rank and the device copy of everyone's counts (receive metadata)."""

    send_rows: list[list[int]]
    send_pairs: list[list[int]]
    recv_rows: list[list[int]]
    recv_pairs: list[list[int]]
    counts_PW: torch.Tensor  # int64 [P, W] on the device: no host-to-device copy for the receive side


def counts_slot(side: SendSide | None, world_size: int, num_chunks: int, device) -> list[torch.Tensor]:
    """This rank's counts [W] as pieces to concatenate: zeros without a send side (bad input, or rounding
    still to come), else rows_NP and pairs_NP each padded to MAX_CHUNKS chunks."""
    P = world_size
    if side is None:
        return [torch.zeros(2 * V.MAX_CHUNKS * P, dtype=torch.int64, device=device)]
    pad = torch.zeros((V.MAX_CHUNKS - num_chunks) * P, dtype=torch.int64, device=device)
    return [side.rows_NP, pad, side.pairs_NP, pad]


@dataclass(frozen=True)
class SizesInFlight:
    """The header + counts all-gather on its way to the host (``launch_exchange``): ``device`` [P, H + W]
    on the device; on CUDA ``host`` is pinned memory its non-blocking copy fills and ``ready`` the event recorded
    after that copy, so the host waits for this exchange alone, not for the work queued after it."""

    device: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @property
    def counts_PW(self) -> torch.Tensor:
        """Everyone's counts [P, W] on the device (the header cut off)."""
        return self.device[:, V.HEADER_LEN :]


def launch_exchange(exchange: torch.Tensor, group) -> SizesInFlight:
    """Launch the all-gather of every rank's header + counts [H + W] and its copy to the host; no host wait.

    On CUDA both run on a stream of their own (``_exchange_stream``) that first waits for the current stream (which
    wrote ``exchange``): the all-gather waits for the slowest peer, and the current stream does not wait with it.
    Work queued on it after this call (Megatron's 1F1B overlap queues the other micro-batch's MLP backward between
    ``dispatch_preprocess`` and ``token_dispatch``) runs meanwhile. Readers of ``device`` come after the host has
    waited for ``ready`` (``receive_header_and_counts``), so they need no stream order of their own."""
    if not exchange.is_cuda:
        gathered = all_gather(exchange, group)
        return SizesInFlight(gathered, gathered, None)
    side = _exchange_stream(exchange.device)
    side.wait_stream(torch.cuda.current_stream(exchange.device))
    gathered = exchange.new_empty(group_size(group), *exchange.shape)  # on the current stream's memory
    host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        all_gather_into(gathered, exchange, group)
        host.copy_(gathered, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    # both were allocated on the current stream and are used on the side stream: not reused before it is done
    exchange.record_stream(side)
    gathered.record_stream(side)
    return SizesInFlight(gathered, host, ready)


@functools.cache
def _exchange_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the plan's sizes exchange runs on, one per device."""
    return torch.cuda.Stream(device=device)


def exchange_buffer(header: list[int], world_size: int, device: torch.device) -> torch.Tensor:
    """A new exchange vector [H + W] holding ``header`` (host ints) and zero counts, for kernels that write the
    counts and the device-computed header fields in place (``exchange_outputs``): one device copy of a cached
    vector instead of building the header and concatenating it with the counts on every call."""
    return _exchange_template(tuple(header), world_size, device).clone()


@functools.lru_cache(maxsize=64)
def _exchange_template(header: tuple[int, ...], world_size: int, device: torch.device) -> torch.Tensor:
    host = torch.tensor([*header, *([0] * (2 * V.MAX_CHUNKS * world_size))], dtype=torch.int64)
    return host.to(device)  # once per header: read only, never written


def exchange_outputs(exchange: torch.Tensor, world_size: int, num_chunks: int):
    """The slices of an exchange vector the send-side kernels write (``triton_send.SendOutputs``): row and pair
    counts per (chunk, destination) and the header's min / max expert and duplicate fields."""
    from .triton_send import SendOutputs

    H, NP, base = V.HEADER_LEN, num_chunks * world_size, pair_base(world_size)
    lo, dup = V.MIN_EXPERT_FIELD, V.DUPLICATE_FIELD
    return SendOutputs(
        exchange[H : H + NP], exchange[H + base : H + base + NP], exchange[lo : lo + 2], exchange[dup : dup + 1]
    )


def receive_header_and_counts(
    sizes: SizesInFlight, *, local_error: str | None, group, num_experts: int
) -> tuple[list[list[int]], torch.Tensor, int]:
    """The plan's host sync: wait for ``sizes``, then the header check (raises the same ``EPInputError`` on every
    rank). Returns (counts [P][W] host ints, the same counts [P, W] on the device, the most tokens of any rank)."""
    if sizes.ready is not None:
        sizes.ready.synchronize()
    gathered = sizes.host.tolist()  # the host sync (on CUDA the event above already waited)
    V.check_headers([g[: V.HEADER_LEN] for g in gathered], local_error, group, num_experts)
    counts_host = [g[V.HEADER_LEN :] for g in gathered]
    check_received_pairs(counts_host)
    return counts_host, sizes.counts_PW, max(g[1] for g in gathered)


def check_received_pairs(counts_host: list[list[int]]) -> None:
    """Every rank's received pair count against ``validation.MAX_PAIRS`` (the receive metadata and the kernels
    index rows with int32), from everyone's counts: every rank knows every count, so all raise together here
    instead of one alone in its experts, between all-to-alls. One sum over all counts decides it almost always."""
    P, base = len(counts_host), pair_base(len(counts_host))
    if sum(sum(row[base:]) for row in counts_host) < V.MAX_PAIRS:
        return
    for r in range(P):
        got = sum(row[base + c * P + r] for row in counts_host for c in range(V.MAX_CHUNKS))
        if got >= V.MAX_PAIRS:
            raise V.EPInputError(
                f"expert-parallel dispatch: the routed pairs rank {r} receives must be < {V.MAX_PAIRS} (int32 row "
                f"indices), got {got} (group of {P} ranks)"
            )


def check_slots_fit(counts_host: list[list[int]], rows: int, pairs: int) -> None:
    """Every rank's one-chunk row and pair counts per destination against the slots (``slots.py``) that carried
    them before this check: from everyone's counts, so all raise together. A count past its slot means rows or
    pairs were cut off: the slots come from the previous call, so this call has more tokens on some rank (or
    more pairs per token) than every earlier one."""
    P, base = len(counts_host), pair_base(len(counts_host))
    for src, row in enumerate(counts_host):
        for dst in range(P):
            for what, got, cap in (("rows", row[dst], rows), ("pairs", row[base + dst], pairs)):
                if got > cap:
                    raise V.SlotsTooSmall(
                        f"expert-parallel dispatch: rank {src} sends {got} {what} to rank {dst}, more than the {cap} "
                        f"of the slots sent before the plan's sync (sized by the previous call of this layer: its "
                        f"most tokens per rank, the top-K and any token rounding's tile); every call of a layer "
                        f"with slots needs at most that many tokens per rank"
                    )


def split_sizes(counts_host: list[list[int]], counts_PW: torch.Tensor, *, rank: int, num_chunks: int) -> SplitSizes:
    """This rank's send split sizes (its own counts) and receive split sizes (everyone's counts for it), [N][P]."""
    P, N, base = len(counts_host), num_chunks, pair_base(len(counts_host))

    def split(src: int, c: int, pairs: bool) -> list[int]:
        o = (base if pairs else 0) + c * P
        return counts_host[src][o : o + P]

    return SplitSizes(
        send_rows=[split(rank, c, False) for c in range(N)],
        send_pairs=[split(rank, c, True) for c in range(N)],
        recv_rows=[[split(src, c, False)[rank] for src in range(P)] for c in range(N)],
        recv_pairs=[[split(src, c, True)[rank] for src in range(P)] for c in range(N)],
        counts_PW=counts_PW,
    )
