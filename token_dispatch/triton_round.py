"""Token rounding without expert parallelism in four Triton launches and one sort (``rounding.round_local`` on
CUDA; ``rounding.round_local_torch`` is the reference and the CPU path, with the same pairs, order and scores).

Shape legend: T tokens, K experts per token, E experts, W = min(tile - 1, T) the most pairs an expert adds,
P = T*K + E*W the padded pair count (``rounded_pairs_bound``).

1. ``_keys_kernel`` (grid: token blocks x expert blocks): one int32 key per (expert, token), [E, T]: a routed
   pair's key orders like the reverse of its routing score (the weakest pair is the largest key), a non-routed
   one's like its dense router probability; a routed flag [E, T]; the routed count f_E (integer atomics: exact).
2. ``_select_kernel`` (grid: experts): the expert's target t_e from f_e (``TokenRounding``), n = |t_e - f_e| and
   the n largest keys among its routed tokens (drop, t_e < f_e) or its non-routed ones (add), ties to the lower
   token: the cut is (thr, cut) = key and token of the n-th, found bit by bit in registers (a row of at most
   ``_MAX_BLOCK`` tokens is loaded once; longer rows are re-read per pass). An adding expert writes its pairs'
   (token, expert) keys into its W slots of the pair keys, padding after them.
3. ``_kept_kernel`` (grid: pair blocks): the top-K pairs' (token, expert) keys, padding for dropped ones.
4. ``torch.sort`` of the P pair keys: token-major order, padding (token T, expert E) last.
5. ``_decode_kernel``: token, expert and score of each sorted pair (a kept pair's routing score, an added pair's
   dense probability); its backward (``_decode_backward_kernel``) writes each gradient to the one score it came
   from (every pair is unique: plain stores, deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.routing import FlatRouting, TopKRouting

_MAX_BLOCK = 16384
# _keys_kernel's program: 128 tokens x 32 experts. Against one program per 16 tokens x all experts (H100,
# _keys_kernel alone): 0.061 vs 0.068 ms at (T, E) = (16384, 256), 0.031 vs 0.033 at (16384, 128), 0.031 vs
# 0.034 at (8192, 256); 64 or 16 experts per program were slower (0.11 / 0.085 ms at (16384, 256)).
_KEYS_TOKENS, _KEYS_EXPERTS = 128, 32
_MODES = {"nearest": 0, "up": 1, "down": 2}


@triton.jit
def _ordered(values):
    """int32 ordering like the fp32 value (sign-folded bits)."""
    bits = values.to(tl.float32).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _keys_kernel(
    idx_ptr,
    scores_ptr,
    dense_ptr,
    key_ptr,
    routed_ptr,
    counts_ptr,
    T,
    E,
    K: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    t_ok = t < T
    ok = t_ok[:, None] & (e < E)[None, :]
    key = _ordered(tl.load(dense_ptr + t[:, None] * E + e[None, :], mask=ok, other=0.0))
    routed = tl.zeros([BT, BE], dtype=tl.int1)
    for k in tl.static_range(K):
        ek = tl.load(idx_ptr + t * K + k, mask=t_ok, other=-1)
        sk = _ordered(tl.load(scores_ptr + t * K + k, mask=t_ok, other=0.0))
        hit = ek[:, None] == e[None, :]
        routed = routed | hit
        key = tl.where(hit, ~sk[:, None], key)
    tl.store(key_ptr + e[None, :].to(tl.int64) * T + t[:, None], key, mask=ok)
    tl.store(routed_ptr + e[None, :].to(tl.int64) * T + t[:, None], routed.to(tl.int8), mask=ok)
    tl.atomic_add(counts_ptr + e, tl.sum((routed & ok).to(tl.int32), axis=0), mask=e < E)


@triton.jit
def _row(key_ptr, routed_ptr, want, t, T):
    """Keys of the row at tokens t, shifted to [1, 2^32); 0 for tokens outside the cut's side (or past T)."""
    k = tl.load(key_ptr + t, mask=t < T, other=0).to(tl.int64) + 2147483648
    r = tl.load(routed_ptr + t, mask=t < T, other=0)
    return tl.where((t < T) & (r == want), k, 0)


@triton.jit
def _chunk(keys, key_ptr, routed_ptr, want, t, T, NUM_CHUNKS: tl.constexpr):
    if NUM_CHUNKS == 1:
        return keys
    return _row(key_ptr, routed_ptr, want, t, T)


@triton.jit
def _count(
    keys, key_ptr, routed_ptr, want, T, cand, cmp: tl.constexpr, cut, BT: tl.constexpr, NUM_CHUNKS: tl.constexpr
):
    """Keys >= cand (cmp 0), > cand (cmp 1), or == cand at tokens < cut (cmp 2)."""
    total = tl.zeros([], dtype=tl.int32)
    for c in range(NUM_CHUNKS):
        t = c * BT + tl.arange(0, BT)
        k = _chunk(keys, key_ptr, routed_ptr, want, t, T, NUM_CHUNKS)
        if cmp == 0:
            hit = k >= cand
        elif cmp == 1:
            hit = k > cand
        else:
            hit = (k == cand) & (t < cut)
        total += tl.sum(hit.to(tl.int32), axis=0)
    return total


@triton.jit
def _select_kernel(
    key_ptr,
    routed_ptr,
    counts_ptr,
    thr_ptr,
    cut_ptr,
    drop_ptr,
    pair_keys_ptr,
    T,
    E,
    W,
    TK,
    PAD,
    MODE: tl.constexpr,
    TILE: tl.constexpr,
    T_BITS: tl.constexpr,
    BT: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    BW: tl.constexpr,
):
    e = tl.program_id(0)
    f = tl.load(counts_ptr + e)
    lo = (f // TILE) * TILE
    if MODE == 2:
        target = lo
    elif MODE == 1:
        target = tl.where(f % TILE == 0, f, lo + TILE)
    else:  # nearest multiple, half to even (as torch.round on f / TILE); a routed expert keeps one tile
        r = f - lo
        up = (2 * r > TILE) | ((2 * r == TILE) & ((lo // TILE) % 2 == 1))
        target = tl.where(up | ((lo == 0) & (f > 0)), lo + TILE, lo)
    target = tl.where(target > T, lo, target)
    delta = target - f
    n = tl.abs(delta)
    want = (delta < 0).to(tl.int8)  # drop: among the routed tokens; add: among the others
    row_key = key_ptr + e.to(tl.int64) * T
    row_routed = routed_ptr + e.to(tl.int64) * T
    offs = tl.arange(0, BT)
    keys = _row(row_key, row_routed, want, offs, T)
    thr = tl.zeros([], dtype=tl.int64) + 4294967295  # n == 0: above every key
    cut = tl.zeros([], dtype=tl.int32) - 1
    count = tl.zeros([], dtype=tl.int32)
    if n > 0:
        thr = tl.zeros([], dtype=tl.int64)
        for i in range(32):
            cand = thr | ((tl.zeros([], dtype=tl.int64) + 1) << (31 - i))
            if _count(keys, row_key, row_routed, want, T, cand, 0, 0, BT, NUM_CHUNKS) >= n:
                thr = cand
        if _count(keys, row_key, row_routed, want, T, thr, 0, 0, BT, NUM_CHUNKS) == n:  # every tie taken: the last
            for c in range(NUM_CHUNKS):
                t = c * BT + offs
                k = _chunk(keys, row_key, row_routed, want, t, T, NUM_CHUNKS)
                cut = tl.maximum(cut, tl.max(tl.where(k == thr, t, -1), axis=0))
        else:  # ties straddle the cut: the need-th tie in token order
            need = n - _count(keys, row_key, row_routed, want, T, thr, 1, 0, BT, NUM_CHUNKS)
            p = tl.zeros([], dtype=tl.int32)
            for i in range(T_BITS):
                cand_t = p | (1 << (T_BITS - 1 - i))
                if _count(keys, row_key, row_routed, want, T, thr, 2, cand_t, BT, NUM_CHUNKS) < need:
                    p = cand_t
            cut = p
        if delta > 0:  # the added pairs' (token, expert) keys, ascending token, into this expert's W slots
            for c in range(NUM_CHUNKS):
                t = c * BT + offs
                k = _chunk(keys, row_key, row_routed, want, t, T, NUM_CHUNKS)
                sel = (k > thr) | ((k == thr) & (t <= cut))
                pos = count + tl.cumsum(sel.to(tl.int32), axis=0) - 1
                value = (t.to(tl.int64) * (E + 1) + e).to(pair_keys_ptr.dtype.element_ty)
                tl.store(pair_keys_ptr + TK + e.to(tl.int64) * W + pos, value, mask=sel)
                count += tl.sum(sel.to(tl.int32), axis=0)
    w = tl.arange(0, BW)
    pads = tl.zeros([BW], dtype=pair_keys_ptr.dtype.element_ty) + PAD
    tl.store(pair_keys_ptr + TK + e.to(tl.int64) * W + w, pads, mask=(w >= count) & (w < W))
    tl.store(thr_ptr + e, (thr - 2147483648).to(tl.int32))
    tl.store(cut_ptr + e, cut)
    tl.store(drop_ptr + e, (delta < 0).to(tl.int8))


@triton.jit
def _kept_kernel(idx_ptr, scores_ptr, thr_ptr, cut_ptr, drop_ptr, pair_keys_ptr, TK, E, K, PAD, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = j < TK
    e = tl.load(idx_ptr + j, mask=ok, other=0).to(tl.int64)
    t = j // K
    key = ~_ordered(tl.load(scores_ptr + j, mask=ok, other=0.0))
    thr = tl.load(thr_ptr + e, mask=ok, other=0)
    cut = tl.load(cut_ptr + e, mask=ok, other=-1)
    drops = tl.load(drop_ptr + e, mask=ok, other=0) != 0
    dropped = drops & ((key > thr) | ((key == thr) & (t <= cut)))
    value = tl.where(dropped, PAD, t * (E + 1) + e).to(pair_keys_ptr.dtype.element_ty)
    tl.store(pair_keys_ptr + j, value, mask=ok)


@triton.jit
def _decode_kernel(
    sorted_ptr, order_ptr, scores_ptr, dense_ptr, tok_ptr, exp_ptr, out_ptr, P, TK, E, PAD, BLOCK: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < P
    key = tl.load(sorted_ptr + i, mask=ok, other=0).to(tl.int64)
    o = tl.load(order_ptr + i, mask=ok, other=0)
    valid = ok & (key < PAD)
    tok = key // (E + 1)
    exp = key - tok * (E + 1)
    kept = valid & (o < TK)
    added = valid & (o >= TK)
    s = tl.load(scores_ptr + o, mask=kept, other=0.0).to(tl.float32)
    s = tl.where(added, tl.load(dense_ptr + tok * E + exp, mask=added, other=0.0).to(tl.float32), s)
    tl.store(tok_ptr + i, tok, mask=ok)
    tl.store(exp_ptr + i, exp, mask=ok)
    tl.store(out_ptr + i, s.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _decode_backward_kernel(
    grad_ptr, tok_ptr, exp_ptr, order_ptr, dscores_ptr, ddense_ptr, P, TK, T, E, BLOCK: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < P
    tok = tl.load(tok_ptr + i, mask=ok, other=T)
    exp = tl.load(exp_ptr + i, mask=ok, other=E)
    o = tl.load(order_ptr + i, mask=ok, other=0)
    g = tl.load(grad_ptr + i, mask=ok, other=0.0)
    valid = ok & (tok < T)
    kept = valid & (o < TK)
    added = valid & (o >= TK)
    tl.store(dscores_ptr + o, g.to(dscores_ptr.dtype.element_ty), mask=kept)
    tl.store(ddense_ptr + tok * E + exp, g.to(ddense_ptr.dtype.element_ty), mask=added)


class _RoundedScores(torch.autograd.Function):
    """Sorted pair keys -> (token, expert, score) per pair; gradients back to the routing scores / dense probs."""

    @staticmethod
    def forward(ctx, scores_TK, dense_TE, sorted_P, order_P, E):
        P, TK = sorted_P.numel(), scores_TK.numel()
        tok = torch.empty(P, dtype=torch.int64, device=sorted_P.device)
        exp = torch.empty_like(tok)
        out = torch.empty(P, dtype=torch.float32, device=sorted_P.device)  # cast by torch (round to nearest)
        pad = scores_TK.shape[0] * (E + 1) + E
        _decode_kernel[(triton.cdiv(P, 1024),)](
            sorted_P, order_P, scores_TK, dense_TE, tok, exp, out, P, TK, E, pad, BLOCK=1024
        )
        ctx.save_for_backward(tok, exp, order_P)
        ctx.shapes = (scores_TK.shape, scores_TK.dtype, dense_TE.shape, dense_TE.dtype)
        ctx.mark_non_differentiable(tok, exp)
        return tok, exp, out

    @staticmethod
    def backward(ctx, _gt, _ge, grad_P):
        tok, exp, order_P = ctx.saved_tensors
        (T, K), s_dtype, (_, E), d_dtype = ctx.shapes
        d_scores = torch.zeros(T, K, dtype=s_dtype, device=grad_P.device)
        d_dense = torch.zeros(T, E, dtype=d_dtype, device=grad_P.device)
        P = grad_P.numel()
        _decode_backward_kernel[(triton.cdiv(P, 1024),)](
            grad_P.contiguous(), tok, exp, order_P, d_scores, d_dense, P, T * K, T, E, BLOCK=1024
        )
        return d_scores, d_dense, None, None, None


def round_local_triton(routing: TopKRouting, dense_TE: torch.Tensor, num_experts: int, mode: str, tile: int):
    """``round_local`` on CUDA (see the module docstring); T, K >= 1, scores and dense probs of at most 32 bits."""
    idx_TK = routing.indices_TK.contiguous()
    scores_TK = routing.scores_TK.contiguous()
    dense_TE = dense_TE.contiguous()
    T, K = idx_TK.shape
    E, device = num_experts, idx_TK.device
    W = min(tile - 1, T)
    key_ET = torch.empty(E, T, dtype=torch.int32, device=device)
    routed_ET = torch.empty(E, T, dtype=torch.int8, device=device)
    counts_E = torch.zeros(E, dtype=torch.int32, device=device)
    BE = min(triton.next_power_of_2(E), _KEYS_EXPERTS)
    BT = _KEYS_TOKENS * _KEYS_EXPERTS // BE
    _keys_kernel[(triton.cdiv(T, BT), triton.cdiv(E, BE))](
        idx_TK, scores_TK, dense_TE, key_ET, routed_ET, counts_E, T, E, K=K, BT=BT, BE=BE
    )

    TK, pad = T * K, T * (E + 1) + E
    key_dtype = torch.int32 if pad <= torch.iinfo(torch.int32).max else torch.int64
    pair_keys = torch.empty(TK + E * W, dtype=key_dtype, device=device)
    thr_E = torch.empty(E, dtype=torch.int32, device=device)
    cut_E = torch.empty(E, dtype=torch.int32, device=device)
    drop_E = torch.empty(E, dtype=torch.int8, device=device)
    block = min(triton.next_power_of_2(T), _MAX_BLOCK)
    _select_kernel[(E,)](
        key_ET,
        routed_ET,
        counts_E,
        thr_E,
        cut_E,
        drop_E,
        pair_keys,
        T,
        E,
        W,
        TK,
        pad,
        MODE=_MODES[mode],
        TILE=tile,
        T_BITS=max(int(T - 1).bit_length(), 1),
        BT=block,
        NUM_CHUNKS=triton.cdiv(T, block),
        BW=triton.next_power_of_2(max(W, 1)),
        num_warps=16 if block >= 8192 else 8 if block >= 2048 else 4,
    )
    _kept_kernel[(triton.cdiv(TK, 1024),)](
        idx_TK, scores_TK, thr_E, cut_E, drop_E, pair_keys, TK, E, K, pad, BLOCK=1024
    )
    sorted_P, order_P = torch.sort(pair_keys)
    tok_P, exp_P, score_P = _RoundedScores.apply(scores_TK, dense_TE, sorted_P, order_P, E)
    return FlatRouting(tok_P, exp_P, score_P.to(scores_TK.dtype), T, padded=True)
