"""Every Triton kernel of the project compiled for Hopper (sm_90) down to a cubin, on any machine: Triton's front end
and ptxas (bundled with Triton) run without a GPU. The interpreter tests check what the kernels compute; this
catches what only the compiler rejects (a constexpr branch, a helper's types, a bitcast of the wrong width) before a
GPU sees the code.

How: the public entry points run once on small CPU inputs under the interpreter (``_drive``) while every launch's
kernel, argument types and constexpr values are recorded; a child process without TRITON_INTERPRET (under it
``triton.jit`` gives functions that cannot be compiled) compiles each distinct launch, as its generic variant (the
JIT's integer and alignment specializations are not reproduced). Every kernel of ``KERNELS`` must have been launched:
a new kernel must be driven here too."""

import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available() and __name__ != "__main__":  # the compiling child runs without it
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

# (module under sonic_megatron, kernel): every @triton.jit kernel the project launches
KERNELS = {
    ("kernels.triton.shared_softmax", "_shared_softmax_bwd_kernel"),
    ("kernels.triton.topk_softmax", "_topk_softmax_fwd_kernel"),
    ("kernels.triton.topk_softmax", "_topk_softmax_bwd_kernel"),
    ("kernels.triton.gather_sum", "_gather_sum_kernel"),
    ("kernels.triton.metadata", "_tile_rank_kernel"),
    ("kernels.triton.metadata", "_tile_scan_kernel"),
    ("kernels.triton.metadata", "_expert_scan_kernel"),
    ("kernels.triton.metadata", "_scatter_kernel"),
    ("kernels.triton.bf16_split", "_split3_kernel"),
    ("kernels.triton.wgrad_merge", "_merge_rows_kernel"),
    ("token_dispatch.triton_round", "_keys_kernel"),
    ("token_dispatch.triton_round", "_select_kernel"),
    ("token_dispatch.triton_round", "_place_kernel"),
    ("token_dispatch.triton_round", "_scores_kernel"),
    ("token_dispatch.triton_round", "_decode_backward_kernel"),
    ("token_dispatch.triton_round_ep", "_candidates_kernel"),
    ("token_dispatch.triton_round_ep", "_apply_kernel"),
    ("token_dispatch.triton_recv", "_recv_rows_keys_kernel"),
    ("token_dispatch.triton_send", "_count_kernel"),
    ("token_dispatch.triton_send", "_scan_kernel"),
    ("token_dispatch.triton_send", "_place_kernel"),
    ("token_dispatch.triton_send_csr", "_count_csr_kernel"),
    ("token_dispatch.triton_send_csr", "_place_csr_kernel"),
    ("token_dispatch.triton_slots", "_slot_layout_kernel"),
    ("token_dispatch.triton_slots", "_slotted_rows_keys_kernel"),
}

_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


def _arg_type(value):
    """Triton's signature type of a launch argument that is not a constexpr (None: a constexpr None)."""
    if isinstance(value, torch.Tensor):
        return "*" + _TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return None
    raise TypeError(f"no Triton type for {type(value).__name__}")


_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def _constexpr_params(fn) -> set:
    """The parameters of a kernel's Python function annotated ``tl.constexpr`` (a string under postponed
    annotations)."""
    import inspect

    import triton.language as tl

    def is_constexpr(a):
        return a is tl.constexpr or (isinstance(a, str) and a.split(".")[-1] == "constexpr")

    return {n for n, p in inspect.signature(fn).parameters.items() if is_constexpr(p.annotation)}


def _record_launches(log: list):
    """Patch the interpreter's ``kernel[grid]`` to append (module, kernel, signature, constexprs, options) per launch.
    Returns the undo."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.__getitem__

    def getitem(self, grid):
        launch = original(self, grid)

        def record(*args, **kwargs):
            fn = self.fn
            names = list(self.arg_names)
            constexpr = _constexpr_params(fn)
            values = dict(zip(names, args, strict=False))
            values.update({k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS})
            sig, consts = {}, {}
            for name in names:
                if name not in values:
                    continue  # a default (constexpr defaults are the kernel's own)
                v = values[name]
                t = None if name in constexpr else _arg_type(v)
                if t is None:
                    consts[name] = v
                else:
                    sig[name] = t
            options = {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs}
            log.append((fn.__module__, fn.__name__, sig, consts, options))
            return launch(*args, **kwargs)

        return record

    InterpretedFunction.__getitem__ = getitem
    return lambda: setattr(InterpretedFunction, "__getitem__", original)


def _drive():
    """Run every entry point that launches a kernel once, on small CPU inputs (interpreter)."""
    import importlib

    from sonic_megatron.kernels.routing import FlatRouting, TopKRouting, compute_metadata_torch
    from sonic_megatron.kernels.triton.wgrad_merge import merge_rows_triton
    from sonic_megatron.token_dispatch import (
        triton_recv,
        triton_round,
        triton_round_ep,
        triton_send,
        triton_send_csr,
        triton_slots,
    )

    # the package exports functions of the modules' names: the modules themselves
    bf16_split, gather_sum, metadata, shared_softmax, topk_softmax = (
        importlib.import_module(f"sonic_megatron.kernels.triton.{m}")
        for m in ("bf16_split", "gather_sum", "metadata", "shared_softmax", "topk_softmax")
    )

    g = torch.Generator().manual_seed(0)
    T, E, K, D = 24, 8, 3, 16
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(T, E, generator=g).to(dtype).requires_grad_()
        scores, idx = topk_softmax.topk_softmax(logits, K)
        scores.sum().backward()
    logits = torch.randn(T, E, generator=g, requires_grad=True)
    a, b = shared_softmax.shared_softmax(logits)
    (a.sum() + b.square().sum()).backward()
    bf16_split.split3_bf16(torch.randn(T, E, generator=g))
    probs = torch.randn(T, E, generator=g).softmax(-1)
    scores, idx = probs.topk(K, dim=-1)
    meta = metadata.compute_metadata_topk_triton(idx, E)
    tok = torch.arange(T).repeat_interleave(K)
    metadata.compute_metadata_triton(tok, idx.reshape(-1), torch.arange(0, T * K + 1, K), E)
    for dtype in (torch.float32, torch.bfloat16):
        rows = torch.randn(T * K, D, generator=g).to(dtype)
        gather_sum.gather_sum(rows, meta, scores.reshape(-1))
        gather_sum.gather_sum(rows, meta, None, pairs_per_token=K)
    m = compute_metadata_torch(tok, idx.reshape(-1), torch.arange(0, T * K + 1, K), E)
    dH, ap = torch.randn(T * K, 8, dtype=torch.bfloat16), torch.randn(T * K, 4, dtype=torch.bfloat16)
    merge_rows_triton(dH, ap, m.x_gather_idx, m.expert_offsets, dH, ap, m.x_gather_idx, m.expert_offsets, T)
    # token rounding, without and under expert parallelism (a group of one), forward and backward
    s = scores.clone().requires_grad_()
    dense = probs.clone().requires_grad_()
    rounded = triton_round.round_local_triton(TopKRouting(s, idx), dense, E, "nearest", 4)
    rounded.scores_R.sum().backward()
    result, _ = triton_round_ep.round_ep_triton(
        TopKRouting(scores, idx), probs, num_experts=E, mode="nearest", tile=4, group=None
    )
    # the expert-parallel plan's send side (top-K and token-sorted) and receive side
    for score_dtype in (torch.float32, torch.bfloat16, torch.float64):
        triton_send.ep_send_side(idx, scores.to(score_dtype), T, E // 2, 2, 2)
    side = triton_send_csr.ep_send_side_csr(result.token_offsets, result.expert_idx_R, result.scores_R, T, 4, 2, 1)
    counts = torch.zeros(2, 4 * 16, dtype=torch.int64)
    counts[:, 0], counts[:, 32] = 2, 3
    meta_QC = torch.tensor([[0, 0, 0], [1, 1, 0], [1, 2, 0]] * 2, dtype=torch.int32)
    kw = dict(rank=0, world_size=2, num_local_experts=4, num_chunks=1, pair_base=32, num_recv_rows=4)
    triton_recv.ep_recv_rows_keys(meta_QC, counts, **kw)
    triton_slots.slot_layout_triton(torch.arange(6), torch.tensor([2, 3]), 2, 3)  # the slots of a send side
    slots_kw = dict(world_size=2, num_local_experts=4, row_slots=2, pair_slots=3)  # pairs received in slots
    triton_slots.slotted_rows_keys_triton(meta_QC, torch.tensor([0, 1, 3, 6, 6, 6]), **slots_kw)
    assert isinstance(side, tuple) and isinstance(rounded, FlatRouting)


def _compile(launches: list) -> dict:
    """In the child: compile every distinct launch; {launch: "ok" or the error}."""
    import importlib

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for module, name, sig, consts, options in launches:
        fn = getattr(importlib.import_module(module), name)
        signature = {n: sig.get(n, "constexpr") for n in fn.arg_names if n in sig or n in consts}
        index = {(fn.arg_names.index(n),): v for n, v in consts.items()}
        key = f"{name} {sig} {consts} {options}"
        try:
            kernel = triton.compile(
                ASTSource(fn, signature, constexprs=index), target=GPUTarget("cuda", 90, 32), options=options
            )
            results[key] = "ok" if kernel.asm.get("cubin") else "no cubin"
        except Exception as exc:  # noqa: BLE001 - reported to the test verbatim
            results[key] = f"{type(exc).__name__}: {str(exc)[-1000:]}"
    return results


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile where they run")
def test_every_kernel_compiles_for_sm90():
    try:
        from triton.backends.nvidia import compiler as nvidia  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a Triton build without the NVIDIA backend
        pytest.skip(f"Triton's NVIDIA backend is not importable here: {exc}")
    log = []
    undo = _record_launches(log)
    try:
        _drive()
    finally:
        undo()
    launched = {(m.removeprefix("sonic_megatron."), n) for m, n, *_ in log}
    assert launched == KERNELS, ("not launched:", KERNELS - launched, "not listed:", launched - KERNELS)
    distinct = {json.dumps(entry, sort_keys=True, default=repr): entry for entry in log}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps(list(distinct.values())),
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = {k: v for k, v in results.items() if v != "ok"}
    assert not bad, bad
    assert len(results) == len(distinct)


if __name__ == "__main__":
    print(json.dumps(_compile(json.load(sys.stdin))))
