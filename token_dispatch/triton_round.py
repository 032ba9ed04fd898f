"""Token rounding without expert parallelism in three Triton launches and a scan, no sort (``rounding.round_local``
on CUDA; ``rounding.round_local_torch`` is the reference and the CPU path, with the same pairs, order and scores).
The rounded routing comes with the experts' metadata of its pairs (``FlatRouting.metadata``), so the experts skip
their own metadata kernels.

Shape legend: T tokens, K experts per token, E experts, W = min(tile - 1, T) the most pairs an expert adds,
P = T*K + E*W the padded pair count (``rounded_pairs_bound``), B = ceil(T / 16) blocks of the placing kernel.

1. ``_keys_kernel`` (grid: token blocks x expert blocks): one int32 key per (expert, token), [E, T]: a routed
   pair's key orders like the reverse of its routing score (the weakest pair is the largest key), a non-routed
   one's like its dense router probability; an int8 flag per (expert, token), [E, T]: 1 + the pair's top-K slot,
   0 where the token did not route to the expert; each token's pair count, K, into the scan buffer.
2. ``_select_kernel`` (grid: experts): the expert's routed count f_e (its row of flags), its target t_e
   (``TokenRounding``), n = |t_e - f_e| and the n largest keys among its routed tokens (drop, t_e < f_e) or its
   non-routed ones (add), ties to the lower token: the cut is (thr, cut) = key and token of the n-th, found bit by
   bit in registers over the keys as uint32 (a row of at most ``_MAX_BLOCK`` tokens is loaded once; longer rows
   are re-read per pass). The cut pairs' flags change (0 for a dropped pair, -1 for an added one) and so do their
   tokens' pair counts (integer atomics). An expert with nothing to cut does not read its keys. It writes t_e
   into the scan buffer and, per block of 16 tokens, its pairs before the block ([E, B]).
3. One in-place scan (``cumsum_``) of the buffer [0, the tokens' pair counts | 0, the experts' row counts] gives
   every token's offset (which the rounded ``FlatRouting`` carries) and every expert's, shifted by the total.
4. ``_place_kernel`` (grid: token blocks): each token's pairs at its offset in ascending expert order, the order
   of the reference's (token, expert) sort: token, expert, score (a kept pair's routing score, read through the
   slot in its flag; an added pair's dense probability) and where the score came from; and each pair's row among
   its expert's rows (ascending token order: the metadata ``compute_metadata`` would build). Its programs then
   fill the rest of the P pairs with padding (token T, expert E). The backward (``_decode_backward_kernel``)
   writes each gradient to the one score it came from (every pair is unique: plain stores, deterministic).

H100, (T, E, K) = (16384, 256, 8), random routing, GPU time of the forward before the metadata was placed here:
0.11 ms (cut 0.050, placing 0.036, keys 0.024, scan 0.003); a sort of the kept and added pairs' keys in place of
the scan and the placing kernel took 0.19 ms (docs/PERF.md, "Token rounding in the layer").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.routing import FlatRouting, RoutingMetadata, TopKRouting

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
    # transposed read). The first expert block also starts the token offsets in the scan buffer: 0, then K pairs
    # per token (the cut adds or takes one per pair it changes).
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
            tl.store(offsets_ptr + T + 1, 0)  # the experts' part of the scan starts after the tokens' total


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
def _block_prefixes(live, c, carry, prefix_ptr, NB, BT: tl.constexpr, PB: tl.constexpr):
    """Store the expert's pairs before each block of PB tokens of chunk c (carry: before the chunk) into its row
    of prefix [E, NB]; returns the carry past the chunk. Sums per block, then a scan over the chunk's blocks."""
    per_block = tl.sum(tl.reshape(live.to(tl.int32), [BT // PB, PB]), axis=1)
    b = c * (BT // PB) + tl.arange(0, BT // PB)
    tl.store(prefix_ptr + b, carry + tl.cumsum(per_block, axis=0) - per_block, mask=b < NB)
    return carry + tl.sum(per_block, axis=0)


@triton.jit
def _select_kernel(
    key_ptr,
    routed_ptr,
    offsets_ptr,
    prefix_ptr,
    T,
    MODE: tl.constexpr,
    TILE: tl.constexpr,
    T_BITS: tl.constexpr,
    BT: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    PB: tl.constexpr,
):
    e = tl.program_id(0)
    row_key = key_ptr + e.to(tl.int64) * T
    row_routed = routed_ptr + e.to(tl.int64) * T
    NB = tl.cdiv(T, PB)
    row_prefix = prefix_ptr + e.to(tl.int64) * NB
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
    tl.store(offsets_ptr + T + 2 + e, target)  # the expert's rows, scanned after the tokens' counts
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
        carry = tl.zeros([], dtype=tl.int32)
        for c in range(NUM_CHUNKS):
            t = c * BT + offs
            k = _chunk(keys, row_key, row_routed, want, t, T, NUM_CHUNKS)
            sel = ((k > thr) | ((k == thr) & (t <= cut))) & (t < T)
            # a cut pair flips: a dropped one was routed, an added one was not (read before the flag is stored)
            live = ((tl.load(row_routed + t, mask=t < T, other=0) > 0) != sel) & (t < T)
            tl.store(row_routed + t, status + tl.zeros([BT], dtype=tl.int8), mask=sel)
            tl.atomic_add(offsets_ptr + 1 + t, step + tl.zeros([BT], dtype=tl.int32), mask=sel, sem="relaxed")
            carry = _block_prefixes(live, c, carry, row_prefix, NB, BT, PB)
    else:  # the row as top-K routed it (a second read of its flags, for the rare expert with nothing to cut)
        carry = tl.zeros([], dtype=tl.int32)
        for c in range(NUM_CHUNKS):
            t = c * BT + offs
            live = tl.load(row_routed + t, mask=t < T, other=0) > 0
            carry = _block_prefixes(live, c, carry, row_prefix, NB, BT, PB)


@triton.jit
def _place_kernel(
    routed_ptr,
    scan_ptr,
    prefix_ptr,
    scores_ptr,
    dense_ptr,
    tok_ptr,
    exp_ptr,
    out_ptr,
    order_ptr,
    expert_offsets_ptr,
    x_gather_ptr,
    s_scatter_ptr,
    s_reverse_ptr,
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
    T*K + its dense index); and each pair's row among its expert's rows (the expert's offset + its pairs before
    this block of BT tokens + those before the token inside the block), which gives the experts' metadata.
    Positions and the scan are int32 (2P < 2^31), addresses int64. The programs also fill the pairs past the last
    token's with padding (token T, expert E, score 0, order -1; row = pair, gathering token T - 1), PAD_BLOCK at a
    time each; program 0 writes the experts' offsets."""
    b = tl.program_id(0)
    t = b * BT + tl.arange(0, BT)
    t_ok = t < T
    pos = tl.load(scan_ptr + t, mask=t_ok, other=0)
    total = tl.load(scan_ptr + T)  # real pairs; the experts' part of the scan starts from it
    t64 = t.to(tl.int64)
    for e0 in range(0, E, BE):
        e = e0 + tl.arange(0, BE)
        e_ok = e < E
        ok = e_ok[:, None] & t_ok[None, :]
        r = tl.load(routed_ptr + e[:, None].to(tl.int64) * T + t64[None, :], mask=ok, other=0).to(tl.int32)
        live = r != 0
        kept = r > 0
        added = r < 0
        n = live.to(tl.int32)
        at = pos[None, :] + tl.cumsum(n, axis=0) - 1
        base = tl.load(scan_ptr + T + 1 + e, mask=e_ok, other=0) - total
        # the cut kernel's block prefixes [E, NB]: NB = this grid's size (blocks of BT = its PB tokens)
        base += tl.load(prefix_ptr + e.to(tl.int64) * tl.num_programs(0) + b, mask=e_ok, other=0)
        row = base[:, None] + tl.cumsum(n, axis=1) - n
        slot = t64[None, :] * K + (r - 1)
        dense_at = t64[None, :] * E + e[:, None]
        s = tl.load(scores_ptr + slot, mask=kept, other=0.0).to(tl.float32)
        s = tl.where(added, tl.load(dense_ptr + dense_at, mask=added, other=0.0).to(tl.float32), s)
        at64 = at.to(tl.int64)
        tl.store(tok_ptr + at64, t64[None, :] + tl.zeros([BE, BT], dtype=tl.int64), mask=live)
        tl.store(exp_ptr + at64, e[:, None].to(tl.int64) + tl.zeros([BE, BT], dtype=tl.int64), mask=live)
        tl.store(out_ptr + at64, s.to(out_ptr.dtype.element_ty), mask=live)
        tl.store(order_ptr + at64, tl.where(kept, slot, T * K + dense_at), mask=live)
        row64 = row.to(tl.int64)
        tl.store(x_gather_ptr + row64, t[None, :] + tl.zeros([BE, BT], dtype=tl.int32), mask=live)
        tl.store(s_scatter_ptr + row64, at, mask=live)
        tl.store(s_reverse_ptr + at64, row, mask=live)
        pos += tl.sum(n, axis=0)
    zero = tl.zeros([PAD_BLOCK], dtype=tl.int64)
    step = tl.num_programs(0) * PAD_BLOCK
    for i0 in range(total + tl.program_id(0) * PAD_BLOCK, P, step):
        i = i0 + tl.arange(0, PAD_BLOCK)
        pad = i < P
        tl.store(tok_ptr + i, zero + T, mask=pad)
        tl.store(exp_ptr + i, zero + E, mask=pad)
        tl.store(out_ptr + i, zero.to(out_ptr.dtype.element_ty), mask=pad)
        tl.store(order_ptr + i, zero - 1, mask=pad)
        tl.store(x_gather_ptr + i, (zero + T - 1).to(tl.int32), mask=pad)
        tl.store(s_scatter_ptr + i, i, mask=pad)
        tl.store(s_reverse_ptr + i, i, mask=pad)
    if b == 0:
        for j0 in range(0, E + 1, PAD_BLOCK):
            j = j0 + tl.arange(0, PAD_BLOCK)
            at_e = tl.load(scan_ptr + T + 1 + j, mask=j <= E, other=0)
            tl.store(expert_offsets_ptr + j, at_e - total, mask=j <= E)


@triton.jit
def _decode_backward_kernel(grad_ptr, order_ptr, dscores_ptr, ddense_ptr, P, TK, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < P
    o = tl.load(order_ptr + i, mask=ok, other=-1)
    g = tl.load(grad_ptr + i, mask=ok, other=0.0)
    kept = (o >= 0) & (o < TK)
    added = o >= TK
    tl.store(dscores_ptr + o, g.to(dscores_ptr.dtype.element_ty), mask=kept)
    tl.store(ddense_ptr + (o - TK), g.to(ddense_ptr.dtype.element_ty), mask=added)


class _RoundedScores(torch.autograd.Function):
    """Rounded routed flags -> (token, expert, score) per pair, token-major and padded to P, and the experts'
    metadata of those pairs; gradients back to the routing scores / dense probs."""

    @staticmethod
    def forward(ctx, scores_TK, dense_TE, routed_ET, scan, prefix, P):
        (T, K), E = scores_TK.shape, routed_ET.shape[0]
        device = scores_TK.device
        tok = torch.empty(P, dtype=torch.int64, device=device)
        exp = torch.empty_like(tok)
        order = torch.empty_like(tok)
        out = torch.empty(P, dtype=torch.float32, device=device)  # cast by torch (round to nearest)
        expert_offsets = torch.empty(E + 1, dtype=torch.int32, device=device)
        x_gather = torch.empty(P, dtype=torch.int32, device=device)
        s_scatter = torch.empty_like(x_gather)
        s_reverse = torch.empty_like(x_gather)
        be = min(triton.next_power_of_2(E), _PLACE_EXPERTS)
        _place_kernel[(triton.cdiv(T, _PLACE_TOKENS),)](
            routed_ET,
            scan,
            prefix,
            scores_TK,
            dense_TE,
            tok,
            exp,
            out,
            order,
            expert_offsets,
            x_gather,
            s_scatter,
            s_reverse,
            P,
            T,
            E,
            K=K,
            BT=_PLACE_TOKENS,
            BE=be,
            PAD_BLOCK=64,
        )
        ctx.set_materialize_grads(False)  # no zero gradients for the index outputs
        ctx.save_for_backward(order)
        ctx.shapes = (scores_TK.shape, scores_TK.dtype, dense_TE.shape, dense_TE.dtype)
        ctx.mark_non_differentiable(tok, exp, expert_offsets, x_gather, s_scatter, s_reverse)
        return tok, exp, out, expert_offsets, x_gather, s_scatter, s_reverse

    @staticmethod
    def backward(ctx, _gt, _ge, grad_P, *_meta):
        if grad_P is None:  # the scores reached no loss
            return None, None, None, None, None, None
        (order_P,) = ctx.saved_tensors
        (T, K), s_dtype, (_, E), d_dtype = ctx.shapes
        d_scores = torch.zeros(T, K, dtype=s_dtype, device=grad_P.device)
        d_dense = torch.zeros(T, E, dtype=d_dtype, device=grad_P.device)
        P = grad_P.numel()
        _decode_backward_kernel[(triton.cdiv(P, 1024),)](
            grad_P.contiguous(), order_P, d_scores, d_dense, P, T * K, BLOCK=1024
        )
        return d_scores, d_dense, None, None, None, None


def round_local_triton(routing: TopKRouting, dense_TE: torch.Tensor, num_experts: int, mode: str, tile: int):
    """``round_local`` on CUDA (see the module docstring); T, K >= 1, scores and dense probs of at most 32 bits,
    2P < 2^31. The rounded ``FlatRouting`` carries the experts' metadata of its pairs."""
    idx_TK = routing.indices_TK.contiguous()
    scores_TK = routing.scores_TK.contiguous()
    dense_TE = dense_TE.contiguous()
    T, K = idx_TK.shape
    E, device = num_experts, idx_TK.device
    W = min(tile - 1, T)
    key_ET = torch.empty(E, T, dtype=torch.int32, device=device)
    routed_ET = torch.empty(E, T, dtype=torch.int8, device=device)
    # One int32 scan for both offsets: [0, pairs of token 0.., T-1 | 0, rows of expert 0.., E-1]. The experts' part
    # comes out shifted by the tokens' total (the placing kernel subtracts it).
    scan = torch.empty(T + E + 2, dtype=torch.int32, device=device)
    prefix_EB = torch.empty(E, triton.cdiv(T, _PLACE_TOKENS), dtype=torch.int32, device=device)
    BE = min(triton.next_power_of_2(E), _KEYS_EXPERTS)
    BT = _KEYS_TOKENS * _KEYS_EXPERTS // BE
    _keys_kernel[(triton.cdiv(T, BT), triton.cdiv(E, BE))](
        idx_TK, scores_TK, dense_TE, key_ET, routed_ET, scan, T, E, K=K, BT=BT, BE=BE
    )
    block = max(min(triton.next_power_of_2(T), _MAX_BLOCK), _PLACE_TOKENS)
    # Warps per expert: H100, _select_kernel alone at (T, E) = (8192, 256) / (16384, 256) / (16384, 128), before it
    # counted its row and the tokens' pairs: 4 warps 0.021 / 0.043 / 0.026 ms, 8 warps 0.027 / 0.045 / 0.023, 16
    # warps 0.029 / 0.045 / 0.023 (int64 keys took 0.027-0.036 / 0.057-0.065 / 0.029-0.036). With the counting, on
    # the warps chosen here: 0.024 / 0.050 / 0.025.
    _select_kernel[(E,)](
        key_ET,
        routed_ET,
        scan,
        prefix_EB,
        T,
        MODE=_MODES[mode],
        TILE=tile,
        T_BITS=max(int(T - 1).bit_length(), 1),
        BT=block,
        NUM_CHUNKS=triton.cdiv(T, block),
        PB=_PLACE_TOKENS,
        num_warps=8 if block > 8192 else 4,
    )
    scan.cumsum_(0)
    P = T * K + E * W
    tok_P, exp_P, score_P, *meta = _RoundedScores.apply(scores_TK, dense_TE, routed_ET, scan, prefix_EB, P)
    token_offsets = scan[: T + 1]
    # every target is a multiple of the tile: the experts' GEMMs may take tiles that the rows fill exactly
    metadata = RoutingMetadata(*meta, token_offsets=token_offsets, rows_multiple=tile)
    return FlatRouting(
        tok_P, exp_P, score_P.to(scores_TK.dtype), T, padded=True, token_offsets=token_offsets, metadata=metadata
    )
