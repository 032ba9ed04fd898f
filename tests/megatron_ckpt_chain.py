"""A checkpoint chain through real ``dist_checkpointing.save`` / ``load`` directories (torch_dist): stock
MoELayer (SequentialMLP) -> SonicMoELayer at other EP sizes -> stock again, checking after every load that the
expert and router weights equal the original global weights bitwise.

Used by ``tests/test_megatron_checkpoint_files.py`` (2 gloo ranks on CPU, chain EP 2 -> 1 -> 2 -> 2, and with
expert tensor parallelism ``CKPT_CHAIN_ETP_2``) and run as the GPU pass's ``ckpt`` step
(``scripts/gpu_megatron.py``) on 4 GPUs under NCCL:

    torchrun --nproc-per-node 4 tests/megatron_ckpt_chain.py --out DIR      # EP 4 -> 2 -> 1 -> 4, then ETP

Legend: E experts, H hidden size, F expert ffn size; fc1 [E, 2F, H] ([gate ; up]), fc2 [E, H, F], router [E, H].
A rank holds its EP rank's experts and, at expert tensor-parallel size ETP > 1, its ETP rank's share of their ffn
dimension (``sonic_megatron.testing.etp_shard``).
"""

from __future__ import annotations

import json
import os
import sys
import time

# Hops of the checkpoint chain: (layer kind, EP size) or (layer kind, EP size, TP = ETP size). Hop 0 sets random
# global weights and saves; every later hop loads the previous hop's checkpoint directory, checks it, and saves its
# own.
CKPT_CHAIN_4 = (("stock", 4), ("sonic", 2), ("sonic", 1), ("stock", 4))
CKPT_CHAIN_2 = (("stock", 2), ("sonic", 1), ("sonic", 2), ("stock", 2))
# stock ETP 2 -> Sonic ETP 2 -> Sonic ETP 1 (EP 1, then EP 2) -> Sonic ETP 2 -> stock ETP 2
CKPT_CHAIN_ETP_2 = (
    ("stock", 1, 2),
    ("sonic", 1, 2),
    ("sonic", 1, 1),
    ("sonic", 2, 1),
    ("sonic", 1, 2),
    ("stock", 1, 2),
)
_CKPT_E, _CKPT_H, _CKPT_F = 8, 64, 96  # experts, hidden, expert ffn: small, so that the pass stays fast


def _hop(entry) -> tuple[str, int, int]:
    """(layer kind, EP, TP = ETP) of a chain entry."""
    kind, ep, *tp = entry
    return kind, ep, tp[0] if tp else 1


def _ckpt_layer(kind: str, device):
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from sonic_megatron.config import SonicConfig
    from sonic_megatron.layer import SonicMoELayer
    from sonic_megatron.spec import moe_submodules_of
    from sonic_megatron.testing import moe_config

    # Megatron's MoE layer refuses tensor parallelism without sequence parallelism in training (the default mode)
    sp = ps.get_tensor_model_parallel_world_size() > 1
    config = moe_config(num_moe_experts=_CKPT_E, hidden_size=_CKPT_H, moe_ffn_hidden_size=_CKPT_F, sequence_parallel=sp)
    torch.manual_seed(0)  # construction-time init; every hop overwrites it by loading or by _ckpt_set_global
    if kind == "stock":
        spec = get_gpt_layer_local_spec(num_experts=_CKPT_E, moe_grouped_gemm=False)
        layer = MoELayer(config, moe_submodules_of(spec.submodules.mlp))
    else:
        layer = SonicMoELayer(config, sonic_config=SonicConfig(backend="torch"))
    return layer.to(device)


def _ckpt_global_weights():
    """fc1 [E, 2F, H] ([gate ; up]), fc2 [E, H, F], router [E, H]: random, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(2024)
    shapes = ((_CKPT_E, 2 * _CKPT_F, _CKPT_H), (_CKPT_E, _CKPT_H, _CKPT_F), (_CKPT_E, _CKPT_H))
    return tuple(torch.randn(s, generator=g) / s[-1] ** 0.5 for s in shapes)  # fan-in scaled


def _ckpt_local(layer):
    """This rank's (fc1, fc2, router) weights as float32 on the CPU."""
    from sonic_megatron.testing import local_moe_weights

    return tuple(t.float().cpu() for t in local_moe_weights(layer))


def _ckpt_expected():
    """This rank's (fc1, fc2, router) of the global weights, in Megatron's parallel state."""
    from megatron.core import parallel_state as ps

    from sonic_megatron.testing import etp_shard

    w1, w2, r = _ckpt_global_weights()
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    sl = slice(ep_rank * (_CKPT_E // ep), (ep_rank + 1) * (_CKPT_E // ep))
    w1, w2 = etp_shard(w1[sl], w2[sl], ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())
    return w1, w2, r


def _ckpt_set_global(layer) -> None:
    import torch

    w1, w2, r = _ckpt_expected()
    with torch.no_grad():
        ex = layer.experts
        if hasattr(ex, "local_experts"):
            for i, e in enumerate(ex.local_experts):
                e.linear_fc1.weight.copy_(w1[i])
                e.linear_fc2.weight.copy_(w2[i])
        else:
            ex.weight1.copy_(w1)
            ex.weight2.copy_(w2)
        layer.router.weight.copy_(r)


def _ckpt_output(layer, rank: int, device):
    """The layer's output on a fixed input (seeded per rank; tokens cross ranks in the dispatch)."""
    import torch

    g = torch.Generator().manual_seed(99 + rank)
    x = torch.randn(16, 2, _CKPT_H, generator=g).to(device)
    with torch.no_grad():
        out, _ = layer(x)
    return out.float().cpu()


def ckpt_worker(rank: int, world: int, out: str, chain=CKPT_CHAIN_4, ckpt_root: str | None = None) -> dict:
    """Run the checkpoint chain with real ``dist_checkpointing.save/load`` (torch_dist) directories under
    ``ckpt_root`` (default ``out/ckpt``; one host's ranks share it). Per hop, all-reduced over ranks: the max
    abs difference of the loaded expert and router weights from the original global weights (must be 0:
    bitwise) and of the layer output on a fixed input from hop 0's output (must be 0 on the last hop, the
    same layer kind and EP size as hop 0; Sonic hops, fp32 with another EP size and summation order, must be
    within 1e-4 of the output's magnitude). Returns the summary (the same on every rank) and writes it to
    ``out/ckpt_summary.json`` on rank 0. The process group must already exist."""
    import shutil

    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from sonic_megatron.megatron_compat import allow_checkpoint_save_without_psutil
    from sonic_megatron.testing import init_model_parallel

    allow_checkpoint_save_without_psutil()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    root = ckpt_root or os.path.join(out, "ckpt")
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()
    hops, out0 = [], None
    for i, entry in enumerate(chain):
        t0 = time.time()
        kind, ep, tp = _hop(entry)
        init_model_parallel(ep=ep, tp=tp)
        layer = _ckpt_layer(kind, device)
        hop = {"hop": i, "layer": kind, "ep": ep, "etp": tp}
        if i == 0:
            _ckpt_set_global(layer)
        else:
            src = os.path.join(root, f"hop{i - 1}")
            loaded = dist_checkpointing.load(layer.sharded_state_dict(prefix="mlp."), src)
            state = {k[len("mlp.") :]: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}
            missing, unexpected = layer.load_state_dict(state, strict=False)
            missing = [k for k in missing if "_extra_state" not in k]
            if missing:
                raise RuntimeError(f"hop {i} ({kind} EP={ep} ETP={tp}): keys not in the checkpoint: {missing}")
            hop["loaded_from"] = src
        pairs = zip(_ckpt_local(layer), _ckpt_expected(), strict=True)
        diffs = [(got - want).abs().max().item() for got, want in pairs]
        output = _ckpt_output(layer, rank, device)
        out0 = output if i == 0 else out0
        local_stats = [*diffs, (output - out0).abs().max().item(), out0.abs().max().item()]
        stats = torch.tensor(local_stats, dtype=torch.float64, device=device)
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # over all ranks: every expert of the global tensors
        fc1, fc2, router, out_diff, out_mag = stats.tolist()
        hop.update(fc1_max_abs_diff=fc1, fc2_max_abs_diff=fc2, router_max_abs_diff=router)
        hop.update(output_max_abs_diff=out_diff, output_max_abs=out_mag)
        dst = os.path.join(root, f"hop{i}")
        if rank == 0:
            os.makedirs(dst)
        dist.barrier()
        dist_checkpointing.save(layer.sharded_state_dict(prefix="mlp."), dst)
        hop["saved_to"] = dst
        hop["files"] = sorted(os.listdir(dst))
        weights_equal = fc1 == 0 and fc2 == 0 and router == 0
        same_as_hop0 = (kind, ep, tp) == _hop(chain[0])
        hop["pass"] = weights_equal and (out_diff == 0 if same_as_hop0 else out_diff <= 1e-4 * hop["output_max_abs"])
        hop["seconds"] = round(time.time() - t0, 2)
        hops.append(hop)
        if rank == 0:
            print(json.dumps(hop), flush=True)
    summary = {
        "chain": [list(_hop(c)) for c in chain],
        "world": world,
        "hops": hops,
        "pass": all(h["pass"] for h in hops),
    }
    if rank == 0:
        with open(os.path.join(out, "ckpt_summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    return summary


def _ckpt_main(out: str) -> int:
    """torchrun entry of the ckpt step: NCCL with a 120 s collective timeout (a stuck save fails instead of
    hanging; the driver's step limit is the outer bound)."""
    import datetime
    import shutil
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    # The EP chain's summary in OUT, the expert-tensor-parallel chain's in OUT/etp. The checkpoint directories (a
    # few MB) stay off OUT, which keeps only logs and JSON.
    root = os.path.join(os.environ.get("TMPDIR", "/tmp"), "sonic_megatron_ckpt")
    chains = ((CKPT_CHAIN_4 if world >= 4 else CKPT_CHAIN_2, out), (CKPT_CHAIN_ETP_2, os.path.join(out, "etp")))
    passed = True
    for chain, where in chains:
        if rank == 0:
            os.makedirs(where, exist_ok=True)
        passed &= ckpt_worker(rank, world, where, chain, ckpt_root=root)["pass"]
        dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(_ckpt_main(sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."))
