"""Typed configuration: what one run needs, grouped by concern, and the sizes derived from it.

Every module receives the dataclass it needs explicitly; nothing reads global argument state. Field
names follow Megatron's flag names (``--num-query-groups`` -> ``num_query_groups``) so a reader of
Megatron's docs finds them here. A field set by a command-line flag carries that flag in its metadata
(``flag(...)``: name, type, choices, help; megatron_cli.py builds the parser from it); a field computed
from other inputs says how (``derived(...)``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megalite.config.cli import (integer, moe_layer_pattern, non_negative_int, number, positive_float, positive_int,
                                 window_pair)
from megalite.config.fields import derived, flag
from megalite.config.deepseek_fields import DeepSeekFields
from megalite.config.fp8_fields import Fp8Fields, Fp8GatherFields
from megalite.config.model_variants import ModelVariantFields
from megalite.config.muon_fields import MuonFields, QKClipFields
from megalite.errors import UserError

# ---- the pipeline schedules --pipeline-schedule names, in one place ------------------------------------
SYNCHRONOUS_SCHEDULES = ("1f1b", "gpipe", "zb-h1", "zbv")    # flush every step: equal to one process
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zbv")                     # backward split into B and W (Qi et al. 2024)
ASYNC_SCHEDULES = ("pipedream", "pipedream-2bw")             # no flush, weight stashing (pipedream.py)
PIPELINE_SCHEDULES = SYNCHRONOUS_SCHEDULES + ASYNC_SCHEDULES
# --data-parallel-sharding-strategy: ZeRO stage 0 (replicated), 1 (optimizer state), 2 (+ gradients), 3 (+ params)
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# --optimizer: the update rules megalite implements (optim/rules/: one module each, registered by this name)
OPTIMIZERS = ("adam", "muon")
# --softmax-type: plain softmax, a fixed extra logit 0 in every denominator, or a learned one per head
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")

# ---- derived sizes, in one place ------------------------------------------------------------------------
def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP size."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """4h, or with SwiGLU Megatron's 2/3 of 4h rounded down to a multiple of 64."""
    if swiglu:
        return int((4 * hidden_size * 2 / 3) / 64) * 64
    return 4 * hidden_size


def default_kv_channels(hidden_size: int, num_attention_heads: int) -> int:
    """The head dimension when --kv-channels is not given: hidden / heads, which must divide."""
    if hidden_size % num_attention_heads:
        raise UserError(f"--hidden-size {hidden_size} must be divisible by --num-attention-heads "
                        f"{num_attention_heads} (or give --kv-channels)")
    return hidden_size // num_attention_heads


def rotary_dim(head_dim: int, rotary_percent: float) -> int:
    """Dimensions of each head that RoPE rotates (Megatron: int(kv_channels * rotary_percent))."""
    return int(head_dim * rotary_percent)


def is_window_layer(window_size, window_attn_skip_freq, layer_number: int) -> bool:
    """Whether 1-based layer ``layer_number`` has the --window-size window (Megatron's
    --window-attn-skip-freq: N keeps layers N, 2N, ... full; a list marks window layers 1, full ones 0)."""
    skip = window_attn_skip_freq
    return window_size is not None and (
        skip is None or (layer_number % skip != 0 if isinstance(skip, int) else bool(skip[layer_number - 1])))


@dataclass
class ModelConfig(ModelVariantFields, DeepSeekFields, QKClipFields, Fp8Fields):
    num_layers: int = flag("--num-layers", positive_int)
    hidden_size: int = flag("--hidden-size", positive_int)
    num_attention_heads: int = flag("--num-attention-heads", positive_int)
    ffn_hidden_size: int = flag("--ffn-hidden-size", positive_int,
                                help="default 4*hidden, or Megatron's 2/3 rule with --swiglu")
    kv_channels: int = flag("--kv-channels", positive_int, help="head dimension; default hidden/heads")
    num_query_groups: int = flag("--num-query-groups", positive_int,
                                 help="KV heads, with --group-query-attention (default: one per attention head)")
    seq_length: int = flag("--seq-length", positive_int)
    max_position_embeddings: int = flag("--max-position-embeddings", positive_int, help="default --seq-length")
    padded_vocab_size: int = derived("the tokenizer's vocabulary padded to --make-vocab-size-divisible-by x TP size")
    vocab_size: int = derived("the tokenizer's true vocabulary (logits are trimmed to it on export)", 0)
    position_embedding_type: str = flag("--position-embedding-type", default="learned_absolute",
                                        choices=("learned_absolute", "rope", "yarn"))
    rotary_base: float = flag("--rotary-base", number, default=10000.0)
    rotary_percent: float = flag("--rotary-percent", number, default=1.0, help=(
        "RoPE on this fraction of each head's dimensions, the rest pass through (partial rotary)"))
    normalization: str = flag("--normalization", default="LayerNorm", choices=("LayerNorm", "RMSNorm"))
    norm_epsilon: float = flag("--norm-epsilon", number, default=1e-5)
    apply_layernorm_1p: bool = flag("--apply-layernorm-1p", default=False, help=(
        "zero-centred norm weights: the norm scales by (weight + 1), weights start at 0"))
    swiglu: bool = flag("--swiglu", default=False)
    openai_gelu: bool = flag("--openai-gelu", default=False, help="tanh-approximated GELU (GPT-2); exact GELU otherwise")
    add_bias_linear: bool = flag("--disable-bias-linear", default=True)
    add_qkv_bias: bool = flag("--add-qkv-bias", default=False,
                              help="q/k/v biases even with --disable-bias-linear (Qwen2)")
    qk_layernorm: bool = flag("--qk-layernorm", default=False, help=(
        "normalise each head of q and k (--normalization, over the head dimension) before RoPE (Qwen3)"))
    untie_embeddings_and_output_weights: bool = flag("--untie-embeddings-and-output-weights", default=False)
    init_method_std: float = flag("--init-method-std", number, default=0.02)
    attention_dropout: float = flag("--attention-dropout", number, default=0.1)
    hidden_dropout: float = flag("--hidden-dropout", number, default=0.1)
    params_dtype: str = derived("--bf16 / --fp16 / neither: the dtype compute runs in", "float32")
    reset_position_ids: bool = derived("--reset-position-ids: RoPE at the batch's positions, not 0..s-1", False)
    recompute_granularity: Optional[str] = flag("--recompute-granularity", default=None, choices=("full", "selective"))
    recompute_method: Optional[str] = flag("--recompute-method", default=None, choices=("uniform", "block"))
    recompute_num_layers: Optional[int] = flag("--recompute-num-layers", positive_int, default=None)
    # ---- attention shape (model/attention): a sliding window on some layers, and a softmax sink
    window_size: Optional[list] = flag("--window-size", window_pair, default=None, help=(
        '"LEFT,RIGHT": query i sees keys i-LEFT..i+RIGHT (-1: unbounded; RIGHT is 0 in a causal model); '
        "absent: full attention"))
    window_attn_skip_freq: object = flag("--window-attn-skip-freq", moe_layer_pattern, default=None, help=(
        "with --window-size: every N-th layer (N, 2N, ...) keeps full attention (int), or a 1 (window) / "
        '0 (full) list per layer such as "([1]*3+[0])*2"; absent: every layer has the window'))
    softmax_type: str = flag("--softmax-type", default="vanilla", choices=SOFTMAX_TYPES, help=(
        "off-by-one: a logit 0 added to every softmax denominator; learnable: one learned logit per head (a sink)"))
    cross_entropy_loss_fusion: bool = flag("--cross-entropy-loss-fusion", default=False, help=(
        "chunked vocabulary-parallel cross-entropy: fp32 logits of a chunk of tokens at a time"))
    # ---- Mixture of Experts (model/moe.py): the MLP of the layers --moe-layer-freq selects
    num_experts: Optional[int] = flag("--num-experts", positive_int, default=None,
                                      help="experts per MoE layer (absent: a dense model)")
    moe_layer_freq: object = flag("--moe-layer-freq", moe_layer_pattern, default=1, help=(
        'MoE every N-th layer (int), or a 0/1 list per layer such as "([0]*3+[1]*29)" (dense first layers)'))
    moe_ffn_hidden_size: Optional[int] = flag("--moe-ffn-hidden-size", positive_int, default=None,
                                              help="each expert's hidden size (default --ffn-hidden-size)")
    moe_shared_expert_intermediate_size: Optional[int] = flag(
        "--moe-shared-expert-intermediate-size", positive_int, default=None,
        help="hidden size of the shared expert every token also goes through (absent: none)")
    moe_shared_expert_gate: bool = flag("--moe-shared-expert-gate", default=False, help=(
        "scale the shared expert's output by sigmoid(a learned linear of the token), as Qwen2-MoE"))
    moe_router_topk: int = flag("--moe-router-topk", positive_int, default=2, help="experts per token")
    moe_router_score_function: str = flag("--moe-router-score-function", default="softmax",
                                          choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: bool = flag("--moe-router-pre-softmax", default=False, help=(
        "softmax over all experts, then top-k (weights not renormalised); default: softmax over the top-k"))
    moe_router_topk_scaling_factor: Optional[float] = flag("--moe-router-topk-scaling-factor", positive_float,
                                                           default=None, help="multiplies the routing weights")
    moe_router_dtype: str = flag("--moe-router-dtype", default="fp32", choices=("fp32", "fp64"),
                                 help="dtype of the router's logits, scores and auxiliary losses")
    moe_router_load_balancing_type: str = flag("--moe-router-load-balancing-type", default="aux_loss",
                                               choices=("aux_loss", "seq_aux_loss", "none"))
    moe_aux_loss_coeff: float = flag("--moe-aux-loss-coeff", number, default=0.0)
    moe_z_loss_coeff: Optional[float] = flag("--moe-z-loss-coeff", number, default=None)
    moe_router_enable_expert_bias: bool = flag("--moe-router-enable-expert-bias", default=False, help=(
        "auxiliary-loss-free balancing: a per-expert bias added to the scores for top-k selection only, "
        "moved once per step towards the mean load (DeepSeek-V3)"))
    moe_router_bias_update_rate: float = flag("--moe-router-bias-update-rate", number, default=1e-3)
    moe_router_force_load_balancing: bool = flag("--moe-router-force-load-balancing", default=False, help=(
        "route token t to experts (t*k + j) mod E whatever the scores (benchmarks only)"))
    moe_grouped_gemm: bool = flag("--moe-grouped-gemm", default=False,
                                  help="accepted; experts always run as one grouped GEMM")
    moe_token_dispatcher_type: str = flag("--moe-token-dispatcher-type", default="allgather",
                                          choices=("allgather", "alltoall"))
    moe_expert_capacity_factor: Optional[float] = flag("--moe-expert-capacity-factor", number, default=None, help=(
        "drop tokens beyond factor x (tokens x topk / experts) per expert, counted over this rank's "
        "own tokens, so which tokens drop depends on the layout (absent: dropless)"))
    moe_pad_expert_input_to_capacity: bool = flag("--moe-pad-expert-input-to-capacity", default=False,
                                                  help="with a capacity factor: every expert computes capacity rows")
    moe_token_drop_policy: str = flag("--moe-token-drop-policy", default="probs", choices=("probs", "position"),
                                      help="beyond capacity drop the lowest-weighted tokens, or the latest ones")

    @property
    def use_rope(self) -> bool:
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def attention_type(self) -> str:
        """Key of the attention module every layer builds (megalite.model.attention.ATTENTION): "self",
        grouped-query self-attention with a fused QKV projection, or "mla", multi-latent attention."""
        return "mla" if self.multi_latent_attention else "self"

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether 1-based layer ``layer_number`` has an MoE in place of its MLP (Megatron's --moe-layer-freq:
        every N-th layer counting from the first, or a per-layer 0/1 list)."""
        if not self.num_experts:
            return False
        if isinstance(self.moe_layer_freq, int):
            return (layer_number - 1) % self.moe_layer_freq == 0
        return bool(self.moe_layer_freq[layer_number - 1])

    def attention_window(self, layer_number: int) -> tuple[int, int]:
        """(left, right) window of 1-based layer ``layer_number``, (-1, -1) for full attention."""
        windowed = is_window_layer(self.window_size, self.window_attn_skip_freq, layer_number)
        return tuple(self.window_size) if windowed else (-1, -1)

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def kv_projection_size(self) -> int:
        return self.kv_channels * self.num_query_groups


@dataclass
class ParallelConfig(Fp8GatherFields):
    world_size: int = derived("the launcher's WORLD_SIZE (parallel/launch_env.py)", 1)
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", positive_int, default=1)
    pipeline_model_parallel_size: int = flag("--pipeline-model-parallel-size", positive_int, default=1)
    context_parallel_size: int = flag("--context-parallel-size", positive_int, default=1)
    # the ring, Ulysses, Ulysses inside rings or K/V all-gathered (parallel/context/); one value or one per layer
    cp_comm_type: list[str] = flag("--cp-comm-type", factory=lambda: ["p2p"], nargs="+",
                                   choices=("p2p", "a2a", "a2a+p2p", "allgather"))
    hierarchical_context_parallel_sizes: Optional[list[int]] = flag("--hierarchical-context-parallel-sizes", positive_int,
                                                                    default=None, nargs="+")
    num_layers_per_virtual_pipeline_stage: Optional[int] = flag("--num-layers-per-virtual-pipeline-stage",
                                                                positive_int, default=None)
    # uneven pipeline splits (config/pipeline_split.py: virtual_stage_layers)
    num_virtual_stages_per_pipeline_rank: Optional[int] = flag(
        "--num-virtual-stages-per-pipeline-rank", positive_int, default=None,
        help="model chunks per pipeline rank (the way to interleave with uneven first/last stages)")
    decoder_first_pipeline_num_layers: Optional[int] = flag(
        "--decoder-first-pipeline-num-layers", int, default=None,
        help="transformer layers on the first pipeline stage; the middle stages split the rest evenly")
    decoder_last_pipeline_num_layers: Optional[int] = flag(
        "--decoder-last-pipeline-num-layers", int, default=None,
        help="transformer layers on the last pipeline stage; the middle stages split the rest evenly")
    account_for_embedding_in_pipeline_split: bool = flag(
        "--account-for-embedding-in-pipeline-split", default=False,
        help="count the embedding as one layer when splitting layers over pipeline stages")
    account_for_loss_in_pipeline_split: bool = flag(
        "--account-for-loss-in-pipeline-split", default=False,
        help="count the output layer and loss as one layer when splitting layers over pipeline stages")
    pipeline_model_parallel_layout: Optional[str] = flag("--pipeline-model-parallel-layout", default=None, help=(
        'Megatron\'s layout string, e.g. "Et*3|(tt|)*2,t|L": stages split by |, E embedding, t transformer layer, '
        "L loss; pp x vpp stages"))
    sequence_parallel: bool = flag("--sequence-parallel", default=False)
    pipeline_schedule: str = flag("--pipeline-schedule", default="1f1b", choices=PIPELINE_SCHEDULES,
                                  help="pipeline schedule (1f1b becomes interleaved 1F1B whenever virtual stages are used)")
    use_distributed_optimizer: bool = flag("--use-distributed-optimizer", default=False,
                                           help="= --data-parallel-sharding-strategy optim (ZeRO-1)")
    use_layer_wise_distributed_optimizer: bool = flag("--use-layer-wise-distributed-optimizer", default=False, help=(
        "ZeRO layout: each data-parallel rank owns whole parameters (assigned to ranks balanced by size, each "
        "rank's share of a bucket padded to the largest) instead of the r-th equal slice of every bucket; needs "
        "a sharding strategy other than no_shard"))
    overlap_grad_reduce: bool = flag("--overlap-grad-reduce", default=False)
    overlap_param_gather: bool = flag("--overlap-param-gather", default=False)
    data_parallel_sharding_strategy: str = flag(
        "--data-parallel-sharding-strategy", default="no_shard", choices=SHARDING_STRATEGIES, cli_default=None,
        help="ZeRO stage: optim = 1 (= --use-distributed-optimizer), optim_grads = 2, optim_grads_params = 3; "
             "default no_shard")
    num_distributed_optimizer_instances: int = flag(
        "--num-distributed-optimizer-instances", positive_int, default=1, help=(
            "hybrid sharding (HSDP): split the data-parallel (x context-parallel) ranks into this many instances "
            "of consecutive ranks; ZeRO shards optimizer state (and gradients / parameters) within an instance and "
            "all-reduces each gradient shard across instances (default 1: shard over all of them)"))
    ddp_bucket_size: Optional[int] = flag("--ddp-bucket-size", positive_int, default=None, help=(
        "elements per data-parallel gradient bucket (default max(40M, 1M x data-parallel size) with "
        "--overlap-grad-reduce, else one bucket)"))
    grad_reduce_in_bf16: bool = flag("--grad-reduce-in-bf16", default=False,
                                     help="data-parallel gradient reductions in bf16 (gradient accumulation stays fp32)")
    gradient_accumulation_fusion: bool = flag("--no-gradient-accumulation-fusion", default=True, help=(
        "compute each linear's weight gradient on its own and add it into the fp32 main_grad after; by default the "
        "matmul adds it in place (fp32 weights; bf16/fp16 on CUDA)"))
    expert_model_parallel_size: int = flag("--expert-model-parallel-size", positive_int, default=1,
                                           help="EP: ranks the experts of each MoE layer are split over")
    expert_tensor_parallel_size: Optional[int] = flag(
        "--expert-tensor-parallel-size", positive_int, default=None,
        help="ETP: ranks each expert's hidden dimension is split over (default --tensor-model-parallel-size)")
    fake_process_group: bool = flag("--fake-process-group", default=False, help=(
        "dry run: this process plays one rank (--fake-rank, or RANK) of a world of --fake-world-size (or "
        "WORLD_SIZE) ranks on torch's fake backend, whose collectives do nothing; it builds that rank's "
        "grid, shards and schedule and trains on them, to measure its memory without the other ranks"))
    fake_world_size: Optional[int] = flag("--fake-world-size", positive_int, default=None)
    fake_rank: Optional[int] = flag("--fake-rank", non_negative_int, default=None)
    no_storage: bool = flag("--no-storage", default=False, help=(
        "with --fake-process-group: tensors have shapes and no storage (the meta device), so a rank too large "
        "for this machine dry-runs in seconds; its memory is accounted by category, peak included"))
    use_torch_fsdp2: bool = flag("--use-torch-fsdp2", default=False, help=(
        "PyTorch FSDP2 (fully_shard per layer) instead of megalite's own data parallelism; ZeRO-3 by default, "
        "--data-parallel-sharding-strategy optim_grads keeps parameters gathered from forward to backward"))

    def __post_init__(self):
        # the one place --use-distributed-optimizer and the strategy agree: ZeRO-1 is "optim"
        if self.use_distributed_optimizer and self.data_parallel_sharding_strategy == "no_shard":
            self.data_parallel_sharding_strategy = "optim"
        self.use_distributed_optimizer = self.data_parallel_sharding_strategy != "no_shard"

    @property
    def expert_tp_size(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """EDP: the ranks holding the same experts, world / (ETP x EP x PP) (Megatron's expert grid)."""
        return self.world_size // (self.expert_tp_size * self.expert_model_parallel_size
                                   * self.pipeline_model_parallel_size)

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // self.model_parallel_size


@dataclass
class OptimizerConfig(MuonFields):
    lr: float = flag("--lr", number)
    optimizer: str = flag("--optimizer", default="adam", choices=OPTIMIZERS,
                          help="update rule: adam = AdamW (decoupled weight decay), muon = Muon + AdamW")
    min_lr: float = flag("--min-lr", number, default=0.0)
    weight_decay: float = flag("--weight-decay", number, default=0.01)
    adam_beta1: float = flag("--adam-beta1", number, default=0.9)
    adam_beta2: float = flag("--adam-beta2", number, default=0.999)
    adam_eps: float = flag("--adam-eps", number, default=1e-8)
    clip_grad: float = flag("--clip-grad", number, default=1.0)
    bf16: bool = flag("--bf16", default=False)
    fp16: bool = flag("--fp16", default=False)
    loss_scale: Optional[float] = flag("--loss-scale", number, default=None,
                                       help="static fp16 loss scale; dynamic when absent")
    initial_loss_scale: float = flag("--initial-loss-scale", number, default=2.0 ** 32)
    min_loss_scale: float = flag("--min-loss-scale", number, default=1.0)
    loss_scale_window: int = flag("--loss-scale-window", positive_int, default=1000)
    hysteresis: int = flag("--hysteresis", positive_int, default=2)
    # the learning-rate schedule, in iterations (megatron_cli.py converts the --*-samples and fraction forms)
    lr_decay_style: str = flag("--lr-decay-style", default="linear",
                               choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"))
    lr_decay_iters: Optional[int] = flag("--lr-decay-iters", positive_int, default=None, help="default --train-iters")
    lr_warmup_iters: int = flag("--lr-warmup-iters", non_negative_int, default=0)
    lr_warmup_init: float = flag("--lr-warmup-init", number, default=0.0)
    lr_wsd_decay_style: str = flag("--lr-wsd-decay-style", default="exponential",
                                   choices=("exponential", "linear", "cosine", "minus_sqrt"))
    lr_wsd_decay_iters: Optional[int] = flag("--lr-wsd-decay-iters", positive_int, default=None)
    # the input embedding and output layer follow the same schedule between these instead of lr / min_lr
    decoupled_lr: Optional[float] = flag("--decoupled-lr", positive_float, default=None,
                                         help="learning rate of the input embedding and output layer (the rest use --lr)")
    decoupled_min_lr: Optional[float] = flag("--decoupled-min-lr", number, default=None, help=(
        "minimum learning rate of the input embedding and output layer (with --decoupled-lr; default --min-lr)"))


@dataclass
class DataConfig:
    data_path: list[str] = flag("--data-path", factory=list, nargs="*",
                                help='PREFIX, or "W1 PREFIX1 W2 PREFIX2 ..."')
    train_data_path: list[str] = flag("--train-data-path", factory=list, nargs="*")
    valid_data_path: list[str] = flag("--valid-data-path", factory=list, nargs="*")
    test_data_path: list[str] = flag("--test-data-path", factory=list, nargs="*")
    split: str = flag("--split", default="969, 30, 1", cli_default=None,
                      help='train,valid,test weights, default "969, 30, 1"')
    data_cache_path: Optional[str] = flag("--data-cache-path", default=None)
    mock_data: bool = flag("--mock-data", default=False)
    tokenizer_type: Optional[str] = flag("--tokenizer-type", default=None, choices=(
        "GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"))
    tokenizer_model: Optional[str] = flag("--tokenizer-model", default=None)
    vocab_file: Optional[str] = flag("--vocab-file", default=None)
    merge_file: Optional[str] = flag("--merge-file", default=None)
    vocab_size: Optional[int] = flag("--vocab-size", positive_int, default=None,
                                     help="vocabulary of NullTokenizer (eod is one past it)")
    num_workers: int = flag("--num-workers", non_negative_int, default=2)
    eod_mask_loss: bool = flag("--eod-mask-loss", default=False)
    reset_position_ids: bool = flag("--reset-position-ids", default=False, help="positions restart at 0 after each EOD")
    reset_attention_mask: bool = flag("--reset-attention-mask", default=False, help="attention stays within documents")
    seq_length: int = derived("ModelConfig.seq_length (--seq-length): the samples' length", 1024)
    mmap_bin_files: bool = flag("--no-mmap-bin-files", default=True,
                                help="read each .bin file into memory instead of memory-mapping it")


@dataclass
class TrainingConfig:
    micro_batch_size: int = flag("--micro-batch-size", positive_int)
    global_batch_size: int = flag("--global-batch-size", positive_int,
                                  help="default micro-batch-size x data-parallel size")
    train_iters: int = flag("--train-iters", positive_int)
    seed: int = flag("--seed", integer, default=1234)
    log_interval: int = flag("--log-interval", positive_int, default=100)
    eval_interval: int = flag("--eval-interval", positive_int, default=1000)
    eval_iters: int = flag("--eval-iters", non_negative_int, default=100)
    log_throughput: bool = flag("--log-throughput", default=False)
    log_memory_breakdown: bool = flag("--log-memory-breakdown", default=False, help=(
        "every rank prints the bytes of its first training step by category (parameters, gradients, "
        "optimizer state, activations by layer, data-parallel buffers) at the step's peak; "
        "--fake-process-group dry runs always do"))
    timing_log_level: int = flag("--timing-log-level", integer, default=0, choices=(0, 1, 2))
    # --log-straggler: train/straggler.py
    log_straggler: bool = flag("--log-straggler", default=False, help=(
        "at each --log-interval name the ranks whose compute time per iteration (step time minus time blocked on "
        "communication) exceeds --straggler-factor x the median rank's, else the slowest and fastest ranks "
        "(one small all-gather per log interval)"))
    straggler_minmax_count: int = flag("--straggler-minmax-count", positive_int, default=1,
                                       help="with --log-straggler: how many slowest (and fastest) ranks to report")
    straggler_factor: float = flag("--straggler-factor", positive_float, default=1.3, help=(
        "with --log-straggler: a rank is named when its compute time exceeds this x the median rank's (a megalite "
        "flag)"))
    disable_straggler_on_startup: bool = flag("--disable-straggler-on-startup", default=False, help=(
        "with --log-straggler: start with the report off, until turned on through --straggler-ctrlr-port"))
    straggler_ctrlr_port: int = flag("--straggler-ctrlr-port", non_negative_int, default=65535, help=(
        "with --log-straggler: rank 0 listens on this port; each HTTP request (curl HOST:PORT) turns the report "
        "on or off at the next log interval (0: no controller)"))
    tensorboard_dir: Optional[str] = flag("--tensorboard-dir", default=None)
    wandb_project: Optional[str] = flag("--wandb-project", default=None)
    wandb_exp_name: Optional[str] = flag("--wandb-exp-name", default=None)
    wandb_entity: Optional[str] = flag("--wandb-entity", default=None)
    wandb_save_dir: Optional[str] = flag("--wandb-save-dir", default=None)
    metrics_file: Optional[str] = flag("--metrics-file", default=None, help=(
        "JSON-lines metrics; default metrics.jsonl in --save/--tensorboard-dir/--wandb-save-dir"))
    save: Optional[str] = flag("--save", default=None)
    load: Optional[str] = flag("--load", default=None)
    save_interval: Optional[int] = flag("--save-interval", positive_int, default=None)
    async_save: bool = flag("--async-save", default=False, help=(
        "write checkpoints while training goes on: each rank's shard is snapshotted (a copy-on-write fork on CPU, "
        "reusable pinned host memory on GPU) and written in the background; a save is published only once every "
        "rank's files are on disk, the next save waits for the previous one, and so does the end of the run"))
    non_persistent_save_interval: Optional[int] = flag("--non-persistent-save-interval", positive_int, default=None,
                                                       help=(
        "also save a cheap checkpoint every this many iterations (--non-persistent-ckpt-type), keeping the newest "
        "two; --load resumes from the newest complete checkpoint, persistent or not"))
    non_persistent_ckpt_type: Optional[str] = flag("--non-persistent-ckpt-type", default=None,
                                                   choices=("global", "local"), help=(
        "global: in --non-persistent-global-ckpt-dir, shared by all ranks; local: in --non-persistent-local-ckpt-dir, "
        "a directory of each node's own"))
    non_persistent_global_ckpt_dir: Optional[str] = flag("--non-persistent-global-ckpt-dir", default=None,
                                                         help="default: SAVE/non_persistent")
    non_persistent_local_ckpt_dir: Optional[str] = flag("--non-persistent-local-ckpt-dir", default=None, help=(
        "a node-local directory (fast local disk) for --non-persistent-ckpt-type local"))
    non_persistent_local_ckpt_algo: str = flag("--non-persistent-local-ckpt-algo", default="fully_parallel",
                                               choices=("fully_parallel", "atomic"), help=(
        "accepted for Megatron's scripts: every rank writes its own files either way"))
    no_load_optim: bool = flag("--no-load-optim", default=False)
    no_load_rng: bool = flag("--no-load-rng", default=False)
    finetune: bool = flag("--finetune", default=False)
    use_checkpoint_args: bool = flag("--use-checkpoint-args", default=False)
    exit_signal_handler: bool = flag("--exit-signal-handler", default=False, help=(
        "on SIGTERM/SIGINT finish the iteration, save a checkpoint (with --save) and exit 0"))
    exit_duration_in_mins: Optional[float] = flag("--exit-duration-in-mins", positive_float, default=None, help=(
        "stop (saving a checkpoint with --save) once training has run this long"))
    exit_interval: Optional[int] = flag("--exit-interval", positive_int, default=None, help=(
        "stop (saving a checkpoint with --save) at the first iteration that is a multiple of this"))
    peak_flops: Optional[float] = flag("--peak-flops", positive_float, default=None, help=(
        "one device's peak FLOP/s (e.g. 989e12 for an H100 in bf16), for the MFU in the log; default: a table of "
        "known GPUs; MFU is left out on CPUs without it"))
    skip_nan_iterations: bool = flag("--skip-nan-iterations", default=False, help=(
        "a NaN/Inf loss or gradient norm skips that update and training goes on (default: stop)"))
    distributed_timeout_minutes: float = flag("--distributed-timeout-minutes", positive_float, default=10, help=(
        "a collective waiting longer than this (a rank died or hung) ends the run with an error"))
    # [(consumed samples from which it applies, global batch size), ...] ascending; empty: global_batch_size
    batch_size_schedule: list = derived("--rampup-batch-size or --step-batch-size-schedule", factory=list)
    calculate_per_token_loss: bool = flag("--calculate-per-token-loss", default=False, help=(
        "loss = sum over every token of the global batch / their count (not a mean of micro-batch means)"))
    log_params_norm: bool = flag("--log-params-norm", default=False, help="log the L2 norm of all parameters")
    log_num_zeros_in_grad: bool = flag("--log-num-zeros-in-grad", default=False,
                                       help="log the number of zero gradient elements")
    log_validation_ppl_to_tensorboard: bool = flag("--log-validation-ppl-to-tensorboard", default=False)
    log_timers_to_tensorboard: bool = flag("--log-timers-to-tensorboard", default=False, help=(
        "timers and Megatron's iteration-time also to tensorboard and wandb (they are always in the JSONL)"))
    manual_gc: bool = flag("--manual-gc", default=False, help=(
        "Python's garbage collector runs only at --manual-gc-interval iterations and around evaluation"))
    manual_gc_interval: int = flag("--manual-gc-interval", non_negative_int, default=0,
                                   help="with --manual-gc: collect every N iterations (0: not between training steps)")
    manual_gc_eval: bool = flag("--no-manual-gc-eval", default=True,
                                help="with --manual-gc: no collection before and after evaluation")
    empty_unused_memory_level: int = flag("--empty-unused-memory-level", integer, default=0, choices=(0, 1, 2), help=(
        "free the CUDA caching allocator's unused memory: 1 after forward-backward, 2 also after the optimizer step "
        "(no effect on CPUs)"))
    profile: bool = flag("--profile", default=False,
                         help="profile iterations [--profile-step-start, --profile-step-end) on --profile-ranks")
    profile_step_start: int = flag("--profile-step-start", non_negative_int, default=10)
    profile_step_end: int = flag("--profile-step-end", non_negative_int, default=12)
    use_pytorch_profiler: bool = flag("--use-pytorch-profiler", default=False, help=(
        "with --profile on GPUs: torch.profiler traces (default: an nsys capture range); CPUs always use "
        "torch.profiler"))
    profile_ranks: list = flag("--profile-ranks", non_negative_int, factory=lambda: [0], nargs="+")
    compile: bool = flag("--compile", default=False, help=(
        "torch.compile each transformer layer (regional; eager numerics); layouts it cannot handle say so at "
        "start-up and run eager"))
    tf32: bool = flag("--no-tf32", default=True, help=(
        "fp32 matmuls and convolutions in full fp32 (default: TF32 on Ampere and newer GPUs)"))


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


CONFIG_SECTIONS = (ModelConfig, ParallelConfig, OptimizerConfig, DataConfig, TrainingConfig)
