"""Typed configuration: what `arguments.py` builds from Megatron's command line.

Every module receives the dataclass it needs explicitly; nothing reads global argument state.
Field names follow Megatron's flag names (``--num-query-groups`` -> ``num_query_groups``) so a
reader of Megatron's docs finds them here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# ---- the pipeline schedules --pipeline-schedule names, in one place ------------------------------------
SYNCHRONOUS_SCHEDULES = ("1f1b", "gpipe", "zb-h1", "zbv")    # flush every step: equal to one process
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zbv")                     # backward split into B and W (Qi et al. 2024)
ASYNC_SCHEDULES = ("pipedream", "pipedream-2bw")             # no flush, weight stashing (pipedream.py)
PIPELINE_SCHEDULES = SYNCHRONOUS_SCHEDULES + ASYNC_SCHEDULES
# --data-parallel-sharding-strategy: ZeRO stage 0 (replicated), 1 (optimizer state), 2 (and gradients),
# 3 (and parameters)
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP size."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


@dataclass
class ModelConfig:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    kv_channels: int                    # head dimension
    num_query_groups: int               # = num_attention_heads unless --group-query-attention
    seq_length: int
    max_position_embeddings: int
    padded_vocab_size: int              # true vocab padded to make_vocab_size_divisible_by * tp
    vocab_size: int = 0                 # the tokenizer's true vocabulary (logits trimmed to it on export)
    position_embedding_type: str = "learned_absolute"   # or "rope"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0         # --rotary-percent: RoPE on the first rotary_percent of each head's dims
    normalization: str = "LayerNorm"    # or "RMSNorm"
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False    # --apply-layernorm-1p: zero-centred norm weights (the norm scales by w + 1)
    swiglu: bool = False
    openai_gelu: bool = False           # tanh-approximated GELU (GPT-2); exact GELU otherwise
    add_bias_linear: bool = True
    add_qkv_bias: bool = False          # Qwen2-style q/k/v biases without other biases
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    params_dtype: str = "float32"       # "float32", "bfloat16" or "float16": the dtype compute runs in
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    cross_entropy_loss_fusion: bool = False   # chunked loss: never the fp32 logits of all tokens at once

    @property
    def use_rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def query_projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        return self.kv_channels * self.num_query_groups


@dataclass
class ParallelConfig:
    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    # uneven pipeline splits, Megatron's flags (pipeline_parallel/stages.py: virtual_stage_layers)
    num_virtual_stages_per_pipeline_rank: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    pipeline_model_parallel_layout: Optional[str] = None
    sequence_parallel: bool = False
    pipeline_schedule: str = "1f1b"          # or "gpipe"; interleaved 1F1B whenever there are virtual stages
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # no_shard | optim (ZeRO-1, = use_distributed_optimizer) | optim_grads (ZeRO-2) | optim_grads_params (ZeRO-3)
    data_parallel_sharding_strategy: str = "no_shard"
    ddp_bucket_size: Optional[int] = None       # elements per gradient bucket; None: Megatron's default
    grad_reduce_in_bf16: bool = False           # data-parallel gradient reductions in bf16 (accumulation stays fp32)
    gradient_accumulation_fusion: bool = True   # linears add their weight gradient straight into main_grad
    use_torch_fsdp2: bool = False               # PyTorch FSDP2 instead of megalite's own DP/ZeRO (distributed/fsdp2.py)

    @property
    def data_parallel_size(self) -> int:
        model_parallel = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                          * self.context_parallel_size)
        return self.world_size // model_parallel


@dataclass
class OptimizerConfig:
    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None          # static loss scale for fp16; dynamic when None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    # learning-rate schedule, in iterations (converted from samples/fractions by arguments.py)
    lr_decay_style: str = "linear"
    lr_decay_iters: Optional[int] = None
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: Optional[int] = None
    # --decoupled-lr / --decoupled-min-lr: the input embedding and output layer follow the same schedule
    # between these instead of lr / min_lr (None: they use lr / min_lr like every other parameter)
    decoupled_lr: Optional[float] = None
    decoupled_min_lr: Optional[float] = None


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)   # "prefix" or "w1 p1 w2 p2" tokens
    train_data_path: list[str] = field(default_factory=list)
    valid_data_path: list[str] = field(default_factory=list)
    test_data_path: list[str] = field(default_factory=list)
    split: str = "969, 30, 1"
    data_cache_path: Optional[str] = None
    mock_data: bool = False
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None            # for NullTokenizer
    num_workers: int = 2
    eod_mask_loss: bool = False
    seq_length: int = 1024
    mmap_bin_files: bool = True                 # --no-mmap-bin-files: read each .bin into memory instead


@dataclass
class TrainingConfig:
    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    log_throughput: bool = False
    timing_log_level: int = 0
    tensorboard_dir: Optional[str] = None
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    metrics_file: Optional[str] = None
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    use_checkpoint_args: bool = False
    exit_signal_handler: bool = False
    exit_duration_in_mins: Optional[float] = None
    exit_interval: Optional[int] = None
    peak_flops: Optional[float] = None         # one device's peak FLOP/s for MFU (default: known-GPU table)
    skip_nan_iterations: bool = False          # NaN/Inf loss or grad norm: skip the update (default: stop the run)
    distributed_timeout_minutes: float = 10
    # batch-size schedule: [(consumed samples from which it applies, global batch size), ...] ascending,
    # from --rampup-batch-size or --step-batch-size-schedule; empty: global_batch_size throughout
    batch_size_schedule: list = field(default_factory=list)
    calculate_per_token_loss: bool = False     # loss = sum over all tokens of the step / their count
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_timers_to_tensorboard: bool = False
    manual_gc: bool = False                    # Python's garbage collector runs only where we call it
    manual_gc_interval: int = 0                # with manual_gc: collect every N iterations (0: never in training)
    manual_gc_eval: bool = True                # with manual_gc: collect before and after each evaluation
    empty_unused_memory_level: int = 0         # 1: free the CUDA cache after forward-backward, 2: also after the step
    profile: bool = False                      # torch.profiler trace of iterations [profile_step_start, profile_step_end)
    profile_step_start: int = 10
    profile_step_end: int = 12
    use_pytorch_profiler: bool = False         # on GPUs: torch.profiler instead of an nsys capture range
    profile_ranks: list = field(default_factory=lambda: [0])
    compile: bool = False                      # torch.compile each transformer layer (megalite/train/compile.py)
    tf32: bool = True                          # TF32 for fp32 matmuls on Ampere+ GPUs (--no-tf32: off)


@dataclass
class MegaliteConfig:
    """Everything one run needs, grouped by concern."""
    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    training: TrainingConfig

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step at the full global batch size (the most any step of a schedule uses)."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.parallel.data_parallel_size)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch size of the step that starts after ``consumed_samples`` samples."""
        size = self.training.global_batch_size
        for start, batch in self.training.batch_size_schedule:
            if consumed_samples >= start:
                size = batch
        return size

    def num_microbatches_at(self, consumed_samples: int) -> int:
        t = self.training
        return self.global_batch_size_at(consumed_samples) // (t.micro_batch_size * self.parallel.data_parallel_size)
