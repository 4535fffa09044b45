"""Megatron-LM's DeepSeek-V3 pretraining flags run through megalite's pretrain_gpt.py unmodified.

The flags of Megatron-LM's ``examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh`` (its PRETRAIN_ARGS, the
run without Megatron-FSDP) are copied below, each with its real value and a tiny one, plus what the
DeepSeek-V3 proxy of its functional tests (``deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release``) adds:
a pipeline layout with the multi-token prediction layer on the last stage, the cross-entropy flags,
--save-retain-interval, the wandb names and a GPTSentencePieceTokenizer. Only sizes and paths shrink;
every flag stays but the two that need GPU-only kernels: ``--moe-token-dispatcher-type flex`` and
``--moe-flex-dispatcher-backend hybridep`` (DeepEP/HybridEP), which megalite refuses in one line.
Checked:

- at the real sizes every flag parses and validates at a 256-rank world (DP 256, EP 8), into the model Megatron builds;
- at tiny sizes the script's flags train on 2 CPU processes at EP=2 under torchrun, saving a checkpoint,
  each flag megalite decides for itself named once at start-up.
"""
import os

import pytest

from harness import logged_losses
from test_examples import data  # noqa: F401  (the fixture: a small corpus with its tokenizers)
from test_megatron_scripts import OMIT, field, flags, paths, torchrun

# sbatch_mfsdp_deepseek_v3.sh's PRETRAIN_ARGS: (flag, real value, tiny value)
DEEPSEEK_V3 = {
    "PRETRAIN_ARGS": [
        ("--distributed-timeout-minutes", "60", "60"), ("--tensor-model-parallel-size", "1", "1"),
        ("--expert-model-parallel-size", "8", "2"), ("--expert-tensor-parallel-size", "1", "1"),
        ("--context-parallel-size", "1", "1"), ("--use-distributed-optimizer", None, None),
        ("--overlap-grad-reduce", None, None), ("--overlap-param-gather", None, None),
        ("--use-mcore-models", None, None), ("--sequence-parallel", None, None), ("--use-flash-attn", None, None),
        ("--disable-bias-linear", None, None), ("--micro-batch-size", "4", "1"),
        ("--global-batch-size", "2048", "4"), ("--train-samples", "585937500", "{samples}"),
        ("--exit-duration-in-mins", "220", "220"), ("--no-check-for-nan-in-loss-and-grad", None, None),
        ("--manual-gc", None, None), ("--manual-gc-interval", "10", "10"),
        ("--recompute-granularity", "selective", "selective"),
        ("--recompute-modules", ("mlp", "moe", "mla_up_proj", "layernorm"), ("mlp", "moe", "mla_up_proj", "layernorm")),
        ("--transformer-impl", "transformer_engine", "transformer_engine"), ("--seq-length", "4096", "32"),
        ("--data-cache-path", "{cache}", "{cache}"), ("--tokenizer-type", "HuggingFaceTokenizer", "HuggingFaceTokenizer"),
        ("--tokenizer-model", "deepseek-ai/DeepSeek-V3", "{tokenizer}"), ("--data-path", "{data}", "{data}"),
        ("--split", "99,1,0", "99,1,0"), ("--no-mmap-bin-files", None, None),
        ("--no-create-attention-mask-in-dataloader", None, None), ("--num-workers", "6", "0"),
        ("--num-layers", "61", "3"), ("--hidden-size", "7168", "64"), ("--ffn-hidden-size", "18432", "128"),
        ("--num-attention-heads", "128", "4"), ("--kv-channels", "128", "16"),
        ("--max-position-embeddings", "4096", "32"), ("--position-embedding-type", "rope", "rope"),
        ("--rotary-base", "10000", "10000"), ("--make-vocab-size-divisible-by", "3232", "3232"),
        ("--normalization", "RMSNorm", "RMSNorm"), ("--norm-epsilon", "1e-6", "1e-6"), ("--swiglu", None, None),
        ("--untie-embeddings-and-output-weights", None, None), ("--multi-latent-attention", None, None),
        ("--attention-dropout", "0.0", "0.0"), ("--hidden-dropout", "0.0", "0.0"), ("--clip-grad", "1.0", "1.0"),
        ("--weight-decay", "0.1", "0.1"), ("--qk-layernorm", None, None),
        ("--lr-decay-samples", "584765624", "16"), ("--lr-warmup-samples", "1536000", "4"),
        ("--lr-warmup-init", "3.9e-7", "3.9e-7"), ("--lr", "3.9e-6", "3.9e-3"), ("--min-lr", "3.9e-7", "3.9e-4"),
        ("--lr-decay-style", "cosine", "cosine"), ("--adam-beta1", "0.9", "0.9"), ("--adam-beta2", "0.95", "0.95"),
        ("--num-experts", "256", "8"), ("--moe-layer-freq", "[0]*3+[1]*58", "[0]*1+[1]*2"),
        ("--moe-ffn-hidden-size", "2048", "32"), ("--moe-shared-expert-intermediate-size", "2048", "32"),
        ("--moe-router-load-balancing-type", "seq_aux_loss", "seq_aux_loss"), ("--moe-router-topk", "8", "4"),
        # GPU-only kernels (DeepEP / HybridEP): dropped at both sizes
        ("--moe-token-dispatcher-type", OMIT, OMIT), ("--moe-flex-dispatcher-backend", OMIT, OMIT),
        ("--moe-router-pre-softmax", None, None), ("--moe-grouped-gemm", None, None),
        ("--moe-aux-loss-coeff", "1e-4", "1e-4"), ("--moe-router-group-topk", "4", "2"),
        ("--moe-router-num-groups", "8", "4"), ("--moe-router-topk-scaling-factor", "2.5", "2.5"),
        ("--moe-router-score-function", "sigmoid", "sigmoid"), ("--moe-router-enable-expert-bias", None, None),
        ("--moe-router-bias-update-rate", "1e-3", "1e-3"), ("--moe-router-dtype", "fp32", "fp32"),
        ("--moe-permute-fusion", None, None), ("--moe-router-force-load-balancing", None, None),
        ("--q-lora-rank", "1536", "32"), ("--kv-lora-rank", "512", "16"), ("--qk-head-dim", "128", "16"),
        ("--qk-pos-emb-head-dim", "64", "8"), ("--v-head-dim", "128", "16"),
        ("--rotary-scaling-factor", "40", "40"), ("--mscale", "1.0", "1.0"), ("--mscale-all-dim", "1.0", "1.0"),
        ("--mtp-num-layers", "1", "1"), ("--mtp-loss-scaling-factor", "0.1", "0.1"),
        ("--eval-iters", "32", "1"), ("--eval-interval", "100", "2"), ("--auto-detect-ckpt-format", None, None),
        ("--load", "{ckpt}", "{ckpt}"), ("--save", "{ckpt}", "{ckpt}"), ("--save-interval", "100", "4"),
        ("--dist-ckpt-strictness", "log_all", "log_all"), ("--init-method-std", "0.02", "0.02"),
        ("--log-timers-to-tensorboard", None, None), ("--log-memory-to-tensorboard", None, None),
        ("--log-num-zeros-in-grad", None, None), ("--log-params-norm", None, None),
        ("--log-validation-ppl-to-tensorboard", None, None), ("--log-throughput", None, None),
        ("--log-interval", "1", "1"), ("--logging-level", "40", "40"), ("--tensorboard-dir", "{tb}", "{tb}"),
        ("--bf16", None, None), ("--enable-experimental", None, None),
    ],
}
# what the functional tests' DeepSeek-V3 proxy adds (TP 2 x PP 4 x EP 16, 14 layers; tiny: PP 1)
PROXY_EXTRAS = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native", "--save-retain-interval",
                "5000", "--wandb-entity", "adlr", "--exit-interval", "47683"]
def test_deepseek_v3_flags_parse_at_their_real_size():
    from megalite.config.megatron_cli import startup_notes
    from megalite.train.command_line import parse_args
    argv = flags(DEEPSEEK_V3, "real", ckpt="/ckpt", tb="/tb", cache="/cache", data="/corpus_text_document")
    config = parse_args(argv + PROXY_EXTRAS, world_size=256, true_vocab_size=129280)
    m, t = config.model, config.training
    assert (m.num_layers, m.hidden_size, m.num_experts, m.moe_router_topk) == (61, 7168, 256, 8)
    assert m.moe_layer_freq == [0] * 3 + [1] * 58 and m.padded_vocab_size == 129280
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.mtp_num_layers) == (True, 1536, 512, 1)
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == (8, 4, 2.5)
    assert m.uses_yarn and m.rotary_head_dim == 64          # MLA takes YaRN on its 64-wide RoPE part
    assert t.skip_nan_iterations and t.wandb_entity == "adlr" and t.log_validation_ppl_to_tensorboard
    assert config.parallel.expert_model_parallel_size == 8 and not config.data.mmap_bin_files
    notes = "\n".join(startup_notes(argv + PROXY_EXTRAS))
    for flag in ("--moe-permute-fusion", "--cross-entropy-fusion-impl", "--auto-detect-ckpt-format",
                 "--dist-ckpt-strictness", "--enable-experimental", "--log-memory-to-tensorboard", "--logging-level",
                 "--save-retain-interval", "--recompute-modules", "--no-check-for-nan-in-loss-and-grad"):
        assert flag in notes, flag


def test_the_proxy_pipeline_layout_places_the_mtp_layer_on_the_last_stage():
    """The proxy's layout "Et*2|(tt|)*5t|tmL" (14 layers over 8 virtual stages of PP 4, the MTP layer m
    with the loss) parses; an m elsewhere, or one too many, is a one-line error."""
    from megalite.config.pipeline_split import stage_layers_of
    from megalite.errors import UserError
    from megalite.train.command_line import parse_args
    argv = flags(DEEPSEEK_V3, "real", ckpt="/ckpt", tb="/tb", cache="/cache", data="/corpus_text_document")
    argv += ["--num-layers", "14", "--moe-layer-freq", "([0]*3+[1]*11)", "--num-experts", "64",
             "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
             "--expert-model-parallel-size", "16", "--global-batch-size", "512", "--micro-batch-size", "1"]
    config = parse_args(argv + ["--pipeline-model-parallel-layout", "Et*2|(tt|)*5t|tmL"], world_size=256,
                        true_vocab_size=129280)
    assert stage_layers_of(14, config.parallel) == [2, 2, 2, 2, 2, 2, 1, 1]
    for layout, message in (("Et*2|(tt|)*5tm|tL", "m (multi-token prediction layers) must follow every t"),
                            ("Et*2|(tt|)*5t|tmmL", "places 2 multi-token prediction layers (m) but --mtp-num-layers")):
        with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_args(argv + ["--pipeline-model-parallel-layout", layout], world_size=256, true_vocab_size=129280)


def test_gpu_only_dispatchers_are_one_line_errors():
    from megalite.errors import UserError
    from megalite.train.command_line import parse_args
    argv = flags(DEEPSEEK_V3, "real", ckpt="/ckpt", tb="/tb", cache="/cache", data="/corpus_text_document")
    with pytest.raises((UserError, SystemExit)):
        parse_args(argv + ["--moe-token-dispatcher-type", "flex"], world_size=256, true_vocab_size=129280)


def test_deepseek_v3_flags_train_at_ep2_on_cpu(tmp_path, data):  # noqa: F811  (the fixture)
    """The script's flags at tiny sizes on 2 ranks: EP=2 (4 of the 8 experts each), data parallel 2 with
    the distributed optimizer for the rest, bf16, sigmoid routing with the expert bias, a dense first
    layer and a shared expert; 4 iterations, saved at the 4th."""
    argv = flags(DEEPSEEK_V3, "tiny", **paths(tmp_path, samples="16", tokenizer=str(data["hf_tokenizer"])))
    argv = [data["hf_data"] if a == str(tmp_path / "corpus_text_document") else a for a in argv]
    proc = torchrun(2, argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = logged_losses(proc.stdout)
    assert sorted(losses) == [1, 2, 3, 4], proc.stdout[-3000:]
    assert field(proc.stdout, 4, "global batch size") == "4"
    assert "--moe-permute-fusion" in proc.stdout.split("accepted with no effect")[1].split("\n")[0]
    assert "--recompute-modules:" in proc.stdout and "validation loss at iteration 2" in proc.stdout
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000004")
