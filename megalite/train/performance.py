"""How fast and how big a run is: FLOPs, tokens/s, model FLOP/s per device, MFU, and memory.

MFU follows PaLM (appendix B): model FLOPs per token 6*N + 12*L*h*s, N the
non-embedding matmul parameters plus the output layer, the attention term without a causal discount
and no recomputation counted; MFU = tokens/s per device * FLOPs per token / the device's peak FLOP/s.
The peak comes from --peak-flops or, on a GPU, from a table of dense bf16/fp16 tensor-core peaks
(the figure people quote MFU against); a CPU has no table entry, so MFU needs --peak-flops there.
Megatron's own "throughput per GPU" (--log-throughput) counts FLOPs its way (flops_per_iteration).

The start-up memory report (report_memory) measures the bytes of parameters, gradients and optimizer
state each rank holds from the tensors that exist (storage sizes, so padding and ZeRO-3's gathered
buckets count), next to the theoretical optimizer-state bytes of the ZeRO paper: Adam with fp32
master weights keeps 12 bytes per parameter (master, m, v), sharded over the d data-parallel ranks by
the distributed optimizer: 12Ψ/d, Ψ = parameters on this model-parallel rank. An fp32 model's own
weights are its master copy, so there it is 8Ψ/d (m, v). Under --optimizer muon its matrices keep one
momentum instead of m and v: 4 bytes less for each of their elements. MoE expert weights are replicated, and their
state sharded, over the expert-data-parallel ranks instead (d = EDP for them). Rank 0 prints one line
per rank, and for a model with expert weights two more, the expert weights' share and the rest's:

    memory rank R: parameters P bytes | gradients G bytes | optimizer state O bytes | theoretical O' bytes
    memory rank R expert weights: parameters ... (the same four figures)
    memory rank R dense weights: parameters ...
"""
from __future__ import annotations

import os
import resource

import torch
import torch.distributed as dist

from megalite.config.schema import ModelConfig
from megalite.parallel import collectives
from megalite.parallel.dry_run import REAL_RUN, RealRun
from megalite.parallel.param_meta import param_meta

# Dense (no sparsity) bf16 tensor-core peaks in FLOP/s, from the vendors' datasheets. Matched as
# substrings of torch.cuda.get_device_name(), most specific first.
KNOWN_GPU_PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),          # SXM
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("A6000", 155e12),
    ("V100", 125e12),          # fp16 (no bf16 on Volta)
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


def matmul_parameters(model: ModelConfig) -> int:
    """N of PaLM's 6N: the transformer layers' weight matrices plus the output layer (embeddings excluded);
    an MoE layer's are those a token runs (k experts, the shared expert, the router)."""
    h, d = model.hidden_size, model.kv_channels
    nq, nkv = model.num_attention_heads, model.num_query_groups
    attention = h * (nq + 2 * nkv) * d + nq * d * h
    mlp = h * model.ffn_hidden_size * (3 if model.gated_linear_unit else 2)
    dense = model.num_layers * (attention + mlp) + model.padded_vocab_size * h
    if not model.num_experts:
        return dense
    return dense + moe_extra_flops_per_token(model) // 2 * sum(map(model.is_moe_layer, range(1, model.num_layers + 1)))


def model_flops_per_token(model: ModelConfig) -> float:
    """PaLM: 6N + 12*L*h*s (forward + backward)."""
    return 6.0 * matmul_parameters(model) + 12.0 * model.num_layers * model.hidden_size * model.seq_length


def flops_per_iteration(model: ModelConfig, batch_size: int, attended_fraction: float = 1.0) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3 x forward, no recomputation).

    Per token and layer, forward: QKV 2*h*(nq+2*nkv)*d, attention scores and values 4*s*nq*d (no causal
    discount), output projection 2*nq*d*h, MLP 2*h*ffn*(3 if SwiGLU else 2); plus logits 2*h*V per token.
    For GPT with a 4h MLP and no GQA this equals Megatron's
    72*B*s*L*h^2 * (1 + s/(6h) + V/(12*L*h)). An MoE layer counts the FLOPs its tokens run instead of
    the MLP's (``moe_extra_flops_per_token``). ``attended_fraction``: the share of a causal mask's query/key
    pairs that document masks or a window keep (planning/attention.py), which scales the attention term.
    """
    h, s, d = model.hidden_size, model.seq_length, model.kv_channels
    nq, nkv = model.num_attention_heads, model.num_query_groups
    per_layer = (2 * h * (nq + 2 * nkv) * d + 4 * s * nq * d * attended_fraction + 2 * nq * d * h
                 + mlp_flops_per_token(model, model.ffn_hidden_size))
    per_token = model.num_layers * per_layer + 2 * h * model.padded_vocab_size
    if model.num_experts:
        per_token += moe_extra_flops_per_token(model) * sum(map(model.is_moe_layer, range(1, model.num_layers + 1)))
    return 3.0 * per_token * batch_size * s


def mlp_flops_per_token(model: ModelConfig, ffn: int) -> float:
    """Forward FLOPs of a dense MLP of ``ffn`` hidden units per token."""
    return 2 * model.hidden_size * ffn * (3 if model.gated_linear_unit else 2)


def moe_extra_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs per token an MoE layer runs beyond a dense layer's MLP: k experts' MLPs of f hidden,
    the shared expert's MLP and the router (2 h E), less the dense MLP."""
    routed = mlp_flops_per_token(model, model.expert_ffn_hidden_size) * model.moe_router_topk
    shared = mlp_flops_per_token(model, model.moe_shared_expert_intermediate_size or 0)
    router = 2 * model.hidden_size * model.num_experts
    return routed + shared + router - mlp_flops_per_token(model, model.ffn_hidden_size)


def peak_flops_per_device(flag_value: float | None, device: torch.device) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from); (None, reason) when unknown, so MFU is left out."""
    if flag_value:
        return flag_value, "--peak-flops"
    if device.type != "cuda":
        return None, "no --peak-flops given for this CPU run"
    name = torch.cuda.get_device_name(device)
    for key, peak in KNOWN_GPU_PEAK_FLOPS:
        if key in name:
            return peak, f"{name} (dense bf16 peak {peak / 1e12:.0f} TFLOP/s)"
    return None, f"{name} is not in megalite's table of GPU peaks: pass --peak-flops"


def memory_usage(device: torch.device) -> dict[str, float]:
    """This process's memory in MB: CUDA current and max allocated on a GPU; RSS and peak RSS on a CPU."""
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device) / 2**20,
                "max allocated": torch.cuda.max_memory_allocated(device) / 2**20}
    rss = current_rss_bytes()
    # the kernel updates its high-water mark lazily, so it can trail the current figure slightly
    return {"rss": rss / 2**20, "max rss": max(rss, peak_rss_bytes()) / 2**20}


def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):      # not Linux: the peak is the best we have
        return peak_rss_bytes()


def reset_peak_rss() -> bool:
    """Restart this process's RSS high-water mark (Linux: /proc/self/clear_refs), so ``window_peak_rss_bytes``
    measures the peak of what runs next. False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def window_peak_rss_bytes() -> int:
    """Peak RSS since the last ``reset_peak_rss`` (VmHWM), at least the current RSS."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return max(int(line.split()[1]) * 1024, current_rss_bytes())
    except (OSError, ValueError, IndexError):
        pass
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if os.uname().sysname == "Darwin" else peak * 1024   # bytes on macOS, KiB on Linux


class Throughput:
    """Per-interval rates for one run: tokens/s, model TFLOP/s per device, MFU, and Megatron's
    "throughput per GPU (TFLOP/s/GPU)" when given Megatron's FLOPs per iteration (--log-throughput)."""

    def __init__(self, model: ModelConfig, global_batch_size: int, world_size: int, peak_flops: float | None,
                 megatron_flops_per_iteration: float | None = None):
        self.tokens_per_iteration = global_batch_size * model.seq_length
        self.flops_per_token = model_flops_per_token(model)
        self.world_size = world_size
        self.peak_flops = peak_flops
        self.megatron_flops_per_iteration = megatron_flops_per_iteration

    def rates(self, seconds_per_iteration: float) -> dict[str, float]:
        tokens_per_second = self.tokens_per_iteration / seconds_per_iteration
        per_device = tokens_per_second / self.world_size
        rates = {"tokens per second": tokens_per_second, "tokens per second per device": per_device,
                 "model TFLOP/s per device": per_device * self.flops_per_token / 1e12}
        if self.peak_flops:
            rates["MFU"] = per_device * self.flops_per_token / self.peak_flops
        if self.megatron_flops_per_iteration is not None:
            rates["throughput (TFLOP/s/GPU)"] = (self.megatron_flops_per_iteration / seconds_per_iteration
                                                 / self.world_size / 1e12)
        return rates


# ---- the start-up memory report -----------------------------------------------------------------
KEYS = ("parameters", "gradients", "optimizer", "theoretical")


def theoretical_optimizer_bytes(num_params: int, param_dtype: torch.dtype, shards: int, fewer_states: int = 0) -> int:
    """Adam's 12 (8) bytes per parameter over ``shards``, less 4 bytes for each of ``fewer_states``
    (``fewer_state_elements``: Muon's matrices keep one fp32 momentum where Adam keeps two moments)."""
    per_param = 8 if param_dtype == torch.float32 else 12
    return round((per_param * num_params - 4 * fewer_states) / shards)


def fewer_state_elements(ddp, optimizer, expert: bool) -> int:
    """Elements x state tensors that the update rule keeps fewer of than for the rest (Muon: one momentum
    for each element of its matrices, optimizer.state_names_of, where AdamW keeps two), over the expert
    weights or the others; 0 under AdamW."""
    full = len(optimizer.state_names)
    return sum(p.numel() * (full - len(optimizer.state_names_of(name))) for name, p in ddp.named_params
               if bool(param_meta(p).expert) == expert)


def measure(ddp, optimizer) -> dict[str, int]:
    """This rank's bytes (module docstring), and with MoE expert weights their share of each figure
    (``expert ...``); the theoretical figure shards the expert weights' state over the
    expert-data-parallel ranks, the dense weights' over the data-parallel ones."""
    buf = ddp.buffer
    shards = buf.dp_size if ddp.shard_optimizer else 1       # the shard group's size (hybrid sharding: DP/K)
    dense_fewer = fewer_state_elements(ddp, optimizer, expert=False)
    measured = {"parameters": buf.param_bytes(), "gradients": buf.grad_bytes(), "optimizer": optimizer.state_bytes(),
                "theoretical": theoretical_optimizer_bytes(buf.numel_unpadded, buf.param_dtype, shards, dense_fewer)}
    experts = expert_share(ddp, optimizer) if any(param_meta(p).expert for p in buf.params) else None
    if experts is not None:
        dense = theoretical_optimizer_bytes(buf.numel_unpadded - experts.pop("numel"), buf.param_dtype, shards,
                                            dense_fewer)
        measured["theoretical"] = dense + experts["theoretical"]
    return measured | {f"expert {key}": (experts or {}).get(key, 0) for key in KEYS}


def expert_share(ddp, optimizer) -> dict[str, int]:
    """The bytes of the expert weights' parameters, gradients and optimizer state this rank holds, read
    from the flat layout: the elements of expert slots (``param_meta(p).expert``) inside what the rank
    holds (all of the layout, or its chunk of each bucket, ``local_range``, where sharded: ZeRO-3 for
    parameters, ZeRO-2/3 for gradients; the optimizer's pieces for its state). The optimizer state splits
    in proportion to the elements it updates (moments and master copy are per element). ``numel``: the
    expert weights' elements; ``theoretical``: their optimizer state by the ZeRO paper over the
    expert-data-parallel ranks."""
    buf = ddp.buffer
    experts = sorted((buf.slots[name].start, buf.slots[name].end) for name, p in ddp.named_params
                     if param_meta(p).expert)
    whole = [(0, buf.numel)]
    sharded = [buf.local_range(b) for b in buf.buckets]
    grads = buf.grad_data if buf.grad_data is not None else buf.local_grad_chunk(buf.buckets[0])
    pieces = [(piece.start, piece.end) for piece in optimizer.pieces]
    updated = sum(end - start for start, end in pieces)
    numel = sum(end - start for start, end in experts)
    edp = optimizer.parallel.edp_shard_size if optimizer.parallel is not None else 1
    return {"parameters": overlap(whole if buf.param_data is not None else sharded, experts)
            * buf.param_dtype.itemsize,
            "gradients": overlap(whole if buf.grad_data is not None else sharded, experts) * grads.element_size(),
            "optimizer": optimizer.state_bytes() * overlap(pieces, experts) // max(updated, 1),
            "theoretical": theoretical_optimizer_bytes(numel, buf.param_dtype, edp if ddp.shard_optimizer else 1,
                                                       fewer_state_elements(ddp, optimizer, expert=True)),
            "numel": numel}


def overlap(ranges: list[tuple[int, int]], segments: list[tuple[int, int]]) -> int:
    """Elements of ``segments`` inside ``ranges`` (each a list of disjoint [start, end) ranges)."""
    return sum(max(0, min(end, hi) - max(start, lo)) for start, end in ranges for lo, hi in segments)


def format_memory_line(rank: int, m: dict[str, int], kind: str = "") -> str:
    """The rank's line; ``kind`` "expert" or "dense": that share of each figure (MoE models)."""
    if kind:
        m = {key: m[f"expert {key}"] if kind == "expert" else m[key] - m[f"expert {key}"] for key in KEYS}
    label = f"memory rank {rank}" + (f" {kind} weights" if kind else "")
    return (f"{label}: parameters {m['parameters']} bytes | gradients {m['gradients']} bytes | "
            f"optimizer state {m['optimizer']} bytes | theoretical {m['theoretical']} bytes")


def gather_memory(ddp, optimizer) -> list[dict[str, int]]:
    """Every rank's measurement (collective: all ranks call it)."""
    keys = KEYS + tuple(f"expert {key}" for key in KEYS)
    mine = measure(ddp, optimizer)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    device = ddp.buffer.params[0].device
    local = torch.tensor([mine[k] for k in keys], dtype=torch.int64, device=device)
    everyone = torch.empty(dist.get_world_size() * len(keys), dtype=torch.int64, device=device)
    collectives.all_gather_single(everyone, local)
    rows = everyone.view(-1, len(keys)).tolist()
    return [dict(zip(keys, row)) for row in rows]


def report_memory(ddp, optimizer, rank: int, print_fn=print, run: RealRun = REAL_RUN) -> None:
    """The reporting rank prints the line of every rank (with MoE expert weights, then its expert and its
    dense share); ``run`` (parallel/dry_run.py) says which rank reports and whose lines it has: rank 0
    every rank's, or a rank without peers its own."""
    per_rank = run.per_rank(rank, lambda: measure(ddp, optimizer), lambda: gather_memory(ddp, optimizer))
    moe = any(m["expert parameters"] for m in per_rank.values())
    if run.reports_here(rank):
        for r, m in per_rank.items():
            print_fn(format_memory_line(r, m))
            if moe:
                print_fn(format_memory_line(r, m, "expert"))
                print_fn(format_memory_line(r, m, "dense"))
