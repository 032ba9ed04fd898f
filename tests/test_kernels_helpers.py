"""Shared helpers of the kernels/ tests (no tests here): random MoE problems, running an experts
implementation forward + backward, and the low-precision error criterion.

Shape legend as in kernels/routing.py: T tokens, D hidden, F expert ffn size, G fc1 width (2F gated),
E experts, K experts per token, R routed pairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from sonic_megatron.kernels import GATED_ACTIVATIONS, FlatRouting, TopKRouting, moe_experts

GRADS = ("dx", "dscores", "dw1", "dw2")


def require_cute() -> None:
    """Skip the calling test unless the cute backend runs here (a CUDA GPU it supports, its packages importable)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from sonic_megatron.kernels.interface import cute_unavailable_reason

    reason = cute_unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)


OUTPUTS = ("out",) + GRADS


@dataclass
class Problem:
    """One MoE problem in float64 (fresh random values, never zeros). ``scores`` is [T, K] for top-K
    routing (``indices`` [T, K]) or [R] for flat routing (``token_idx``/``expert_idx`` [R])."""

    x_TD: torch.Tensor
    scores: torch.Tensor
    w1_EGD: torch.Tensor
    w2_EDF: torch.Tensor
    dO_TD: torch.Tensor
    indices_TK: torch.Tensor | None = None
    token_idx_R: torch.Tensor | None = None
    expert_idx_R: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.x_TD.shape[0]

    @property
    def num_experts(self) -> int:
        return self.w1_EGD.shape[0]

    def routing(self, scores: torch.Tensor) -> TopKRouting | FlatRouting:
        if self.indices_TK is not None:
            return TopKRouting(scores, self.indices_TK)
        return FlatRouting(self.token_idx_R, self.expert_idx_R, scores, self.num_tokens)

    def token_of_pairs(self) -> torch.Tensor:
        """Token of every flat pair (top-K entries flattened row-major)."""
        if self.indices_TK is not None:
            return torch.arange(self.num_tokens).repeat_interleave(self.indices_TK.shape[1])
        return self.token_idx_R

    def expert_of_pairs(self) -> torch.Tensor:
        """Expert of every flat pair (top-K entries flattened row-major)."""
        return self.indices_TK.reshape(-1) if self.indices_TK is not None else self.expert_idx_R


@pytest.fixture
def poison_uninitialized():
    """Deterministic mode makes torch.empty* fill new memory with NaN (ints with their max), so a kernel
    that leaves part of an output unwritten fails the comparison instead of passing on leftover values."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    assert torch.utils.deterministic.fill_uninitialized_memory
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def _scores(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # Router probabilities are positive and below 1; keep them away from 0 so no pair is a no-op.
    return 0.1 + 0.9 * torch.rand(shape, generator=gen, dtype=torch.float64)


def _dense(T: int, D: int, F: int, E: int, activation: str, gen: torch.Generator) -> dict:
    G = 2 * F if activation in GATED_ACTIVATIONS else F
    return dict(
        x_TD=torch.randn(T, D, generator=gen, dtype=torch.float64),
        w1_EGD=torch.randn(E, G, D, generator=gen, dtype=torch.float64) / math.sqrt(D),
        w2_EDF=torch.randn(E, D, F, generator=gen, dtype=torch.float64) / math.sqrt(F),
        dO_TD=torch.randn(T, D, generator=gen, dtype=torch.float64),
    )


def topk_problem(
    T: int,
    D: int,
    F: int,
    E: int,
    K: int,
    *,
    activation: str = "swiglu",
    seed: int = 0,
    experts: list[int] | None = None,
    index_dtype: torch.dtype = torch.int64,
) -> Problem:
    """Top-K routing: each token picks K distinct experts at random among ``experts`` (default: all)."""
    gen = torch.Generator().manual_seed(seed)
    dense = _dense(T, D, F, E, activation, gen)
    allowed = torch.tensor(experts if experts is not None else list(range(E)))
    pick = torch.rand(T, allowed.numel(), generator=gen).argsort(dim=1)[:, :K]
    indices_TK = allowed[pick].to(index_dtype)
    return Problem(scores=_scores((T, K), gen), indices_TK=indices_TK, **dense)


def flat_problem(
    mask_TE: torch.Tensor,
    D: int,
    F: int,
    *,
    activation: str = "swiglu",
    seed: int = 0,
    index_dtype: torch.dtype = torch.int64,
) -> Problem:
    """Flat routing with the pairs where ``mask_TE`` is True, sorted by token; inside a token the experts
    come in random order (kernels must not assume expert order within a token)."""
    gen = torch.Generator().manual_seed(seed)
    T, E = mask_TE.shape
    dense = _dense(T, D, F, E, activation, gen)
    token_idx, expert_idx = mask_TE.nonzero(as_tuple=True)
    key = token_idx.double() + 0.5 * torch.rand(token_idx.numel(), generator=gen, dtype=torch.float64)
    order = key.argsort()
    return Problem(
        scores=_scores((token_idx.numel(),), gen),
        token_idx_R=token_idx[order].to(index_dtype),
        expert_idx_R=expert_idx[order].to(index_dtype),
        **dense,
    )


def mask_from_counts(T: int, counts_E: list[int], seed: int = 0) -> torch.Tensor:
    """[T, E] mask where expert e has exactly counts_E[e] tokens, chosen at random."""
    gen = torch.Generator().manual_seed(seed + 1000)
    mask = torch.zeros(T, len(counts_E), dtype=torch.bool)
    for e, c in enumerate(counts_E):
        mask[torch.randperm(T, generator=gen)[:c], e] = True
    return mask


def mask_variable(T: int, E: int, seed: int = 0) -> torch.Tensor:
    """[T, E] mask with a random number (0..E) of experts per token; token 0 has none, token 1 all E."""
    gen = torch.Generator().manual_seed(seed + 2000)
    per_token = torch.randint(0, E + 1, (T,), generator=gen)
    per_token[0], per_token[min(1, T - 1)] = 0, E
    ranks = torch.rand(T, E, generator=gen).argsort(dim=1).argsort(dim=1)
    return ranks < per_token[:, None]


def ours(x, routing, w1, w2, activation):
    return moe_experts(x, routing, w1, w2, activation=activation, backend="torch")


def run(
    fn: Callable,
    p: Problem,
    activation: str,
    dtype: torch.dtype,
    score_dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """Forward + backward of ``fn(x, routing, w1, w2, activation)`` on fresh leaves cast to ``dtype``
    (scores to ``score_dtype``, default ``dtype``); returns the output and the four gradients."""
    x = p.x_TD.to(dtype).requires_grad_()
    s = p.scores.to(score_dtype or dtype).requires_grad_()
    w1 = p.w1_EGD.to(dtype).requires_grad_()
    w2 = p.w2_EDF.to(dtype).requires_grad_()
    inputs = (x, s, w1, w2)
    out = fn(x, p.routing(s), w1, w2, activation)
    if out.requires_grad:
        grads = torch.autograd.grad(out, inputs, p.dO_TD.to(out.dtype), allow_unused=True, materialize_grads=True)
    else:  # e.g. the reference with T = 0 or no pairs: the output does not depend on anything
        grads = tuple(torch.zeros_like(t) for t in inputs)
    return dict(zip(OUTPUTS, (out.detach(),) + tuple(grads), strict=True))


def max_abs_err(a: torch.Tensor, ref64: torch.Tensor) -> float:
    return (a.double() - ref64).abs().max().item() if ref64.numel() else 0.0


def rms_err(a: torch.Tensor, ref64: torch.Tensor) -> float:
    return (a.double() - ref64).square().mean().sqrt().item() if ref64.numel() else 0.0


def within_torch_error(
    name: str, got: torch.Tensor, torch_low: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype
) -> str | None:
    """None if ``got`` is as accurate as PyTorch in ``dtype`` (``torch_low``: the same computation done
    by plain PyTorch in ``dtype``), else a message. Both against the float64 result ``ref64``:

    * RMS error <= 2 x PyTorch's RMS error + eps(dtype)/4 * max|ref64| (a quarter ulp of the largest
      value, so that an exactly representable result does not demand a zero error).
    * max error <= 2 x PyTorch's max error + eps(dtype) * max|ref64|: catches a few wrong elements that
      the RMS dilutes. Here the atol is one ulp of the largest value because single-element errors are
      quantized to ulps: 2 ulps vs PyTorch's 1 ulp is rounding luck, not a defect (seen in fp16 dW1).
    Both tolerances are far below the 1.4e-2 atol that hid SonicMoE issue #63 on ~1e-5 outputs."""
    if got.shape != ref64.shape or got.dtype != torch_low.dtype:
        return f"{name}: {got.dtype} {tuple(got.shape)}, expected {torch_low.dtype} {tuple(ref64.shape)}"
    if ref64.numel() == 0:
        return None
    scale, eps = ref64.abs().max().item(), torch.finfo(dtype).eps
    rms, rms_torch = rms_err(got, ref64), rms_err(torch_low, ref64)
    err, err_torch = max_abs_err(got, ref64), max_abs_err(torch_low, ref64)
    if not math.isfinite(rms) or rms > 2 * rms_torch + eps / 4 * scale:
        return f"{name}: RMS error {rms:.3g} > 2 * torch {dtype} RMS error {rms_torch:.3g} + {eps / 4 * scale:.3g}"
    if err > 2 * err_torch + eps * scale:
        return f"{name}: max error {err:.3g} > 2 * torch {dtype} max error {err_torch:.3g} + {eps * scale:.3g}"
    return None


def test_sm_reservation_counts_gemm_launches():
    """``reserve_sms(n, gemms=k)``: the first k GEMM launches inside leave n SMs free, the later ones none (and
    are ``past_reservation``: the cute backend gives them the dynamic tile scheduler);
    without ``gemms`` every launch does; nested contexts restore the outer one; bad arguments name themselves."""
    from sonic_megatron.kernels import torch_backend
    from sonic_megatron.kernels.sm_reservation import (
        budgeted_clusters,
        past_reservation,
        reserve_sms,
        reserved_sms,
        take_reservation,
    )

    assert take_reservation() == 0 and reserved_sms() == 0 and not past_reservation()
    with reserve_sms(32, gemms=2):
        assert not past_reservation()
        assert [take_reservation() for _ in range(4)] == [32, 32, 0, 0]
        assert reserved_sms() == 0 and past_reservation()  # later launches: every SM, beside the collective
        with reserve_sms(16):
            assert [take_reservation() for _ in range(3)] == [16, 16, 16]
            assert not past_reservation()
        assert take_reservation() == 0  # the outer reservation is still spent
    with reserve_sms(8, gemms=0):
        assert take_reservation() == 0 and past_reservation()
    with reserve_sms(0, gemms=1):  # nothing reserved: nothing to be past
        take_reservation()
        assert not past_reservation()
    assert reserved_sms() == 0 and not past_reservation()
    assert budgeted_clusters(66, 2, 32) == 50 and budgeted_clusters(66, 2, 0) == 66 and budgeted_clusters(3, 2, 99) == 1
    for bad, word in (((-1, None), "n must be"), ((4, -2), "gemms must be"), ((4, 1.5), "gemms must be")):
        with pytest.raises(ValueError, match=word), reserve_sms(*bad):
            pass
        with pytest.raises(ValueError, match=word):
            torch_backend.reserve_sms(*bad)
