"""Multi-latent attention under parallelism: a tiny MLA model trained through the real training loop at
TP=2 (without and with sequence parallelism: the replicated down projections' and latent norms'
gradients), CP=2 (ring, all-to-all and all-gather: K/V head dims unlike V's, the shared RoPE key expanded
per head) and TP=2 x CP=2 equals the single-process run, with q-LoRA, and with DeepSeek-V2-Lite's full
query projection over packed documents (--reset-attention-mask) and learned softmax sinks."""
import pytest

from harness import run_ranks
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

MLA = with_flags(TINY_LLAMA_ARGS, group_query_attention=None, num_query_groups=None, multi_latent_attention=True,
                 q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=12,
                 qk_layernorm=True, rotary_scaling_factor=2.0, mscale_all_dim=1.0, train_iters=4, lr="3e-3",
                 clip_grad=1.0, make_vocab_size_divisible_by=32)
# the full query projection over packed documents (mock samples of 1 to 3 documents at this seed), with sinks
LITE = with_flags(MLA, q_lora_rank=None, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True,
                  seed=2, softmax_type="learnable")
LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
           "cp2-p2p": dict(context_parallel_size=2), "cp2-a2a": dict(context_parallel_size=2, cp_comm_type="a2a"),
           "cp2-allgather": dict(context_parallel_size=2, cp_comm_type="allgather")}


def _train(rank, world, runs):
    from megalite.train.trainer import pretrain
    return [pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history for argv in runs]


def _assert_equal(got, want, name):
    assert len(got) == len(want) == 4, name
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-5), (name, got, want)


def test_mla_training_at_tp2_and_cp2_equals_single_process():
    serial = dict(zip(("mla", "lite"), _train(0, 1, [MLA, LITE])))
    runs = {f"{model}-{name}": with_flags(base, **flags) for model, base in (("mla", MLA), ("lite", LITE))
            for name, flags in LAYOUTS.items()}
    results = run_ranks(2, _train, list(runs.values()))
    for histories in results:                         # every rank logs the whole loss
        for (name, _), history in zip(runs.items(), histories):
            _assert_equal(history, serial[name.split("-")[0]], name)


@pytest.mark.slow
def test_mla_training_at_tp2_sp_times_cp2_equals_single_process():
    serial = _train(0, 1, [LITE])[0]
    argv = with_flags(LITE, tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                      cp_comm_type="a2a")
    for history in run_ranks(4, _train, [argv])[0]:
        _assert_equal(history, serial, "tp2-sp-cp2-a2a")
