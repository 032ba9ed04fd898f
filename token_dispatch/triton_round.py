"""Token rounding without expert parallelism in three Triton launches and a scan, no sort (``rounding.round_local``
on CUDA; ``rounding.round_local_torch`` is the reference and the CPU path, with the same pairs, order and scores).

Shape legend: T tokens, K experts per token, E experts, W = min(tile - 1, T) the most pairs an expert adds,
P = T*K + E*W the padded pair count (``rounded_pairs_bound``).

1. ``_keys_kernel`` (grid: token blocks x expert blocks): one int32 key per (expert, token), [E, T]: a routed
   pair's key orders like the reverse of its routing score (the weakest pair is the largest key), a non-routed
   one's like its dense router probability; an int8 flag per (expert, token), [E, T]: 1 + the pair's top-K slot,
   0 where the token did not route to the expert; each token's pair count, K, into the offsets [T + 1].
2. ``_select_kernel`` (grid: experts): the expert's routed count f_e (its row of flags), its target t_e
   (``TokenRounding``), n = |t_e - f_e| and the n largest keys among its routed tokens (drop, t_e < f_e) or its
   non-routed ones (add), ties to the lower token: the cut is (thr, cut) = key and token of the n-th, found bit by
   bit in registers over the keys as uint32 (a row of at most ``_MAX_BLOCK`` tokens is loaded once; longer rows
   are re-read per pass). The cut pairs' flags change (0 for a dropped pair, -1 for an added one) and so do their
   tokens' pair counts (integer atomics). An expert with nothing to cut does not read its keys.
3. An in-place scan of the counts (``cumsum_``) gives every token's offset, which the rounded ``FlatRouting``
   carries (the experts need no search for them).
4. ``_place_kernel`` (grid: token blocks): each token's pairs at its offset in ascending expert order, the order
   of the reference's (token, expert) sort: token, expert, score (a kept pair's routing score, read through the
   slot in its flag; an added pair's dense probability) and where the score came from; its programs then fill the
   rest of the P pairs with padding (token T, expert E). The backward (``_decode_backward_kernel``) writes each
   gradient to the one score it came from (every pair is unique: plain stores, deterministic).

H100, (T, E, K) = (16384, 256, 8), random routing, GPU time of the forward: 0.11 ms (cut 0.050, placing 0.036,
keys 0.024, scan 0.003); a sort of the kept and added pairs' keys in place of the scan and the placing kernel took
0.19 ms (docs/PERF.md, "Token rounding in the layer").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.routing import FlatRouting, TopKRouting

_MAX_BLOCK = 16384
# _keys_kernel's program: 32 experts x 128 tokens, tokens fastest, 4 warps. H100, _keys_kernel alone at (T, E) =
# (16384, 256) / (16384, 128): 0.024 / 0.013 ms; tokens x experts tiles (experts fastest, the dense read's order)
# took 0.054 / 0.026 ms; 16 x 256 tiles 0.029 / 0.015, 64 x 64 0.052 / 0.027, 32 x 128 on 8 warps 0.110 / 0.055.
_KEYS_TOKENS, _KEYS_EXPERTS = 128, 32
_MODES = {"nearest": 0, "up": 1, "down": 2}
# _place_kernel's program: 16 tokens x 128 experts per step. H100 at (T, E) = (16384, 256), with a counting kernel
# of the same tiles: 0.039 ms; 32 x 64: 0.046, 8 x 256: 0.042, 16 x 64: 0.044, 32 x 32: 0.049, 64 x 16: 0.057.
_PLACE_TOKENS, _PLACE_EXPERTS = 16, 128


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
    offsets_ptr,
    T,
    E,
    K: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
):
    # Tiles are [experts, tokens], tokens fastest: the order of the [E, T] stores (the dense load is the
    # transposed read). The first expert block also starts the token offsets: 0, then K pairs per token (the cut
    # adds or takes one per pair it changes).
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    t_ok = t < T
    ok = (e < E)[:, None] & t_ok[None, :]
    key = _ordered(tl.load(dense_ptr + t[None, :] * E + e[:, None], mask=ok, other=0.0))
    slot = tl.zeros([BE, BT], dtype=tl.int32)  # 1 + the pair's top-K slot; 0: not routed
    for k in tl.static_range(K):
        ek = tl.load(idx_ptr + t * K + k, mask=t_ok, other=-1)
        sk = _ordered(tl.load(scores_ptr + t * K + k, mask=t_ok, other=0.0))
        hit = ek[None, :] == e[:, None]
        slot = tl.where(hit, k + 1, slot)
        key = tl.where(hit, ~sk[None, :], key)
    tl.store(key_ptr + e[:, None].to(tl.int64) * T + t[None, :], key, mask=ok)
    tl.store(routed_ptr + e[:, None].to(tl.int64) * T + t[None, :], slot.to(tl.int8), mask=ok)
    if tl.program_id(1) == 0:
        tl.store(offsets_ptr + 1 + t, tl.zeros([BT], dtype=tl.int32) + K, mask=t_ok)
        if tl.program_id(0) == 0:
            tl.store(offsets_ptr, 0)


@triton.jit
def _row(key_ptr, routed_ptr, want, t, T):
    """Keys of the row at tokens t as uint32 in the same order (sign bit flipped; uint32 compares take half the
    instructions of int64 ones); 0 for tokens outside the cut's side (or past T). A key of INT32_MIN would read as
    0 too: only two NaN bit patterns give it."""
    k = (tl.load(key_ptr + t, mask=t < T, other=0) ^ -2147483648).to(tl.uint32, bitcast=True)
    r = tl.load(routed_ptr + t, mask=t < T, other=0)
    return tl.where((t < T) & ((r > 0) == want), k, 0)


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
    offsets_ptr,
    T,
    MODE: tl.constexpr,
    TILE: tl.constexpr,
    T_BITS: tl.constexpr,
    BT: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    e = tl.program_id(0)
    row_key = key_ptr + e.to(tl.int64) * T
    row_routed = routed_ptr + e.to(tl.int64) * T
    offs = tl.arange(0, BT)
    f = tl.zeros([], dtype=tl.int32)  # the expert's routed count
    for c in range(NUM_CHUNKS):
        t = c * BT + offs
        f += tl.sum((tl.load(row_routed + t, mask=t < T, other=0) > 0).to(tl.int32), axis=0)
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
    want = delta < 0  # drop: among the routed tokens; add: among the others
    if n > 0:  # else nothing to cut: the keys are not even read
        keys = _row(row_key, row_routed, want, offs, T)
        cut = tl.zeros([], dtype=tl.int32) - 1
        thr = tl.zeros([], dtype=tl.uint32)
        bit = tl.full([], 2147483648, tl.uint32)
        for _ in range(32):
            cand = thr | bit
            if _count(keys, row_key, row_routed, want, T, cand, 0, 0, BT, NUM_CHUNKS) >= n:
                thr = cand
            bit = bit >> 1
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
        # the cut pairs' new status in the routed flags (0 for a dropped pair, -1 for an added one) and their
        # tokens' pair counts (integer atomics: exact in any order)
        status = tl.where(delta > 0, -1, 0).to(tl.int8)
        step = tl.where(delta > 0, 1, -1)
        for c in range(NUM_CHUNKS):
            t = c * BT + offs
            k = _chunk(keys, row_key, row_routed, want, t, T, NUM_CHUNKS)
            sel = ((k > thr) | ((k == thr) & (t <= cut))) & (t < T)
            tl.store(row_routed + t, status + tl.zeros([BT], dtype=tl.int8), mask=sel)
            tl.atomic_add(offsets_ptr + 1 + t, step + tl.zeros([BT], dtype=tl.int32), mask=sel, sem="relaxed")


@triton.jit
def _place_kernel(
    routed_ptr,
    offsets_ptr,
    scores_ptr,
    dense_ptr,
    tok_ptr,
    exp_ptr,
    out_ptr,
    order_ptr,
    P,
    T,
    E,
    K: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):
    """Each token's pairs at its offset, in ascending expert order: a kept pair (flag 1 + its top-K slot) with its
    routing score (order: the slot's flat index), an added one (flag -1) with its dense probability (order:
    T*K + its dense index). Positions and the scan are int32 (P < 2^31), addresses int64. The programs also fill
    the pairs past the last token's with padding (token T, expert E, score 0), PAD_BLOCK at a time each."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    pos = tl.load(offsets_ptr + t, mask=t_ok, other=0)
    t64 = t.to(tl.int64)
    for e0 in range(0, E, BE):
        e = e0 + tl.arange(0, BE)
        ok = (e < E)[:, None] & t_ok[None, :]
        r = tl.load(routed_ptr + e[:, None].to(tl.int64) * T + t64[None, :], mask=ok, other=0).to(tl.int32)
        live = r != 0
        kept = r > 0
        added = r < 0
        at = (pos[None, :] + tl.cumsum(live.to(tl.int32), axis=0) - 1).to(tl.int64)
        slot = t64[None, :] * K + (r - 1)
        dense_at = t64[None, :] * E + e[:, None]
        s = tl.load(scores_ptr + slot, mask=kept, other=0.0).to(tl.float32)
        s = tl.where(added, tl.load(dense_ptr + dense_at, mask=added, other=0.0).to(tl.float32), s)
        tl.store(tok_ptr + at, t64[None, :] + tl.zeros([BE, BT], dtype=tl.int64), mask=live)
        tl.store(exp_ptr + at, e[:, None].to(tl.int64) + tl.zeros([BE, BT], dtype=tl.int64), mask=live)
        tl.store(out_ptr + at, s.to(out_ptr.dtype.element_ty), mask=live)
        tl.store(order_ptr + at, tl.where(kept, slot, T * K + dense_at), mask=live)
        pos += tl.sum(live.to(tl.int32), axis=0)
    zero = tl.zeros([PAD_BLOCK], dtype=tl.int64)
    step = tl.num_programs(0) * PAD_BLOCK
    for i0 in range(tl.load(offsets_ptr + T) + tl.program_id(0) * PAD_BLOCK, P, step):
        i = i0 + tl.arange(0, PAD_BLOCK)
        pad = i < P
        tl.store(tok_ptr + i, zero + T, mask=pad)
        tl.store(exp_ptr + i, zero + E, mask=pad)
        tl.store(out_ptr + i, zero.to(out_ptr.dtype.element_ty), mask=pad)
        tl.store(order_ptr + i, zero, mask=pad)


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
    """Rounded routed flags -> (token, expert, score) per pair, token-major and padded to P; gradients back to the
    routing scores / dense probs."""

    @staticmethod
    def forward(ctx, scores_TK, dense_TE, routed_ET, offsets_T1, P):
        (T, K), E = scores_TK.shape, routed_ET.shape[0]
        device = scores_TK.device
        tok = torch.empty(P, dtype=torch.int64, device=device)
        exp = torch.empty_like(tok)
        order = torch.empty_like(tok)
        out = torch.empty(P, dtype=torch.float32, device=device)  # cast by torch (round to nearest)
        be = min(triton.next_power_of_2(E), _PLACE_EXPERTS)
        _place_kernel[(triton.cdiv(T, _PLACE_TOKENS),)](
            routed_ET,
            offsets_T1,
            scores_TK,
            dense_TE,
            tok,
            exp,
            out,
            order,
            P,
            T,
            E,
            K=K,
            BT=_PLACE_TOKENS,
            BE=be,
            PAD_BLOCK=64,
        )
        ctx.save_for_backward(tok, exp, order)
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
    offsets_T1 = torch.empty(T + 1, dtype=torch.int32, device=device)
    BE = min(triton.next_power_of_2(E), _KEYS_EXPERTS)
    BT = _KEYS_TOKENS * _KEYS_EXPERTS // BE
    _keys_kernel[(triton.cdiv(T, BT), triton.cdiv(E, BE))](
        idx_TK, scores_TK, dense_TE, key_ET, routed_ET, offsets_T1, T, E, K=K, BT=BT, BE=BE
    )
    block = min(triton.next_power_of_2(T), _MAX_BLOCK)
    # Warps per expert: H100, _select_kernel alone at (T, E) = (8192, 256) / (16384, 256) / (16384, 128), before it
    # counted its row and the tokens' pairs: 4 warps 0.021 / 0.043 / 0.026 ms, 8 warps 0.027 / 0.045 / 0.023, 16
    # warps 0.029 / 0.045 / 0.023 (int64 keys took 0.027-0.036 / 0.057-0.065 / 0.029-0.036). With the counting, on
    # the warps chosen here: 0.024 / 0.050 / 0.025.
    _select_kernel[(E,)](
        key_ET,
        routed_ET,
        offsets_T1,
        T,
        MODE=_MODES[mode],
        TILE=tile,
        T_BITS=max(int(T - 1).bit_length(), 1),
        BT=block,
        NUM_CHUNKS=triton.cdiv(T, block),
        num_warps=8 if block > 8192 else 4,
    )
    offsets_T1[1:].cumsum_(0)
    P = T * K + E * W
    tok_P, exp_P, score_P = _RoundedScores.apply(scores_TK, dense_TE, routed_ET, offsets_T1, P)
    return FlatRouting(tok_P, exp_P, score_P.to(scores_TK.dtype), T, padded=True, token_offsets=offsets_T1)
