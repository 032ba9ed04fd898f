"""The interleaved EP step of the issue-4 size for the device scripts (``gpu_a2a_host_cost.py``,
``gpu_host_skew.py``, ``gpu_launch_cache_ab.py``, ``gpu_scheduler_ab.py``): this rank's random top-K routing,
tokens, local experts and output gradient, and a callable that runs one ``ep_forward_backward`` (schedule 1i) on
them; the results of two interleaved micro-batches (for the A/B scripts' bitwise checks); the A/B scripts' setting
switch and report; and the scripts' process-group setup under torchrun. Imported as a sibling module: torchrun
puts ``scripts/`` on ``sys.path``."""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist
from sonic_megatron.kernels import TopKRouting
from sonic_megatron.token_dispatch import interleave

ISSUE4 = (16384, 1536, 256, 128, 8)  # per-rank (T, D, F, E, K)
TINY = (256, 64, 32, 8, 2)  # for the scripts' own CPU / gloo check


def init_ranks(cpu_check: bool = False) -> tuple[torch.device, int, int]:
    """(device, rank, P) under torchrun: NCCL with this rank's GPU; with ``cpu_check`` and no GPU, gloo on the
    CPU (a script's own check with the torch backend)."""
    if cpu_check and not torch.cuda.is_available():
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    return device, dist.get_rank(), dist.get_world_size()


def interleaved_step(device: torch.device, comm_sms: int, sizes=ISSUE4, dtype=torch.bfloat16, leaf_grads=False):
    """One call = the forward of a micro-batch with the backward of the previous one, same tokens every call
    (the first micro-batch's forward runs here). Module attributes are looked up at call time, so monkeypatches
    of ``interleave`` made before this call apply. ``step.inputs``: (x, routing, group, E). ``leaf_grads``: as
    ``bench layer``'s 1i call -- x, the scores, w1 and w2 are leaves that require grad, and every call adds the
    returned gradients into their ``.grad``."""
    rank, P = dist.get_rank(), dist.get_world_size()
    T, D, F, E, K = sizes
    L = E // P
    g = torch.Generator(device="cpu").manual_seed(7 + rank)
    scores, indices = torch.randn(T, E, generator=g).softmax(-1).topk(K, dim=-1)
    routing = TopKRouting(scores.to(device), indices.to(device))
    x = torch.randn(T, D, generator=g).to(device, dtype)
    w1 = (torch.randn(L, 2 * F, D, generator=g) / D**0.5).to(device, dtype)
    w2 = (torch.randn(L, D, F, generator=g) / F**0.5).to(device, dtype)
    grad = torch.randn(T, D, generator=g).to(device, dtype)
    if leaf_grads:
        x, w1, w2 = (t.requires_grad_() for t in (x, w1, w2))
        routing = TopKRouting(routing.scores_TK.requires_grad_(), routing.indices_TK)
    kw = dict(group=dist.group.WORLD, num_experts=E, comm_sms=comm_sms)
    state = [interleave.ep_forward(x, routing, w1, w2, **kw)[1]]

    def step():
        state[0], g = interleave.ep_forward_backward(state[0], grad, x, routing, w1, w2, **kw)[1:]
        if leaf_grads:
            pairs = ((x, g.dx_TD), (routing.scores_TK, g.dscores_R.view_as(routing.scores_TK)))
            for t, d in (*pairs, (w1, g.dw1_EGD), (w2, g.dw2_EDF)):
                t.grad = d if t.grad is None else t.grad.add_(d)

    step.inputs = (x, routing, kw["group"], E)
    return step


def interleaved_results(x, routing, group, E: int, comm_sms: int) -> list[torch.Tensor]:
    """Output and gradients of two interleaved micro-batches from a fresh state (fixed weights and output
    gradient): A's forward, B's forward with A's backward, B's backward. For bitwise checks between settings."""
    T, D = x.shape
    L = E // dist.get_world_size()
    g = torch.Generator(device="cpu").manual_seed(11)
    w1 = (torch.randn(L, 512, D, generator=g) / D**0.5).to(x)
    w2 = (torch.randn(L, D, 256, generator=g) / 256**0.5).to(x)
    grad = torch.randn(T, D, generator=g).to(x)
    kw = dict(group=group, num_experts=E, comm_sms=comm_sms)
    _, st = interleave.ep_forward(x, routing, w1, w2, **kw)
    out, st2, gA = interleave.ep_forward_backward(st, grad, x, routing, w1, w2, **kw)
    gB = interleave.ep_backward(st2, grad)
    return [out, gA.dx_TD, gA.dscores_R, gA.dw1_EGD, gA.dw2_EDF, gB.dx_TD, gB.dw1_EGD]


def report_and_finish(report: dict, out_dir: str, filename: str) -> int:
    """Rank 0 prints ``report`` and writes it as JSON to ``out_dir/filename``; every rank leaves the group.
    The A/B scripts' last step (returns their exit code)."""
    if dist.get_rank() == 0:
        print(json.dumps(report, indent=1))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, filename), "w") as f:
            json.dump(report, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


@contextlib.contextmanager
def setting(obj, name: str, value, a2a: bool):
    """``obj.name = value`` inside (restored after), and with ``a2a`` False the layer's all-to-alls skipped
    (``bench layer``'s ``no a2a`` reference): one variant of an A/B script."""
    from sonic_megatron.bench.layer import _no_layer_a2a

    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        with contextlib.nullcontext() if a2a else _no_layer_a2a():
            yield
    finally:
        setattr(obj, name, saved)
