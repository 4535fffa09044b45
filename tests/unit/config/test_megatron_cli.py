"""Megatron's command line -> config dataclasses: defaults, derived values, and one-line errors."""
import pytest

from megalite_test_utils import TINY_GPT2_ARGS, TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.config.schema import default_ffn_hidden_size, padded_vocab_size
from megalite.errors import UserError


def parse(argv, world_size=1):
    return parse_args(argv, world_size=world_size)


def test_llama_flags_map_onto_model_config():
    cfg = parse(TINY_LLAMA_ARGS)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (2, 64, 176, 4)
    assert m.num_query_groups == 2 and m.kv_channels == 16
    assert m.use_rope and m.normalization == "RMSNorm" and m.swiglu and not m.add_bias_linear
    assert m.untie_embeddings_and_output_weights
    # NullTokenizer: vocab 200 + eod = 201, padded to a multiple of 128
    assert m.vocab_size == 201 and m.padded_vocab_size == 256
    assert cfg.num_microbatches == 2 and cfg.training.train_iters == 4


def test_megatron_defaults():
    cfg = parse(TINY_GPT2_ARGS)
    m, o, t, d = cfg.model, cfg.optimizer, cfg.training, cfg.data
    assert m.position_embedding_type == "learned_absolute" and m.normalization == "LayerNorm"
    assert m.add_bias_linear and not m.untie_embeddings_and_output_weights
    assert m.num_query_groups == m.num_attention_heads          # no GQA unless asked
    assert m.ffn_hidden_size == 4 * 64 and m.init_method_std == 0.02 and m.norm_epsilon == 1e-5
    assert (o.weight_decay, o.adam_beta1, o.adam_beta2, o.adam_eps, o.clip_grad) == (0.01, 0.9, 0.999, 1e-8, 1.0)
    assert o.lr_decay_style == "linear" and o.min_lr == 0.0 and o.initial_loss_scale == 2.0 ** 32
    assert (o.loss_scale_window, o.hysteresis) == (1000, 2)
    assert t.seed == 1234 and t.eval_interval == 1000 and t.distributed_timeout_minutes == 10
    assert d.split == "969, 30, 1"
    assert m.params_dtype == "float32"


def test_defaults_that_megatron_derives():
    assert default_ffn_hidden_size(4096, swiglu=True) == 10880     # Megatron's 2/3 rule, multiple of 64
    assert default_ffn_hidden_size(768, swiglu=False) == 3072
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    argv = with_flags(TINY_LLAMA_ARGS, global_batch_size=None, max_position_embeddings=None)
    cfg = parse(argv)
    assert cfg.training.global_batch_size == 2                     # micro-batch x data-parallel 1
    assert cfg.model.max_position_embeddings == 32                 # defaults to --seq-length


def test_precision_flags():
    assert parse(with_flags(TINY_LLAMA_ARGS, bf16=True)).model.params_dtype == "bfloat16"
    cfg = parse(with_flags(TINY_LLAMA_ARGS, fp16=True, initial_loss_scale=1024, hysteresis=1))
    assert cfg.model.params_dtype == "float16" and cfg.optimizer.initial_loss_scale == 1024
    assert cfg.optimizer.hysteresis == 1


def test_train_samples_and_warmup_fraction_become_iterations():
    argv = with_flags(TINY_LLAMA_ARGS, train_iters=None, train_samples=40, lr_warmup_fraction=0.25,
                      lr_decay_samples=32)
    cfg = parse(argv)
    assert cfg.training.train_iters == 10                     # 40 samples / global batch 4
    assert cfg.optimizer.lr_decay_iters == 8                  # 32 samples / 4
    assert cfg.optimizer.lr_warmup_iters == 2                 # 0.25 x 8


def test_gradient_accumulation_derived_from_dp_size():
    cfg = parse(with_flags(TINY_LLAMA_ARGS, global_batch_size=16), world_size=1)
    assert cfg.num_microbatches == 8


@pytest.mark.parametrize("overrides, message", [
    ({"global_batch_size": 30, "micro_batch_size": 4},
     "--global-batch-size 30 must be divisible by --micro-batch-size 4 x data-parallel size 1"),
    ({"lr": None}, "--lr is required"),
    ({"num_layers": None}, "--num-layers is required"),
    ({"train_iters": None}, "--train-iters N or --train-samples N"),
    ({"train_samples": 100}, "--train-iters and --train-samples are exclusive"),
    ({"bf16": True, "fp16": True}, "--bf16 and --fp16 are exclusive"),
    ({"hidden_size": 66}, "--hidden-size 66 must be divisible by --num-attention-heads 4"),
    ({"num_query_groups": 3}, "--num-attention-heads 4 must be divisible by --num-query-groups 3"),
    ({"group_query_attention": False}, "--num-query-groups needs --group-query-attention"),
    ({"max_position_embeddings": 16}, "--seq-length 32 exceeds --max-position-embeddings 16"),
    ({"hidden_dropout": 1.5}, "--hidden-dropout must be in [0, 1)"),
    ({"attention_dropout": -0.1}, "--attention-dropout must be in [0, 1)"),
    ({"init_method_std": 0}, "--init-method-std must be > 0"),
    ({"min_lr": 1.0}, "--min-lr 1.0 must be in [0, --lr"),
    ({"lr": -1}, "--lr must be > 0"),
    ({"lr_warmup_iters": 2, "lr_warmup_fraction": 0.1}, "are exclusive; give one warm-up"),
    ({"lr_warmup_iters": 10, "lr_decay_iters": 4}, "the warm-up (10 iterations) is longer than the decay (4 iterations)"),
    ({"lr_decay_style": "WSD"}, "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    ({"lr_decay_style": "exotic"}, "argument --lr-decay-style: invalid choice"),
    ({"normalization": "BatchNorm"}, "argument --normalization: invalid choice"),
    ({"num_layers": 0}, "argument --num-layers: must be a positive integer"),
    ({"micro_batch_size": "two"}, "argument --micro-batch-size"),
    ({"mock_data": False}, "no training data: give --data-path PREFIX"),
    ({"data_path": "data/x_text_document"}, "--mock-data and --data-path/--train-data-path are exclusive"),
    ({"tokenizer_type": None}, "--tokenizer-type is required"),
    ({"tokenizer_type": "SentencePieceTokenizer"}, "--vocab-size only applies to --tokenizer-type NullTokenizer"),
    ({"vocab_size": None}, "--tokenizer-type NullTokenizer needs --vocab-size"),
    ({"split": "90,x,1"}, "--split '90,x,1' must be up to 3 non-negative weights"),
    ({"adam_beta2": 1.0}, "--adam-beta2 must be in [0, 1)"),
    ({"fp16": True, "loss_scale": -1}, "--loss-scale must be > 0"),
    ({"kv_channels": 15, "hidden_size": 60}, "rope needs an even head dimension"),
    ({"bogus_flag": 3}, "unrecognized arguments: --bogus-flag 3"),
    ({"tensor_model_parallel_size": 3}, "--num-attention-heads 4 must be divisible by --tensor-model-parallel-size 3"),
    ({"tensor_model_parallel_size": 2, "ffn_hidden_size": 175}, "--ffn-hidden-size 175 must be divisible"),
    ({"num_attention_heads": 12, "num_query_groups": 4, "tensor_model_parallel_size": 6, "hidden_size": 96},
     "--tensor-model-parallel-size 6 must be a multiple of --num-query-groups 4"),
    ({"tensor_model_parallel_size": 4, "sequence_parallel": True, "seq_length": 30, "max_position_embeddings": 30},
     "--sequence-parallel needs --seq-length 30 divisible by --tensor-model-parallel-size 4"),
    ({"recompute_granularity": "full"}, "--recompute-granularity full needs --recompute-method"),
    ({"recompute_granularity": "selective", "recompute_method": "block"}, "apply only to --recompute-granularity full"),
])
def test_bad_combinations_give_one_line_naming_the_flag(overrides, message):
    with pytest.raises(UserError) as err:
        parse(with_flags(TINY_LLAMA_ARGS, **overrides))
    text = str(err.value)
    assert message in text
    assert "\n" not in text


@pytest.mark.parametrize("overrides, message", [
    ({"save_interval": 5}, "--save-interval needs --save"),
    ({"async_save": True}, "--async-save needs --save"),
    ({"non_persistent_save_interval": 2, "save": "/tmp/x"}, "--non-persistent-save-interval needs "
                                                             "--non-persistent-ckpt-type"),
    ({"non_persistent_ckpt_type": "local", "save": "/tmp/x"}, "--non-persistent-ckpt-type local needs "
                                                               "--non-persistent-local-ckpt-dir"),
    ({"non_persistent_ckpt_type": "global"}, "--non-persistent-ckpt-type needs --save"),
    ({"finetune": True}, "--finetune needs --load"),
    ({"use_checkpoint_args": True}, "--use-checkpoint-args needs --load"),
    ({"load": "/nonexistent/ckpt", "use_checkpoint_args": True}, "--load /nonexistent/ckpt: no such directory"),
])
def test_checkpoint_flag_mistakes(overrides, message):
    with pytest.raises(UserError) as err:
        parse(with_flags(TINY_LLAMA_ARGS, **overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_run_shorter_than_its_warm_up_is_accepted():
    cfg = parse(with_flags(TINY_LLAMA_ARGS, train_iters=1, lr_warmup_iters=2))      # smoke tests do this
    assert cfg.optimizer.lr_warmup_iters == 2 and cfg.optimizer.lr_decay_iters == 1


def test_data_parallel_flags_map_onto_parallel_config():
    cfg = parse(with_flags(TINY_LLAMA_ARGS, global_batch_size=8), world_size=4)
    assert cfg.parallel.data_parallel_size == 4 and cfg.num_microbatches == 1
    assert cfg.parallel.data_parallel_sharding_strategy == "no_shard" and not cfg.parallel.use_distributed_optimizer
    cfg = parse(TINY_LLAMA_ARGS + ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                                   "--ddp-bucket-size", "1000"], world_size=2)
    p = cfg.parallel
    assert (p.data_parallel_sharding_strategy, p.use_distributed_optimizer, p.overlap_grad_reduce,
            p.overlap_param_gather, p.ddp_bucket_size) == ("optim", True, True, True, 1000)
    for strategy in ("optim_grads", "optim_grads_params"):
        cfg = parse(TINY_LLAMA_ARGS + ["--data-parallel-sharding-strategy", strategy], world_size=2)
        assert cfg.parallel.data_parallel_sharding_strategy == strategy and cfg.parallel.use_distributed_optimizer


@pytest.mark.parametrize("flags, message", [
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "no_shard"],
     "--use-distributed-optimizer shards the optimizer state but --data-parallel-sharding-strategy no_shard"),
    (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    (["--data-parallel-sharding-strategy", "zero9"], "--data-parallel-sharding-strategy: invalid choice"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size: must be a positive integer"),
])
def test_bad_data_parallel_flags_give_one_line(flags, message):
    with pytest.raises(UserError) as err:
        parse(TINY_LLAMA_ARGS + flags, world_size=2)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, world, message", [
    ({"pipeline_model_parallel_size": 2}, 1, "world size 1 is not divisible by --tensor-model-parallel-size 1 x "
                                             "--pipeline-model-parallel-size 2"),
    ({"pipeline_model_parallel_size": 2, "num_layers": 3}, 2, "--num-layers 3 must be divisible by --pipeline-model"),
    ({"pipeline_model_parallel_size": 2, "num_layers": 4, "num_layers_per_virtual_pipeline_stage": 1,
      "global_batch_size": 6}, 2, "needs the number of micro-batches (3) to be a multiple of"),
    ({"pipeline_schedule": "zigzag"}, 1, "argument --pipeline-schedule: invalid choice"),
])
def test_bad_pipeline_flags(overrides, world, message):
    with pytest.raises(UserError) as err:
        parse(with_flags(TINY_LLAMA_ARGS, **overrides), world_size=world)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_compat_flags_are_accepted():
    cfg = parse(TINY_LLAMA_ARGS + ["--use-flash-attn", "--use-mcore-models", "--transformer-impl", "local"])
    assert cfg.model.num_layers == 2
