"""Token rounding without expert parallelism in four Triton launches and a scan, no sort (``rounding.round_local``
on CUDA; ``rounding.round_local_torch`` is the reference and the CPU path, with the same pairs, order and scores).
The rounded routing comes with the experts' metadata of its pairs (``FlatRouting.metadata``), so the experts skip
their own metadata kernels.

Shape legend: T tokens, K experts per token, E experts, W = min(tile - 1, T) the most pairs an expert adds,
P = T*K + E*W the padded pair count (``rounded_pairs_bound``), B = ceil(T / 8) blocks of the placing kernel.

1. ``_keys_kernel`` (grid: token blocks x expert blocks): one int32 key per (expert, token), [E, T]: a routed
   pair's key orders like the reverse of its routing score (the weakest pair is the largest key), a non-routed
   one's like its dense router probability; an int8 flag per (expert, token), [E, T]: 1 + the pair's top-K slot,
   0 where the token did not route to the expert; each token's pair count, K, into the scan buffer.
2. ``_select_kernel`` (grid: experts): the expert's routed count f_e (its row of flags), its target t_e
   (``rounding.TargetRule``), n = |t_e - f_e| and the n largest keys among its routed tokens (drop, t_e < f_e) or its
   non-routed ones (add), ties to the lower token: the cut is (thr, cut) = key and token of the n-th, found bit by
   bit over the keys as uint32 (held in registers for rows of up to ``_MAX_BLOCK`` tokens, else re-read per pass),
   from the bits that the side's largest and smallest keys share, and stopping at the first threshold with
   exactly n keys at or above it. The cut pairs' flags change (0 for a dropped pair, -1 for an added one) and so
   do their tokens' pair counts (integer atomics). An expert with nothing to cut does not read its keys. It
   writes t_e into the scan buffer and, per block of 8 tokens, its pairs before the block ([E, B]).
3. One in-place scan (``cumsum_``) of the buffer [0, the tokens' pair counts | 0, the experts' row counts] gives
   every token's offset (which the rounded ``FlatRouting`` carries) and every expert's, shifted by the total.
4. ``_place_kernel`` (grid: token blocks): each token's pairs at its offset in ascending expert order, the order
   of the reference's (token, expert) sort: token, expert and where its score comes from (a kept pair's top-K
   slot, read from its flag; an added pair's dense index); and each pair's row among its expert's rows (ascending
   token order: the metadata ``compute_metadata`` would build). Its programs then fill the rest of the P pairs
   with padding (token T, expert E).
5. ``_scores_kernel`` (grid: pair blocks): each pair's score from where it comes from: a kept pair's routing
   score, an added pair's dense probability. The backward (``_decode_backward_kernel``) writes each gradient to
   the one score it came from (every pair is unique: plain stores, deterministic).

No sort: a sort of the kept and added pairs' keys in place of the scan and the placing kernel was measured slower.
Each kernel's GPU time and the variants that did not pay: docs/PERF.md ("Token rounding", "Tried, did not pay").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels.routing import FlatRouting, RoutingMetadata, TopKRouting
from .rounding import TARGET_RULES, RoundingMode

_MAX_BLOCK = 32768  # the longest row that _select_kernel's search holds in registers
# tokens per step of _select_kernel's other passes over its row: streaming the row in steps leaves the registers to
# the search's keys; the whole row at once (more registers) and shorter steps were measured slower
_STREAM_BLOCK = 4096
# _keys_kernel's program: 32 experts x 128 tokens, tokens fastest (the [E, T] stores' order), 4 warps: the fastest
# of the tilings measured, among them tokens x experts tiles in the dense read's order
_KEYS_TOKENS, _KEYS_EXPERTS, _KEYS_WARPS = 128, 32, 4
# _place_kernel's program: 8 tokens x 32 experts per step on one warp (tokens x experts, warps): as fast as the
# best of the larger tilings measured over the token and expert counts tried
_PLACE_TOKENS, _PLACE_EXPERTS, _PLACE_WARPS = 8, 32, 1


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
    counts_ptr,
    T,
    E,
    K: tl.constexpr,
    BT: tl.constexpr,
    BE: tl.constexpr,
    COUNT: tl.constexpr,
):
    # Tiles are [experts, tokens], tokens fastest: the order of the [E, T] stores (the dense load is the
    # transposed read). The first expert block also starts the token offsets in the scan buffer: 0, then K pairs
    # per token (the cut adds or takes one per pair it changes). COUNT (expert parallelism): each expert's routed
    # count is added into counts [E], and the routed (token, expert) pairs less the pairs naming an expert in range
    # into counts[E + 1] (nonzero: a token names an expert twice); integer atomics.
    t = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    e = tl.program_id(1) * BE + tl.arange(0, BE)
    t_ok = t < T
    ok = (e < E)[:, None] & t_ok[None, :]
    key = _ordered(tl.load(dense_ptr + t[None, :] * E + e[:, None], mask=ok, other=0.0))
    slot = tl.zeros([BE, BT], dtype=tl.int32)  # 1 + the pair's top-K slot; 0: not routed
    in_range = tl.zeros([BT], dtype=tl.int32)  # the token's pairs naming an expert in [0, E)
    for k in tl.static_range(K):
        ek = tl.load(idx_ptr + t * K + k, mask=t_ok, other=-1)
        in_range += ((ek >= 0) & (ek < E)).to(tl.int32)
        sk = _ordered(tl.load(scores_ptr + t * K + k, mask=t_ok, other=0.0))
        hit = ek[None, :] == e[:, None]
        slot = tl.where(hit, k + 1, slot)
        key = tl.where(hit, ~sk[None, :], key)
    tl.store(key_ptr + e[:, None].to(tl.int64) * T + t[None, :], key, mask=ok)
    tl.store(routed_ptr + e[:, None].to(tl.int64) * T + t[None, :], slot.to(tl.int8), mask=ok)
    if COUNT:
        per_expert = tl.sum((slot > 0).to(tl.int64), axis=1)
        tl.atomic_add(counts_ptr + e, per_expert, mask=e < E, sem="relaxed")
        routed = tl.sum(per_expert, axis=0)
        if tl.program_id(1) == 0:  # the pairs naming an expert in range, once per token
            routed -= tl.sum(in_range.to(tl.int64), axis=0)
        tl.atomic_add(counts_ptr + E + 1, routed, sem="relaxed")
        # each token's pairs as flagged (the scan starts zeroed): bad indices, which the plan's header reports,
        # then leave no pair unplaced
        tl.atomic_add(offsets_ptr + 1 + t, tl.sum((slot > 0).to(tl.int32), axis=0), mask=t_ok, sem="relaxed")
    elif tl.program_id(1) == 0:
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
def _count(keys, key_ptr, routed_ptr, want, T, cand, cmp: tl.constexpr, cut, SB: tl.constexpr, IN_REGS: tl.constexpr):
    """Keys >= cand (cmp 0), > cand (cmp 1), or == cand at tokens < cut (cmp 2): over the row in registers
    (IN_REGS, the search's own passes) or re-read SB tokens at a time."""
    total = tl.zeros([], dtype=tl.int32)
    if IN_REGS:
        total += tl.sum((keys >= cand).to(tl.int32), axis=0)  # the search: cmp 0 only
    else:
        for s0 in range(0, T, SB):
            t = s0 + tl.arange(0, SB)
            k = _row(key_ptr, routed_ptr, want, t, T)
            if cmp == 0:
                hit = k >= cand
            elif cmp == 1:
                hit = k > cand
            else:
                hit = (k == cand) & (t < cut)
            total += tl.sum(hit.to(tl.int32), axis=0)
    return total


@triton.jit
def _extremes(keys, key_ptr, routed_ptr, want, T, n, SB: tl.constexpr, IN_REGS: tl.constexpr):
    """Bounds on the n largest keys of the cut's side for the search's fixed bits: the largest key, and the
    smallest nonzero one (0 if fewer than n keys are nonzero: a zero key reads like the tokens off the side)."""
    if IN_REGS:
        hi = tl.max(keys, axis=0)
        lo = tl.min(tl.where(keys != 0, keys, 4294967295), axis=0)
        nonzero = tl.sum((keys != 0).to(tl.int32), axis=0)
    else:
        hi = tl.zeros([], dtype=tl.uint32)
        lo = tl.full([], 4294967295, tl.uint32)
        nonzero = tl.zeros([], dtype=tl.int32)
        for s0 in range(0, T, SB):
            k = _row(key_ptr, routed_ptr, want, s0 + tl.arange(0, SB), T)
            hi = tl.maximum(hi, tl.max(k, axis=0))
            lo = tl.minimum(lo, tl.min(tl.where(k != 0, k, 4294967295), axis=0))
            nonzero += tl.sum((k != 0).to(tl.int32), axis=0)
    return hi, tl.where(nonzero >= n, lo, 0).to(tl.uint32)


@triton.jit
def _block_prefixes(live, s0, carry, prefix_ptr, NB, SB: tl.constexpr, PB: tl.constexpr):
    """Store the expert's pairs before each block of PB tokens of the SB tokens from s0 (carry: before s0) into
    its row of prefix [E, NB]; returns the carry past them. Sums per block, then a scan over the blocks."""
    per_block = tl.sum(tl.reshape(live.to(tl.int32), [SB // PB, PB]), axis=1)
    b = s0 // PB + tl.arange(0, SB // PB)
    tl.store(prefix_ptr + b, carry + tl.cumsum(per_block, axis=0) - per_block, mask=b < NB)
    return carry + tl.sum(per_block, axis=0)


@triton.jit
def _target(
    f,
    total,
    UP_PAST_HALF_TILES: tl.constexpr,
    TIES_TO_EVEN: tl.constexpr,
    KEEP_ONE_TILE: tl.constexpr,
    TILE: tl.constexpr,
):
    """The mode's target for an expert's routed count f (``rounding.TargetRule``, whose constants these are); a
    target above the ``total`` tokens available falls back to the multiple below."""
    lo = (f // TILE) * TILE
    twice_r = 2 * (f - lo)
    up = twice_r > UP_PAST_HALF_TILES * TILE
    if TIES_TO_EVEN:
        up = up | ((twice_r == UP_PAST_HALF_TILES * TILE) & ((lo // TILE) % 2 == 1))
    if KEEP_ONE_TILE:
        up = up | ((lo == 0) & (f > 0))
    target = tl.where(up, lo + TILE, lo)
    return tl.where(target > total, lo, target)


@triton.jit
def _search_cut(
    row_key, row_routed, want, n, T, T_BITS: tl.constexpr, BT: tl.constexpr, IN_REGS: tl.constexpr, SB: tl.constexpr
):
    """(thr, cut): the n largest keys (0 < n <= the side's size) of the row's side ``want`` (True: its routed
    tokens, False: the others), ties to the lower token, are the keys > thr and those == thr at tokens <= cut."""
    cut = tl.zeros([], dtype=tl.int32) - 1
    keys = tl.zeros([], dtype=tl.uint32)  # unused unless in registers
    if IN_REGS:
        keys = _row(row_key, row_routed, want, tl.arange(0, BT), T)
    # The search fixes thr bit by bit from the top: thr | bit stays if at least n keys are >= it. Bits where
    # the side's largest and smallest keys agree are fixed from those two (n <= the side's size), and the
    # search stops at the first candidate with exactly n keys at or above it: those are the n largest, with
    # no tie across the cut (about half the passes of a search over all 32 bits on random routings).
    hi, lo_key = _extremes(keys, row_key, row_routed, want, T, n, SB, IN_REGS)
    bit = tl.full([], 2147483648, tl.uint32)
    while (bit != 0) & ((bit & (hi ^ lo_key)) == 0):
        bit = bit >> 1
    # the common prefix (bit 0: every key is hi); the bits above `bit` by an xor with an unsigned all-ones
    # constant, not `~`: Triton's interpreter fills `~`'s all-ones operand of an unsigned type with -1, which
    # some Triton releases reject under numpy 2
    thr = tl.where(bit == 0, hi, hi & ((bit | (bit - 1)) ^ 0xFFFFFFFF))
    exact = n < 0
    while bit != 0:
        cand = thr | bit
        above = _count(keys, row_key, row_routed, want, T, cand, 0, 0, SB, IN_REGS)
        if above >= n:
            thr = cand
        exact = above == n
        bit = tl.where(exact, 0, bit >> 1).to(tl.uint32)
    if exact:  # the keys >= thr are the cut: the last token of any key
        cut = tl.zeros([], dtype=tl.int32) + T
    elif _count(keys, row_key, row_routed, want, T, thr, 0, 0, SB, False) == n:  # every tie taken
        for s0 in range(0, T, SB):
            t = s0 + tl.arange(0, SB)
            k = _row(row_key, row_routed, want, t, T)
            cut = tl.maximum(cut, tl.max(tl.where(k == thr, t, -1), axis=0))
    else:  # ties straddle the cut: the need-th tie in token order
        need = n - _count(keys, row_key, row_routed, want, T, thr, 1, 0, SB, False)
        p = tl.zeros([], dtype=tl.int32)
        for i in range(T_BITS):
            cand_t = p | (1 << (T_BITS - 1 - i))
            if _count(keys, row_key, row_routed, want, T, thr, 2, cand_t, SB, False) < need:
                p = cand_t
        cut = p
    return thr, cut


@triton.jit
def _apply_cut(
    row_key, row_routed, offsets_ptr, row_prefix, NB, want, delta, thr, cut, T, SB: tl.constexpr, PB: tl.constexpr
):
    """The cut pairs' new status in the routed flags (0 for a dropped pair, -1 for an added one) and their tokens'
    pair counts (integer atomics: exact in any order); every block's pairs before it. Returns the row's pairs
    after the cut."""
    status = tl.where(delta > 0, -1, 0).to(tl.int8)
    step = tl.where(delta > 0, 1, -1)
    carry = tl.zeros([], dtype=tl.int32)
    for s0 in range(0, T, SB):
        t = s0 + tl.arange(0, SB)
        routed = tl.load(row_routed + t, mask=t < T, other=0) > 0
        k = (tl.load(row_key + t, mask=t < T, other=0) ^ -2147483648).to(tl.uint32, bitcast=True)
        sel = (routed == want) & ((k > thr) | ((k == thr) & (t <= cut))) & (t < T)
        live = (routed != sel) & (t < T)  # a cut pair flips: a dropped one was routed, an added one was not
        tl.store(row_routed + t, status + tl.zeros([SB], dtype=tl.int8), mask=sel)
        tl.atomic_add(offsets_ptr + 1 + t, step + tl.zeros([SB], dtype=tl.int32), mask=sel, sem="relaxed")
        carry = _block_prefixes(live, s0, carry, row_prefix, NB, SB, PB)
    return carry


@triton.jit
def _keep_row(row_routed, row_prefix, NB, T, SB: tl.constexpr, PB: tl.constexpr):
    """The row as top-K routed it: its blocks' pairs only. Returns the row's pairs."""
    carry = tl.zeros([], dtype=tl.int32)
    for s0 in range(0, T, SB):
        t = s0 + tl.arange(0, SB)
        live = tl.load(row_routed + t, mask=t < T, other=0) > 0
        carry = _block_prefixes(live, s0, carry, row_prefix, NB, SB, PB)
    return carry


@triton.jit
def _expert_rows(key_ptr, routed_ptr, prefix_ptr, e, T, PB: tl.constexpr):
    """Expert e's rows of the per-expert kernels: (its keys [T], its routed flags [T], the placing kernel's block
    count NB, its block prefixes [NB])."""
    NB = tl.cdiv(T, PB)
    e64 = e.to(tl.int64)
    return key_ptr + e64 * T, routed_ptr + e64 * T, NB, prefix_ptr + e64 * NB


@triton.jit
def _select_kernel(
    key_ptr,
    routed_ptr,
    offsets_ptr,
    prefix_ptr,
    T,
    UP_PAST_HALF_TILES: tl.constexpr,
    TIES_TO_EVEN: tl.constexpr,
    KEEP_ONE_TILE: tl.constexpr,
    TILE: tl.constexpr,
    T_BITS: tl.constexpr,
    BT: tl.constexpr,
    IN_REGS: tl.constexpr,
    SB: tl.constexpr,
    PB: tl.constexpr,
):
    # Only the search keeps the row in registers (IN_REGS: T <= BT; else its passes re-read it, SB tokens at a
    # time): the other passes stream SB tokens at a time, which leaves the registers to the keys, so that rows
    # of up to 32768 tokens fit on 16 warps (with [T] vectors in every pass, longer rows than half that had to be
    # re-read per pass, much slower).
    e = tl.program_id(0)
    row_key, row_routed, NB, row_prefix = _expert_rows(key_ptr, routed_ptr, prefix_ptr, e, T, PB)
    f = tl.zeros([], dtype=tl.int32)  # the expert's routed count
    for s0 in range(0, T, SB):
        t = s0 + tl.arange(0, SB)
        f += tl.sum((tl.load(row_routed + t, mask=t < T, other=0) > 0).to(tl.int32), axis=0)
    target = _target(f, T, UP_PAST_HALF_TILES, TIES_TO_EVEN, KEEP_ONE_TILE, TILE)
    tl.store(offsets_ptr + T + 2 + e, target)  # the expert's rows, scanned after the tokens' counts
    delta = target - f
    n = tl.abs(delta)
    want = delta < 0  # drop: among the routed tokens; add: among the others
    if n > 0:  # else nothing to cut: the keys are not even read
        thr, cut = _search_cut(row_key, row_routed, want, n, T, T_BITS, BT, IN_REGS, SB)
        _apply_cut(row_key, row_routed, offsets_ptr, row_prefix, NB, want, delta, thr, cut, T, SB, PB)
    else:
        _keep_row(row_routed, row_prefix, NB, T, SB, PB)


@triton.jit
def _place_kernel(
    routed_ptr,
    scan_ptr,
    prefix_ptr,
    tok_ptr,
    exp_ptr,
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
    """Each token's pairs at its offset, in ascending expert order, with where each one's score comes from (order):
    a kept pair (flag 1 + its top-K slot) its routing score (the slot's flat index), an added one (flag -1) its dense
    probability (T*K + its dense index); and each pair's row among its expert's rows (the expert's offset + its pairs
    before this block of BT tokens + those before the token inside the block), which gives the experts' metadata.
    Positions and the scan are int32 (2P < 2^31), addresses int64. The programs also fill the pairs past the last
    token's with padding (token T, expert E, order -1: score 0; row = pair, gathering token T - 1), PAD_BLOCK at a
    time each; program 0 writes the experts' offsets. (The scores are read by ``_scores_kernel``: gathering them
    here took the kernel to its register limit, with spills, and made it slower.)"""
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
        n = live.to(tl.int32)
        at = pos[None, :] + tl.cumsum(n, axis=0) - 1
        base = tl.load(scan_ptr + T + 1 + e, mask=e_ok, other=0) - total
        # the cut kernel's block prefixes [E, NB]: NB = this grid's size (blocks of BT = its PB tokens)
        base += tl.load(prefix_ptr + e.to(tl.int64) * tl.num_programs(0) + b, mask=e_ok, other=0)
        row = base[:, None] + tl.cumsum(n, axis=1) - n
        slot = t64[None, :] * K + (r - 1)
        dense_at = t64[None, :] * E + e[:, None]
        at64 = at.to(tl.int64)
        tl.store(tok_ptr + at64, t64[None, :] + tl.zeros([BE, BT], dtype=tl.int64), mask=live)
        tl.store(exp_ptr + at64, e[:, None].to(tl.int64) + tl.zeros([BE, BT], dtype=tl.int64), mask=live)
        tl.store(order_ptr + at64, tl.where(kept, slot, T * K + dense_at).to(order_ptr.dtype.element_ty), mask=live)
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
        tl.store(order_ptr + i, (zero - 1).to(order_ptr.dtype.element_ty), mask=pad)
        tl.store(x_gather_ptr + i, (zero + T - 1).to(tl.int32), mask=pad)
        tl.store(s_scatter_ptr + i, i, mask=pad)
        tl.store(s_reverse_ptr + i, i, mask=pad)
    if b == 0:
        for j0 in range(0, E + 1, PAD_BLOCK):
            j = j0 + tl.arange(0, PAD_BLOCK)
            at_e = tl.load(scan_ptr + T + 1 + j, mask=j <= E, other=0)
            tl.store(expert_offsets_ptr + j, at_e - total, mask=j <= E)


@triton.jit
def _scores_kernel(order_ptr, scores_ptr, dense_ptr, out_ptr, P, TK, BLOCK: tl.constexpr):
    """Each pair's score from where its order says it came from (padding: 0)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < P
    o = tl.load(order_ptr + i, mask=ok, other=-1).to(tl.int64)
    kept = (o >= 0) & (o < TK)
    added = o >= TK
    s = tl.load(scores_ptr + o, mask=kept, other=0.0).to(tl.float32)
    s = tl.where(added, tl.load(dense_ptr + (o - TK), mask=added, other=0.0).to(tl.float32), s)
    tl.store(out_ptr + i, s.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _decode_backward_kernel(grad_ptr, order_ptr, dscores_ptr, ddense_ptr, P, TK, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = i < P
    o = tl.load(order_ptr + i, mask=ok, other=-1).to(tl.int64)
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
        # int32 where every order fits (T * (K + E) < 2^31): a narrower store in the placing kernel
        order = torch.empty(P, dtype=torch.int32 if T * (K + E) < 2**31 else torch.int64, device=device)
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
            tok,
            exp,
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
            num_warps=_PLACE_WARPS,
        )
        _scores_kernel[(triton.cdiv(P, 1024),)](order, scores_TK, dense_TE, out, P, T * K, BLOCK=1024)
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
    idx_TK, scores_TK, dense_TE = routing.indices_TK.contiguous(), routing.scores_TK.contiguous(), dense_TE.contiguous()
    T, K = idx_TK.shape
    E = num_experts
    key_ET, routed_ET, scan, prefix_EB = row_buffers(T, E, idx_TK.device)
    launch_keys(idx_TK, scores_TK, dense_TE, key_ET, routed_ET, scan)
    rule = TARGET_RULES[RoundingMode(mode)]
    _select_kernel[(E,)](
        key_ET,
        routed_ET,
        scan,
        prefix_EB,
        T,
        UP_PAST_HALF_TILES=rule.up_past_half_tiles,
        TIES_TO_EVEN=rule.ties_to_even,
        KEEP_ONE_TILE=rule.keep_one_tile,
        TILE=tile,
        **row_pass_args(T),
    )
    # every target is a multiple of the tile: the experts' GEMMs may take tiles that the rows fill exactly
    return rounded_routing(scores_TK, dense_TE, routed_ET, scan, prefix_EB, E, tile, rows_multiple=tile)


def row_buffers(T: int, E: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(key_ET int32, routed_ET int8, scan int32 [T + E + 2], prefix_EB int32 [E, B]) for the kernels: one int32
    scan serves both offsets, [0, pairs of token 0.., T-1 | 0, rows of expert 0.., E-1]; the experts' part comes
    out shifted by the tokens' total (the placing kernel subtracts it)."""
    key_ET = torch.empty(E, T, dtype=torch.int32, device=device)
    routed_ET = torch.empty(E, T, dtype=torch.int8, device=device)
    scan = torch.empty(T + E + 2, dtype=torch.int32, device=device)
    prefix_EB = torch.empty(E, triton.cdiv(T, _PLACE_TOKENS), dtype=torch.int32, device=device)
    return key_ET, routed_ET, scan, prefix_EB


def launch_keys(idx_TK, scores_TK, dense_TE, key_ET, routed_ET, scan, counts=None) -> None:
    """``_keys_kernel`` over [T, K] routing (T >= 1); ``counts`` (int64 [E + 2], expert parallelism): each expert's
    routed count is added into counts[:E], the distinct routed pairs less the pairs in range into counts[E + 1], and
    each token's flagged pairs into the scan, which must start zeroed."""
    (T, K), E = idx_TK.shape, key_ET.shape[0]
    BE = min(triton.next_power_of_2(E), _KEYS_EXPERTS)
    BT = _KEYS_TOKENS * _KEYS_EXPERTS // BE
    _keys_kernel[(triton.cdiv(T, BT), triton.cdiv(E, BE))](
        idx_TK,
        scores_TK,
        dense_TE,
        key_ET,
        routed_ET,
        scan,
        scan if counts is None else counts,
        T,
        E,
        K=K,
        BT=BT,
        BE=BE,
        COUNT=counts is not None,
        num_warps=_KEYS_WARPS,
    )


def row_pass_args(T: int) -> dict:
    """The per-expert kernels' row-pass arguments (``_search_cut``'s block, register and streaming choices)."""
    block = max(triton.next_power_of_2(T), _PLACE_TOKENS)
    return dict(
        T_BITS=max(int(T - 1).bit_length(), 1),
        BT=min(block, _MAX_BLOCK),
        IN_REGS=block <= _MAX_BLOCK,
        SB=min(block, _STREAM_BLOCK),
        PB=_PLACE_TOKENS,
        num_warps=16 if block > 16384 else (8 if block > 8192 else 4),
    )


def rounded_routing(scores_TK, dense_TE, routed_ET, scan, prefix_EB, E: int, tile: int, rows_multiple: int = 0):
    """The scan, then the padded ``FlatRouting`` of the cut flags (``rounded_pairs_bound`` pairs) with the experts'
    metadata of its pairs (``rows_multiple``: what every expert's row count is a multiple of, 0 if nothing)."""
    T, K = scores_TK.shape
    scan.cumsum_(0)
    P = T * K + E * min(tile - 1, T)
    tok_P, exp_P, score_P, *meta = _RoundedScores.apply(scores_TK, dense_TE, routed_ET, scan, prefix_EB, P)
    token_offsets = scan[: T + 1]
    metadata = RoutingMetadata(*meta, token_offsets=token_offsets, rows_multiple=rows_multiple)
    return FlatRouting(
        tok_P, exp_P, score_P.to(scores_TK.dtype), T, padded=True, token_offsets=token_offsets, metadata=metadata
    )
