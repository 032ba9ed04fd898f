"""Two micro-batches interleaved (token_dispatch/interleave.py): the forward of B run with the backward of A gives
bitwise the results of the autograd path run one after the other, on 2 and 4 gloo ranks; the launch order is the
one the module documents (each one's collectives in flight while the other one's kernels run)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import run_distributed
from sonic_megatron.token_dispatch import ep_backward, ep_forward, ep_forward_backward, expert_parallel_experts
from test_token_dispatch import D, _leaves, build_routing, global_case, recording_reservations


def _micro_batches(kind: str, P: int):
    """Two micro-batches of one layer: different tokens and routing, the same weights (A's)."""
    a, b = global_case(kind, P, seed=3), global_case(kind, P, seed=4)
    b["w1"], b["w2"] = a["w1"], a["w2"]
    return a, b


def _autograd(case, rank, P, opts):
    off, T, x, logits, w1, w2 = _leaves(case, rank, P, torch.float64)
    out = expert_parallel_experts(
        x, build_routing(case, logits, off, T), w1, w2, group=dist.group.WORLD, num_experts=case["E"], **opts
    )
    out.backward(case["grad"][off : off + T])
    return [t.detach() for t in (out, x.grad, logits.grad, w1.grad, w2.grad)]


def _functional(case, rank, P, opts, step):
    """``step(x, routing, w1, w2, kw)`` -> (out, fwd, grads): the functional path; dscores go on to the logits."""
    off, T, x, logits, w1, w2 = _leaves(case, rank, P, torch.float64)
    kw = dict(group=dist.group.WORLD, num_experts=case["E"], **opts)
    out, fwd, grads = step(x, build_routing(case, logits, off, T), w1, w2, kw)
    return out, fwd, grads, logits


def _interleave_worker(rank, P, kind, opts):
    a, b = _micro_batches(kind, P)
    ref_opts = {k: v for k, v in opts.items() if k != "sm_reservation"}  # an option of the interleaved path only
    ref_a, ref_b = _autograd(a, rank, P, ref_opts), _autograd(b, rank, P, ref_opts)
    off_a, T_a = sum(a["T_r"][:rank]), a["T_r"][rank]
    off_b, T_b = sum(b["T_r"][:rank]), b["T_r"][rank]
    # A's forward alone, then B's forward interleaved with A's backward, then B's backward alone.
    out_a, fwd_a, _, logits_a = _functional(
        a, rank, P, opts, lambda x, r, w1, w2, kw: (*ep_forward(x, r, w1, w2, **kw), None)
    )
    holder = {}

    def fwd_b_with_bwd_a(x, r, w1, w2, kw):
        out, fwd, grads_a = ep_forward_backward(fwd_a, a["grad"][off_a : off_a + T_a], x, r, w1, w2, **kw)
        holder["grads_a"] = grads_a
        return out, fwd, None

    out_b, fwd_b, _, logits_b = _functional(b, rank, P, opts, fwd_b_with_bwd_a)
    grads_a = holder["grads_a"]
    grads_b = ep_backward(fwd_b, b["grad"][off_b : off_b + T_b])
    results = []
    for out, fwd, grads, logits in ((out_a, fwd_a, grads_a, logits_a), (out_b, fwd_b, grads_b, logits_b)):
        torch.autograd.backward(fwd.plan.scores_R, grads.dscores_R)  # on into the router (the logits here)
        results.append([out, grads.dx_TD, logits.grad, grads.dw1_EGD, grads.dw2_EDF])
    return ref_a, ref_b, results[0], results[1]


NAMES = ("out", "dx", "dlogits", "dw1", "dw2")


@pytest.mark.parametrize(
    "P,kind,opts",
    [
        (2, "random", {}),
        (2, "empty_rank", {}),
        (2, "random", {"num_chunks": 2, "comm_sms": 8}),
        (2, "skewed", {"redispatch_x_in_backward": True}),
        (4, "random", {}),
        (2, "skewed", {"comm_sms": 8, "sm_reservation": "all"}),
    ],
)
def test_interleaved_equals_autograd_bitwise(P, kind, opts):
    for rank, (ref_a, ref_b, got_a, got_b) in enumerate(
        run_distributed(_interleave_worker, P, kind, dict(opts, backend="torch"), timeout=240)
    ):
        for mb, ref, got in (("A", ref_a, got_a), ("B", ref_b, got_b)):
            for n, r, g in zip(NAMES, ref, got, strict=True):
                assert torch.equal(r, g), f"rank {rank} micro-batch {mb} {n}"


def test_launch_order(monkeypatch):
    """ep_forward_backward's order (one process): A's dO rows go out inside B's plan; B's dispatch before A's
    backward-data GEMMs; A's dX / dS before B's experts; B's combine before A's weight gradients; and nothing
    waits for a collective between its launch and the other micro-batch's kernels that should hide it."""
    from sonic_megatron.kernels import torch_backend
    from sonic_megatron.token_dispatch import comm, exchange, sizes

    log = []

    def wrap(mod, name, label):
        orig = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, **k: (log.append(label), orig(*a, **k))[1])

    wrap(exchange, "rows_to_experts", "rows_out")
    wrap(exchange, "rows_to_sources", "rows_back")
    wrap(exchange, "pairs_to_sources", "pairs_back")
    wrap(sizes, "all_gather", "plan")
    for name in ("forward", "backward_data", "backward_weights"):
        wrap(torch_backend, name, name)
    monkeypatch.setattr(comm.Pending, "wait", lambda self, o=comm.Pending.wait: (log.append("wait"), o(self))[1])
    a, b = _micro_batches("random", 1)
    kw = dict(num_experts=a["E"], backend="torch")
    off, T, x, logits, w1, w2 = _leaves(a, 0, 1, torch.float64)
    _, fwd_a = ep_forward(x, build_routing(a, logits, off, T), w1, w2, **kw)
    _, _, logits_b = _leaves(b, 0, 1, torch.float64)[1:4]
    log.clear()
    ep_forward_backward(fwd_a, a["grad"], x, build_routing(b, logits_b, 0, T), w1, w2, **kw)
    events = [e for e in log if e != "wait"]
    assert events == [
        "plan",  # B: plan (its counts all-gather; the host copy follows A's dO launch: test_plan_before_sync)
        "rows_out",  # A: dO
        "rows_out",  # B: dispatch
        "backward_data",  # A
        "rows_back",  # A: dX
        "pairs_back",  # A: dS
        "forward",  # B: experts
        "rows_back",  # B: combine
        "backward_weights",  # A
    ], log
    i_dispatch_b = [i for i, e in enumerate(log) if e == "rows_out"][1]
    assert "wait" not in log[:i_dispatch_b], log  # B's plan and A's dO: nothing waited for before B's rows go
    i_combine_b = [i for i, e in enumerate(log) if e == "rows_back"][1]
    assert "wait" not in log[i_combine_b : log.index("backward_weights")], log


def test_plan_before_sync_runs_between_the_all_gather_and_the_host_copy(monkeypatch):
    """make_plan(before_sync=f): f runs once, after the counts all-gather is launched and before the host reads
    it (the header check follows the copy), also when the input is bad (every rank launches the same)."""
    from sonic_megatron.token_dispatch import EPInputError, make_plan, sizes, validation

    log = []
    monkeypatch.setattr(sizes, "all_gather", lambda *a, o=sizes.all_gather: (log.append("all_gather"), o(*a))[1])
    check = validation.check_headers
    monkeypatch.setattr(validation, "check_headers", lambda *a: (log.append("host copy read"), check(*a))[1])
    a, _ = _micro_batches("random", 1)
    off, T, x, logits, w1, w2 = _leaves(a, 0, 1, torch.float64)
    routing = build_routing(a, logits, off, T)
    p = make_plan(routing, num_experts=a["E"], x_TD=x, before_sync=lambda: log.append("before_sync"))
    assert log == ["all_gather", "before_sync", "host copy read"], log
    assert torch.equal(p.send_token_idx_S, make_plan(routing, num_experts=a["E"], x_TD=x).send_token_idx_S)
    log.clear()
    with pytest.raises(EPInputError, match="num_chunks"):
        make_plan(routing, num_experts=a["E"], num_chunks=0, before_sync=lambda: log.append("before_sync"))
    assert log == ["all_gather", "before_sync", "host copy read"], log


def _bad_b_worker(rank, P):
    """B's input is bad on rank 1 only: every rank raises (A's dO all-to-all was already launched inside B's
    plan on every rank), and the group still works for a valid interleaved step afterwards."""
    from sonic_megatron.token_dispatch import EPInputError

    a, b = _micro_batches("random", P)
    kw = dict(group=dist.group.WORLD, num_experts=a["E"], backend="torch")
    off, T, x, logits, w1, w2 = _leaves(a, rank, P, torch.float64)
    _, fwd_a = ep_forward(x, build_routing(a, logits, off, T), w1, w2, **kw)
    off_b, T_b, x_b, logits_b = _leaves(b, rank, P, torch.float64)[:4]
    bad_x = x_b.float() if rank == 1 else x_b
    grad_a = a["grad"][off : off + T]
    try:
        ep_forward_backward(fwd_a, grad_a, bad_x, build_routing(b, logits_b, off_b, T_b), w1, w2, **kw)
        msg = None
    except EPInputError as exc:
        msg = str(exc)
    out, _, grads = ep_forward_backward(fwd_a, grad_a, x_b, build_routing(b, logits_b, off_b, T_b), w1, w2, **kw)
    return msg, bool(torch.isfinite(out).all() and torch.isfinite(grads.dx_TD).all())


def test_bad_next_micro_batch_raises_on_every_rank():
    for rank, (msg, ok) in enumerate(run_distributed(_bad_b_worker, 2, timeout=120)):
        assert msg is not None and "rank 1" in msg, (rank, msg)
        assert ok, rank


def test_bad_comm_sms_or_sm_reservation():
    a, _ = _micro_batches("random", 1)
    off, T, x, logits, w1, w2 = _leaves(a, 0, 1, torch.float64)
    kw = dict(num_experts=a["E"], backend="torch")
    with pytest.raises(ValueError, match="comm_sms must be an int >= 0"):
        ep_forward(x, build_routing(a, logits, off, T), w1, w2, comm_sms=-1, **kw)
    with pytest.raises(ValueError, match=r"ep_forward: sm_reservation must be one of \('auto', 'all'\), got 'some'"):
        ep_forward(x, build_routing(a, logits, off, T), w1, w2, sm_reservation="some", **kw)
    _, fwd = ep_forward(x, build_routing(a, logits, off, T), w1, w2, **kw)
    with pytest.raises(ValueError, match="ep_forward_backward: sm_reservation must be one of"):
        ep_forward_backward(fwd, a["grad"], x, build_routing(a, logits, off, T), w1, w2, sm_reservation=1, **kw)
    from sonic_megatron.token_dispatch import DeferredWeightGrad, EPInputError, EPOptions

    with pytest.raises(EPInputError, match="ep_forward: wgrad must be None"):
        ep_forward(x, build_routing(a, logits, off, T), w1, w2, options=EPOptions(wgrad=DeferredWeightGrad()), **kw)
    with pytest.raises(EPInputError, match="ep_forward: by_source must be False"):
        ep_forward(x, build_routing(a, logits, off, T), w1, w2, by_source=True, **kw)


def test_bad_state_or_gradient():
    a, b = _micro_batches("random", 1)
    off, T, x, logits, w1, w2 = _leaves(a, 0, 1, torch.float64)
    kw = dict(num_experts=a["E"], backend="torch")
    routing = build_routing(a, logits, off, T)
    _, fwd = ep_forward(x, routing, w1, w2, **kw)
    with pytest.raises(TypeError, match="prev must be the EPForward"):
        ep_forward_backward(None, a["grad"], x, routing, w1, w2, **kw)
    with pytest.raises(ValueError, match=rf"output gradient of prev must be a tensor of shape \({T}, {D}\)"):
        ep_forward_backward(fwd, a["grad"][:, :3], x, routing, w1, w2, **kw)
    with pytest.raises(ValueError, match="output gradient of fwd"):
        ep_backward(fwd, a["grad"][1:])


def _reservation_worker(rank, P, policy):
    """The (SMs, GEMM count) reservation active around each backend call of an interleaved step."""
    a, b = _micro_batches("random", P)
    kw = dict(group=dist.group.WORLD, num_experts=a["E"], backend="torch", comm_sms=8, sm_reservation=policy)
    off, T, x, logits, w1, w2 = _leaves(a, rank, P, torch.float64)
    _, fwd_a = ep_forward(x, build_routing(a, logits, off, T), w1, w2, **kw)
    off_b, T_b, x_b, logits_b = _leaves(b, rank, P, torch.float64)[:4]
    with recording_reservations() as log:
        ep_forward_backward(fwd_a, a["grad"][off : off + T], x_b, build_routing(b, logits_b, off_b, T_b), w1, w2, **kw)
    return log


@pytest.mark.parametrize("policy,gemms", [("auto", 1), ("all", None)])
def test_interleaved_step_reserves_sms_per_policy(policy, gemms):
    """In ep_forward_backward every backend call runs under comm_sms; "auto" limits each call (forward,
    backward-data, weight-gradient) to its first GEMM, "all" reserves in every GEMM."""
    for log in run_distributed(_reservation_worker, 2, policy, timeout=120):
        assert log == [
            ("backward_data", (8, gemms)),
            ("forward", (8, gemms)),
            ("backward_weights", (8, gemms)),
        ], log
