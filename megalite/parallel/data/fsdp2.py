"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) as megalite's data-parallel backend (``--use-torch-fsdp2``).

The alternative to megalite's own ZeRO (ddp.py), for users who want PyTorch's implementation (DTensor
parameters for torch.distributed.checkpoint or torchao float8, or a comparison of the two). Megatron
offers the same choice under the same flag; torchtitan is built on it.

Sharding. ``fully_shard`` is applied to every transformer layer and then to each model chunk (the root:
embedding, final norm, output layer), over a 1-D DeviceMesh built from ParallelState's data-parallel
(x context-parallel) group: context-parallel ranks hold the same parameters, so like ddp.py gradients are
reduced over dp x cp. Tensor parallelism stays megalite's own: a TP-sharded weight is a plain local tensor
inside its module, and FSDP2 shards that local tensor along dim 0 (a DTensor over the DP mesh only).
With pipeline parallelism each of the rank's model chunks is sharded the same way.

Megatron's flags:
- ``--data-parallel-sharding-strategy optim_grads_params`` (the default with FSDP2): reshard after forward,
  ZeRO-3; ``optim_grads``: parameters stay gathered from forward to backward (ZeRO-2 within a step).
  ``no_shard``/``optim`` and ``--use-distributed-optimizer`` are refused in config validation: FSDP2 always
  shards gradients and optimizer state.
- ``--overlap-param-gather``: explicit prefetch, each layer's forward starts the next layer's all-gather and
  each layer's backward the previous one's.
- ``--overlap-grad-reduce``: FSDP2 always reduce-scatters a layer's gradients as its backward ends (on a
  separate stream on GPUs); the flag is accepted and changes nothing.
- ``--bf16``/``--fp16``: ``MixedPrecisionPolicy`` with the parameters in 16 bits for compute, gradients
  reduced in fp32 (bf16 with ``--grad-reduce-in-bf16``); the sharded parameters themselves stay fp32 and
  are the optimizer's master weights. fp16 uses megalite's loss scaler (the gradients it unscales and
  checks are the fp32 shards).
- ``--fp8-param-gather``: the weights of FP8 layers gather in FP8 with the whole weight's scales, through
  FSDP2's all-gather extension on their local shards (fsdp2_fp8.py).

Start-up is memory-true: the chunks are built on the meta device and sharded there; materialise.py
then gives the shards storage (this rank's only) and fills each at its position in the TP-local tensor,
as ``local_elements`` states it (as it fills ddp.py's ZeRO-3 chunks), so the weights equal the
single-process run's bit for bit. The shards' FlatLayout (``buffer``) is built from that storage.

Everything else in megalite (optimizer, gradient clipping, NaN checks, TP/PP gradient fix-ups,
checkpoints, the memory report) works on the rank's FlatLayout (protocol.py). ``ShardLayout`` is
FSDP2's: each parameter's TP-local tensor flattened and concatenated in order (the "slots"), and this
rank's FSDP2 shard of a parameter, rows [r0, r1) of dim 0, is the contiguous flat range
[slot.start + r0 * row, slot.start + r1 * row) of it; its ``buckets`` are the local shards, one per
parameter this rank holds rows of, so megalite's DistributedOptimizer steps the shards' local tensors with fused AdamW, and
checkpoints write and read them as boxes by global name and offsets: a run saved under FSDP2 resumes
under megalite's ZeRO-3 or any other layout, and the reverse. Its shards are rows of parameters
(``row_shards``): --optimizer muon sends them to an owner rank per matrix for Newton-Schulz
(optim/muon_redistribute.py).

Numerics: every micro-batch's gradients are reduce-scattered and summed into the fp32 shard (like
ddp.py's ZeRO-2/3), divided by the group size after a SUM (never ReduceOp.AVG, whose result differs
between backends). With fp32 this equals the single-process run to fp32 rounding.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from megalite.config.schema import ParallelConfig
from megalite.errors import UserError
from megalite.parallel.data.ddp import data_parallel_group
from megalite.parallel.data.fsdp2_fp8 import dim0_shard, gather_weights_in_fp8, local_rows
from megalite.parallel.data.materialise import LocalElements
from megalite.parallel.data.protocol import DataParallel, FlatLayout, UnitSource
from megalite.parallel.param_meta import mark, param_meta
from megalite.parallel.mesh import ParallelState

# the chunk's forward returns the per-token losses transposed (a view); nothing writes into them in place
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPTModel\) returned a view tensor")


@dataclass
class Slot:
    """A parameter's TP-local tensor as the flat range [start, end) of the virtual layout."""
    start: int
    end: int


@dataclass(eq=False)
class LocalShard:
    """This rank's FSDP2 shard of one parameter: the flat range [start, end) of the virtual layout, and
    1-D views of its values (FSDP2's sharded storage) and of its fp32 gradient."""
    index: int
    name: str
    param: nn.Parameter
    start: int
    end: int
    values: torch.Tensor
    grad: torch.Tensor


class ShardLayout(FlatLayout):
    """The FlatLayout of a rank's FSDP2 shards: one bucket per parameter shard this rank holds."""
    row_shards = True

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], dp_rank: int, dp_size: int,
                 compute_dtype: torch.dtype):
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.params = [p for _, p in named_params]
        self.param_dtype = named_params[0][1].dtype        # the sharded (master) dtype: fp32 for 16-bit runs
        self.compute_dtype = compute_dtype                 # what forward and backward run in
        self.param_data = self.grad_data = None            # nothing is held whole
        self.slots: dict[str, Slot] = {}
        self.buckets: list[LocalShard] = []
        offset = 0
        for name, param in named_params:
            self.slots[name] = Slot(offset, offset + param.numel())
            local = local_rows(param.to_local())
            if local.numel():                              # a rank may hold no rows of a small tensor
                row = param.numel() // param.shape[0]
                r0, r1 = dim0_shard(param.shape[0], dp_rank, dp_size)
                assert local.shape[0] == r1 - r0, (name, tuple(local.shape), r0, r1)
                start = offset + r0 * row
                self.buckets.append(LocalShard(len(self.buckets), name, param, start, start + local.numel(),
                                               local.detach().view(-1), local_rows(param.grad.to_local()).view(-1)))
            offset += param.numel()
        self.numel = self.numel_unpadded = offset
        self.param_shard = self.buckets[0].values if self.buckets else None

    def local_range(self, shard: LocalShard) -> tuple[int, int]:
        return shard.start, shard.end

    def local_param_chunk(self, shard: LocalShard) -> torch.Tensor:
        return shard.values

    def local_grad_chunk(self, shard: LocalShard) -> torch.Tensor:
        return shard.grad

    def zero_grad(self) -> None:
        for shard in self.buckets:
            shard.grad.zero_()

    def param_bytes(self) -> int:
        return sum(s.values.numel() * s.values.element_size() for s in self.buckets)

    def grad_bytes(self) -> int:
        return sum(s.grad.numel() * s.grad.element_size() for s in self.buckets)

    def state_tensors(self, kind: str) -> list[torch.Tensor]:
        """This rank's shards of its parameters or of their gradients (``kind``)."""
        return [s.values if kind == "parameters" else s.grad for s in self.buckets]

    def transients(self) -> list:
        """None of megalite's own: FSDP2 allocates its gathered parameters and reduction buffers inside the
        step, where the memory account sees them as they are made."""
        return []


def mixed_precision_policy(params_dtype: torch.dtype, grad_reduce_in_bf16: bool) -> MixedPrecisionPolicy:
    """16-bit parameters in compute; gradients reduced in fp32 (or bf16); sharded parameters stay fp32."""
    if params_dtype == torch.float32:
        return MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if grad_reduce_in_bf16 else None)
    return MixedPrecisionPolicy(param_dtype=params_dtype,
                                reduce_dtype=torch.bfloat16 if grad_reduce_in_bf16 else torch.float32)


class FullyShardedDataParallel(DataParallel):
    """FSDP2 over a rank's model chunks, as a DataParallel backend.

    ``models``: the rank's chunks, built on the meta device with ``init_values`` (GPTModel(meta=True)),
    given storage and values by materialise.py once this backend is built (build.py).
    Per step: ``zero_grad()`` -> forward/backward (FSDP2 gathers and reduce-scatters per layer) ->
    ``finish_grad_sync()`` -> optimizer step on the local shards."""

    def __init__(self, models: list[nn.Module], config: ParallelConfig, parallel: ParallelState,
                 num_microbatches: int = 1, device: torch.device | None = None):
        self.models = list(models) if isinstance(models, (list, tuple)) else [models]
        self.parallel, self.num_microbatches = parallel, num_microbatches
        self.strategy = config.data_parallel_sharding_strategy
        self.shard_optimizer = self.shard_grads = True
        self.shard_params = self.strategy == "optim_grads_params"
        self.group, self.dp_size, self.dp_rank = data_parallel_group(parallel)
        if self.group is None:
            raise UserError("--use-torch-fsdp2 needs torch.distributed: launch with torchrun (even one process)")
        self.device = device or torch.device("cpu")
        self.mesh = DeviceMesh.from_group(self.group, self.device.type)
        self.compute_dtype = next(self.models[0].parameters()).dtype
        policy = mixed_precision_policy(self.compute_dtype, config.grad_reduce_in_bf16)
        for model in self.models:
            self._shard(model, policy, config.overlap_param_gather, config.fp8_param_gather)
        self.named_params = self._named_params()

    # ---- start-up ----------------------------------------------------------------------------------
    def _shard(self, model: nn.Module, policy: MixedPrecisionPolicy, prefetch: bool, fp8_param_gather: bool) -> None:
        """fully_shard every transformer layer and the chunk, still on the meta device. The new DTensor
        parameters get the old ones' records (TP layout, init_values, markers), which they do not carry."""
        records = {name: param_meta(p) for name, p in model.named_parameters()}
        for p in model.parameters():                     # sharded parameters are the fp32 master weights
            p.data = p.data.float()
        if fp8_param_gather:                             # the FP8 layers' weights gather in FP8 (fsdp2_fp8.py)
            gather_weights_in_fp8(model)
        units = model.data_parallel_units() if isinstance(model, UnitSource) else []
        layers = [unit.module for unit in units if unit.layer]
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, reshard_after_forward=self.shard_params, mp_policy=policy)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=self.shard_params, mp_policy=policy)
        for unit in layers + [model]:
            unit.set_force_sum_reduction_for_comms(True)     # SUM then divide, never ReduceOp.AVG
        if prefetch:                                        # --overlap-param-gather
            for a, b in zip(layers, layers[1:]):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
        for name, p in model.named_parameters():
            mark(p, **vars(records[name]))

    @functools.cached_property
    def buffer(self) -> ShardLayout:
        """This rank's shards as a FlatLayout, built on first use, from the shards' storage: materialise.py
        gives it to them once this backend is built. Each parameter also gets its fp32 gradient shard,
        which lives for the whole run: FSDP2 accumulates every micro-batch into it."""
        if self.device.type != "meta" and any(p.device.type == "meta" for _, p in self.named_params):
            raise RuntimeError("FSDP2's shards have no storage yet: materialise the model chunks first")
        with torch.no_grad():
            for _, param in self.named_params:
                param.grad = DTensor.from_local(torch.zeros_like(param.to_local()), self.mesh, [Shard(0)],
                                                run_check=False, shape=param.shape, stride=param.stride())
        return ShardLayout(self.named_params, self.dp_rank, self.dp_size, self.compute_dtype)

    def local_elements(self) -> list[LocalElements]:
        """This rank's row shard of each parameter, in FSDP2's sharded storage (materialise.py fills it)."""
        return [LocalElements(s.param, s.start - self.buffer.slots[s.name].start,
                              s.end - self.buffer.slots[s.name].start, s.values) for s in self.buffer.buckets]

    def _named_params(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) over the chunks, names prefixed ``chunk{i}.`` with several (as ddp.py names them)."""
        named = []
        for c, model in enumerate(self.models):
            prefix = f"chunk{c}." if len(self.models) > 1 else ""
            named += [(prefix + n, p) for n, p in model.named_parameters() if p.requires_grad]
        return named

    # ---- per step --------------------------------------------------------------------------------
    def zero_grad(self, num_microbatches: int | None = None) -> None:
        self.buffer.zero_grad()
        if num_microbatches is not None:
            self.num_microbatches = num_microbatches

    def finish_grad_sync(self) -> None:
        """Nothing left to do: FSDP2's backward has reduce-scattered every layer (its final callback
        waits for the last one) and divided by the group size."""

    def start_param_sync(self) -> None:
        """The updated shards are gathered by the next forward's FSDP2 pre-hooks."""

    def wait_for_param_gather(self) -> None:
        """No all-gather is in flight between steps."""

    def close(self) -> None:
        """FSDP2 leaves nothing in flight after backward and the step."""

    # ---- what the model-parallel fix-ups see --------------------------------------------------
    def grad_views(self, param: nn.Parameter) -> list[tuple[torch.Tensor, int]]:
        """The reduced gradient of ``param`` this rank holds, as (1-D view, offset of its first element
        in the flattened TP-local parameter); empty when this rank holds none of it."""
        shard = self._shard_of.get(id(param))
        if shard is None:
            return []
        return [(shard.grad, shard.start - self.buffer.slots[shard.name].start)]

    @functools.cached_property
    def _shard_of(self) -> dict[int, LocalShard]:
        return {id(s.param): s for s in self.buffer.buckets}
