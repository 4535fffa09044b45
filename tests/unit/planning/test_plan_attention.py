"""The attended fraction of masked attention: pair counts by hand, packing as Megatron packs, a corpus."""
import os
import sys

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.planning.attention import attended_fraction, causal_pairs, corpus_document_lengths, packed_pieces
from megalite_test_utils import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))


def brute_pairs(length, left):
    return sum(1 for i in range(length) for j in range(length) if j <= i and (left < 0 or i - j <= left))


@pytest.mark.parametrize("length, left", [(1, -1), (7, -1), (7, 0), (7, 2), (7, 6), (7, 10), (64, 5)])
def test_causal_pairs_count_what_the_mask_keeps(length, left):
    assert causal_pairs([length], left)[0] == brute_pairs(length, left)


def test_documents_continue_into_the_next_sample():
    # samples of 8: [3 | 5], [4 | 4 (the 6-token document's first part)], [2 (its rest) | 6 ...]
    assert packed_pieces([3, 5, 4, 6, 6], 8).tolist() == [3, 5, 4, 4, 2, 6]


def test_fraction_is_one_for_plain_causal_and_the_pair_ratio_otherwise():
    assert attended_fraction(8) == 1.0
    assert attended_fraction(8, document_lengths=[8, 8, 8]) == 1.0
    kept = brute_pairs(3, -1) + brute_pairs(5, -1) + 2 * brute_pairs(4, -1)
    assert attended_fraction(8, document_lengths=[3, 5, 4, 4, 3]) == pytest.approx(kept / (2 * brute_pairs(8, -1)))
    assert attended_fraction(8, window_left=2) == pytest.approx(brute_pairs(8, 2) / brute_pairs(8, -1))
    with pytest.raises(ValueError, match="fewer than one sample"):
        attended_fraction(8, document_lengths=[3])


def test_a_corpus_gives_its_document_lengths(tmp_path):
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix)
    for doc in ([np.arange(5)], [np.arange(2), np.arange(3)], [np.arange(7)]):   # the second has two sentences
        for sentence in doc:
            builder.add_item(sentence)
        builder.end_document()
    builder.finalize()
    assert corpus_document_lengths(prefix).tolist() == [5, 5, 7]
    assert corpus_document_lengths(prefix, tokens=6).tolist() == [5, 5]


# ---- the planner: masked attention's FLOPs, a2a's traffic against the ring's ------------------------------
def _llama_8k(**flags):
    from megalite.planning import flags as plan_flags
    return plan_flags.model_from_flags(32, 4096, 32, 128256, seq_length=8192, ffn_hidden_size=14336,
                                       num_query_groups=8, swiglu=True, **flags)


def test_document_masks_and_windows_count_only_the_attended_pairs():
    from megalite.planning import inputs, time as timing
    from megalite.planning.attention import model_attended_fraction
    from megalite.train.performance import flops_per_iteration
    model = _llama_8k()
    fraction = model_attended_fraction(model, [1024] * 600)
    assert fraction == pytest.approx(causal_pairs([1024])[0] * 8 / causal_pairs([8192])[0], rel=1e-3)
    plain = flops_per_iteration(model, 8)
    masked = flops_per_iteration(model, 8, fraction)
    assert plain - masked == pytest.approx(3 * 4 * 8192 * 32 * 128 * 32 * 8 * 8192 * (1 - fraction))
    workload = inputs.Workload(model, 8, attended_fraction=fraction)
    assert timing.hardware_flops(workload, inputs.Layout(dp=8))[0] == pytest.approx(masked)
    # a window on every other layer: the mean of the windowed and the full layers' fractions
    windowed = _llama_8k(window_size=[127, 0], window_attn_skip_freq=2, attention_dropout=0.0)
    assert model_attended_fraction(windowed) == pytest.approx((1 + attended_fraction(8192, 127)) / 2)


def test_ulysses_traffic_is_all_to_all_volume_and_is_not_hidden():
    from megalite.planning import inputs, time as timing
    model = _llama_8k()
    hardware = inputs.Hardware(num_gpus=8, gpu_memory_gb=80)
    layout = inputs.Layout(tp=1, cp=8, dp=1, micro_batch_size=1)
    ring = timing.step_time(inputs.Workload(model, 8), layout, hardware).context_parallel
    a2a = timing.step_time(inputs.Workload(model, 8, cp_comm_types=("a2a",)), layout, hardware).context_parallel
    tokens = 8192 // 8 * 32 * 8                          # the rank's tokens x layers x micro-batches
    exchanged = tokens * (2 * 32 + 2 * 8) * 128 * 2      # q, k, v and the output, bf16
    assert a2a == pytest.approx(2 * exchanged * 7 / 8 / (hardware.intra_node_gbps * 1e9))
    assert ring == 0.0                                   # at 8K the ring hides behind attention on NVLink
    hybrid = inputs.Workload(model, 8, cp_comm_types=("a2a+p2p",), cp_a2a_size=2)
    assert 0 < timing.step_time(hybrid, layout, hardware).context_parallel < a2a


def test_allgather_traffic_is_gathered_kv_and_dkv_reduce_scatter_and_is_not_hidden():
    from megalite.planning import inputs, time as timing
    model = _llama_8k()
    hardware = inputs.Hardware(num_gpus=8, gpu_memory_gb=80)
    layout = inputs.Layout(tp=1, cp=8, dp=1, micro_batch_size=1)
    gathered = timing.step_time(inputs.Workload(model, 8, cp_comm_types=("allgather",)), layout, hardware)
    tokens = 8192 // 8 * 32 * 8                          # the rank's tokens x layers x micro-batches
    whole_kv = 8 * tokens * 2 * 8 * 128                  # the whole sequence's K and V
    bandwidth = hardware.intra_node_gbps * 1e9
    # the K/V all-gathers forward and backward (bf16) hide behind 1/8 of the rank's attention (its own K/V)
    own_attention = 3 * 4 * 8192 * 32 * 128 * tokens / (hardware.peak_flops("bf16") * hardware.compute_efficiency) / 8
    gathers = max(0.0, 7 / 8 * whole_kv * 2 * 2 / bandwidth - own_attention)
    reduce_scatter = 7 / 8 * whole_kv * 4 / bandwidth    # dK/dV in fp32, behind nothing
    assert gathered.context_parallel == pytest.approx(gathers + reduce_scatter)
    assert gathered.context_parallel >= reduce_scatter > 0
    mixed = inputs.Workload(model, 8, cp_comm_types=("allgather", "p2p"))   # the ring's layers hide theirs
    assert timing.step_time(mixed, layout, hardware).context_parallel == pytest.approx(gathered.context_parallel / 2)


def test_the_planner_refuses_document_masks_it_cannot_count(capsys):
    import plan_parallelism
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--vocab-size", "100",
            "--num-gpus", "8", "--gpu-memory-gb", "80", "--seq-length", "64", "--global-batch-size", "64",
            "--reset-attention-mask", "--attention-dropout", "0"]
    assert plan_parallelism.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--document-length" in err
    assert plan_parallelism.main(argv + ["--document-length", "16", "--top", "1"]) == 0
