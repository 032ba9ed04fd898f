"""Cached kernel launches (QuACK's GEMMs): per call signature, the compiled kernel and its arguments' recipe.

Why: QuACK's Python entry points (``gemm_tuned.fn`` -> ``gemm`` / ``gemm_act`` / ``gemm_dact``) spend several
times the host time of the TVM-FFI launch they wrap -- shape checks, layout permutes, a 30-field compile-cache
key, the argument NamedTuples. The expert-parallel layer is host-bound and its slowest rank's host paces every
all-to-all, and a micro-batch's forward and backward make six such calls (timings: docs/PERF.md, "Expert
parallelism").

How: the first call of a signature runs QuACK's own path while a spy on QuACK's compile-cache functions records
the compiled kernel and the exact arguments it was launched with. Each tensor among them is matched to the
call's input tensor with the same data pointer and to the view that made it (a dtype view, a leading unit dim,
a permutation: exactly one must fit, so it is the one QuACK applied); the match is checked by rebuilding every
argument from the inputs and comparing pointer, dtype, shape and strides. Later calls with the same signature
rebuild the arguments from their own tensors and call the compiled kernel directly. NamedTuples whose type is
in ``per_call`` (QuACK's scheduler options: the grid size, which follows the SM reservation, and the dynamic
tile scheduler's semaphore address) are rebuilt at every call by their builder, which must replace every field
that changes per call (an address in one is not checked: the builder owns it).

Signature = the call site's static key (GEMM kind, tile config, flags) + the first input's device index + per
input tensor None or (dtype, strides). QuACK's compile key derives from exactly these (dtypes, majors = which
stride is 1, config, flags, the optional operands present) and its kernels take sizes at run time, so one
signature means one compiled kernel and one argument recipe.

What keeps QuACK's path: a launch whose arguments hold a tensor that is none of the inputs' views (QuACK
allocated it), an int that looks like a device pointer, or not exactly one compiled-kernel call (the signature
is then never cached); and, for this call only, inputs that alias each other or are empty, or an ambiguous
permutation (a later call records instead). Results are bitwise the same either way: the same kernel on the same
arguments. The code here names nothing of QuACK (tests/test_launch_cache.py runs it against a QuACK-like fake on
the CPU). Not used by the cute backend with QuACK 0.6: recording needs QuACK's compile functions replaced for one
call, which ``kernels/cute/quack_adapter.py`` no longer does (its docstring says why).
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
from collections.abc import Callable, Sequence

import torch

_POINTER_LIKE = 2**32  # an int argument this large is likely an address (a tensor passed by data_ptr())


class _Uncacheable(Exception):
    """The launch's arguments cannot be rebuilt from the inputs (``permanent``: never for this signature)."""

    def __init__(self, why: str, permanent: bool) -> None:
        super().__init__(why)
        self.permanent = permanent


def _view_chain(t: torch.Tensor, r: torch.Tensor) -> tuple | None:
    """The ops (("view", dtype), ("unsqueeze",), ("permute", p)) that turn input ``t`` into argument ``r`` (same
    data pointer), or None. Raises (transient) if more than one permutation fits."""
    ops: list[tuple] = []
    v = t
    if v.dtype != r.dtype:
        try:
            v = v.view(r.dtype)
        except RuntimeError:
            return None
        ops.append(("view", r.dtype))
    if v.dim() + 1 == r.dim() and r.shape[0] == 1:
        v = v.unsqueeze(0)
        ops.append(("unsqueeze",))
    if v.dim() != r.dim():
        return None
    fits = [
        p
        for p in itertools.permutations(range(v.dim()))
        if tuple(v.shape[i] for i in p) == tuple(r.shape) and tuple(v.stride(i) for i in p) == r.stride()
    ]
    if not fits:
        return None
    if len(fits) > 1:
        raise _Uncacheable("ambiguous permutation", permanent=False)
    if fits[0] != tuple(range(v.dim())):
        ops.append(("permute", fits[0]))
    return tuple(ops)


def _is_namedtuple(x) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


class _Recipe:
    """How to rebuild a recorded argument tuple from new inputs. Nodes: ("c", obj) constant, ("t", index, ops)
    an input's view, ("n", type, [nodes]) a NamedTuple with inputs inside, ("p", type, obj) a per-call
    NamedTuple (rebuilt by ``per_call[type](obj, ctx)``)."""

    def __init__(self, cargs: tuple, inputs: Sequence, per_call: dict) -> None:
        by_ptr: dict[int, int] = {}
        for i, t in enumerate(inputs):
            if t is None:
                continue
            if t.numel() == 0:
                raise _Uncacheable(f"input {i} is empty", permanent=False)
            if t.data_ptr() in by_ptr:
                raise _Uncacheable(f"inputs {by_ptr[t.data_ptr()]} and {i} alias", permanent=False)
            by_ptr[t.data_ptr()] = i
        self.per_call = per_call
        self.nodes = [self._node(x, inputs, by_ptr) for x in cargs]

    def _node(self, x, inputs, by_ptr):
        if isinstance(x, torch.Tensor):
            i = by_ptr.get(x.data_ptr())
            if i is None:
                raise _Uncacheable("an argument tensor is none of the inputs", permanent=True)
            ops = _view_chain(inputs[i], x)
            if ops is None:
                raise _Uncacheable(f"no view of input {i} gives an argument", permanent=True)
            return ("t", i, ops)
        if _is_namedtuple(x) and type(x) in self.per_call:
            # Its builder rebuilds it from the recorded one at every call, replacing what changes per call
            # (grid size, a semaphore's address); a tensor inside would be the recorded call's.
            if any(isinstance(v, torch.Tensor) for v in x):
                raise _Uncacheable("a per-call argument holds a tensor", permanent=True)
            return ("p", type(x), x)
        if _is_namedtuple(x):
            kids = [self._node(v, inputs, by_ptr) for v in x]
            if all(k[0] == "c" for k in kids):
                return ("c", x)
            return ("n", type(x), kids)
        if isinstance(x, (list, dict, set)) or (isinstance(x, tuple) and not _is_namedtuple(x)):
            raise _Uncacheable(f"a {type(x).__name__} argument", permanent=True)
        if isinstance(x, int) and not isinstance(x, bool) and abs(x) >= _POINTER_LIKE:
            raise _Uncacheable("an int argument that looks like an address", permanent=True)
        return ("c", x)

    def builder(self, recorded: bool = False) -> Callable:
        """``build(inputs, ctx)`` -> the argument list. The launch's host time is the point of this module, so the
        node tree is turned into closures once here: each call fills a copy of the constant arguments with the
        few that come from the inputs. ``recorded``: per-call NamedTuples as recorded (for the check at record
        time, which must not run their builders: those may count the launch, e.g. against an SM reservation)."""
        return _fill(self.nodes, self.per_call, recorded)


def _part(node, per_call: dict, recorded: bool) -> tuple[bool, object]:
    """(True, value) for a node that is the same at every call, else (False, get(inputs, ctx))."""
    kind = node[0]
    if kind == "c":
        return True, node[1]
    if kind == "t":
        return False, _tensor_getter(node[1], node[2])
    if kind == "p":
        if recorded:
            return True, node[2]
        rebuild, recorded_value = per_call[node[1]], node[2]
        return False, lambda inputs, ctx: rebuild(recorded_value, ctx)
    cls, fill = node[1], _fill(node[2], per_call, recorded)
    return False, lambda inputs, ctx: cls(*fill(inputs, ctx))


def _fill(nodes, per_call: dict, recorded: bool) -> Callable:
    """``fill(inputs, ctx)`` -> [one value per node]: the constants copied, the rest computed."""
    parts = [_part(n, per_call, recorded) for n in nodes]
    template = [value if constant else None for constant, value in parts]
    computed = tuple((pos, get) for pos, (constant, get) in enumerate(parts) if not constant)

    def fill(inputs, ctx):
        out = template.copy()
        for pos, get in computed:
            out[pos] = get(inputs, ctx)
        return out

    return fill


def _tensor_getter(index: int, ops: tuple) -> Callable:
    """``get(inputs, ctx)`` -> inputs[index] through the recorded view ops (the common chains unrolled)."""
    if not ops:
        return lambda inputs, ctx: inputs[index]
    if len(ops) == 1:
        kind, *arg = ops[0]
        if kind == "permute":
            return lambda inputs, ctx: inputs[index].permute(arg[0])
        if kind == "unsqueeze":
            return lambda inputs, ctx: inputs[index].unsqueeze(0)
        return lambda inputs, ctx: inputs[index].view(arg[0])

    def get(inputs, ctx):
        t = inputs[index]
        for op in ops:
            if op[0] == "view":
                t = t.view(op[1])
            elif op[0] == "unsqueeze":
                t = t.unsqueeze(0)
            else:
                t = t.permute(op[1])
        return t

    return get


def _same_args(a, b) -> bool:
    """Recorded vs rebuilt argument trees: tensors equal in pointer, dtype, shape, strides; the rest identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.data_ptr(), a.dtype, tuple(a.shape), a.stride())
            == (b.data_ptr(), b.dtype, tuple(b.shape), b.stride())
        )
    if _is_namedtuple(a):
        return type(a) is type(b) and len(a) == len(b) and all(_same_args(x, y) for x, y in zip(a, b, strict=True))
    return a is b


class LaunchCache:
    """Recorded launches of the compiled kernels returned by ``compile_fns`` ((module name, attribute) pairs:
    compile-cache functions that return the compiled kernel, called at launch time through the module)."""

    def __init__(self, compile_fns: Sequence[tuple[str, str]], per_call: dict[type, Callable] | None = None):
        self.compile_fns = tuple(compile_fns)
        self.per_call = dict(per_call or {})
        self._entries: dict = {}
        self._never: set = set()
        self.stats = {"fast": 0, "recorded": 0, "slow": 0}

    def launch(self, site_key, inputs: Sequence, slow: Callable[[], object], ctx=None):
        """Run one launch: QuACK's path ``slow()`` (recorded on a signature's first call) or the cached kernel.
        ``inputs``: every tensor the launch reads or writes (None for absent operands; the first one is present
        and on the launch's device), in a fixed order per ``site_key`` (hashed at every call: keep it cheap);
        ``ctx``: passed to the per-call NamedTuple builders. Returns ``slow()``'s result on QuACK's path and None
        on the cached one (callers use their own output buffers)."""
        key = (site_key, inputs[0].get_device(), *[None if t is None else (t.dtype, t.stride()) for t in inputs])
        entry = self._entries.get(key)
        if entry is not None:
            kernel, build = entry
            kernel(*build(inputs, ctx))
            self.stats["fast"] += 1
            return None
        if key in self._never:
            self.stats["slow"] += 1
            return slow()
        return self._record(key, inputs, slow, ctx)

    def _record(self, key, inputs, slow, ctx):
        calls: list = []
        with self.spying(calls):
            result = slow()
        self.stats["slow"] += 1
        try:
            if len(calls) != 1:
                raise _Uncacheable(f"{len(calls)} compiled-kernel calls in one launch", permanent=True)
            kernel, cargs = calls[0]
            recipe = _Recipe(cargs, inputs, self.per_call)
            rebuilt = recipe.builder(recorded=True)(inputs, ctx)
            if len(rebuilt) != len(cargs) or not all(_same_args(a, b) for a, b in zip(cargs, rebuilt, strict=True)):
                raise _Uncacheable("the rebuilt arguments differ from the recorded ones", permanent=True)
        except _Uncacheable as why:
            if why.permanent:
                self._never.add(key)
            return result
        self._entries[key] = (kernel, recipe.builder())
        self.stats["recorded"] += 1
        return result

    @contextlib.contextmanager
    def spying(self, calls: list):
        """Inside: the compile-cache functions return kernels that append (kernel, arguments) to ``calls`` at
        each launch (how a signature's first call is recorded; also lets a benchmark time the bare kernel call)."""
        saved = []
        for mod_name, attr in self.compile_fns:
            module = importlib.import_module(mod_name)
            compile_fn = getattr(module, attr)
            saved.append((module, attr, compile_fn))

            def spy(*a, _compile=compile_fn, **k):
                kernel = _compile(*a, **k)

                def recording(*cargs):
                    calls.append((kernel, cargs))
                    return kernel(*cargs)

                return recording

            setattr(module, attr, spy)
        try:
            yield
        finally:
            for module, attr, compile_fn in saved:
                setattr(module, attr, compile_fn)
