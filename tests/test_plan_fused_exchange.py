"""The plan's fused path for top-K routing on CUDA (token_dispatch/plan.py): the send-side kernels write the
counts and the header's index stats straight into the sizes exchange's buffer (a copy of a cached header).
Here on CPU gloo ranks, the kernels under Triton's interpreter stand in for CUDA: the exchanged vectors and the
plans equal the reference path's bit for bit, and bad indices raise the same error on every rank."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
# CPU tensors through interpreted kernels; on a GPU machine the fused path runs for real in the NCCL EP checks
# (scripts/gpu_ep.py check).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interprets the kernels on CPU tensors")

from _dist import run_distributed  # noqa: E402

E_PER_RANK, K = 3, 2


def _routing(rank, T, P, bad):
    from sonic_megatron.kernels.routing import TopKRouting

    g = torch.Generator().manual_seed(11 + rank)
    E = E_PER_RANK * P
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.zeros(0, K).long()
    if rank == 1 and bad == "out_of_range":
        idx[T // 2, 1] = E + 4
    if rank == 1 and bad == "duplicate":
        idx[T - 1, 1] = idx[T - 1, 0]
    return TopKRouting(torch.rand(T, K, generator=g, dtype=torch.float64), idx)


def _plan(routing, P, N, fused):
    """(exchanged vectors [P, H + W], plan or the error message) with the fused path on or off."""
    import torch.distributed as dist
    from sonic_megatron.token_dispatch import EPInputError, finish_plan, start_plan
    from sonic_megatron.token_dispatch import plan as plan_mod
    from sonic_megatron.token_dispatch.triton_send import ep_send_side

    plan_mod.triton_send_side = (lambda topk, world_size: ep_send_side) if fused else (lambda topk, world_size: None)
    started = start_plan(routing, num_experts=E_PER_RANK * P, group=dist.group.WORLD, num_chunks=N)
    exchanged = started.sizes.host.clone()
    try:
        return exchanged, finish_plan(started)
    except EPInputError as exc:
        return exchanged, str(exc)


def _worker(rank, P, bad):
    out = []
    for N in (1, 2):
        # the last rank has no tokens in the plain cases: it takes the reference path, its peers the fused one
        T = 0 if bad is None and rank == P - 1 and N == 2 else 7 + 5 * rank
        routing = _routing(rank, T, P, bad)
        (ref_x, ref), (got_x, got) = _plan(routing, P, N, fused=False), _plan(routing, P, N, fused=True)
        if isinstance(ref, str) or isinstance(got, str):
            out.append(("error", ref, got))
            continue
        assert torch.equal(ref_x, got_x), (ref_x, got_x)
        for f in ("send_rows", "send_pairs", "recv_rows", "recv_pairs"):
            assert getattr(ref, f) == getattr(got, f), f
        for f in ("token_idx_R", "expert_idx_R", "scores_R", "send_token_idx_S", "send_pair_idx", "combine_order_S"):
            assert torch.equal(getattr(ref, f), getattr(got, f)), f
        assert torch.equal(ref.recv_scores(), got.recv_scores())
        for m, n in zip(ref.recv_meta, got.recv_meta, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(m.tensors(), n.tensors(), strict=True))
        out.append(("ok", None, None))
    return out


@pytest.mark.parametrize("P", [2, 4])
def test_fused_exchange_equals_the_reference_plan(P):
    for res in run_distributed(_worker, P, None):
        assert [r[0] for r in res] == ["ok", "ok"], res


@pytest.mark.parametrize("bad", ["out_of_range", "duplicate"])
def test_fused_exchange_reports_bad_indices_on_every_rank(bad):
    """Rank 1's bad index reaches every rank through the kernels' index stats, with the reference's message."""
    want = {"out_of_range": "expert", "duplicate": "twice"}[bad]
    for res in run_distributed(_worker, 2, bad):
        for kind, ref, got in res:
            assert kind == "error" and ref == got and "rank 1" in got and want in got, (ref, got)
