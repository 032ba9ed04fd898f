"""Checkpoints move between Megatron's SequentialMLP experts and SonicExperts and across EP sizes, losing
nothing. A checkpoint here is what dist_checkpointing writes -- every main-replica ShardedTensor of the
layer's sharded_state_dict (factories applied) placed at its global offset -- gathered over gloo into
global tensors, and loading fills each rank's sharded tensors from them and merges the factories, as
dist_checkpointing.load does, so that this test sees every shard; the real checkpoint directories
(dist_checkpointing.save/load, torch_dist) are tested in test_megatron_checkpoint_files.py. Chains (``CHAIN``):
stock EP=4 -> Sonic EP=2 -> Sonic EP=1 -> stock EP=4 and stock EP=2; with expert tensor parallelism (TP = ETP =
2) stock -> Sonic -> stock at ETP 2, Sonic ETP 2 -> ETP 1 at EP 1 and EP 4, and back to ETP 2 at EP 1 -> stock;
with ETP 2 at TP 1 (Megatron's "MoE parallel folding") Sonic TP 1 ETP 2 EP 2 <- stock TP = ETP = 2, and stock
TP 1 ETP 2 EP 1 <- it; the values compared against the global weights after every load. And the Sonic sharded
state dict has exactly SequentialMLP's keys, global shapes, per-expert and per-ETP-rank offsets and replica ids,
at EP 1, 2, 4, at TP = ETP = 2 and at TP 1 ETP 2, each with EP 1 and 2."""

from __future__ import annotations

import pytest
import torch

from sonic_megatron.compare import case_key
from sonic_megatron.testing import etp_shard, local_moe_weights

E, H, F = 8, 32, 48
# (layer, EP, TP, ETP, checkpoint it writes, checkpoint it reads): a hop that reads none sets the global weights
CHAIN = (
    ("stock", 4, 1, 1, "a", None),
    ("sonic", 2, 1, 1, "b", "a"),
    ("sonic", 1, 1, 1, "c", "b"),
    ("stock", 4, 1, 1, None, "c"),
    ("stock", 2, 1, 1, None, "b"),
    ("stock", 2, 2, 2, "e", None),
    ("sonic", 2, 2, 2, "f", "e"),
    ("stock", 2, 2, 2, None, "f"),
    ("sonic", 1, 1, 1, None, "f"),
    ("sonic", 4, 1, 1, "g", "f"),
    ("sonic", 1, 2, 2, "h", "g"),
    ("stock", 2, 2, 2, None, "h"),
    ("sonic", 2, 1, 2, "i", "e"),
    ("stock", 1, 1, 2, None, "i"),
)
# (TP, ETP, EP) of the sharded-layout comparison
LAYOUTS = ((1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 2, 1), (2, 2, 2), (1, 2, 1), (1, 2, 2))


def _global_weights():
    g = torch.Generator().manual_seed(7)
    return (
        torch.randn(E, 2 * F, H, generator=g),
        torch.randn(E, H, F, generator=g),
        torch.randn(E, H, generator=g),
    )


def _layers(kind):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from sonic_megatron.config import SonicConfig
    from sonic_megatron.layer import SonicMoELayer
    from sonic_megatron.testing import moe_config

    config = moe_config(num_moe_experts=E, hidden_size=H, moe_ffn_hidden_size=F)
    torch.manual_seed(0)
    if kind == "stock":
        from sonic_megatron.spec import moe_submodules_of

        spec = get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)
        return MoELayer(config, moe_submodules_of(spec.submodules.mlp))
    return SonicMoELayer(config, sonic_config=SonicConfig(backend="torch"))


def _local_global_weights():
    """This rank's (fc1, fc2, router) of the global weights: its EP rank's experts, its ETP rank's share."""
    from megatron.core import parallel_state as ps

    w1, w2, r = _global_weights()
    n = E // ps.get_expert_model_parallel_world_size()
    sl = slice(ps.get_expert_model_parallel_rank() * n, (ps.get_expert_model_parallel_rank() + 1) * n)
    l1, l2 = etp_shard(w1[sl], w2[sl], ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    return l1, l2, r


@torch.no_grad()
def _set_global(layer):
    w1, w2, r = _local_global_weights()
    ex = layer.experts
    if hasattr(ex, "local_experts"):
        for i, e in enumerate(ex.local_experts):
            e.linear_fc1.weight.copy_(w1[i])
            e.linear_fc2.weight.copy_(w2[i])
    else:
        ex.weight1.copy_(w1)
        ex.weight2.copy_(w2)
    layer.router.weight.copy_(r)


def _check_global(layer, what):
    for name, got, want in zip(
        ("fc1", "fc2", "router"), local_moe_weights(layer), _local_global_weights(), strict=True
    ):
        assert torch.equal(got, want), f"{what}: {name} differs after load"


def _sharded_layout(layer):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    sd = layer.sharded_state_dict(prefix="mlp.")
    out = {}
    for v in sd.values():
        items = [v]
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            items = []
            stack = [built]
            while stack:
                b = stack.pop()
                if isinstance(b, list | tuple):
                    stack.extend(b)
                elif isinstance(b, dict):
                    stack.extend(b.values())
                else:
                    items.append(b)
        for it in items:
            if isinstance(it, ShardedTensor):
                out.setdefault(it.key, []).append(
                    [list(it.global_shape), list(it.global_offset), list(it.local_shape), list(it.replica_id)]
                )
            else:
                out.setdefault(it.key, []).append([list(it.global_shape), list(it.global_offset), list(it.replica_id)])
    return {k: sorted(v) for k, v in out.items()}


def _tensors(obj):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if isinstance(obj, ShardedTensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def _index(st):
    local = (1,) * st.prepend_axis_num + tuple(st.local_shape)
    return tuple(slice(o, o + n) for o, n in zip(st.global_offset, local, strict=True)), local


def _save(layer, store):
    """Write this layer's main-replica shards into ``store`` (key -> global tensor), gathered from all ranks:
    the same sharded tensors (factories applied) that dist_checkpointing would write."""
    from megatron.core.dist_checkpointing.mapping import apply_factories

    sd = layer.sharded_state_dict(prefix="mlp.")
    apply_factories(sd)
    mine = []
    for st in _tensors(sd):
        rid = st.replica_id if isinstance(st.replica_id, tuple) else (st.replica_id,)
        if all(r == 0 for r in rid):
            mine.append((st.key, tuple(st.global_shape), _index(st), st.data.detach().clone()))
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, mine)
    store.clear()
    for items in gathered:
        for key, shape, (idx, local), data in items:
            t = store.setdefault(key, torch.full(shape, float("nan"), dtype=data.dtype))
            assert torch.isnan(t[idx]).all(), f"{key}: two main replicas wrote the same region"
            t[idx] = data.reshape(local)
    for key, t in store.items():
        assert not torch.isnan(t).any(), f"{key}: part of the global tensor was never written"


def _load(layer, store):
    """Fill this layer's sharded tensors from ``store``, merge factories as dist_checkpointing.load does,
    then load_state_dict."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        apply_factories,
        apply_factory_merges,
    )

    sd = layer.sharded_state_dict(prefix="mlp.")
    factories = {k: v for k, v in sd.items() if type(v).__name__ == "ShardedTensorFactory"}
    apply_factories(sd)

    def fill(obj):
        if isinstance(obj, ShardedTensor):
            idx, local = _index(obj)
            assert tuple(store[obj.key].shape) == tuple(obj.global_shape), obj.key
            return store[obj.key][idx].reshape(obj.local_shape).clone()
        if isinstance(obj, ShardedObject):
            return None
        if isinstance(obj, dict):
            return {k: fill(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(fill(v) for v in obj)
        return obj

    loaded = apply_factory_merges(fill(sd), factories)
    state = {k[len("mlp.") :]: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not [k for k in missing if "_extra_state" not in k], missing


def _hop_key(kind, ep, tp, etp, src):
    return f"{case_key(kind, ep, tp, etp)}<-{src}"


def _worker(rank, world):
    from sonic_megatron.testing import init_model_parallel

    report = {}
    stores = {}
    for kind, ep, tp, etp, dst, src in CHAIN:
        init_model_parallel(ep=ep, tp=tp, etp=etp)
        layer = _layers(kind)
        if src is None:
            _set_global(layer)
        else:
            _load(layer, stores[src])
            _check_global(layer, f"{kind} EP={ep} TP={tp} ETP={etp} from checkpoint {src}")
            report[_hop_key(kind, ep, tp, etp, src)] = "ok"
        if dst is not None:
            _save(layer, stores.setdefault(dst, {}))
    for tp, etp, ep in LAYOUTS:
        init_model_parallel(ep=ep, tp=tp, etp=etp)
        report[case_key("layout", ep, tp, etp)] = [_sharded_layout(_layers("stock")), _sharded_layout(_layers("sonic"))]
    return report


@pytest.fixture(scope="module")
def reports():
    from sonic_megatron.testing import spawn

    return spawn(_worker, 4, timeout=600)


@pytest.mark.slow
def test_round_trip_across_implementations_and_ep_sizes(reports):
    for rep in reports:
        for key in ("sonic@ep2<-a", "sonic@ep1<-b", "stock@ep4<-c", "stock@ep2<-b"):
            assert rep[key] == "ok", key


@pytest.mark.slow
def test_round_trip_across_expert_tensor_parallel_sizes(reports):
    """Stock ETP 2 -> Sonic ETP 2 -> stock ETP 2; Sonic ETP 2 -> ETP 1 (EP 1, EP 4) -> ETP 2 (EP 1) -> stock."""
    for rep in reports:
        for key in ("sonic@tp2ep2<-e", "stock@tp2ep2<-f", "sonic@ep1<-f", "sonic@ep4<-f", "sonic@tp2ep1<-g"):
            assert rep[key] == "ok", key
        assert rep["stock@tp2ep2<-h"] == "ok"


@pytest.mark.slow
def test_round_trip_with_expert_tensor_parallel_2_at_tensor_parallel_1(reports):
    """Stock TP = ETP = 2 -> Sonic TP 1 ETP 2 (EP 2) -> stock TP 1 ETP 2 (EP 1)."""
    for rep in reports:
        for key in ("sonic@tp1etp2ep2<-e", "stock@tp1etp2ep1<-i"):
            assert rep[key] == "ok", key


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep1", "ep2", "ep4", "tp2ep1", "tp2ep2", "tp1etp2ep1", "tp1etp2ep2"])
def test_sharded_layout_matches_sequential_mlp(reports, layout):
    for rank, rep in enumerate(reports):
        stock, sonic = rep[f"layout@{layout}"]
        assert sorted(stock) == sorted(sonic), f"rank {rank}: keys differ"
        expert_keys = [k for k in stock if ".experts." in k]
        assert any(k.endswith("experts.experts.linear_fc1.weight") for k in expert_keys), expert_keys
        for k in stock:
            assert stock[k] == sonic[k], f"rank {rank}, {k}: {stock[k]} != {sonic[k]}"
