"""Checkpoints move between Megatron's SequentialMLP experts and SonicExperts and across EP sizes, losing
nothing. A checkpoint here is what dist_checkpointing writes -- every main-replica ShardedTensor of the
layer's sharded_state_dict (factories applied) placed at its global offset -- gathered over gloo into
global tensors, and loading fills each rank's sharded tensors from them and merges the factories, as
dist_checkpointing.load does, so that this test sees every shard; the real checkpoint directories
(dist_checkpointing.save/load, torch_dist) are tested in test_megatron_checkpoint_files.py. Chain:
stock EP=4 -> Sonic EP=2 -> Sonic EP=1 -> stock EP=4 and stock EP=2, with the values compared against the
global weights after every load; and the Sonic sharded state dict has exactly SequentialMLP's keys, global
shapes and per-expert offsets."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sonic_megatron.testing import local_moe_weights

E, H, F = 8, 32, 48


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


@torch.no_grad()
def _set_global(layer, rank_ep, ep):
    w1, w2, r = _global_weights()
    n = E // ep
    sl = slice(rank_ep * n, (rank_ep + 1) * n)
    ex = layer.experts
    if hasattr(ex, "local_experts"):
        for i, e in enumerate(ex.local_experts):
            e.linear_fc1.weight.copy_(w1[sl][i])
            e.linear_fc2.weight.copy_(w2[sl][i])
    else:
        ex.weight1.copy_(w1[sl])
        ex.weight2.copy_(w2[sl])
    layer.router.weight.copy_(r)


def _check_global(layer, rank_ep, ep, what):
    w1, w2, r = _global_weights()
    n = E // ep
    sl = slice(rank_ep * n, (rank_ep + 1) * n)
    l1, l2, lr = local_moe_weights(layer)
    for name, got, want in (("fc1", l1, w1[sl]), ("fc2", l2, w2[sl]), ("router", lr, r)):
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
                out.setdefault(it.key, []).append([list(it.global_shape), list(it.global_offset)])
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


def _worker(rank, world, tmp):
    from megatron.core import parallel_state as ps

    from sonic_megatron.testing import init_model_parallel

    report = {}
    stores = {}
    chain = [
        ("stock", 4, "save", "a"),
        ("sonic", 2, "load", "a"),
        ("sonic", 2, "save", "b"),
        ("sonic", 1, "load", "b"),
        ("sonic", 1, "save", "c"),
        ("stock", 4, "load", "c"),
        ("stock", 2, "load", "b"),
    ]
    for kind, ep, op, name in chain:
        init_model_parallel(ep=ep)
        layer = _layers(kind)
        er = ps.get_expert_model_parallel_rank()
        if op == "save":
            if kind == "stock":
                _set_global(layer, er, ep)
            else:
                _load(layer, stores[{"b": "a", "c": "b"}[name]])
            _save(layer, stores.setdefault(name, {}))
        else:
            _load(layer, stores[name])
            _check_global(layer, er, ep, f"{kind} EP={ep} from checkpoint {name}")
            report[f"{kind}@ep{ep}<-{name}"] = "ok"
    for ep in (1, 2, 4):
        init_model_parallel(ep=ep)
        report[f"layout@ep{ep}"] = [_sharded_layout(_layers("stock")), _sharded_layout(_layers("sonic"))]
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    from sonic_megatron.testing import spawn

    tmp = tmp_path_factory.mktemp("ckpt")
    spawn(_worker, 4, str(tmp), timeout=600)
    return [json.load(open(tmp / f"rank{r}.json")) for r in range(4)]


@pytest.mark.slow
def test_round_trip_across_implementations_and_ep_sizes(reports):
    for rep in reports:
        for key in ("sonic@ep2<-a", "sonic@ep1<-b", "stock@ep4<-c", "stock@ep2<-b"):
            assert rep[key] == "ok", key


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_sharded_layout_matches_sequential_mlp(reports, ep):
    for rank, rep in enumerate(reports):
        stock, sonic = rep[f"layout@ep{ep}"]
        assert sorted(stock) == sorted(sonic), f"rank {rank}: keys differ"
        expert_keys = [k for k in stock if ".experts." in k]
        assert any(k.endswith("experts.experts.linear_fc1.weight") for k in expert_keys), expert_keys
        for k in stock:
            assert stock[k] == sonic[k], f"rank {rank}, {k}: {stock[k]} != {sonic[k]}"
