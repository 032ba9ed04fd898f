"""Bad input to moe_experts raises before computing, with a message naming the argument, the expected
and the actual value (kernels/interface.py::validate_inputs and resolve_backend)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from sonic_megatron.kernels import FlatRouting, TopKRouting, moe_experts, torch_backend

T, D, F, E, K = 6, 8, 3, 4, 2


def _good(activation: str = "swiglu") -> dict:
    g = torch.Generator().manual_seed(71)
    G = 2 * F if activation in ("swiglu", "geglu") else F
    return dict(
        x=torch.randn(T, D, generator=g),
        scores=torch.rand(T, K, generator=g) + 0.1,
        indices=torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]]),
        w1=torch.randn(E, G, D, generator=g),
        w2=torch.randn(E, D, F, generator=g),
        activation=activation,
        backend="torch",
    )


def _flat(**over) -> FlatRouting:
    args = dict(
        token_idx_R=torch.tensor([0, 0, 2, 3, 5]),
        expert_idx_R=torch.tensor([1, 3, 0, 2, 2]),
        scores_R=torch.rand(5) + 0.1,
        num_tokens=T,
    )
    args.update(over)
    return FlatRouting(**args)


def _call(a: dict, routing=None, **kwargs):
    routing = routing if routing is not None else TopKRouting(a["scores"], a["indices"])
    return moe_experts(a["x"], routing, a["w1"], a["w2"], activation=a["activation"], backend=a["backend"], **kwargs)


def _topk(**over):
    a = _good()
    a.update(over)
    return a, None


def _with_flat(**over):
    return _good(), _flat(**over)


meta = torch.device("meta")  # another device without a GPU

# (id, (inputs, flat routing or None), regex parts that must all appear in the message)
BAD = [
    ("activation", _topk(activation="swish"), ["activation", "swiglu", "'swish'"]),
    ("x_1d", _topk(x=torch.randn(D)), ["x must be a 2-D tensor", r"\(8,\)"]),
    ("x_3d", _topk(x=torch.randn(1, T, D)), ["x must be a 2-D tensor", r"\(1, 6, 8\)"]),
    ("x_not_tensor", _topk(x=[[1.0] * D] * T), ["x must be a 2-D tensor", "list"]),
    ("x_int", _topk(x=torch.ones(T, D, dtype=torch.int32)), ["x.dtype", "float", "torch.int32"]),
    (
        "D0",
        _topk(x=torch.randn(T, 0), w1=torch.randn(E, 2 * F, 0), w2=torch.randn(E, 0, F)),
        [r"x.shape\[1\]", "> 0", "got 0"],
    ),
    ("w1_2d", _topk(w1=torch.randn(2 * F, D)), ["w1 must be a 3-D tensor", r"\(6, 8\)"]),
    ("w2_4d", _topk(w2=torch.randn(1, E, D, F)), ["w2 must be a 3-D tensor", r"\(1, 4, 8, 3\)"]),
    (
        "w1_dtype",
        _topk(w1=torch.randn(E, 2 * F, D, dtype=torch.float64)),
        ["w1.dtype", "torch.float32", "torch.float64"],
    ),
    ("w2_dtype", _topk(w2=torch.randn(E, D, F, dtype=torch.bfloat16)), ["w2.dtype", "torch.float32", "torch.bfloat16"]),
    ("w1_device", _topk(w1=torch.empty(E, 2 * F, D, device=meta)), ["w1.device", "cpu", "meta"]),
    ("w2_device", _topk(w2=torch.empty(E, D, F, device=meta)), ["w2.device", "cpu", "meta"]),
    ("E0", _topk(w1=torch.randn(0, 2 * F, D), w2=torch.randn(0, D, F)), [r"w1.shape\[0\]", ">= 1", "got 0"]),
    ("E_mismatch", _topk(w2=torch.randn(E + 1, D, F)), [r"w2.shape\[0\]", r"w1.shape\[0\] = 4", "got 5"]),
    ("w1_D", _topk(w1=torch.randn(E, 2 * F, D + 1)), [r"w1.shape\[2\]", r"x.shape\[1\] = 8", "got 9"]),
    ("w2_D", _topk(w2=torch.randn(E, D + 2, F)), [r"w2.shape\[1\]", r"x.shape\[1\] = 8", "got 10"]),
    (
        "w1_not_2F_gated",
        _topk(w1=torch.randn(E, F, D)),
        [r"w1.shape\[1\]", "2 \\* w2.shape\\[2\\] = 6", "'swiglu'", "got 3"],
    ),
    ("w1_2F_not_gated", _topk(activation="relu2"), [r"w1.shape\[1\]", r"w2.shape\[2\] = 3", "'relu2'", "got 6"]),
    ("F0", _topk(w1=torch.randn(E, 0, D), w2=torch.randn(E, D, 0)), [r"w1.shape\[1\]", r"\(> 0\)", "got 0"]),
    (
        "indices_float",
        _topk(indices=torch.zeros(T, K)),
        ["routing.indices_TK.dtype", "int32 or int64", "torch.float32"],
    ),
    ("indices_1d", _topk(indices=torch.zeros(T * K, dtype=torch.long)), ["routing.indices_TK", "2-D", r"\(12,\)"]),
    ("scores_shape", _topk(scores=torch.rand(T, K + 1)), ["routing.scores_TK", r"\(6, 2\)", r"\(6, 3\)"]),
    (
        "indices_rows",
        _topk(indices=torch.zeros(T + 1, K, dtype=torch.long), scores=torch.rand(T + 1, K)),
        [r"routing.indices_TK.shape\[0\]", r"x.shape\[0\] = 6", "got 7"],
    ),
    (
        "K_gt_E",
        _topk(indices=torch.zeros(T, E + 1, dtype=torch.long), scores=torch.rand(T, E + 1)),
        ["top-K", r"\[1, E = 4\]", "got 5"],
    ),
    (
        "K0",
        _topk(indices=torch.zeros(T, 0, dtype=torch.long), scores=torch.rand(T, 0)),
        ["top-K", r"\[1, E = 4\]", "got 0"],
    ),
    (
        "scores_int",
        _topk(scores=torch.ones(T, K, dtype=torch.long)),
        ["routing scores dtype", "floating point", "torch.int64"],
    ),
    ("scores_device", _topk(scores=torch.empty(T, K, device=meta)), ["routing scores.device", "cpu", "meta"]),
    (
        "indices_device",
        _topk(indices=torch.empty(T, K, dtype=torch.long, device=meta)),
        ["routing expert indices.device", "cpu", "meta"],
    ),
    (
        "expert_negative",
        _topk(indices=torch.tensor([[0, 1]] * 5 + [[-1, 2]])),
        ["routing expert indices", r"\[0, E = 4\)", r"\[-1, 2\]"],
    ),
    (
        "expert_too_big",
        _topk(indices=torch.tensor([[0, 1]] * 5 + [[4, 2]])),
        ["routing expert indices", r"\[0, E = 4\)", r"\[0, 4\]"],
    ),
    (
        "flat_token_dtype",
        _with_flat(token_idx_R=torch.tensor([0.0, 0, 2, 3, 5])),
        ["routing.token_idx_R.dtype", "int32 or int64", "torch.float32"],
    ),
    (
        "flat_expert_dtype",
        _with_flat(expert_idx_R=torch.tensor([1, 3, 0, 2, 2], dtype=torch.int16)),
        ["routing.expert_idx_R.dtype", "int32 or int64", "torch.int16"],
    ),
    (
        "flat_token_2d",
        _with_flat(token_idx_R=torch.tensor([[0, 0, 2, 3, 5]])),
        ["routing.token_idx_R", "1-D", r"\(1, 5\)"],
    ),
    (
        "flat_expert_length",
        _with_flat(expert_idx_R=torch.tensor([1, 3, 0, 2])),
        ["routing.expert_idx_R", "length 5", r"\(4,\)"],
    ),
    ("flat_scores_length", _with_flat(scores_R=torch.rand(6)), ["routing.scores_R", "length 5", r"\(6,\)"]),
    ("flat_num_tokens", _with_flat(num_tokens=T + 1), ["routing.num_tokens", r"x.shape\[0\] = 6", "got 7"]),
    (
        "flat_token_too_big",
        _with_flat(token_idx_R=torch.tensor([0, 0, 2, 3, 6])),
        ["routing.token_idx_R", r"\[0, T = 6\)", r"\[0, 6\]"],
    ),
    (
        "flat_token_negative",
        _with_flat(token_idx_R=torch.tensor([-1, 0, 2, 3, 5])),
        ["routing.token_idx_R", r"\[0, T = 6\)", r"\[-1, 5\]"],
    ),
    (
        "flat_unsorted",
        _with_flat(token_idx_R=torch.tensor([0, 2, 0, 3, 5])),
        ["routing.token_idx_R", "sorted ascending", "unsorted"],
    ),
    (
        "flat_offsets_length",
        _with_flat(token_offsets=torch.tensor([0, 2, 2, 3, 4, 5])),
        ["routing.token_offsets", r"length T \+ 1 = 7", r"\(6,\)"],
    ),
    (
        "flat_offsets_dtype",
        _with_flat(token_offsets=torch.tensor([0.0, 2, 2, 3, 4, 4, 5])),
        ["routing.token_offsets.dtype", "int32 or int64", "float32"],
    ),
    (
        "flat_offsets_values",
        _with_flat(token_offsets=torch.tensor([0, 2, 2, 3, 4, 4, 4])),
        ["routing.token_offsets", "CSR offsets"],
    ),
    (
        "flat_expert_too_big",
        _with_flat(expert_idx_R=torch.tensor([1, 3, 0, 2, 7])),
        ["routing expert indices", r"\[0, E = 4\)", r"\[0, 7\]"],
    ),
    (
        "flat_token_device",
        _with_flat(token_idx_R=torch.empty(5, dtype=torch.long, device=meta)),
        ["routing.token_idx_R.device", "cpu", "meta"],
    ),
    ("backend", _topk(backend="cuda"), ["backend", "'auto', 'torch', 'cute'", "'cuda'"]),
]


@pytest.mark.parametrize("inputs,parts", [pytest.param(b[1], b[2], id=b[0]) for b in BAD])
def test_bad_input_raises_value_error_naming_it(inputs, parts, monkeypatch):
    a, routing = inputs
    ran = []
    monkeypatch.setattr(torch_backend, "forward", lambda *args, **kw: ran.append(1))
    with pytest.raises(ValueError) as info:
        _call(a, routing)
    msg = str(info.value)
    for part in parts:
        assert re.search(part, msg), f"{part!r} not in message {msg!r}"
    assert not ran, "validation must happen before any computation"


def test_good_inputs_pass():
    """The fixtures above differ from valid input only in the field each case breaks."""
    a = _good()
    assert _call(a).shape == (T, D)
    assert _call(a, _flat()).shape == (T, D)
    assert _call(_good("relu2")).shape == (T, D)


def test_routing_of_wrong_type_raises_type_error():
    a = _good()
    with pytest.raises(TypeError, match="routing must be TopKRouting or FlatRouting, got tuple"):
        _call(a, (a["scores"], a["indices"]))


def test_check_indices_false_skips_the_host_read(monkeypatch):
    """check_indices=False (the GPU default) must not read index values back; a bad value then is the
    caller's responsibility (here PyTorch's own index check catches it)."""
    a = _good()
    bad = TopKRouting(a["scores"], torch.tensor([[0, 1]] * 5 + [[9, 2]]))
    with pytest.raises(ValueError, match="routing expert indices"):
        _call(a, bad)
    with pytest.raises((IndexError, RuntimeError)) as info:
        _call(a, bad, check_indices=False)
    assert "moe_experts" not in str(info.value)


def test_cute_backend_on_cpu_says_why():
    a = _good()
    a["backend"] = "cute"
    with pytest.raises(RuntimeError, match="backend='cute' cannot run: .*cpu.*CUDA GPU"):
        _call(a)


@pytest.mark.filterwarnings("ignore:sonic_megatron.kernels")
def test_auto_backend_on_cpu_uses_torch(monkeypatch):
    """``backend`` is the argument alone: the layer's SONIC_MEGATRON_BACKEND (a SonicConfig option) is not read."""
    monkeypatch.setenv("SONIC_MEGATRON_BACKEND", "cute")
    a = _good()
    a["backend"] = "auto"
    assert torch.equal(_call(a), _call(_good()))


def test_flat_routing_with_its_offsets_gives_the_same_output():
    """A FlatRouting that carries its CSR offsets (token rounding's) computes what the same routing without them
    does (the offsets found by a binary search)."""
    a, flat = _good(), _flat()
    offsets = torch.tensor([0, 2, 2, 3, 4, 4, 5], dtype=torch.int32)
    assert torch.equal(_call(a, flat), _call(a, dataclasses.replace(flat, token_offsets=offsets)))
