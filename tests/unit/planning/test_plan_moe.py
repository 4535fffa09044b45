"""The parallelism planner on Mixture-of-Experts models: parameters per rank as GPTModel builds them at
every EP x ETP x TP rank, the search offering EP and ETP, the dispatch volume and expert FLOPs against
hand counts, ZeRO over the expert-data-parallel group, the dropless imbalance margin, a Mixtral-8x7B
layout, and the command line. (The planner's MoE memory against measured training runs is in
test_plan_parallelism.py's measured layouts.)"""
import dataclasses
import os
import re
import sys

import pytest

from megalite_test_utils import ROOT, TINY_LLAMA_ARGS, with_flags
from megalite.errors import UserError
from megalite.planning import experts, inputs, memory, search
from megalite.planning import flags as plan_flags
from megalite.planning import time as timing

sys.path.insert(0, os.path.join(ROOT, "tools"))

TINY_MOE = with_flags(TINY_LLAMA_ARGS, num_layers=4, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=96,
                      moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
                      moe_layer_freq="([0]+[1]*3)", moe_token_dispatcher_type="alltoall")


def _mixtral(**overrides) -> inputs.Workload:
    """Mixtral 8x7B's shape: 32 layers, hidden 4096, 8 experts of 14336, top-2, GQA 32/8, vocab 32000."""
    model = plan_flags.model_from_flags(32, 4096, 32, 32000, 4096, ffn_hidden_size=14336, num_query_groups=8,
                                        swiglu=True, position_embedding_type="rope", normalization="RMSNorm",
                                        add_bias_linear=False, untie_embeddings_and_output_weights=True,
                                        hidden_dropout=0.0, attention_dropout=0.0, num_experts=8, moe_router_topk=2,
                                        moe_token_dispatcher_type="alltoall", **overrides)
    return inputs.Workload(model, global_batch_size=512)


# ---- parameters per rank ------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,ep,etp", [(1, 1, 1), (1, 4, 1), (2, 2, 1), (2, 1, 2), (2, 4, 2), (1, 2, 2)])
def test_parameters_per_rank_equal_gptmodels_at_every_expert_rank(tp, ep, etp):
    """Dense and expert parameters (param_meta(p).expert) of GPTModel built on the meta device at each
    TP x EP x ETP rank: experts E/EP whole, f/ETP of each; the router, the gated shared expert and the
    dense first layer (--moe-layer-freq) as TP shards them."""
    from megalite.train.command_line import parse_args
    from megalite.model.gpt import GPTModel
    from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
    from megalite.parallel.param_meta import param_meta
    from megalite.parallel.tensor.layers import TensorParallel
    model = parse_args(TINY_MOE, world_size=1).model
    workload = inputs.Workload(dataclasses.replace(model, vocab_size=model.padded_vocab_size), 4,
                               make_vocab_size_divisible_by=1)
    planned = inputs.stage_parameters(workload, inputs.Layout(tp=tp, ep=ep, etp=None if etp == tp else etp), 0)
    total_experts = 0
    for t in range(tp):
        for e in range(ep):
            for r in range(etp):
                moe = MoEContext(ExpertParallel(ep_rank=e, ep_size=ep, etp_rank=r, etp_size=etp))
                built = GPTModel(model, moe=moe, tp=TensorParallel(rank=t, size=tp), meta=True)
                params = list(built.parameters())
                expert = sum(p.numel() for p in params if param_meta(p).expert)
                dense = sum(p.numel() for p in params if not param_meta(p).expert)
                assert (dense, expert) == (planned.dense, planned.experts), (t, e, r)
                total_experts += expert if t == 0 else 0
    # the pieces over EP x ETP make every expert once: 3 MoE layers x 8 experts x (2f + f) x h
    assert total_experts == 3 * 8 * 3 * 96 * 64


def test_pipeline_stages_count_their_own_moe_layers():
    """--moe-layer-freq decides per layer: each pipeline stage's chunks (build_model_chunks) hold the
    experts of their own MoE layers."""
    from megalite.train.command_line import parse_args
    from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
    from megalite.parallel.param_meta import param_meta
    from megalite.model.chunks import build_model_chunks
    from megalite.parallel.tensor.layers import TensorParallel
    model = parse_args(with_flags(TINY_MOE, num_layers=8, moe_layer_freq="([0]*3+[1]*5)"), world_size=1).model
    workload = inputs.Workload(dataclasses.replace(model, vocab_size=model.padded_vocab_size), 4,
                               make_vocab_size_divisible_by=1)
    for pp, vpp in ((2, 1), (2, 2), (4, 1)):
        layout = inputs.Layout(pp=pp, vpp=vpp, ep=2)
        for rank in range(pp):
            chunks = build_model_chunks(model, 1, TensorParallel(), rank, pp, vpp, meta=True,
                                        moe=MoEContext(ExpertParallel(ep_rank=1, ep_size=2)))
            params = [p for chunk in chunks for p in chunk.parameters()]
            planned = inputs.stage_parameters(workload, layout, rank)
            assert planned.experts == sum(p.numel() for p in params if param_meta(p).expert)
            assert planned.total == sum(p.numel() for p in params)
    assert inputs.rank_moe_layers(workload, inputs.Layout(pp=2, vpp=2), 0) == 2     # layers 1-2 and 5-6


# ---- the search ---------------------------------------------------------------------------------------
def test_search_offers_expert_grids_that_pretrain_gpt_accepts():
    """EP over the divisors of the expert count, ETP 1 or TP; every kept layout's flags parse back into
    the same layout (megalite's rules, check_experts included) and every dropped one is refused."""
    from megalite.train.command_line import parse_args
    argv = with_flags(TINY_MOE, seq_length=64, max_position_embeddings=64, global_batch_size=8)
    model = parse_args(argv, world_size=1).model
    workload = inputs.Workload(model, 8, "bf16")
    hardware = inputs.Hardware(num_gpus=8, gpu_memory_gb=80, gpus_per_node=4)
    pins = search.Pins(micro_batch_size=1, recompute="none", sharding="optim")
    kept = set(search.candidate_layouts(workload, hardware, pins))
    assert {lay.ep for lay in kept} == {1, 2, 4, 8}
    assert {lay.expert_tp for lay in kept} == {1, 2, 4}              # ETP 8 would span a 4-GPU node
    assert any(lay.ep > 1 and lay.expert_tp > 1 for lay in kept)
    for layout in (lay for lay in search.layouts_of(workload, 8, pins) if pins.allow(lay, model.num_layers)):
        flags = plan_flags.pretrain_flags(workload, layout)
        layout_argv = with_flags(argv, global_batch_size=None, micro_batch_size=None) + flags
        if layout in kept:
            assert plan_flags.workload_and_layout(parse_args(layout_argv, world_size=8))[1] == layout
        elif layout.shards > 1 and layout.expert_tp <= 4:
            with pytest.raises(UserError):
                parse_args(layout_argv, world_size=8)


def test_plan_picks_expert_parallelism_for_mixtral():
    """On 16 x 80 GB with the distributed optimizer only layouts that split the experts (EP > 1) fit
    Mixtral: without EP every rank of a stage holds all 8 experts of its layers, and their optimizer
    state shards over the data-parallel ranks only."""
    pins = search.Pins(recompute="none", sharding="optim", micro_batch_size=1)
    best = search.plan(_mixtral(), inputs.Hardware(16, 80), pins, top=3)
    assert best and all(e.layout.ep > 1 for e in best)
    with pytest.raises(UserError, match="no layout fits 16 x 80 GB"):
        search.plan(_mixtral(), inputs.Hardware(16, 80), dataclasses.replace(pins, ep=1))


# ---- communication and compute ------------------------------------------------------------------------
def test_dispatch_volume_against_a_hand_count():
    """Per MoE layer and micro-batch, T tokens of the rank (SP share), k = 2, h = 4096, bf16:
    alltoall sends T k h-rows out and back forward, (EP-1)/EP of them off the rank, and again backward;
    ETP adds an all-gather of the received rows and a reduce-scatter of the outputs, (ETP-1) T k rows
    each; allgather gathers (g-1) T tokens (with k int64 ids and fp32 weights each) and reduce-scatters
    (g-1) T rows, forward and backward."""
    workload = _mixtral()
    layout = inputs.Layout(tp=2, dp=4, micro_batch_size=2, ep=4, etp=1)
    T, h, e = 4096 * 2 // 2, 4096, 2
    row = h * e
    assert experts.dispatch_bytes(workload, layout) == 2 * (2 * T * 2 * row * 3 / 4)
    etp2 = dataclasses.replace(layout, etp=2)
    assert experts.dispatch_bytes(workload, etp2) == 2 * (2 * T * 2 * row * 3 / 4 + 2 * 1 * T * 2 * row)
    gather = dataclasses.replace(workload, model=dataclasses.replace(workload.model,
                                                                     moe_token_dispatcher_type="allgather"))
    assert experts.dispatch_bytes(gather, etp2) == 2 * (7 * T * row + 7 * T * 2 * (8 + 4) + 7 * T * row)
    # the step: every MoE layer, every micro-batch, over the EP x ETP span (8 GPUs: NVLink)
    hardware = inputs.Hardware(8, 80)
    m = layout.num_microbatches(workload.global_batch_size)
    seconds = experts.dispatch_bytes(workload, layout) * 32 * m / (hardware.intra_node_gbps * 1e9)
    assert timing.step_time(workload, layout, hardware).expert_parallel == pytest.approx(seconds)


def test_expert_flops_follow_the_six_n_rule_of_active_parameters():
    """Model FLOPs of an MoE step: 6 x the parameters a token passes through (top-2 of 8 experts, the
    router; not the embedding lookup) x tokens, plus attention's scores and values (3 x 4 s h per
    token and layer): Mixtral's 12.9B active parameters."""
    workload = _mixtral()
    model = workload.model
    expert = 3 * 14336 * 4096
    total = inputs.count_parameters(dataclasses.replace(workload, make_vocab_size_divisible_by=1))
    active = total - 32 * (8 - 2) * expert - 32000 * 4096
    assert 12.8e9 < active + 32000 * 4096 < 13.0e9
    tokens = 512 * 4096
    flops, _ = timing.hardware_flops(dataclasses.replace(workload, make_vocab_size_divisible_by=1), inputs.Layout())
    norms = 32 * 2 * 4096 + 4096                 # (norm weights multiply nothing)
    assert flops == pytest.approx(6 * (active - norms) * tokens + 3 * 4 * 4096 * 4096 * 32 * tokens)


# ---- memory --------------------------------------------------------------------------------------------
def test_zero_shards_experts_over_the_expert_data_parallel_group():
    """EDP = tp x cp x dp / (ETP x EP): with EP = 8 on 16 ranks per stage the experts shard over 2 ranks,
    the dense parameters over the 8 data-parallel ranks; ZeRO-1's 6 + 12/d bytes per parameter each."""
    workload = _mixtral()
    layout = inputs.Layout(tp=2, pp=4, dp=8, ep=8, etp=1, sharding="optim")
    assert layout.expert_shards == 2
    params = inputs.stage_parameters(workload, layout, 1)
    assert params.experts == 8 * 3 * 14336 * 4096           # 8 layers, one whole expert each
    mem = memory.rank_memory(workload, layout, 1)
    assert mem.optimizer == pytest.approx(12 * params.dense / 8 + 12 * params.experts / 2)
    assert mem.grads >= 4 * params.total
    no_ep = dataclasses.replace(layout, ep=1)
    assert no_ep.expert_shards == 16
    assert inputs.stage_parameters(workload, no_ep, 1).experts == 8 * params.experts


def test_mixtral_on_64_gpus_fits_with_expert_parallelism():
    """Mixtral 8x7B at EP=8, TP=2, PP=4 on 64 ranks, seq 4096, one sequence per micro-batch: 0.70B expert
    and about 0.23B dense parameters per rank, 18 bytes each without ZeRO (bf16 weights, fp32 gradients,
    Adam), plus 1F1B's activations on the first stage: a sensible 20-72 GB of an 80 GB H100."""
    workload = _mixtral()
    layout = inputs.Layout(tp=2, pp=4, dp=8, ep=8)
    params = inputs.stage_parameters(workload, layout, 0)
    assert params.experts == 8 * 3 * 14336 * 4096 // 2                            # ETP = TP = 2
    assert 0.2e9 < params.dense < 0.26e9
    mem = memory.estimate_memory(workload, layout)
    assert mem.weights + mem.grads + mem.optimizer == pytest.approx(18 * params.total)
    assert 20 * inputs.GiB < mem.total < 72 * inputs.GiB
    assert mem.total < memory.estimate_memory(workload, dataclasses.replace(layout, ep=1)).total


def test_dropless_margin_raises_the_dispatched_rows():
    """The busiest rank's rows: margin x the mean for dropless routing, the capacity factor when tokens
    drop beyond it; the rows' memory (input rows, hidden units) grows with it, the router's does not."""
    workload = _mixtral()
    layout = inputs.Layout(tp=2, pp=4, dp=8, ep=8)
    T = 4096 // 2
    assert experts.dispatched_rows(workload, layout, T) == pytest.approx(2 * T * 2 * 1.2)
    even = dataclasses.replace(workload, moe_imbalance_margin=1.0)
    rows_bytes = 2 * T * 2 * (4096 + 4 * 14336 // 2) * 2 + 2 * T * 2 * 16              # rows x (h + 4f) x e + ids
    assert experts.moe_activation_bytes(workload, layout) - experts.moe_activation_bytes(even, layout) == \
        pytest.approx(0.2 * rows_bytes)
    capped = dataclasses.replace(workload, model=dataclasses.replace(workload.model, moe_expert_capacity_factor=1.5))
    assert capped.dispatch_margin == 1.5


# ---- Hugging Face configs ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_hf_moe_config_gives_the_parameter_count_of_transformers_and_megalite(family, tmp_path):
    """--hf-config of an MoE family (checkpoint/hf_config.py's mapping): the planner counts what
    transformers and megalite build (Qwen2-MoE's gated shared expert, Qwen3-MoE's q/k head norms)."""
    import transformers
    from megalite.checkpoint.hf_config import read_hf_config_file
    from megalite.model.gpt import GPTModel
    cls, extra = {"mixtral": ("Mixtral", dict(num_local_experts=4)),
                  "qwen2_moe": ("Qwen2Moe", dict(num_experts=4, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48)),
                  "qwen3_moe": ("Qwen3Moe", dict(num_experts=4, moe_intermediate_size=32))}[family]
    config = getattr(transformers, f"{cls}Config")(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=128, tie_word_embeddings=False, num_experts_per_tok=2, **extra)
    hf_model = getattr(transformers, f"{cls}ForCausalLM")(config)
    config.save_pretrained(tmp_path)
    model = plan_flags.model_from_hf_config(read_hf_config_file(str(tmp_path)), seq_length=128)
    assert model.num_experts == 4
    unpadded = inputs.Workload(model, 8, make_vocab_size_divisible_by=1)
    assert inputs.count_parameters(unpadded) == sum(p.numel() for p in hf_model.parameters())
    padded = inputs.Workload(model, 8)
    megalite_model = GPTModel(dataclasses.replace(model, padded_vocab_size=padded.padded_vocab(1)), meta=True)
    assert inputs.count_parameters(padded) == sum(p.numel() for p in megalite_model.parameters())


# ---- the command line ----------------------------------------------------------------------------------
MIXTRAL_FLAGS = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads",
                 "32", "--group-query-attention", "--num-query-groups", "8", "--swiglu", "--normalization", "RMSNorm",
                 "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--vocab-size", "32000",
                 "--seq-length", "4096", "--global-batch-size", "512", "--num-gpus", "16", "--gpu-memory-gb", "80",
                 "--recompute-granularity", "none", "--use-distributed-optimizer", "--micro-batch-size", "1"]


def test_cli_plans_an_moe_model_with_expert_flags(capsys):
    import plan_parallelism
    code = plan_parallelism.main(MIXTRAL_FLAGS + ["--disable-bias-linear", "--num-experts", "8", "--moe-router-topk",
                                                  "2", "--moe-token-dispatcher-type", "alltoall", "--top", "2"])
    out = capsys.readouterr().out
    assert code == 0 and "46.70B parameters" in out and "MoE in 32 layers: 8 experts of 14336, top-2" in out
    flags = [line for line in out.splitlines() if re.match(r"\s+#\d+: ", line)]
    assert len(flags) == 2 and all("--expert-model-parallel-size" in f for f in flags)


def test_cli_moe_mistakes_are_one_line_errors(capsys):
    import plan_parallelism
    cases = {("--disable-bias-linear", "--moe-router-topk", "4"): "--moe-router-topk applies to MoE layers",
             ("--num-experts", "8", "--expert-tensor-parallel-size", "2"): "no layout of 16 GPUs suits",
             ("--disable-bias-linear", "--num-experts", "8", "--moe-imbalance-margin", "0.5"): "--moe-imbalance-margin",
             ("--disable-bias-linear", "--num-experts", "8", "--expert-model-parallel-size", "3"):
                 "--expert-model-parallel-size 3"}
    for argv, expected in cases.items():
        code = plan_parallelism.main(MIXTRAL_FLAGS + list(argv))
        err = capsys.readouterr().err
        assert code == 1 and expected in err and err.count("\n") == 1, (argv, err)
