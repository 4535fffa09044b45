"""--compile: torch.compile per transformer layer (regional compilation).

Each TransformerLayer's ``forward`` is replaced by a compiled version of itself; the module's
``__call__`` stays eager. So everything attached to the module from outside keeps working as it does
eagerly: the data-parallel wrapper's forward pre-hooks (ZeRO-3 gathers a layer just before it runs,
ZeRO-1/2 wait for the overlapped parameter all-gather) and forward hooks (ZeRO-3 frees the layer after
it), the tensor hooks those register for backward, and the post-accumulate-grad hooks on parameters
(overlapped gradient reduction, ZeRO-2/3 staging): a compiled region's backward hands its parameter
gradients to autograd's AccumulateGrad like an eager layer does. Activation recomputation
(torch.utils.checkpoint around a layer or a chunk of layers) calls the compiled layer again when it
recomputes. Every layer of a model has the same code and shapes, so one graph serves them all
(parameters are graph inputs, not constants).

Compiling only the layers (not the embedding, the loss or the step) keeps compile time bounded at any
depth and leaves the parts that change shape or talk to other ranks outside: pipeline send/receive,
the data-parallel reductions, the optimizer. The tensor-parallel collectives inside a layer (the
all-reduces of TP, the all-gather / reduce-scatter of sequence parallelism) are traced into the graph
as functional collectives.

Numerics follow eager: dropout draws from the same generator stream as eager (inductor's
``fallback_random``), and low-precision intermediate results are rounded where eager rounds them
(``emulate_precision_casts``), so a compiled run equals the eager one to float rounding (fp32
tolerance in tests/unit/train/test_compile.py). Incremental decoding with a KV cache (growing shapes) runs the
eager forward.

Layouts that cannot be compiled (see ``compile_unsupported_reason``) are reported in one start-up
line and run eager.
"""
from __future__ import annotations

import torch
from torch import nn

from megalite.config.schema import ASYNC_SCHEDULES, MegaliteConfig
from megalite.model.attention import ATTENTION


def compile_unsupported_reason(config: MegaliteConfig, device: torch.device) -> str | None:
    """Why this run's layers cannot be compiled, or None when they can.

    Checked equal to eager (tests/unit/train/test_compile.py): serial, TP + SP, DP with ZeRO-1/2/3 and overlap,
    PP (1F1B, interleaved, zero-bubble), CP, full and selective recomputation, dropout, FSDP2. Refused: the
    asynchronous pipeline schedules, which swap weight versions in place under what autograd saved in
    forward; a compiled graph may save tensors computed from the weights instead, which that swap
    does not reach. And environments where torch.compile cannot build kernels."""
    schedule = config.parallel.pipeline_schedule
    if schedule in ASYNC_SCHEDULES and config.parallel.pipeline_model_parallel_size > 1:
        return f"--pipeline-schedule {schedule} swaps weight versions under the saved activations"
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python version"
    if device.type == "cuda":
        from torch.utils._triton import has_triton
        if not has_triton():
            return "compiling for CUDA needs Triton (pip install triton)"
    elif device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler
        try:
            get_cpp_compiler()
        except Exception:          # inductor's InvalidCxxCompiler and whatever the search hits
            return "compiling for CPU needs a C++ compiler (install g++ or clang++)"
    else:
        return f"no torch.compile backend is set up here for {device.type} devices"
    return None


def configure_inductor_for_eager_numerics() -> None:
    import torch._inductor.config as inductor
    inductor.fallback_random = True              # dropout masks from the same generator as eager
    inductor.emulate_precision_casts = True      # bf16/fp16 intermediates rounded where eager rounds them


def compile_layer(layer: nn.Module) -> None:
    """Replace ``layer.forward`` by its compiled version (eager with a KV cache); hooks stay eager."""
    eager = layer.forward
    compiled = torch.compile(eager, dynamic=False)

    def forward(x: torch.Tensor, inputs=None, kv_cache=None) -> torch.Tensor:
        if kv_cache is not None:
            return eager(x, inputs, kv_cache)
        return compiled(x, inputs)

    layer.forward = forward
    layer.compiled = True
    for module in layer.modules():          # QK-clip's max-logit pass (its loops skip empty blocks) runs eager
        if isinstance(module, tuple(ATTENTION.values())) and module.max_logits is not None:
            module.max_logits.record = torch.compiler.disable(module.max_logits.record)


def compile_layers(chunks: list[nn.Module], config: MegaliteConfig, device: torch.device, log=print) -> bool:
    """With --compile, compile every transformer layer of this rank's model chunks; returns whether it did.
    A layout it cannot handle gets one line and stays eager."""
    if not config.training.compile:
        return False
    reason = compile_unsupported_reason(config, device)
    if reason is not None:
        log(f" > --compile: {reason}; the layers run eager")
        return False
    configure_inductor_for_eager_numerics()
    layers = [layer for chunk in chunks for layer in chunk.decoder.layers]
    # one graph per distinct layer code and shapes; allow a recompile per layer in case guards
    # specialise on something layer-specific, so no layer silently falls back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(layers) + 8)
    for layer in layers:
        compile_layer(layer)
    log(f" > --compile: torch.compile per transformer layer ({len(layers)} on this rank), compiled at first use")
    return True
