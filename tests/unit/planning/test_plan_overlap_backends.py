"""The planner's ZeRO-2/3 gradient staging follows ddp.py's reductions on each backend: NCCL leaves a
backward's last reduce-scatter in flight into the next micro-batch, gloo finishes it when the backward
pass ends (its temporaries), so only NCCL's estimate counts it at the top of the next backward."""
import pytest

from megalite.planning import flags as plan_flags
from megalite.planning import inputs, memory


def test_the_previous_micro_batchs_last_reduction_is_alive_on_nccl_only():
    """Llama-3 8B's layer at d = 8, 40M-element buckets, pipeline rank 1 (no head): backward through the
    top layer's MLP, linear_fc2's bucket just complete. NCCL still reduces the previous micro-batch's
    last bucket (the bottom layer's input norm, h elements); gloo finished it, and copies (d-1)/d of the
    bucket it reduces."""
    model = plan_flags.model_from_flags(32, 4096, 32, 128256, 4096, ffn_hidden_size=14336, num_query_groups=8,
                                        swiglu=True, position_embedding_type="rope", normalization="RMSNorm",
                                        add_bias_linear=False, untie_embeddings_and_output_weights=True,
                                        hidden_dropout=0.0, attention_dropout=0.0)
    workload, d = inputs.Workload(model, global_batch_size=64), 8
    h, fc2 = model.hidden_size, model.ffn_hidden_size * model.hidden_size
    layout = inputs.Layout(pp=4, dp=d, sharding="optim_grads", overlap_grad_reduce=True, overlap_param_gather=True)
    assert layout.num_microbatches(workload.global_batch_size) > 1

    def staging(kernels):
        return memory.data_parallel_transients(workload, layout, 1, kernels, "layer", depth=0).grads

    assert staging(inputs.GPU_KERNELS) == pytest.approx(4 * (h + fc2) * (1 + 1 / d))
    assert staging(inputs.CPU_KERNELS) == pytest.approx(4 * fc2 * (1 + 1 / d) + 4 * fc2 * (d - 1) / d)
