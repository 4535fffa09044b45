"""The planner on the DeepSeek-V3 family: multi-latent attention's parameters and kept activations, the
multi-token prediction layers on the last stage, and group-limited routing's dispatch, against hand
counts of DeepSeek-V3 671B and GPTModel as built on the meta device."""
import dataclasses

import pytest

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.planning import buckets, deepseek, experts, inputs, memory
from megalite.planning import flags as plan_flags

H, HEADS, VOCAB = 7168, 128, 129280


def _deepseek_v3(**overrides) -> inputs.Workload:
    """DeepSeek-V3 671B: 61 layers of 7168, MLA (q 1536, kv 512, heads 128 of 128 + 64 RoPE, v 128), the
    first 3 layers dense (18432), then 256 routed experts of 2048 (top 8) and one shared, untied
    embeddings over 129280 tokens, one MTP depth."""
    fields = dict(ffn_hidden_size=18432, swiglu=True, position_embedding_type="rope", normalization="RMSNorm",
                  add_bias_linear=False, untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                  attention_dropout=0.0, multi_latent_attention=True, qk_layernorm=True, q_lora_rank=1536,
                  kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=256,
                  moe_router_topk=8, moe_layer_freq=[0] * 3 + [1] * 58, moe_ffn_hidden_size=2048,
                  moe_shared_expert_intermediate_size=2048, moe_router_score_function="sigmoid",
                  moe_token_dispatcher_type="alltoall", mtp_num_layers=1)
    layers = overrides.pop("num_layers", 61)
    model = plan_flags.model_from_flags(layers, H, HEADS, VOCAB, 4096, **{**fields, **overrides})
    return inputs.Workload(model, global_batch_size=8192, make_vocab_size_divisible_by=3232)


# MLA's tensors of one DeepSeek-V3 layer at TP=1, by hand: q down, q norm, q up, kv down, kv norm, kv up, proj
MLA_V3 = [1536 * H, 1536, HEADS * (128 + 64) * 1536, (512 + 64) * H, 512, HEADS * (128 + 128) * 512, H * HEADS * 128]


def test_mla_parameters_of_deepseek_v3_by_hand():
    """At TP=2 the heads split (q up, kv up, linear_proj halve) and the down projections and their
    norms stay whole; without --q-lora-rank one query projection [heads x 192, h] replaces q's three."""
    model = _deepseek_v3().model
    assert deepseek.mla_tensors(model, 1) == MLA_V3
    assert deepseek.mla_tensors(model, 2) == [1536 * H, 1536, 64 * 192 * 1536, 576 * H, 512, 64 * 256 * 512,
                                              H * 64 * 128]
    assert deepseek.mla_tensors(dataclasses.replace(model, q_lora_rank=None), 1)[:1] == [HEADS * 192 * H]
    layer = inputs.layer_tensors(model, 1)              # a dense layer: norm, MLA, norm, SwiGLU MLP
    assert layer == [H, *MLA_V3, H, 2 * 18432 * H, 18432 * H]


def test_deepseek_v3_has_671b_parameters_and_its_mtp_depth_11_6b():
    """The main model, by hand: embedding and output layer, final norm, 61 x (MLA + 2 norms), 3 dense
    SwiGLU MLPs, 58 x (router, 256 experts, shared expert): 671.03B, DeepSeek's 671B. The MTP depth adds
    an MoE layer, 3 norms and eh_proj [h, 2h]: 11.61B (13.46B in the released checkpoint, which stores
    its own copies of the embedding and the output layer: 684.5B in all)."""
    main = (2 * VOCAB * H + H + 61 * (sum(MLA_V3) + 2 * H) + 3 * 3 * 18432 * H
            + 58 * (256 * H + 256 * 3 * 2048 * H + 3 * 2048 * H))
    mtp = sum(MLA_V3) + 2 * H + 256 * H + 256 * 3 * 2048 * H + 3 * 2048 * H + 3 * H + 2 * H * H
    workload = _deepseek_v3()
    no_mtp = dataclasses.replace(workload, model=dataclasses.replace(workload.model, mtp_num_layers=None))
    assert inputs.count_parameters(no_mtp) == main and round(main / 1e9, 2) == 671.03
    assert inputs.count_parameters(workload) == main + mtp and round(mtp / 1e9, 2) == 11.61


@pytest.mark.parametrize("untied", [True, False])
def test_mtp_layers_and_the_embedding_copy_sit_on_the_last_stage(untied):
    """PP=2: the last stage holds the MTP depths (a layer of the last layer's kind, its norms and eh_proj,
    h/TP rows of it per TP rank), plus a copy of the embedding when the output layer is not the tied one's
    copy already; the first stage holds none of it, and the gradient buffer's tensors add up."""
    workload = _deepseek_v3(num_layers=4, moe_layer_freq=[0, 1, 1, 1], untie_embeddings_and_output_weights=untied,
                            mtp_num_layers=2)
    plain = dataclasses.replace(workload, model=dataclasses.replace(workload.model, mtp_num_layers=None))
    layout = inputs.Layout(tp=2, pp=2, ep=8)
    first, last = (inputs.stage_parameters(workload, layout, r) for r in (0, 1))
    assert first == inputs.stage_parameters(plain, layout, 0)
    before = inputs.stage_parameters(plain, layout, 1)
    vocab_rows = workload.padded_vocab(2) // 2
    glue = 3 * H + H // 2 * 2 * H
    moe_layer = inputs.layer_parameters(workload.model, 2, (8, 2))
    assert last.total - before.total == 2 * (moe_layer + glue) + (vocab_rows * H if untied else 0)
    assert last.experts - before.experts == 2 * inputs.expert_parameters(workload.model, 8, 2)
    assert sum(p.size for p in buckets.backward_tensors(workload, layout, 1)) == last.total
    one_stage = inputs.stage_parameters(workload, inputs.Layout(tp=2, ep=8), 0)      # PP=1: no copy
    assert one_stage.total == inputs.stage_parameters(plain, inputs.Layout(tp=2, ep=8), 0).total + 2 * (moe_layer + glue)


def test_mla_keeps_its_latents_and_the_expanded_heads():
    """Per token on a TP rank: q and kv latents twice each (norm input, up-projection input), q and k
    expanded to the rank's heads (128 + 64 each), v and the output (128 each)."""
    model = _deepseek_v3().model
    assert memory.attention_saved_elements(model, 2, 10) == 10 * (2 * 1536 + 2 * 512 + 2 * 64 * 192 + 2 * 64 * 128)


def test_mtp_depths_keep_a_layer_and_a_loss_each():
    """The last stage keeps, per depth and micro-batch in flight: the layer's activations, enorm's, hnorm's
    and eh_proj's inputs (4 h per token) and its own output head's."""
    workload = _deepseek_v3(num_layers=4, moe_layer_freq=[0, 1, 1, 1], mtp_num_layers=2)
    plain = dataclasses.replace(workload, model=dataclasses.replace(workload.model, mtp_num_layers=None))
    layout = inputs.Layout(tp=2, pp=2, ep=8)
    kernels = inputs.GPU_KERNELS
    layer = memory.layer_activation_bytes(workload, layout, kernels, moe=True)
    head, _ = memory.output_layer_bytes(workload, layout, kernels)
    _, sp_tokens = inputs.token_counts(workload, layout)
    extra = memory.kept_activations(workload, layout, 1, kernels) - memory.kept_activations(plain, layout, 1, kernels)
    assert extra == 2 * (layer + 4 * sp_tokens * H * 2 + head)
    assert memory.kept_activations(workload, layout, 0, kernels) == memory.kept_activations(plain, layout, 0, kernels)


def test_group_limited_routing_sends_the_same_rows():
    """megalite's dispatchers send one row per (token, expert) pair, so restricting a token to g groups
    changes which ranks receive its k rows, not how many: the volume is that of plain top-k."""
    workload = _deepseek_v3()
    grouped = dataclasses.replace(workload, model=dataclasses.replace(workload.model, moe_router_num_groups=8,
                                                                      moe_router_group_topk=4))
    layout = inputs.Layout(tp=2, pp=16, dp=32, ep=64)
    assert experts.dispatch_bytes(grouped, layout) == experts.dispatch_bytes(workload, layout) > 0


TINY_V3 = with_flags(TINY_LLAMA_ARGS, num_layers=3, group_query_attention=None, num_query_groups=None, num_experts=8,
                     moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_layer_freq="([0]+[1]*2)",
                     moe_token_dispatcher_type="alltoall", multi_latent_attention=True, qk_layernorm=True,
                     q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12,
                     mtp_num_layers=2, rotary_scaling_factor=4)


@pytest.mark.parametrize("tp", [1, 2])
def test_planned_parameters_equal_a_tiny_deepseek_v3_built_on_meta(tp):
    """GPTModel with MLA (q-LoRA, latent norms), two MTP depths and MoE layers after a dense one, built on
    the meta device at each TP rank: the planner's count of a one-stage rank is the model's."""
    from megalite.train.command_line import parse_args
    from megalite.model.gpt import GPTModel
    from megalite.parallel.expert.dispatch import ExpertParallel, MoEContext
    from megalite.parallel.tensor.layers import TensorParallel
    model = parse_args(TINY_V3, world_size=1).model
    workload = inputs.Workload(dataclasses.replace(model, vocab_size=model.padded_vocab_size), 4,
                               make_vocab_size_divisible_by=1)
    planned = inputs.stage_parameters(workload, inputs.Layout(tp=tp), 0)
    for rank in range(tp):
        experts = MoEContext(ExpertParallel(etp_rank=rank, etp_size=tp))      # ETP = TP, the default
        built = GPTModel(model, tp=TensorParallel(rank=rank, size=tp), meta=True, moe=experts)
        assert sum(p.numel() for p in built.parameters()) == planned.total, rank


def test_mla_flops_replace_the_attention_term_by_hand():
    """Forward FLOPs per token of a DeepSeek-V3 attention: 2 x its projection weights (q down and up, kv
    down and up, output: 374.2M) and 2 s x 128 heads x (192 + 128) for scores and values; the correction
    is that less what the kv_channels formula counted."""
    model = _deepseek_v3().model
    s, d = model.seq_length, model.kv_channels
    counted = 2 * H * (3 * HEADS) * d + 4 * s * HEADS * d + 2 * HEADS * d * H
    by_hand = 2 * (sum(MLA_V3) - 1536 - 512) + 2 * s * HEADS * (192 + 128)
    assert deepseek.mla_flops_correction(model) + counted == by_hand
    assert deepseek.mla_flops_correction(dataclasses.replace(model, multi_latent_attention=False)) == 0.0


@pytest.mark.parametrize("schedule,pp,vpp", [("1f1b", 4, 1), ("1f1b", 4, 2), ("1f1b", 2, 4), ("gpipe", 4, 1),
                                             ("gpipe", 2, 2), ("zb-h1", 4, 1), ("zbv", 4, 2)])
def test_the_loss_chunk_holds_what_the_schedules_order_keeps(schedule, pp, vpp):
    """The micro-batches through the last virtual stage (the loss and the MTP depths) whose backward has
    not run, at most, counted on the order the pipeline executor runs."""
    from megalite.parallel.pipeline.orders import schedule_order, stage_placement
    m = 8
    rank, chunk = next((r, c) for r in range(pp) for c in range(vpp)
                       if stage_placement(schedule)(r, c, pp) == pp * vpp - 1)
    alive = most = 0
    for action in schedule_order(schedule, pp, rank, m, vpp):
        if action.chunk == chunk and action.kind in "FB":
            alive += 1 if action.kind == "F" else -1
            most = max(most, alive)
    assert memory.loss_chunk_in_flight(inputs.Layout(pp=pp, vpp=vpp, schedule=schedule), m) == most


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_mtp_on_an_interleaved_last_stage_is_a_dry_runs_peak(recompute):
    """One MTP depth with a large vocabulary (its loss keeps an fp32 softmax as large as a layer) on the last
    rank of a PP=2 x 2-chunk pipeline: interleaved 1F1B runs the loss chunk's backward right after its
    forward, so the rank keeps one micro-batch's depth, not one per pair of chunks in flight. The planner's
    peak and activations against a dry run of that rank (verify.py), within 10%."""
    from megalite.planning import verify
    model = plan_flags.model_from_flags(4, 256, 4, 8192, 256, ffn_hidden_size=704, num_query_groups=2, swiglu=True,
                                        position_embedding_type="rope", normalization="RMSNorm",
                                        add_bias_linear=False, untie_embeddings_and_output_weights=True,
                                        attention_dropout=0.0, hidden_dropout=0.0, mtp_num_layers=1)
    workload = inputs.Workload(model, 8, "bf16")
    layout = inputs.Layout(pp=2, vpp=2, micro_batch_size=2, recompute=recompute)
    measured = verify.measured_categories(verify.measure(verify.measuring_argv(
        workload, layout, verify.Role(1, 1, "last")), 1))
    planned = verify.estimated_categories(memory.rank_memory(workload, layout, 1, inputs.GPU_KERNELS))
    for category in ("activations", "total"):
        assert planned[category] == pytest.approx(measured[category], rel=0.1), (category, planned, measured)
