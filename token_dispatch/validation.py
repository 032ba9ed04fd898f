"""Input checks that give the same clear error on every rank of the EP group, without hangs.

Each rank first checks its own inputs (shapes, dtypes, devices, E % P, weights, and the experts backend's own
argument rules, ``check_backend``), catching the error instead of raising it, and writes a fixed-size int64 header
(below); checks that need the device (index ranges, duplicate pairs under rounding) are device values in the
header, never read back on their own. The plan's header all-gather carries the headers together with the split
sizes (no extra round trip, no extra host sync); then every rank compares them and, if any rank failed or the
ranks disagree, all ranks raise the same ``ValueError``. A rank raising alone would leave its peers blocked in the
next collective, so every check of an expert-parallel call that could fail on one rank only runs here, before its
first collective, and what the later steps check is decided by this header (equal on every rank) or by the split
sizes every rank knows (``sizes.check_received_pairs``).

Header fields (int64):
    0 error flag      1 T (tokens)     2 D (hidden, -1 unknown)   3 x dtype code (-1 unknown)
    4 E (experts)     5 P (group size)  6 group fingerprint        7 rounding mode code
    8 rounding tile   9 num_chunks     10 min expert index        11 max expert index
   12 token index problem (1: out of [0, T) or unsorted)           13 local experts of w1 (-1 unknown)
   14 G (w1 rows)    15 F (w2 cols)    16 activation code          17 K (-1 for flat routing)
   18 duplicate (token, expert) pairs under token rounding (1: some, 0: none, -1: not rounding)
   19 a routing row naming an expert twice: top-K 1 (some) or 0; flat the first such pair as
      token * 2^32 + expert (-1: none)
   20 routing scores dtype code (-1 unknown): their bits ride in the pair all-to-all (two int32 columns for
      float64, one otherwise) and their gradients come back in that dtype, so it must be equal on every rank
   21, 22 slots (``slots.py``: rows / pairs per (source, destination) slot of the all-to-alls launched before this
      header arrived; 0 without): every rank must have launched the same ones
Fields 10-12, 18 and 19 are computed on the device and read back in the same host copy as the split sizes.
"""

from __future__ import annotations

import torch

from ..kernels.activations import ACTIVATIONS, is_gated
from ..kernels.interface import FLOAT_DTYPES, resolve_backend
from ..kernels.routing import INDEX_DTYPES, FlatRouting, TopKRouting
from .comm import all_gather_strings

HEADER_LEN = 23
_INDEX_STAT_FIELDS = (10, 11, 12, 19)  # where ``index_stats``' values go
MIN_EXPERT_FIELD, DUPLICATE_FIELD = 10, 19  # min expert (max at + 1), a row naming an expert twice
_KEY_SHIFT = 32  # field 19's key: token << 32 | expert (indices < 2^31: int32 or in-range int64)
_NO_KEY = torch.iinfo(torch.int64).max
MAX_CHUNKS = 16  # num_chunks limit: the counts exchange has a fixed size (see plan.py)
MAX_PAIRS = 2**31 - 1  # routed / received pairs: the metadata and the kernels index rows with int32
_DTYPE_CODES = {dt: i for i, dt in enumerate(FLOAT_DTYPES)}
_DTYPE_FIELDS = (3, 20)  # shown by dtype name in errors

# Fields every rank must agree on: (index, name).
_SAME_ON_ALL_RANKS = (
    (2, "x.shape[1] (hidden size D)"),
    (3, "x.dtype"),
    (4, "num_experts"),
    (5, "group size"),
    (6, "group members"),
    (7, "rounding mode"),
    (8, "rounding tile"),
    (9, "num_chunks"),
    (13, "local experts (w1.shape[0])"),
    (14, "w1.shape[1]"),
    (15, "w2.shape[2]"),
    (16, "activation"),
    (20, "routing scores dtype"),
    (21, "row slots (the token rows' all-to-all before the plan's sync)"),
    (22, "pair slots (the pairs' all-to-all before the plan's sync)"),
)


def rounding_code(rounding) -> int:
    """Header field 7: 0 without token rounding, else 1 + the mode's place in ``rounding.ROUNDING_MODES`` (99 for
    a mode that is none of them)."""
    from .rounding import ROUNDING_MODES  # imported here: rounding.py imports this module

    mode = getattr(rounding, "mode", None)
    if mode is None:
        return 0
    return ROUNDING_MODES.index(mode) + 1 if mode in ROUNDING_MODES else 99


class EPInputError(ValueError):
    """Bad input to expert-parallel dispatch (raised on every rank of the group)."""


class SlotsTooSmall(EPInputError):
    """A call's counts past the slots its rows and pairs left in before the plan's sync (``slots.py``)."""


def fail(arg: str, expected: str, got: object) -> None:
    raise EPInputError(f"{arg} must be {expected}, got {got}")


def duplicate_pairs_message(ranks: list[int]) -> str:
    """Token rounding's error for routings that name a (token, expert) pair twice on ``ranks``."""
    return f"token rounding: the routed (token, expert) pairs of rank(s) {ranks} must be unique, got duplicates"


def dtype_code(dtype: torch.dtype | None) -> int:
    return -1 if dtype is None else _DTYPE_CODES.get(dtype, 99)


def routing_num_tokens(routing) -> int:
    if isinstance(routing, TopKRouting):
        return routing.indices_TK.shape[0] if routing.indices_TK.dim() == 2 else -1
    if isinstance(routing, FlatRouting):
        return int(routing.num_tokens)
    return -1


def check_local(
    routing,
    *,
    num_experts: int,
    group_size: int,
    rounding,
    rounding_scores_TE: torch.Tensor | None,
    x_TD: torch.Tensor | None,
    w1_EGD: torch.Tensor | None,
    w2_EDF: torch.Tensor | None,
    activation: str | None,
) -> None:
    """Raise EPInputError naming the argument, the expected and the actual value (TypeError for an argument that
    is no tensor); this rank only. The options (chunks, the activation's name, ...) were validated by
    ``EPOptions``."""
    if not isinstance(num_experts, int) or num_experts < 1:
        fail("num_experts", "a positive int", num_experts)
    if num_experts % group_size:
        fail("num_experts", f"a multiple of the EP group size P = {group_size}", num_experts)
    for name, t, what in (
        ("x", x_TD, "a 2-D tensor [T, D]"),
        ("w1", w1_EGD, "a 3-D tensor [E/P, G, D]"),
        ("w2", w2_EDF, "a 3-D tensor [E/P, D, F]"),
        ("rounding_scores_TE", rounding_scores_TE, "a 2-D tensor [T, E]"),
    ):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be {what} (a torch.Tensor), got {type(t).__name__}")
    if isinstance(routing, TopKRouting):
        s, idx = routing.scores_TK, routing.indices_TK
        if idx.dtype not in INDEX_DTYPES:
            fail("routing.indices_TK.dtype", "int32 or int64", idx.dtype)
        if idx.dim() != 2:
            fail("routing.indices_TK", "2-D [T, K]", tuple(idx.shape))
        if tuple(s.shape) != tuple(idx.shape):
            fail("routing.scores_TK.shape", f"{tuple(idx.shape)} (as indices_TK)", tuple(s.shape))
        if not 1 <= idx.shape[1] <= num_experts:
            fail("top-K (routing.indices_TK.shape[1])", f"in [1, num_experts = {num_experts}]", idx.shape[1])
        device = idx.device
        if s.device != device:
            fail("routing.scores_TK.device", f"routing.indices_TK's device ({device})", s.device)
    elif isinstance(routing, FlatRouting):
        R = routing.token_idx_R.numel()
        for name, t in (("routing.token_idx_R", routing.token_idx_R), ("routing.expert_idx_R", routing.expert_idx_R)):
            if t.dtype not in INDEX_DTYPES:
                fail(f"{name}.dtype", "int32 or int64", t.dtype)
        for name, t in (
            ("routing.token_idx_R", routing.token_idx_R),
            ("routing.expert_idx_R", routing.expert_idx_R),
            ("routing.scores_R", routing.scores_R),
        ):
            if t.dim() != 1 or t.numel() != R:
                fail(f"{name}.shape", f"[{R}] (as token_idx_R)", tuple(t.shape))
        if not isinstance(routing.num_tokens, int) or routing.num_tokens < 0:
            fail("routing.num_tokens", "an int >= 0", routing.num_tokens)
        s, device = routing.scores_R, routing.token_idx_R.device
        for name, t in (("routing.expert_idx_R", routing.expert_idx_R), ("routing.scores_R", s)):
            if t.device != device:
                fail(f"{name}.device", f"routing.token_idx_R's device ({device})", t.device)
    else:
        raise EPInputError(f"routing must be TopKRouting or FlatRouting, got {type(routing).__name__}")
    if s.dtype not in FLOAT_DTYPES:
        fail("routing scores dtype", f"one of {FLOAT_DTYPES}", s.dtype)
    if s.numel() >= MAX_PAIRS:
        fail("routed pairs (routing scores' size)", f"< {MAX_PAIRS} (int32 row indices)", s.numel())
    T = routing_num_tokens(routing)
    if x_TD is not None:
        if x_TD.dim() != 2:
            fail("x", "2-D [T, D]", tuple(x_TD.shape))
        if x_TD.dtype not in FLOAT_DTYPES:
            fail("x.dtype", f"one of {FLOAT_DTYPES}", x_TD.dtype)
        if x_TD.shape[0] != T:
            fail("x.shape[0]", f"the routing's token count {T}", x_TD.shape[0])
        if x_TD.device != device:
            fail("x.device", f"the routing's device {device}", x_TD.device)
    if activation is not None and activation not in ACTIVATIONS:
        fail("activation", f"one of {ACTIVATIONS}", repr(activation))
    if w1_EGD is not None or w2_EDF is not None:
        if w1_EGD is None or w2_EDF is None or w1_EGD.dim() != 3 or w2_EDF.dim() != 3:
            fail("w1 and w2", "3-D tensors [E/P, G, D] and [E/P, D, F]", "other shapes")
        E_loc = num_experts // group_size
        if w1_EGD.shape[0] != E_loc:
            fail(
                "w1.shape[0] (local experts)",
                f"num_experts / P = {num_experts} / {group_size} = {E_loc}",
                w1_EGD.shape[0],
            )
        if w2_EDF.shape[0] != E_loc:
            fail("w2.shape[0] (local experts)", f"{E_loc}", w2_EDF.shape[0])
        if x_TD is not None:
            for name, w in (("w1", w1_EGD), ("w2", w2_EDF)):
                if w.dtype != x_TD.dtype:  # either may be the wrong one: both named
                    fail(f"x.dtype and {name}.dtype", "equal", f"{x_TD.dtype} and {w.dtype}")
                if w.device != x_TD.device:
                    fail(f"x.device and {name}.device", "equal", f"{x_TD.device} and {w.device}")
            if w1_EGD.shape[2] != x_TD.shape[1]:
                fail("w1.shape[2]", f"x.shape[1] = {x_TD.shape[1]}", w1_EGD.shape[2])
            if w2_EDF.shape[1] != x_TD.shape[1]:
                fail("w2.shape[1]", f"x.shape[1] = {x_TD.shape[1]}", w2_EDF.shape[1])
        F = w2_EDF.shape[2]
        G = 2 * F if (activation is not None and is_gated(activation)) else F
        if w1_EGD.shape[1] != G or F == 0:
            fail("w1.shape[1]", f"{G} (w2.shape[2] = {F}, activation {activation!r})", w1_EGD.shape[1])
    if rounding is not None:
        if rounding_scores_TE is None:
            fail("rounding_scores_TE", "the dense router probabilities [T, E] when rounding is set", None)
        if tuple(rounding_scores_TE.shape) != (T, num_experts):
            fail("rounding_scores_TE.shape", f"[T, E] = {(T, num_experts)}", tuple(rounding_scores_TE.shape))
        if not rounding_scores_TE.is_floating_point():
            fail("rounding_scores_TE.dtype", "floating point", rounding_scores_TE.dtype)
        if rounding_scores_TE.device != device:  # rounding's all-gather comes before the header: no fault there
            fail("rounding_scores_TE.device", f"the routing's device {device}", rounding_scores_TE.device)


def check_backend(backend: str, x_TD: torch.Tensor | None, w1_EGD, w2_EDF, activation: str) -> None:
    """Resolve the experts backend on x's device and run its own argument rules (the ``cute`` backend's dtypes,
    16-byte rows, contiguous weights: ``check_supported``) on this rank's x and weights, as EPInputError. Run in
    the plan, before the first collective: where the experts' GEMMs run, these errors would stop this rank alone
    between all-to-alls its peers wait in (and a node that cannot load the backend fails here too). Without x
    and the weights there is nothing to check."""
    if x_TD is None or w1_EGD is None or w2_EDF is None:
        return
    try:
        check = getattr(resolve_backend(backend, x_TD.device), "check_supported", None)
        if check is not None:
            check(x_TD, w1_EGD, w2_EDF, activation)
    except (RuntimeError, ValueError) as exc:
        raise EPInputError(str(exc)) from exc


def header(*, index_stats: list | None, duplicate_pairs: torch.Tensor | None = None, device: torch.device, **fields):
    """The int64 header of this rank (fields in the module docstring) on ``device``, as pieces whose
    concatenation is the header (the caller concatenates them with the split sizes in one launch).
    ``index_stats``: ``index_stats``' list; ``duplicate_pairs``: 0-d device flag of rounding's duplicate check;
    ``fields``: ``header_host``'s."""
    error = fields["error"]
    stats = index_stats if index_stats is not None and not error else [-1] * len(_INDEX_STAT_FIELDS)
    on_device = dict(zip(_INDEX_STAT_FIELDS, stats, strict=True))
    on_device[18] = -1 if duplicate_pairs is None or error else duplicate_pairs
    host = header_host(**fields, device_fields={i: (v if isinstance(v, int) else -1) for i, v in on_device.items()})
    # Built on the host and copied without a stream sync: pinned memory, so the copy is truly asynchronous (a
    # pageable or blocking H2D copy may wait for the GPU's queue).
    h = torch.tensor(host, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    parts, start = [], 0
    for i, v in sorted(on_device.items()):
        if isinstance(v, torch.Tensor):  # computed on the device: spliced in by the caller's concatenation
            parts += [h[start:i], v.reshape(1)]
            start = i + 1
    return [*parts, h[start:]]


def header_host(
    *,
    error: bool,
    num_tokens: int,
    x_TD: torch.Tensor | None,
    num_experts: int,
    group_size: int,
    fingerprint: int,
    rounding,
    num_chunks: int,
    w1_EGD: torch.Tensor | None,
    w2_EDF: torch.Tensor | None,
    activation: str | None,
    top_k: int,
    scores_dtype: torch.dtype | None,
    slots=None,
    device_fields: dict[int, int] | None = None,
) -> list[int]:
    """The header's fields as host ints: the device-computed ones (10-12, 18, 19) as given in ``device_fields``
    (keyed by field number; -1 where not given), to be overwritten on the device where the caller computes them."""
    vals = {
        0: int(error),
        1: num_tokens,
        2: -1 if x_TD is None or x_TD.dim() != 2 else x_TD.shape[1],
        3: -1 if x_TD is None else dtype_code(x_TD.dtype),
        4: num_experts if isinstance(num_experts, int) else -1,
        5: group_size,
        6: fingerprint,
        7: rounding_code(rounding),
        8: getattr(rounding, "tile", -1),
        9: num_chunks if isinstance(num_chunks, int) else -1,
        13: -1 if w1_EGD is None or w1_EGD.dim() != 3 else w1_EGD.shape[0],
        14: -1 if w1_EGD is None or w1_EGD.dim() != 3 else w1_EGD.shape[1],
        15: -1 if w2_EDF is None or w2_EDF.dim() != 3 else w2_EDF.shape[2],
        16: -1 if activation is None else (ACTIVATIONS.index(activation) if activation in ACTIVATIONS else 99),
        17: top_k,
        20: dtype_code(scores_dtype),
        # 0, not -1 ("unknown"): a rank without slots must differ from one with
        21: slots.rows if slots is not None else 0,
        22: slots.pairs if slots is not None else 0,
    }
    host = [-1] * HEADER_LEN
    for i, v in vals.items():
        host[i] = v
    for i, v in (device_fields or {}).items():
        host[i] = v
    return host


def check_headers(headers_PH, local_error: str | None, group, num_experts: int) -> None:
    """Compare all ranks' headers (a host int list of lists) and raise the same EPInputError on every rank."""
    P = len(headers_PH)
    if any(h[0] for h in headers_PH):
        msgs = all_gather_strings(local_error or "", group)
        bad = "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m)
        raise EPInputError(f"expert-parallel dispatch: bad input on {bad}")
    problems = []
    for idx, name in _SAME_ON_ALL_RANKS:
        vals = [h[idx] for h in headers_PH]
        known = {v for v in vals if v != -1}
        if len(known) > 1:
            shown = ", ".join(_shown(idx, v) for v in vals)
            problems.append(f"{name} differs between ranks: [{shown}] (per rank; must be the same on every rank)")
    duplicates = []
    for r, h in enumerate(headers_PH):
        lo, hi = h[10], h[11]
        bad_experts = h[12] != -1 and (lo < 0 or hi >= num_experts)  # h[12] == -1: this rank has no pairs
        if bad_experts:
            problems.append(
                f"rank {r}: routing expert indices must be in [0, num_experts = {num_experts}), "
                f"got values in [{lo}, {hi}]"
            )
        if h[12] == 1:
            problems.append(f"rank {r}: routing.token_idx_R must be sorted ascending with values in [0, T = {h[1]})")
        # Rounding ran on indices clamped into range: duplicates mean something only where the indices are good.
        if h[18] == 1 and not bad_experts and h[12] != 1:
            duplicates.append(r)
        if h[19] not in (-1, 0) and not bad_experts and h[12] != 1:
            problems.append(f"rank {r}: {duplicate_row_message(h[19], h[17])}")
    if duplicates:
        problems.append(duplicate_pairs_message(duplicates))
    if problems:
        raise EPInputError(
            "expert-parallel dispatch: ranks disagree or bad input: " + "; ".join(problems) + f" (group of {P} ranks)"
        )


def _shown(field: int, value: int) -> str:
    """A header value as an error shows it: dtype fields by the dtype's name."""
    if field in _DTYPE_FIELDS and 0 <= value < len(FLOAT_DTYPES):
        return str(FLOAT_DTYPES[value])
    return str(value)


def duplicate_row_message(value: int, top_k: int) -> str:
    """The error for header field 19: for top-K routing (``top_k`` K) a flag, for flat routing (``top_k`` -1) the
    key token << 32 | expert of the first pair named twice."""
    if top_k != -1:
        return (
            f"routing.indices_TK must name K = {top_k} different experts in every row (a token routes to an expert "
            "once), got a row that names one expert twice"
        )
    token, expert = value >> _KEY_SHIFT, value & ((1 << _KEY_SHIFT) - 1)
    return (
        f"the pairs of token {token} (routing.token_idx_R, routing.expert_idx_R) must be unique (a token routes to "
        f"an expert once), got expert {expert} twice"
    )


def index_stats(token_idx_R: torch.Tensor, expert_idx_R: torch.Tensor, num_tokens: int, flat: bool) -> list:
    """[min expert, max expert, token problem flag, duplicate pairs] (header fields 10, 11, 12, 19): 0-d
    int64/bool device tensors (no host sync) or host ints (all -1 for no pairs; flag 0 for top-K routing, whose
    tokens are 0..T-1 by construction). The last, meaningful where the indices are in range: for top-K routing 1
    where a row names an expert twice, else 0; for flat routing the smallest key token << 32 | expert of a pair
    named twice, -1 for none."""
    if expert_idx_R.numel() == 0:
        return [-1, -1, -1, -1]
    exp = expert_idx_R.long()
    lo, hi = exp.aminmax()
    if not flat:
        return [lo, hi, 0, _first_duplicate_topk(exp, num_tokens)]
    t = token_idx_R.long()
    problem = (t.min() < 0) | (t.max() >= num_tokens) | (t[1:] < t[:-1]).any()
    if exp.numel() < 2:
        return [lo, hi, problem, -1]
    keys = ((t << _KEY_SHIFT) + exp).sort().values
    return [lo, hi, problem, _first_key(keys[1:], keys[1:] == keys[:-1])]


def _first_duplicate_topk(exp_R: torch.Tensor, T: int):
    """Field 19 of a top-K routing (pairs t * K + k): 1 where some row names an expert twice, else 0, on the
    device. A flag rather than the row: the check runs on every expert-parallel call, so it costs as few launches
    as it can (a row sort, one compare, one reduction); the error names the rule and the rank."""
    K = exp_R.numel() // T
    if K < 2:
        return -1
    sorted_TK = exp_R.reshape(T, K).sort(dim=1).values
    return (sorted_TK[:, 1:] == sorted_TK[:, :-1]).any()


def _first_key(keys: torch.Tensor, duplicate: torch.Tensor) -> torch.Tensor:
    first = torch.where(duplicate, keys, _NO_KEY).amin()
    return torch.where(first == _NO_KEY, -1, first)
