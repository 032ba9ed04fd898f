"""Backend ``cute``: SonicMoE's eight experts kernels on Hopper, with ``kernels/torch_backend.py``'s contract.

Shape legend: see ``kernels/routing.py``; G = 2F (gated). The six grouped GEMMs are QuACK 0.6 CuTe-DSL
kernels (SonicMoE's design); aggregation and the dX sum are our Triton ``gather_sum``:

    up    gemm_gated  X rows gathered by x_gather_idx (varlen-M) x W1_e, SwiGLU epilogue stores H and A
    down  gemm        A x W2_e (varlen-M) -> Y, expert-sorted, contiguous
    O     gather_sum  O_t = sum_j s_j Y[row(j)], fp32, deterministic
    dH    gemm_dgated gathered dO x W2_e (varlen-M); epilogue loads H, recomputes A, dH = dSwiGLU(s * dA'),
                      A' = s * A, dS_row = sum_f A * dA' (colvec_reduce)
    dW2   gemm        dO^T (gathered along K) x A' (varlen-K)
    dX~   gemm        dH x W1_e (varlen-M)
    dX    gather_sum  dX_t = sum_j dX~[row(j)]
    dW1   gemm        X^T (gathered along K) x dH (varlen-K)

Weights stay in Megatron's layout (w1_EGD [E, 2F, D] with ``[gate ; up]`` rows, w2_EDF [E, D, F]); QuACK's
``concat_layout`` makes the kernels read (and dW1's epilogue write) the concatenated halves as interleaved
gate/up pairs, so no weight is ever copied. H and dH live in the interleaved layout [R, (gate_f, up_f)...]
that the gated epilogues produce; only this backend reads them. No host sync anywhere (varlen GEMMs read
expert_offsets on the device). The tuning (``kernels/options.py``, resolved once) picks the tiles: under the default
``heuristic`` on Hopper every GEMM gets its tile config from ``configs.py`` (``quack_adapter`` passes it to QuACK,
replays QuACK's launch plans and runs them on fewer SMs inside ``reserve_sms``), and
the GEMMs that take every SM while a collective may still hold some (past the reserved launches of
``reserve_sms(n, gemms=k)``) use QuACK's dynamic tile scheduler (``_dynamic``). ``autotune`` and ``default`` leave
the config to QuACK.

Blackwell (sm_100): QuACK 0.6's interface functions pick their SM100 kernels by the device's compute capability
and take the same arguments, so the calls are the same; the heuristic tiles were measured on Hopper only, so on
any other GPU the heuristic tuning takes QuACK's per-architecture default config (``_tuning``). Untested: no
Blackwell GPU was available, so only an explicit ``backend='cute'`` runs there, with a warning
(``backends.cute_device_reason``).
"""

from __future__ import annotations

import torch
from quack import gemm_interface as qgemm  # after the package's quack_adapter: versions checked

from ..backends import cute_config_reason, warn_once
from ..options import kernel_options
from ..routing import RoutingMetadata
from ..sm_reservation import past_reservation, reserve_sms, take_reservation
from ..torch_backend import check_weight_grad_out
from ..triton import compute_metadata_topk_triton, compute_metadata_triton, gather_sum
from . import quack_adapter
from .configs import heuristic_config

# Routing metadata for this backend: our Triton kernels (same contract and results as
# ``routing.compute_metadata_torch``, checked bitwise on GPU in tests/test_cute_gpu.py). The shared interface
# builds metadata through ``interface.compute_metadata``, which takes this one when the backend is cute.
compute_metadata = compute_metadata_triton
compute_metadata_topk = compute_metadata_topk_triton  # top-K: no flat token index built (token = pair // K)

__all__ = ["backward_data", "backward_weights", "compute_metadata", "compute_metadata_topk", "forward", "reserve_sms"]

ACC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # weight-gradient accumulators (added in the epilogue)
_QUACK_ACT = {"swiglu": "swiglu", "geglu": "geglu"}


def _fail(arg: str, expected: str, got: object) -> None:
    raise ValueError(f"backend 'cute': {arg} must be {expected}, got {got}")


def check_supported(x_TD: torch.Tensor, w1_EGD: torch.Tensor, w2_EDF: torch.Tensor, activation: str) -> None:
    """Raise ValueError for inputs the Hopper kernels cannot take: the backend's rule (``kernels/backends.py``, the
    one a Megatron layer's backend is chosen by when it is built), then the tensors' device and layout."""
    reason = cute_config_reason(activation, x_TD.dtype, x_TD.shape[1], w2_EDF.shape[2], w1_EGD.shape[0])
    if reason is not None:
        raise ValueError(f"backend 'cute': {reason}")
    if not x_TD.is_cuda:
        _fail("x.device", "a CUDA device", x_TD.device)
    for name, w in (("w1", w1_EGD), ("w2", w2_EDF)):
        if not w.is_contiguous():
            _fail(f"{name}", "contiguous (the kernels read Megatron's layout in place; no per-step copy)", w.stride())


def _check_rows(meta: RoutingMetadata) -> None:
    # Under expert parallelism the plan refuses such counts on every rank first (token_dispatch/sizes.py), so this
    # never stops one rank alone between all-to-alls.
    if meta.num_rows >= 2**31 - 1:
        _fail("routed pairs R (T*K)", "< 2^31 - 1 (int32 row indices)", meta.num_rows)


# ----------------------------------------------------------------------------------------------------------
# QuACK calls under the tuning of kernels/options.py
# ----------------------------------------------------------------------------------------------------------


def _dynamic() -> bool:
    """Whether the GEMM launched now uses QuACK's dynamic persistent tile scheduler (each CTA takes its next tile
    from an atomic counter instead of striding through the tiles by the grid size): the launches past the reserved
    ones of a ``reserve_sms(n, gemms=k)`` context. They take every SM while the collective the reservation was
    made for may still hold some; their CTAs for those SMs start only when the collective's kernel ends, and with
    a fixed stride the tiles of those CTAs would then finish last, with the counter the CTAs already running take
    them. Measured faster than the static scheduler in these launches and than the dynamic one in every launch
    (docs/PERF.md, "Expert parallelism"). Static elsewhere, where the counter's zeroing costs a launch and saves
    nothing. Results are bitwise the same either way (every tile is computed by one CTA, the same way)."""
    return past_reservation()


def _tuning(device) -> str:
    """The tuning in force for a launch on ``device``: ``kernel_options().tuning``, except that the heuristic
    tiles (measured on Hopper) give way to QuACK's per-architecture default config on other GPUs."""
    tuning = kernel_options().tuning
    if tuning == "heuristic" and torch.cuda.get_device_capability(device)[0] != 9:
        return "default"
    return tuning


def _reservation_not_honoured() -> None:
    """Counts a launch of QuACK's own functions (the autotune and default tunings) against ``reserve_sms(n,
    gemms=k)``: they launch on every SM, which the first such launch inside a reservation says once. The heuristic
    tuning's launches leave the SMs free (``_heuristic_launch``, ``quack_adapter.on_fewer_sms``)."""
    if take_reservation() > 0:
        warn_once(
            "reserve_sms / comm_sms > 0: under the autotune and default tunings the cute backend's GEMMs run on "
            "every SM (QuACK's own functions launch them); the heuristic tuning leaves the SMs free"
        )


def _heuristic_launch(gemm: str, F: int, D: int, tiles: tuple, main_grad: str | None = None, rows_multiple: int = 0):
    """(tile config, dynamic, reserved SMs) of a GEMM launched now under the heuristic tuning: ``dynamic`` when the
    launch uses the dynamic tile scheduler (``_dynamic``). ``main_grad``: "add" / "store" for a weight GEMM
    writing into a caller's accumulator; ``rows_multiple``: ``RoutingMetadata.rows_multiple``."""
    dynamic = _dynamic()
    reserved = take_reservation()  # the SMs it leaves free; the launch counts against gemms=k
    return heuristic_config(gemm, F, D, tiles, dynamic, main_grad, rows_multiple), dynamic, reserved


def _gemm(
    gemm: str,
    F: int,
    D: int,
    A,
    B,
    out,
    *,
    cu_seqlens_m=None,
    cu_seqlens_k=None,
    A_idx=None,
    concat_layout=None,
    add_to_output: bool = False,
    main_grad: str | None = None,
    rows_multiple: int = 0,
):
    """out = A @ B, or out += A @ B with ``add_to_output`` (each element is added once, by the one tile that owns
    it, so the result is deterministic; not with varlen-M). Under the heuristic tuning the epilogue loads out as
    its C operand (``quack_adapter.gemm``); the autotune and default tunings take QuACK's ``gemm_add_inplace``."""
    tuning = _tuning(A.device)
    if tuning == "heuristic":
        config, dynamic, reserved = _heuristic_launch(gemm, F, D, kernel_options().tiles, main_grad, rows_multiple)
        args = (A, B, out, cu_seqlens_m, cu_seqlens_k, A_idx, concat_layout, add_to_output)
        quack_adapter.gemm(config, dynamic, *args, reserved=reserved)
    else:
        _reservation_not_honoured()
        (qgemm.gemm_add_inplace if add_to_output else qgemm.gemm)(
            A,
            B,
            out=out,
            cu_seqlens_m=cu_seqlens_m,
            cu_seqlens_k=cu_seqlens_k,
            A_idx=A_idx,
            dynamic_scheduler=False,
            tuned=tuning == "autotune",
            concat_layout=concat_layout,
        )


def _gemm_gated(F: int, A, B, preact_out, postact_out, activation, cu_seqlens_m, A_idx):
    tuning = _tuning(A.device)
    if tuning == "heuristic":
        config, dynamic, reserved = _heuristic_launch("up", F, A.shape[1], kernel_options().tiles)
        args = (A, B, preact_out, postact_out, activation, cu_seqlens_m, A_idx)
        quack_adapter.gemm_gated(config, dynamic, *args, reserved=reserved)
    else:
        _reservation_not_honoured()
        qgemm.gemm_gated(
            A,
            B,
            preact_out=preact_out,
            postact_out=postact_out,
            activation=activation,
            cu_seqlens_m=cu_seqlens_m,
            A_idx=A_idx,
            store_preact=preact_out is not None,
            dynamic_scheduler=False,
            tuned=tuning == "autotune",
            concat_layout=("B",),
        )


def _gemm_dgated(F: int, A, B, preact, dx_out, postact_out, colvec_scale, activation, cu_seqlens_m, A_idx):
    """dH GEMM; returns dS per row (fp32). Varlen-M with gathered A only (as ``backward_data`` calls it)."""
    tuning = _tuning(A.device)
    if tuning == "heuristic":
        config, dynamic, reserved = _heuristic_launch("dh", F, A.shape[1], kernel_options().tiles)
        args = (A, B, preact, dx_out, postact_out, colvec_scale, activation, cu_seqlens_m, A_idx)
        return quack_adapter.gemm_dgated(config, dynamic, *args, reserved=reserved)
    _reservation_not_honoured()
    return qgemm.gemm_dgated(
        A,
        B,
        preact,
        activation=activation,
        dx_out=dx_out,
        postact_out=postact_out,
        colvec_scale=colvec_scale,
        colvec_reduce=True,
        cu_seqlens_m=cu_seqlens_m,
        A_idx=A_idx,
        dynamic_scheduler=False,
        tuned=tuning == "autotune",
    )[2]


def _pairs_per_token(meta: RoutingMetadata) -> int:
    if meta.pairs_per_token_hint:
        return meta.pairs_per_token_hint
    T = meta.token_offsets.numel() - 1
    return max(1, meta.num_rows // max(T, 1))


# ----------------------------------------------------------------------------------------------------------
# The backend contract (same signatures and meanings as torch_backend)
# ----------------------------------------------------------------------------------------------------------


def forward(
    x_TD: torch.Tensor,
    scores_R: torch.Tensor,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    meta: RoutingMetadata,
    activation: str,
    store_h: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(O [T, D], H [R, 2F] gate/up interleaved, or None when ``store_h`` is False)."""
    check_supported(x_TD, w1_EGD, w2_EDF, activation)
    _check_rows(meta)
    T, D = x_TD.shape
    F = w2_EDF.shape[2]
    R = meta.num_rows
    h_RG = torch.empty(R, 2 * F, dtype=x_TD.dtype, device=x_TD.device) if store_h else None
    if R == 0:
        return x_TD.new_zeros(T, D), h_RG
    a_RF = torch.empty(R, F, dtype=x_TD.dtype, device=x_TD.device)
    # B operands (L, K, N): W1_e^T = w1_EGD[e].T viewed as [D, 2F]; W2_e^T as [F, D]. Views, no copies.
    _gemm_gated(
        F, x_TD, w1_EGD.permute(0, 2, 1), h_RG, a_RF, _QUACK_ACT[activation], meta.expert_offsets, meta.x_gather_idx
    )
    y_RD = torch.empty(R, D, dtype=x_TD.dtype, device=x_TD.device)
    _gemm("down", F, D, a_RF, w2_EDF.permute(0, 2, 1), y_RD, cu_seqlens_m=meta.expert_offsets)
    del a_RF
    o_TD = gather_sum(y_RD, meta, scores_R.detach(), pairs_per_token=_pairs_per_token(meta))
    return o_TD, h_RG


def backward_data(
    dO_TD: torch.Tensor,
    x_TD: torch.Tensor,
    h_RG: torch.Tensor,
    scores_R: torch.Tensor,
    w1_EGD: torch.Tensor,
    w2_EDF: torch.Tensor,
    meta: RoutingMetadata,
    activation: str,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(dX [T, D], dScores [R] fp32 in flat pair order, (A' [R, F], dH [R, 2F] interleaved))."""
    check_supported(x_TD, w1_EGD, w2_EDF, activation)
    if dO_TD.dtype != x_TD.dtype:
        _fail("dO.dtype", f"x.dtype ({x_TD.dtype})", dO_TD.dtype)
    T, D = x_TD.shape
    F = w2_EDF.shape[2]
    R = meta.num_rows
    dev, dt = x_TD.device, x_TD.dtype
    aprime_RF = torch.empty(R, F, dtype=dt, device=dev)
    dH_RG = torch.empty(R, 2 * F, dtype=dt, device=dev)
    if R == 0:
        return x_TD.new_zeros(T, D), torch.zeros(0, dtype=torch.float32, device=dev), (aprime_RF, dH_RG)
    s_rows_R = scores_R.detach().to(torch.float32).index_select(0, meta.s_scatter_idx)
    ds_rows_R = _gemm_dgated(
        F,
        dO_TD,
        w2_EDF,  # B (L, K=D, N=F) = W2_e as stored
        h_RG,
        dH_RG,
        aprime_RF,
        s_rows_R,
        _QUACK_ACT[activation],
        meta.expert_offsets,
        meta.x_gather_idx,
    )
    dscores_R = ds_rows_R.index_select(0, meta.s_reverse_scatter_idx)  # rows -> flat pair order (int32 index)
    dxg_RD = torch.empty(R, D, dtype=dt, device=dev)
    _gemm(
        "dx",
        F,
        D,
        dH_RG,
        w1_EGD,
        dxg_RD,
        cu_seqlens_m=meta.expert_offsets,
        concat_layout=("B",),
        rows_multiple=meta.rows_multiple,
    )
    dx_TD = gather_sum(dxg_RD, meta, None, pairs_per_token=_pairs_per_token(meta))
    return dx_TD, dscores_R, (aprime_RF, dH_RG)


def backward_weights(
    dO_TD: torch.Tensor,
    x_TD: torch.Tensor,
    aprime_RF: torch.Tensor,
    dH_RG: torch.Tensor,
    meta: RoutingMetadata,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    accumulate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dW1 [E, 2F, D] in ``[gate ; up]`` row order, dW2 [E, D, F]); zeros for experts without rows.
    ``out=(dW1_acc, dW2_acc)`` (contiguous, fp32/bf16/fp16): the GEMMs ADD into them in their epilogue (no
    separate add kernel, no temporary dW) and they are returned; with ``accumulate=False`` the GEMMs store into
    them (no read of the old values: half the memory traffic of an fp32 add)."""
    E = meta.num_experts
    T, D = x_TD.shape
    F = aprime_RF.shape[1]
    dev, dt = x_TD.device, x_TD.dtype
    if out is not None:
        check_weight_grad_out(out, ((E, 2 * F, D), (E, D, F)), dev, ACC_DTYPES)
    if meta.num_rows == 0 or T == 0:
        if out is not None:
            if not accumulate:
                out[0].zero_(), out[1].zero_()
            return out[0], out[1]
        return torch.zeros(E, 2 * F, D, dtype=dt, device=dev), torch.zeros(E, D, F, dtype=dt, device=dev)
    add = out is not None and accumulate
    main_grad = None if out is None else ("add" if add else "store")
    if out is not None:
        dw1_EGD, dw2_EDF = out
    else:
        dw1_EGD = torch.empty(E, 2 * F, D, dtype=dt, device=dev)
        dw2_EDF = torch.empty(E, D, F, dtype=dt, device=dev)
    _gemm(
        "dw2",
        F,
        D,
        dO_TD.t(),
        aprime_RF,
        dw2_EDF,
        cu_seqlens_k=meta.expert_offsets,
        A_idx=meta.x_gather_idx,
        add_to_output=add,
        main_grad=main_grad,
    )
    # out (L, M=D, N=2F) is a transposed view of dw1_EGD; "out" in concat_layout writes the interleaved
    # gate/up columns of dH back as [gate ; up] rows.
    _gemm(
        "dw1",
        F,
        D,
        x_TD.t(),
        dH_RG,
        dw1_EGD.permute(0, 2, 1),
        cu_seqlens_k=meta.expert_offsets,
        A_idx=meta.x_gather_idx,
        concat_layout=("out",),
        add_to_output=add,
        main_grad=main_grad,
    )
    return dw1_EGD, dw2_EDF
