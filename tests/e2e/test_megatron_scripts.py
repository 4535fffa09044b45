"""Megatron-LM's own launch scripts run through megalite's pretrain_gpt.py unmodified (issue 18).

The flag sets of Megatron-LM's ``examples/gpt3/train_gpt3_175b_distributed.sh`` (the version with
``--rampup-batch-size``), ``examples/llama/train_llama3_8b_h100_fp8.sh`` and
``examples/mixtral/train_mixtral_8x7b_distributed.sh`` are copied below, array by
array as the scripts build them, each flag with its real value and a tiny one. Only sizes shrink (and
paths, and the GPT-3 data arguments become ``--mock-data``); every flag stays. Checked:

- at the real sizes, every flag parses and validates at the scripts' world sizes (128 and 8 ranks);
- at tiny sizes, both train on 2 CPU processes under torchrun (GPT-3 with pipeline parallelism and a
  growing batch in fp16, in the slow tier; Llama-3 with data parallelism, the distributed optimizer and
  bf16), save, and a second launch of the same command, on a plain install (without the tensorboard
  package their --tensorboard-dir asks for: one warning), resumes where the first stopped;
- Mixtral's, tiny already, trains unmodified on its own 2 ranks at expert parallel size 2;
- a flag mistake under torchrun reaches the user every time: its "error:" line on stderr and in
  torchrun's "Root Cause" section.
"""
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import logged_losses
from megalite_test_utils import ROOT

TIMEOUT = 300


OMIT = object()          # a flag left out at that size


def flags(arrays: dict, size: str, **paths) -> list[str]:
    """The command line of a script: its arrays in order, each flag with its ``size`` ("real" or "tiny")
    value. A value is a string, a tuple of strings (several words), None (a switch), OMIT, and may name
    a {path}."""
    argv = []
    for array in arrays.values():
        for flag, real, tiny in array:
            value = real if size == "real" else tiny
            if value is OMIT:
                continue
            argv.append(flag)
            if value is None:
                continue
            for word in value if isinstance(value, tuple) else (value,):
                argv.append(word.format(**paths) if "{" in word else word)
    return argv


# examples/gpt3/train_gpt3_175b_distributed.sh: (flag, real value, tiny value)
GPT3_175B = {
    "GPT_MODEL_ARGS": [
        ("--num-layers", "96", "4"), ("--hidden-size", "12288", "64"), ("--num-attention-heads", "96", "4"),
        ("--seq-length", "2048", "32"), ("--max-position-embeddings", "2048", "32"),
        ("--attention-backend", "auto", "auto"),
    ],
    "TRAINING_ARGS": [
        ("--micro-batch-size", "1", "1"), ("--global-batch-size", "1536", "8"),
        ("--rampup-batch-size", ("16", "16", "5859375"), ("2", "2", "12")),
        ("--train-iters", "500000", "{iters}"), ("--weight-decay", "0.1", "0.1"), ("--adam-beta1", "0.9", "0.9"),
        ("--adam-beta2", "0.95", "0.95"), ("--init-method-std", "0.006", "0.006"), ("--clip-grad", "1.0", "1.0"),
        ("--fp16", None, None), ("--lr", "6.0e-5", "6.0e-5"), ("--lr-decay-style", "cosine", "cosine"),
        ("--min-lr", "6.0e-6", "6.0e-6"), ("--lr-warmup-fraction", ".001", ".001"),
        ("--lr-decay-iters", "430000", "40"),
    ],
    "MODEL_PARALLEL_ARGS": [
        ("--tensor-model-parallel-size", "8", "1"), ("--pipeline-model-parallel-size", "16", "2"),
    ],
    # the script reads GPT-2 BPE files and a preprocessed corpus; the tiny run uses mock data instead
    "DATA_ARGS": [
        ("--data-path", "{data}", OMIT), ("--vocab-file", "{vocab}", OMIT), ("--merge-file", "{merges}", OMIT),
        ("--split", "949,50,1", "949,50,1"),
    ],
    "EVAL_AND_LOGGING_ARGS": [
        ("--log-interval", "100", "1"), ("--save-interval", "10000", "8"), ("--eval-interval", "1000", "8"),
        ("--save", "{ckpt}", "{ckpt}"), ("--load", "{ckpt}", "{ckpt}"), ("--eval-iters", "10", "1"),
        ("--tensorboard-dir", "{tb}", "{tb}"),
    ],
}
GPT3_TINY_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200", "--num-workers", "0"]

# examples/llama/train_llama3_8b_h100_fp8.sh (DTYPE=fp8, mock data: the script's defaults)
LLAMA3_8B = {
    "MODEL_ARGS": [
        ("--use-mcore-models", None, None), ("--num-layers", "32", "2"), ("--hidden-size", "4096", "64"),
        ("--ffn-hidden-size", "14336", "176"), ("--num-attention-heads", "32", "4"),
        ("--group-query-attention", None, None), ("--num-query-groups", "8", "2"), ("--kv-channels", "128", "16"),
        ("--seq-length", "8192", "32"), ("--max-position-embeddings", "8192", "32"),
        ("--position-embedding-type", "rope", "rope"), ("--rotary-base", "1000000", "1000000"),
        ("--rotary-percent", "1.0", "1.0"), ("--attention-dropout", "0.0", "0.0"), ("--hidden-dropout", "0.0", "0.0"),
        ("--swiglu", None, None), ("--normalization", "RMSNorm", "RMSNorm"), ("--init-method-std", "0.0134", "0.0134"),
        ("--attention-backend", "fused", "fused"), ("--apply-layernorm-1p", None, None),
        ("--untie-embeddings-and-output-weights", None, None), ("--disable-bias-linear", None, None),
    ],
    "TRAINING_ARGS": [
        ("--micro-batch-size", "1", "1"), ("--global-batch-size", "128", "4"),
        ("--train-samples", "1953125000", "{samples}"), ("--lr-decay-samples", "1949218748", "64"),
        ("--lr-warmup-samples", "3906252", "8"), ("--lr", "0.00015", "0.00015"), ("--min-lr", "0.00001", "0.00001"),
        ("--decoupled-lr", "5.0e-4", "5.0e-4"), ("--decoupled-min-lr", "4.5e-5", "4.5e-5"),
        ("--lr-decay-style", "cosine", "cosine"), ("--clip-grad", "1.0", "1.0"), ("--weight-decay", "0.1", "0.1"),
        ("--adam-beta1", "0.9", "0.9"), ("--adam-beta2", "0.95", "0.95"), ("--bf16", None, None),
        ("--grad-reduce-in-bf16", None, None), ("--cross-entropy-loss-fusion", None, None),
        ("--calculate-per-token-loss", None, None), ("--manual-gc", None, None),
        ("--empty-unused-memory-level", "1", "1"), ("--exit-duration-in-mins", "235", "235"),
    ],
    "DTYPE_ARGS": [
        ("--fp8-format", "hybrid", "hybrid"), ("--fp8-amax-history-len", "1024", "1024"),
        ("--fp8-amax-compute-algo", "max", "max"), ("--fp8-param-gather", None, None),
    ],
    "MODEL_PARALLEL_ARGS": [
        ("--tensor-model-parallel-size", "1", "1"), ("--context-parallel-size", "1", "1"),
        ("--sequence-parallel", None, None),
    ],
    "DDP_ARGS": [
        ("--use-distributed-optimizer", None, None), ("--overlap-grad-reduce", None, None),
        ("--overlap-param-gather", None, None),
    ],
    # "--split '99,1,0'" sits inside a double-quoted array element that the script expands unquoted, so
    # the single quotes reach the program as part of the value
    "DATA_ARGS_LIST": [
        ("--mock-data", None, None), ("--tokenizer-type", "NullTokenizer", "NullTokenizer"),
        ("--vocab-size", "128256", "512"), ("--data-cache-path", "{cache}", "{cache}"),
        ("--tiktoken-pattern", "v2", "v2"), ("--split", "'99,1,0'", "'99,1,0'"),
        ("--no-create-attention-mask-in-dataloader", None, None), ("--no-mmap-bin-files", None, None),
        ("--num-workers", "1", "1"),
    ],
    "EVAL_AND_LOGGING_ARGS": [
        ("--log-interval", "1", "1"), ("--eval-iters", "32", "1"), ("--eval-interval", "100", "4"),
        ("--save-interval", "1000", "4"), ("--log-throughput", None, None), ("--profile", None, None),
        ("--profile-step-start", "4", "1"), ("--profile-step-end", "6", "2"),
        ("--ckpt-format", "torch_dist", "torch_dist"), ("--distributed-timeout-minutes", "60", "60"),
        ("--save", "{ckpt}", "{ckpt}"), ("--load", "{ckpt}", "{ckpt}"), ("--tensorboard-dir", "{tb}", "{tb}"),
    ],
}


# examples/mixtral/train_mixtral_8x7b_distributed.sh: its sizes are already tiny (2 layers of 256, 2
# experts), so every value is the script's; only the tokenizer is swapped (a NullTokenizer of
# Llama-2's 32000 ids for its tokenizer.model). Its LOGGING_ARGS keep --eval-iters, --no-load-optim and
# --no-load-rng (the other lines of that array are commented out in the script: no --load, no --save).
MIXTRAL_8X7B = {
    "MODEL_ARGS": [
        ("--use-mcore-models", None, None), ("--disable-bias-linear", None, None), ("--seq-length", "256", "256"),
        ("--max-position-embeddings", "2048", "2048"), ("--num-layers", "2", "2"), ("--hidden-size", "256", "256"),
        ("--ffn-hidden-size", "896", "896"), ("--num-attention-heads", "2", "2"),
        ("--init-method-std", "0.01", "0.01"), ("--attention-dropout", "0.0", "0.0"),
        ("--hidden-dropout", "0.0", "0.0"), ("--normalization", "RMSNorm", "RMSNorm"),
        ("--position-embedding-type", "rope", "rope"), ("--swiglu", None, None),
        ("--untie-embeddings-and-output-weights", None, None), ("--group-query-attention", None, None),
        ("--num-query-groups", "2", "2"), ("--no-masked-softmax-fusion", None, None),
        ("--no-position-embedding", None, None), ("--rotary-base", "1000000", "1000000"),
    ],
    "MOE_ARGS": [
        ("--num-experts", "2", "2"), ("--moe-router-topk", "2", "2"),
        ("--moe-router-load-balancing-type", "aux_loss", "aux_loss"), ("--moe-aux-loss-coeff", "1e-2", "1e-2"),
        ("--moe-token-dispatcher-type", "alltoall", "alltoall"), ("--overlap-param-gather", None, None),
        ("--overlap-grad-reduce", None, None),
    ],
    "DATA_ARGS": [
        ("--tokenizer-type", "Llama2Tokenizer", "NullTokenizer"), ("--tokenizer-model", "{tokenizer}", OMIT),
        ("--vocab-size", OMIT, "31999"), ("--mock-data", None, None), ("--split", "99990,8,2", "99990,8,2"),
    ],
    "TRAINING_ARGS": [
        ("--micro-batch-size", "1", "1"), ("--global-batch-size", "4", "4"), ("--lr", "1e-4", "1e-4"),
        ("--train-iters", "7", "7"), ("--min-lr", "1.0e-5", "1.0e-5"), ("--weight-decay", "0.1", "0.1"),
        ("--clip-grad", "1.0", "1.0"),
    ],
    "MODEL_PARALLEL_ARGS": [
        ("--tensor-model-parallel-size", "1", "1"), ("--pipeline-model-parallel-size", "1", "1"),
        ("--expert-model-parallel-size", "2", "2"), ("--use-distributed-optimizer", None, None),
        ("--sequence-parallel", None, None),
    ],
    "LOGGING_ARGS": [
        ("--eval-iters", "10", "10"), ("--no-load-optim", None, None), ("--no-load-rng", None, None),
    ],
}


def paths(tmp_path, **extra) -> dict:
    return dict(ckpt=str(tmp_path / "ckpt"), tb=str(tmp_path / "tb"), cache=str(tmp_path / "cache"),
                data=str(tmp_path / "corpus_text_document"), vocab=str(tmp_path / "gpt2-vocab.json"),
                merges=str(tmp_path / "gpt2-merges.txt"), **extra)


def torchrun(nproc: int, argv: list[str], plain_install: str | None = None) -> subprocess.CompletedProcess:
    """``plain_install``: a folder put first on the ranks' path where the tensorboard package (a dev
    dependency, not in requirements.txt) cannot be imported, as after `pip install -r requirements.txt`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(ROOT, "pretrain_gpt.py"), *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    if plain_install:
        os.makedirs(os.path.join(plain_install, "tensorboard"), exist_ok=True)
        with open(os.path.join(plain_install, "tensorboard", "__init__.py"), "w") as f:
            f.write("raise ImportError('tensorboard is not installed (test)')\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [plain_install, env.get("PYTHONPATH")]))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=ROOT)


def field(stdout: str, iteration: int, name: str) -> str:
    """A field of the Megatron line of ``iteration`` ("global batch size" -> "8")."""
    for line in stdout.splitlines():
        if f" iteration {iteration:8d}/" in line:
            return line.split(f" {name}: ")[1].split(" |")[0].strip()
    raise AssertionError(f"no line for iteration {iteration}:\n{stdout[-3000:]}")


# ---- the real sizes parse ---------------------------------------------------------------------------
def test_both_scripts_flags_parse_at_their_real_sizes_and_world_sizes(tmp_path):
    from megalite.train.command_line import parse_args
    gpt3 = parse_args(flags(GPT3_175B, "real", **paths(tmp_path)), world_size=8 * 16, true_vocab_size=50257)
    assert gpt3.parallel.tensor_model_parallel_size == 8 and gpt3.parallel.pipeline_model_parallel_size == 16
    # Megatron: 95 increments of 16, one per 5859375 / 95 = 61677.6 samples (the batch is 32 from sample 61678)
    assert gpt3.training.batch_size_schedule[:2] == [(0, 16), (61678, 32)]
    assert gpt3.training.batch_size_schedule[-1] == (5859375, 1536) and gpt3.optimizer.fp16

    llama = parse_args(flags(LLAMA3_8B, "real", **paths(tmp_path)), world_size=8)
    m, t = llama.model, llama.training
    assert (m.apply_layernorm_1p, m.rotary_percent, m.cross_entropy_loss_fusion) == (True, 1.0, True)
    assert (t.calculate_per_token_loss, t.manual_gc, t.empty_unused_memory_level, t.profile) == (True, True, 1, True)
    assert llama.parallel.grad_reduce_in_bf16 and not llama.data.mmap_bin_files and llama.data.split == "99,1,0"
    assert t.train_iters == 1953125000 // 128 and llama.optimizer.decoupled_lr == 5.0e-4


def test_gpt3_head_version_step_batch_size_schedule_parses(tmp_path):
    """Megatron-LM's newest 175B script replaced the ramp-up by --step-batch-size-schedule (thresholds in
    tokens, converted to samples of --seq-length)."""
    from megalite.train.command_line import parse_args
    argv = flags(GPT3_175B, "real", **paths(tmp_path))
    i = argv.index("--rampup-batch-size")
    argv[i:i + 4] = ["--step-batch-size-schedule", "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"]
    config = parse_args(argv, world_size=128, true_vocab_size=50257)
    assert config.training.batch_size_schedule == [(0, 16), (1171875, 320), (2343750, 624), (3515625, 928),
                                                   (4687500, 1232), (5859375, 1536)]
    assert config.global_batch_size_at(1171874) == 16 and config.global_batch_size_at(1171875) == 320


# ---- tiny runs ----------------------------------------------------------------------------------------
@pytest.mark.slow            # the Llama-3 script below trains, saves and resumes under torchrun in the default suite
def test_gpt3_175b_flags_train_save_and_resume_on_cpu(tmp_path):
    """TP 8 x PP 16 shrinks to PP 2 on 2 processes; the batch ramps 2, 4, 6, 8 by consumed samples, fp16
    skips its first overflowing steps as Megatron does, then the loss falls; the second launch of the
    same command (longer --train-iters) resumes at iteration 24 with the ramp, loss scale and data
    position where the first left them."""
    first = torchrun(2, flags(GPT3_175B, "tiny", **paths(tmp_path, iters="24")) + GPT3_TINY_DATA)
    assert first.returncode == 0, first.stderr[-3000:]
    assert [field(first.stdout, i, "global batch size").strip() for i in (1, 2, 3, 4, 5)] == ["2", "2", "4", "6", "8"]
    assert field(first.stdout, 4, "consumed samples") == "14"
    losses = logged_losses(first.stdout)
    trained = [i for i in range(1, 25) if "grad norm" in first.stdout.split(f" iteration {i:8d}/")[1].split("\n")[0]]
    assert len(trained) >= 5 and losses[24] < losses[trained[0]], first.stdout[-3000:]   # it learns once unskipped
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000024")

    second = torchrun(2, flags(GPT3_175B, "tiny", **paths(tmp_path, iters="28")) + GPT3_TINY_DATA,
                      str(tmp_path / "plain"))                 # on a plain install: no tensorboard
    assert second.returncode == 0, second.stderr[-3000:]
    assert "the tensorboard package is not installed" in second.stdout
    assert "loaded checkpoint" in second.stdout and f" iteration {24:8d}/" not in second.stdout
    assert field(second.stdout, 25, "consumed samples") == str(int(field(first.stdout, 24, "consumed samples")) + 8)
    assert field(second.stdout, 25, "loss scale") == field(first.stdout, 24, "loss scale")
    assert "grad norm" in second.stdout.split(f" iteration {25:8d}/")[1].split("\n")[0]     # no new skips
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000028")


def test_llama3_8b_flags_train_save_and_resume_on_cpu(tmp_path):
    """DP 8 shrinks to DP 2: bf16 with bf16 gradient reduction, the distributed optimizer with overlapped
    reduction and parameter gather, per-token loss, the chunked loss, zero-centred norms, manual GC,
    the profiler, start-up lines for the kernel choices; saved every 4 iterations, resumed by the same
    command with more --train-samples."""
    first = torchrun(2, flags(LLAMA3_8B, "tiny", **paths(tmp_path, samples="32")))
    assert first.returncode == 0, first.stderr[-3000:]
    losses = logged_losses(first.stdout)
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1], first.stdout[-3000:]
    for note in ("--attention-backend --no-create-attention-mask-in-dataloader:", "--ckpt-format torch_dist:",
                 "--tiktoken-pattern v2:"):
        assert note in first.stdout
    assert "--fp8-param-gather:" not in first.stdout            # delayed scaling gathers its weights in FP8
    assert os.path.isfile(tmp_path / "tb" / "profile_rank0_iterations2-2.json")
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000008")

    # the second launch on a plain install (no tensorboard): one warning, and the run goes on
    second = torchrun(2, flags(LLAMA3_8B, "tiny", **paths(tmp_path, samples="48")), str(tmp_path / "plain"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "the tensorboard package is not installed" in second.stdout
    resumed = logged_losses(second.stdout)
    assert sorted(resumed) == list(range(9, 13)) and "loaded checkpoint" in second.stdout
    assert field(second.stdout, 9, "consumed samples") == "36"
    assert os.path.isdir(tmp_path / "ckpt" / "iter_0000012")


@pytest.mark.slow            # EP=2 training from pretrain_gpt.py: test_moe_parallel.py, default suite
def test_mixtral_8x7b_flags_train_at_ep2_on_cpu():
    """Megatron's Mixtral script on its own 2 ranks: EP=2 (one of the 2 experts per rank, tokens
    exchanged all-to-all), data parallel 2 for the rest with the distributed optimizer and overlapped
    reduction and gather, the load-balancing loss. --log-interval 1 is added to see every iteration
    (the script leaves the default of 100)."""
    proc = torchrun(2, flags(MIXTRAL_8X7B, "tiny") + ["--log-interval", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = logged_losses(proc.stdout)
    assert sorted(losses) == list(range(1, 8)) and losses[7] < losses[1], proc.stdout[-3000:]
    assert "load_balancing_loss:" in proc.stdout.split(f" iteration {7:8d}/")[1].split("\n")[0]
    # 2 layers x 1 expert of (2 x 896 x 256 + 256 x 896) fp32 weights per rank: the experts are split
    assert "memory rank 1 expert weights: parameters 5505024 bytes" in proc.stdout, proc.stdout[-3000:]
    assert "--no-position-embedding" in proc.stdout.split("accepted with no effect")[1].split("\n")[0]
    assert "validation loss at the end of training for val data" in proc.stdout


# ---- a flag mistake under torchrun ----------------------------------------------------------------------
# 2 ranks, TP 3: refused while parsing flags, before torch is even imported; each rank exits at once,
# and before the fix the rank that lost the race was SIGTERMed by torchrun before rank 0 printed
MISTAKE = ["--tensor-model-parallel-size", "3", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
           "--seq-length", "32", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "1", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"]
MISTAKE_LINE = "error: --num-attention-heads 4 must be divisible by --tensor-model-parallel-size 3"


def launch_mistake(_=None) -> subprocess.CompletedProcess:
    return torchrun(2, MISTAKE)


def check_mistake_reported(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert ours and all(line == MISTAKE_LINE for line in ours), proc.stderr[-3000:]
    # torchrun's summary shows the line as the root cause, read from the rank's error file
    root_cause = proc.stderr.split("Root Cause (first observed failure):")[1]
    assert f"traceback : {MISTAKE_LINE}" in root_cause, proc.stderr[-3000:]


def test_flag_mistake_under_torchrun_is_reported_every_time():
    with ThreadPoolExecutor(3) as pool:
        for proc in pool.map(launch_mistake, range(3)):
            check_mistake_reported(proc)


@pytest.mark.slow
def test_flag_mistake_under_torchrun_is_reported_in_20_of_20_launches():
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(launch_mistake, range(20)))
    for proc in results:
        check_mistake_reported(proc)
