"""What differs between the supported megatron-core versions (0.16.1 .. 0.19.2), found by feature detection,
plus the CPU/gloo patches that let Megatron's MoE code run without CUDA (tests, the CPU demo).

Nothing here changes Megatron's behaviour on a GPU: ``patch_megatron_for_cpu`` refuses to run when CUDA is
available, and the other helpers only read signatures.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch


def accepted_kwargs(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` accepts (all of them if it takes ``**kwargs``). Megatron 0.19
    passes ``is_mtp_layer``/``name`` to modules that 0.16 built without them; forwarding only what the
    parent accepts keeps one code path for both."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in params}


@functools.cache
def experts_are_built_by_call() -> bool:
    """True on megatron-core >= 0.19, where ``MoELayer`` calls ``submodules.experts(...)`` instead of
    ``build_module(...)`` (detected by the ``ExpertsBuilder`` protocol that came with it)."""
    from megatron.core.transformer.moe import moe_layer

    return hasattr(moe_layer, "ExpertsBuilder")


def default_pg_collection():
    """Megatron's default process-group collection for MoE (from parallel_state)."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    return get_default_pg_collection()


def expert_rng_context():
    """The expert-parallel RNG tracker's fork (``is_expert=True`` initialisation) when Megatron's CUDA RNG
    tracker has it registered; a null context otherwise (CPU, or seeds not set up by
    ``model_parallel_cuda_manual_seed``)."""
    import contextlib

    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
    except ImportError:  # pragma: no cover - all supported versions have both
        return contextlib.nullcontext()
    tracker = get_cuda_rng_tracker()
    name = get_expert_parallel_rng_tracker_name()
    states = tracker.get_states() if hasattr(tracker, "get_states") else {}
    if torch.cuda.is_available() and name in states:
        return tracker.fork(name)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------------------
# CPU / gloo: the patches of patch_megatron_for_cpu
# ----------------------------------------------------------------------------------------------------------


class _FakeStream:
    """Stands in for torch.cuda.Stream/Event on a CPU: every operation is a no-op, it is its own context
    manager and equal to every other fake stream (Megatron compares streams and records events)."""

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def record(self, *args, **kwargs):
        return None

    def query(self):
        return True

    def record_event(self, *args, **kwargs):
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __eq__(self, other):
        return True

    def __hash__(self):
        return 0


_CPU_PATCHED = False


def patch_megatron_for_cpu() -> None:
    """Let Megatron's MoE layer, dispatchers and GPT model run on a CPU over gloo (idempotent).

    Call after ``torch.distributed.init_process_group("gloo")`` and before building layers. Patches:
    (1) ``torch.cuda.current_device`` returns "cpu" (tensor-parallel mappings allocate there);
    (2) CUDA streams/events become no-op objects; (3) the alltoall dispatcher's ``maybe_move_tensor_to_cpu``
    also converts CPU tensors to numpy split sizes; (4) on 0.16 without Transformer Engine the missing
    ``te_general_gemm`` name is defined as None; (5) the CUDA RNG tracker's ``fork`` is a no-op (its states
    need CUDA; attention dropout on a CPU then draws from the default generator); (6) the tensor-parallel
    mappings' gather and reduce-scatter with uneven split sizes (the alltoall dispatcher's, over the expert
    tensor-parallel group) run as equal-size collectives of padded chunks (``_equal_size_mappings``: gloo takes
    equal sizes only). Refuses to patch when CUDA is available.
    """
    global _CPU_PATCHED
    if _CPU_PATCHED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("patch_megatron_for_cpu: CUDA is available; these patches are for CPU-only runs")
    fake = _FakeStream()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = lambda *a, **k: fake
    torch.cuda.Event = lambda *a, **k: fake
    torch.cuda.current_stream = lambda *a, **k: fake
    torch.cuda.default_stream = lambda *a, **k: fake
    torch.cuda.stream = lambda *a, **k: fake
    torch.cuda.synchronize = lambda *a, **k: None

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if tensor is None or not isinstance(tensor, torch.Tensor):
            return tensor
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor

    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None

    import contextlib

    from megatron.core.tensor_parallel import random as mp_random

    mp_random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    _equal_size_mappings()
    _CPU_PATCHED = True


def _equal_size_mappings() -> None:
    """Megatron's ``_gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` with split sizes call
    ``all_gather`` / ``reduce_scatter`` on lists of uneven tensors, which gloo refuses ("invalid tensor size").
    Here every chunk is padded to the largest one, the equal-size collective runs, and the padding is cut off: the
    same values (the padding rows are zeros and are never read)."""
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def padded(chunk: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.cat([chunk, chunk.new_zeros(rows - chunk.shape[0], *chunk.shape[1:])])

    def gather_equal(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        rows = max(max(output_split_sizes), 1)  # a chunk of one row where every rank sends none
        out = gather(padded(input_, rows), group)
        return torch.cat([c[:n] for c, n in zip(out.split(rows), output_split_sizes, strict=True)])

    def reduce_scatter_equal(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        rows = max(max(input_split_sizes), 1)
        chunks = torch.split(input_, list(input_split_sizes))
        out = reduce_scatter(torch.cat([padded(c, rows) for c in chunks]), group)
        return out[: input_split_sizes[group.rank()]]

    mappings._gather_along_first_dim = gather_equal
    mappings._reduce_scatter_along_first_dim = reduce_scatter_equal


# ----------------------------------------------------------------------------------------------------------
# dist_checkpointing.save without psutil
# ----------------------------------------------------------------------------------------------------------


def allow_checkpoint_save_without_psutil() -> bool:
    """Make ``dist_checkpointing.save`` (torch_dist format) work when ``psutil`` is not installed; returns
    True when it patched something.

    Why: megatron-core 0.16.1 .. 0.19.2 write each checkpoint file in a forked process
    (``FileSystemWriterAsync.write_preloaded_data``) whose first statement, outside its try block, logs the
    process memory through psutil -- which megatron-core does not declare as a dependency. Without psutil
    that process dies before it reports, and the saving rank waits on ``count_queue.join()`` forever (this
    was the "save hangs on CPU" of the gloo tests: it hangs the same way on GPUs). The memory figure only
    feeds a debug log line, so without psutil it reads 0.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "HAVE_PSUTIL", True):
        return False
    filesystem_async._process_memory = lambda: 0
    return True
