"""Distributed-checkpoint layout of the stacked Sonic expert weights, identical to Megatron's
SequentialMLP / TEGroupedMLP keys so that checkpoints move between them and across EP and ETP sizes.

Shape legend: E global experts, El = E / EP local experts, F expert ffn size, Fr = F / ETP this rank's share
(expert tensor parallelism), H hidden size, G = 2F (GLU).

Local parameters (what ``kernels/`` computes with):   weight1 [El, 2Fr, H] ([gate_r ; up_r]),  weight2 [El, H, Fr].
Checkpoint tensors (prefix = the experts module's prefix, e.g. ``decoder.layers.0.mlp.experts.``):
    ``{prefix}experts.linear_fc1.weight``  global [E, G, H]; axis 0 = expert (EP-sharded, one shard per
                                            expert); axis 1 ETP-sharded, with GLU in 2 x ETP shards: gate_r is
                                            shard r of 2 ETP, up_r shard ETP + r (Megatron's
                                            ``apply_swiglu_sharded_factory``)
    ``{prefix}experts.linear_fc2.weight``  global [E, H, F]; axis 2 ETP-sharded (RowParallel fc2)
    ``{prefix}experts.linear_fc{1,2}._extra_state``  empty ShardedObjects, global shape (E,), so that a
                                            SequentialMLP can load a Sonic checkpoint (it asks for them)
Replica id (0, 0, expert-DP rank) for the weights and (0, ETP rank, expert-DP rank) for the extra states, as
SequentialMLP. With ``metadata['singleton_local_shards']`` each expert gets its own key
``{prefix}experts.{e}.linear_fc1.weight`` (GLU: ``..._w`` / ``..._v``, each in ETP shards).
Unlike 0.16's GroupedMLP no transpose is involved (the layouts already agree), so optimizer states are
interchangeable too when the optimizer keeps them per parameter (``flattened_range`` is not supported).

Saving with ``dist_checkpointing.save`` (torch_dist) needs ``psutil`` on megatron-core 0.16.1 .. 0.19.2 (its
writer process dies without it and the save hangs); without psutil call
``sonic_megatron.megatron_compat.allow_checkpoint_save_without_psutil()`` first.
"""

from __future__ import annotations

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint


def stacked_experts_sharded_state_dict(
    module,
    prefix: str,
    sharded_offsets: tuple = (),
    metadata: dict | None = None,
) -> dict:
    """Sharded state dict of a module holding ``weight1``/``weight2`` stacked over its local experts
    (``module.num_local_experts``, ``module.ep_group``, ``module.dp_group``, ``module.gated``, and its share of
    the ffn dimension ``module.etp_rank`` of ``module.etp_size``: ``experts.init_stacked_weights``)."""
    singleton = bool((metadata or {}).get("singleton_local_shards", False))
    ep_size, ep_rank = module.ep_group.size(), module.ep_group.rank()
    tp_size, tp_rank = module.etp_size, module.etp_rank
    num_local = module.num_local_experts
    num_global = num_local * ep_size
    first = ep_rank * num_local
    replica_id = (0, 0, module.dp_group.rank())
    n_pre = len(sharded_offsets)

    def expert_offsets(global_idx: int) -> tuple:
        if singleton:
            return tuple(sharded_offsets)
        return (*sharded_offsets, (n_pre, global_idx, num_global))

    def expert_key(key: str, global_idx: int) -> str:
        return key.replace(f"{prefix}experts.", f"{prefix}experts.{global_idx}.") if singleton else key

    def make_build_fn(glu: bool, ffn_axis: int):
        @torch.no_grad()
        def build(key: str, t: torch.Tensor, rid, flattened_range=None):
            if flattened_range is not None:
                raise NotImplementedError(
                    "SonicExperts checkpoints do not support flattened_range (fully sharded optimizer state); "
                    "use the dp_reshardable or fully_reshardable distributed-optimizer format"
                )
            shards = []
            for e in range(num_local):
                g = first + e
                offs = expert_offsets(g)
                n_axes = len(offs)
                k = expert_key(key, g)
                if glu:
                    # singleton: gate and up under their own keys, each in ETP shards; else one key whose ffn axis
                    # holds 2 x ETP shards, all gates first
                    gate, up = torch.chunk(t[e], 2, dim=0)
                    gate_at, up_at = (tp_rank, tp_rank) if singleton else (tp_rank, tp_size + tp_rank)
                    frag = tp_size if singleton else 2 * tp_size
                    shards.append(
                        [
                            ShardedTensor.from_rank_offsets(
                                f"{k}_w" if singleton else k,
                                gate,
                                *offs,
                                (n_axes, gate_at, frag),
                                replica_id=rid,
                                prepend_axis_num=n_axes,
                            ),
                            ShardedTensor.from_rank_offsets(
                                f"{k}_v" if singleton else k,
                                up,
                                *offs,
                                (n_axes, up_at, frag),
                                replica_id=rid,
                                prepend_axis_num=n_axes,
                            ),
                        ]
                    )
                else:  # fc1 [F, H] ETP-sharded on its rows, fc2 [H, F] on its columns
                    shards.append(
                        ShardedTensor.from_rank_offsets(
                            k,
                            t[e],
                            *offs,
                            (n_axes + ffn_axis, tp_rank, tp_size),
                            replica_id=rid,
                            prepend_axis_num=n_axes,
                        )
                    )
            return shards

        return build

    def make_merge_fn(glu: bool):
        @torch.no_grad()
        def merge(sub_state_dict):
            per_expert = [torch.cat(list(s), dim=0) if glu else s for s in sub_state_dict]
            return torch.stack(per_expert, dim=0)

        return merge

    out = {}
    for name, mod, glu, ffn_axis in (
        ("weight1", "linear_fc1", module.gated, 0),
        ("weight2", "linear_fc2", False, 1),
    ):
        param = getattr(module, name)
        out[f"{prefix}{name}"] = ShardedTensorFactory(
            f"{prefix}experts.{mod}.weight",
            param,
            make_build_fn(glu, ffn_axis),
            make_merge_fn(glu),
            replica_id,
        )
    # Empty extra states where SequentialMLP has its linear layers' ones (it requests them on load); replicated
    # over the ETP group, whose rank 0 writes them.
    extra_replica = (0, tp_rank, module.dp_group.rank())
    for e in range(num_local):
        g = first + e
        for mod in ("linear_fc1", "linear_fc2"):
            key = f"{prefix}experts.{g}.{mod}._extra_state" if singleton else f"{prefix}experts.{mod}._extra_state"
            out[f"{prefix}expert{g}.{mod}._extra_state"] = make_sharded_object_for_checkpoint(
                None, key, expert_offsets(g), extra_replica
            )
    return out


def drop_extra_state_keys(module, incompatible_keys) -> None:
    """load_state_dict post-hook: the fake ``_extra_state`` entries come back as unexpected keys."""
    for key in list(incompatible_keys.unexpected_keys):
        if "_extra_state" in key:
            incompatible_keys.unexpected_keys.remove(key)


def modules_holding_weight_grads(model) -> list[str]:
    """Names of the Sonic experts modules of ``model`` that still hold weight-gradient work: a micro-batch's work
    waiting for its pair (``SonicConfig.pair_weight_grads``) or work recorded for ``backward_dw()``
    (``delay_wgrad_compute``). Such work belongs to the iteration in flight and is in no state dict, so a
    checkpoint is only consistent where this is empty: between iterations, after Megatron's
    ``finalize_model_grads_func`` (``sonic_megatron.wgrad.FinalizeAfterHeldWeightGrads``) and ``backward_dw()``
    ran. Trainers check it before saving."""
    names = []
    for name, module in model.named_modules():
        sink = getattr(module, "wgrad", None)
        if sink is None or not hasattr(sink, "num_pending"):
            continue
        if getattr(sink, "_held", None) is not None or sink.num_pending:
            names.append(name)
    return names
