"""The launch scripts in examples/, run as users run them (``bash examples/X.sh``) with their sizes
shrunk through the environment variables they read: tiny models, 2 iterations, 2-4 CPU processes with
gloo, each script keeping its own parallel flags (TP + sequence parallel, pipeline with virtual
stages, distributed optimizer, overlapped reduction) where the shrunk world allows.

The default suite runs the CPU quickstarts, GPT-2 (data parallel) and the SLURM launch (tensor +
sequence + virtual pipeline parallel over 2 "nodes"); Llama-3, Mixtral and the plain two-node torchrun
launch (layouts trained there or in tests/distributed), the continued run's second launch (it resumes)
and GPT-2's real-size check run in the slow tier.

Each run must exit 0, log iterations 1 and 2 with a finite lm loss, and leave what the script promises
(checkpoints, metrics, the converted Hugging Face model). Data is real text tokenized in a temporary
folder by tokenizers built here (SentencePiece via tools/train_tokenizer.py, GPT-2 byte-level BPE and a
Hugging Face tokenizer via the tokenizers library); nothing is downloaded. The SLURM script runs under
a fake ``srun`` (one task per node of a 2-node "allocation", on this machine) and ``scontrol``, from a
copy of the script as sbatch makes, so its rendezvous and checkout discovery really execute, and a
SIGTERM sent as SLURM sends it must leave a checkpoint. Finally the GPU scripts' real default sizes and
layouts are checked against megalite's flag validation at their full world size (8 or 64 ranks),
with TORCHRUN replaced by a checker so nothing starts.
"""
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading

import pytest

from harness import free_port, logged_losses
from megalite_test_utils import ROOT
from process_memory import children, descendants

transformers = pytest.importorskip("transformers")

EXAMPLES = os.path.join(ROOT, "examples")
TIMEOUT = 300

# shrunk sizes every script reads; the scripts' own defaults are the real model sizes
TINY = {
    "NUM_LAYERS": "4", "HIDDEN_SIZE": "64", "FFN_HIDDEN_SIZE": "128", "NUM_HEADS": "4", "NUM_QUERY_GROUPS": "2",
    "SEQ_LENGTH": "32", "MICRO_BATCH": "1", "GLOBAL_BATCH": "4", "TRAIN_ITERS": "2", "WARMUP_ITERS": "1",
    "LOG_INTERVAL": "1", "EVAL_INTERVAL": "1000", "EVAL_ITERS": "1", "SAVE_INTERVAL": "1000",
}


def variables_read_by_examples() -> set:
    """Every ${NAME:-default} / ${NAME-default} / ${NAME:?message} the scripts read: a value left in the
    calling environment (DATA_PATH, TP, SLURM_JOB_ID, ...) must not change what a test runs."""
    names = set()
    for name in os.listdir(EXAMPLES):
        if name.endswith(".sh"):
            with open(os.path.join(EXAMPLES, name)) as f:
                names.update(re.findall(r"\$\{([A-Z][A-Z0-9_]*):?[-?]", f.read()))
    return names


def script_env(**overrides) -> dict:
    scrub = variables_read_by_examples() | {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}
    env = {k: v for k, v in os.environ.items() if k not in scrub and not k.startswith("SLURM_")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", WANDB_MODE="offline", **TINY)
    env.update({k: str(v) for k, v in overrides.items()})
    return env


def run_script(script: str, env: dict, cwd) -> subprocess.CompletedProcess:
    """bash SCRIPT from an unrelated folder (the scripts must find the checkout themselves)."""
    proc = subprocess.run(["bash", script], env=env, cwd=str(cwd), capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{os.path.basename(script)} exited {proc.returncode}:\n" \
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def assert_trained(output: str, iterations=(1, 2)) -> dict:
    losses = logged_losses(output)
    assert sorted(losses) == list(iterations), output[-3000:]
    assert all(math.isfinite(v) and v > 0 for v in losses.values()), losses
    return losses


def assert_checkpoint(path, iteration: int) -> None:
    with open(os.path.join(path, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(iteration)
    assert os.path.isfile(os.path.join(path, f"iter_{iteration:07d}", "metadata.json"))


def assert_metrics(path, iterations=(1, 2)) -> None:
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    training = [r for r in records if "lm loss" in r]          # validation records hold "validation lm loss"
    assert [r["iteration"] for r in training] == list(iterations), records
    assert all(math.isfinite(r["lm loss"]) for r in training)


def tensorboard_events(folder) -> list:
    return [n for n in os.listdir(folder) if n.startswith("events.out.tfevents")]


# ---- data built once: real text, three tokenizers, Megatron .bin/.idx files --------------------------
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("example_data")
    # ~60 KB of real text: the standard library's argparse and textwrap sources, one document per 1 KB
    stdlib = sysconfig.get_paths()["stdlib"]
    text = "".join(open(os.path.join(stdlib, name), encoding="utf-8").read() for name in ("argparse.py", "textwrap.py"))
    documents = [text[start:start + 1000] for start in range(0, min(len(text), 60_000), 1000)]
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))

    # GPT-2 style byte-level BPE: vocab.json + merges.txt, and the same as a Hugging Face tokenizer folder
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(documents, trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.model.save(str(tmp))
    hf_tokenizer = tmp / "hf_tokenizer"
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                        bos_token="<|endoftext|>").save_pretrained(str(hf_tokenizer))
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", str(corpus),
                    "--vocab-size", "400", "--output-prefix", str(tmp / "sp")], check=True, capture_output=True)

    tokenizers = {
        "gpt2": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp / "vocab.json"),
                 "--merge-file", str(tmp / "merges.txt")],
        "hf": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_tokenizer)],
        "sp": ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tmp / "sp.model")],
    }
    for name, flags in tokenizers.items():
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(corpus),
                        "--output-prefix", str(tmp / name), *flags, "--append-eod", "--workers", "1"],
                       check=True, capture_output=True)
    return {"dir": tmp, "corpus": corpus, "vocab": tmp / "vocab.json", "merges": tmp / "merges.txt",
            "hf_tokenizer": hf_tokenizer, "sp_model": tmp / "sp.model",
            **{f"{name}_data": str(tmp / f"{name}_text_document") for name in tokenizers}}


# ---- the scripts ----------------------------------------------------------------------------------
def test_cpu_quickstart_prepares_its_data_and_trains(tmp_path):
    """Data parallel over 2 processes, bf16, wandb offline; the stdlib corpus, tokenizer and
    .bin/.idx are made by the script itself (a small slice of the corpus to keep it quick)."""
    data_dir, run_dir = tmp_path / "data", tmp_path / "run"
    proc = run_script(os.path.join(EXAMPLES, "pretrain_cpu_quickstart.sh"), script_env(
        DATA_DIR=data_dir, RUN_DIR=run_dir, CORPUS_MAX_MB="1", TOKENIZER_VOCAB_SIZE="400",
        NPROC_PER_NODE=2, PRECISION="bf16", MICRO_BATCH=2, EVAL_INTERVAL=2, WANDB_PROJECT="examples-test"), tmp_path)
    for made in ("stdlib.jsonl", "stdlib_sp.model", "stdlib_text_document.bin", "stdlib_text_document.idx"):
        assert (data_dir / made).is_file(), made
    assert_trained(proc.stdout)
    assert "validation loss at iteration 2 | lm loss value:" in proc.stdout      # the 98,2,0 split's valid part
    assert_checkpoint(run_dir / "checkpoints", 2)
    assert_metrics(run_dir / "metrics.jsonl")
    assert tensorboard_events(run_dir / "tensorboard")
    assert (run_dir / "wandb").is_dir()
    assert "iteration        2/" in (run_dir / "train.log").read_text()


def test_gpt2_125m_data_parallel_distributed_optimizer(tmp_path, data):
    """DP=2 with the distributed optimizer and overlapped reduction, 2 micro-batches per step, GPT-2 BPE."""
    ckpt = tmp_path / "ckpt"
    proc = run_script(os.path.join(EXAMPLES, "pretrain_gpt2_125m.sh"), script_env(
        GPUS_PER_NODE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), CHECKPOINT_PATH=ckpt,
        DATA_PATH=data["gpt2_data"], VOCAB_FILE=data["vocab"], MERGE_FILE=data["merges"], NUM_LAYERS=2,
        GLOBAL_BATCH=4), tmp_path)
    assert_trained(proc.stdout)
    assert "global batch 4 = 2 micro-batches of 1 x data-parallel 2" in proc.stdout
    assert_checkpoint(ckpt, 2)
    assert_metrics(ckpt / "metrics.jsonl")
    assert tensorboard_events(ckpt / "tensorboard")


@pytest.mark.slow
def test_llama3_8b_tensor_sequence_and_interleaved_pipeline_parallel(tmp_path, data):
    """TP=2 + sequence parallel x PP=2 with 2 virtual stages per rank, distributed optimizer, selective
    recompute, a Hugging Face tokenizer folder. (Slow tier: the SLURM SIGTERM test trains this layout in
    the default suite, the GPT-2 test the distributed optimizer, and this script's flags are checked at
    8 ranks below.)"""
    ckpt = tmp_path / "ckpt"
    proc = run_script(os.path.join(EXAMPLES, "pretrain_llama3_8b.sh"), script_env(
        GPUS_PER_NODE=4, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), CHECKPOINT_PATH=ckpt, TP=2, PP=2,
        VPP_LAYERS=1, DATA_PATH=data["hf_data"], TOKENIZER_MODEL=data["hf_tokenizer"]), tmp_path)
    assert_trained(proc.stdout)
    assert_checkpoint(ckpt, 2)
    assert_metrics(ckpt / "metrics.jsonl")


def test_moe_cpu_quickstart_splits_the_experts_and_replicates_them(tmp_path, data):
    """EP=2 x expert-data-parallel 2 over 4 processes (data parallel 4 for the rest), 4 experts top-2
    with the load-balancing loss, on the SentencePiece data made here: each rank holds 2 experts' weights."""
    run_dir = tmp_path / "run"
    proc = run_script(os.path.join(EXAMPLES, "pretrain_moe_cpu_quickstart.sh"), script_env(
        RUN_DIR=run_dir, DATA_PATH=data["sp_data"], TOKENIZER_MODEL=data["sp_model"], NPROC_PER_NODE=4, EP=2,
        NUM_EXPERTS=4, EVAL_INTERVAL=2), tmp_path)
    assert_trained(proc.stdout)
    assert "load_balancing_loss:" in proc.stdout and "max/mean tokens per expert:" in proc.stdout
    # 4 layers x 2 experts x (2 x 128 x 64 + 64 x 128) fp32 weights on each rank
    assert "memory rank 1 expert weights: parameters 786432 bytes" in proc.stdout, proc.stdout[-3000:]
    assert "validation loss at iteration 2 | lm loss value:" in proc.stdout
    assert_checkpoint(run_dir / "checkpoints", 2)
    assert_metrics(run_dir / "metrics.jsonl")


def test_deepseek_v3_cpu_quickstart_trains_mla_mtp_and_group_limited_routing(tmp_path, data):
    """A tiny DeepSeek-V3 on 2 processes at EP=2: multi-latent attention, one MTP depth (its loss logged),
    a dense first layer, sigmoid routing limited to 2 of 4 expert groups with the expert bias and a
    shared expert, on the SentencePiece data made here."""
    run_dir = tmp_path / "run"
    proc = run_script(os.path.join(EXAMPLES, "pretrain_deepseek_v3_cpu_quickstart.sh"), script_env(
        RUN_DIR=run_dir, DATA_PATH=data["sp_data"], TOKENIZER_MODEL=data["sp_model"], EVAL_INTERVAL=2), tmp_path)
    assert_trained(proc.stdout)
    assert "mtp" in proc.stdout.split(f" iteration {2:8d}/")[1].split("\n")[0].lower(), proc.stdout[-3000:]
    assert "validation loss at iteration 2 | lm loss value:" in proc.stdout
    assert_checkpoint(run_dir / "checkpoints", 2)
    assert_metrics(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_mixtral_8x7b_expert_tensor_sequence_and_pipeline_parallel(tmp_path, data):
    """EP=2 x TP=2 + sequence parallel x PP=2 on 4 processes (experts not split by TP: ETP=1), the
    distributed optimizer with overlapped reduction and gather, all-to-all dispatch, bf16. (Slow tier: the
    two MoE quickstarts train expert parallel in the default suite, tests/distributed/test_moe_parallel.py
    this layout, and this script's flags are checked at 64 ranks below.)"""
    ckpt = tmp_path / "ckpt"
    proc = run_script(os.path.join(EXAMPLES, "pretrain_mixtral_8x7b.sh"), script_env(
        NNODES=1, GPUS_PER_NODE=4, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), CHECKPOINT_PATH=ckpt, TP=2,
        PP=2, EP=2, ETP=1, NUM_EXPERTS=4, NUM_WORKERS=0, DATA_PATH=data["sp_data"],
        TOKENIZER_MODEL=data["sp_model"]), tmp_path)
    assert_trained(proc.stdout)
    assert "load_balancing_loss:" in proc.stdout
    assert_checkpoint(ckpt, 2)
    assert_metrics(ckpt / "metrics.jsonl")


FAKE_SRUN = r"""#!/bin/bash
# fake srun: one task per node of the allocation, all on this machine, with the variables srun sets
while [[ $# -gt 0 && $1 == -* ]]; do echo "fake srun: option $1" >&2; shift; done
nodes=${SLURM_JOB_NUM_NODES:-1}
pids=()
for ((node = 0; node < nodes; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_NTASKS=$nodes SLURM_STEPID=0 "$@" &
    pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
echo "fake srun: $nodes task(s) done, exit $rc" >&2
exit $rc
"""

FAKE_SCONTROL = r"""#!/bin/bash
# fake scontrol: `show hostnames LIST` prints one host per node; every node is this machine
[[ $1 == show && $2 == hostnames && -n $3 ]] || { echo "fake scontrol: unsupported: $*" >&2; exit 1; }
for ((node = 0; node < ${SLURM_JOB_NUM_NODES:-1}; node++)); do echo localhost; done
"""


@pytest.fixture
def slurm_job(tmp_path, data):
    """(script, env) for the SLURM example as sbatch would run it on a 2-node allocation: a spool copy
    of the script, fake srun/scontrol first on PATH, the checkout known only through SLURM_SUBMIT_DIR;
    2 nodes x 2 processes = TP=2 + SP x PP=2 with virtual stages."""
    bin_dir, spool = tmp_path / "bin", tmp_path / "spool"
    bin_dir.mkdir()
    spool.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = spool / "slurm_script"
    shutil.copy(os.path.join(EXAMPLES, "pretrain_llama2_70b_slurm.sh"), script)
    env = script_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", SLURM_JOB_ID=4242, SLURM_JOB_NAME="llama2-70b",
        SLURM_JOB_NODELIST="node[01-02]", SLURM_JOB_NUM_NODES=2, SLURM_NNODES=2, SLURM_SUBMIT_DIR=ROOT,
        MASTER_PORT=free_port(), GPUS_PER_NODE=2, TP=2, PP=2, VPP_LAYERS=1, CHECKPOINT_PATH=tmp_path / "ckpt",
        DATA_PATH=data["sp_data"], TOKENIZER_MODEL=data["sp_model"])
    return str(script), env


@pytest.mark.slow
def test_llama2_70b_slurm_two_nodes_under_fake_srun(tmp_path, slurm_job):
    """srun starts one torchrun per node; they meet on the first host scontrol lists. Full recompute.
    (Slow tier: the SIGTERM test below runs the same two-node SLURM launch in the default suite.)"""
    script, env = slurm_job
    proc = run_script(script, {**env, "RECOMPUTE": "full"}, tmp_path)
    assert f"2 node(s) x 2 GPU(s), rendezvous at localhost:{env['MASTER_PORT']}" in proc.stdout
    assert "fake srun: option --ntasks-per-node=1" in proc.stderr
    assert "fake srun: 2 task(s) done, exit 0" in proc.stderr
    assert_trained(proc.stdout)
    assert_checkpoint(env["CHECKPOINT_PATH"], 2)
    assert_metrics(os.path.join(env["CHECKPOINT_PATH"], "metrics.jsonl"))


@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{os.getpid()}/children"), reason="needs Linux /proc")
def test_llama2_70b_slurm_sigterm_saves_a_checkpoint_and_stops(tmp_path, slurm_job):
    """The time limit / preemption: SIGTERM to every process of the job step (torchruns, ranks and
    anything they started; not the batch shell), as slurmstepd sends it. The ranks agree to stop,
    save the iteration they reached and exit (torchrun, itself signalled, then exits non-zero)."""
    script, env = slurm_job
    proc = subprocess.Popen(["bash", script], env={**env, "TRAIN_ITERS": "100000"}, cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, training = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "iteration        3/" in line:
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(TIMEOUT), "".join(lines)[-3000:]
        srun, = children(proc.pid)          # the batch shell waits on srun alone
        for pid in descendants(srun):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        proc.wait(TIMEOUT)
        reader.join(10)
    finally:
        if proc.poll() is None:
            for pid in descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
    output = "".join(lines)
    stopped = re.search(r"exiting at iteration (\d+): received SIGTERM", output)
    assert stopped, output[-3000:]
    iteration = int(stopped.group(1))
    assert 3 <= iteration < 100000
    assert_checkpoint(env["CHECKPOINT_PATH"], iteration)


@pytest.mark.slow
def test_llama2_70b_torchrun_two_nodes(tmp_path, data):
    """The same model with one plain torchrun per "node": two copies of the script, NODE_RANK 0 and 1,
    meeting at MASTER_ADDR:MASTER_PORT (2 x 2 processes = TP=2 + SP x PP=2 with virtual stages).
    (Slow tier: the SLURM SIGTERM test runs a two-node launch of the same model and layout in the default
    suite, and the script's flags are checked at 64 ranks below.)"""
    ckpt, port = tmp_path / "ckpt", free_port()
    script = os.path.join(EXAMPLES, "pretrain_llama2_70b_torchrun.sh")
    nodes = []
    for node_rank in (0, 1):
        env = script_env(NNODES=2, NODE_RANK=node_rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, GPUS_PER_NODE=2,
                         TP=2, PP=2, VPP_LAYERS=1, CHECKPOINT_PATH=ckpt, DATA_PATH=data["sp_data"],
                         TOKENIZER_MODEL=data["sp_model"])
        nodes.append(subprocess.Popen(["bash", script], env=env, cwd=str(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=TIMEOUT)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node_rank, (node, output) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {node_rank} exited {node.returncode}:\n{output[-3000:]}"
    assert_trained("\n".join(outputs))
    assert_checkpoint(ckpt, 2)


def test_llama2_70b_torchrun_needs_node_rank_and_master_addr_for_several_nodes(tmp_path):
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, "pretrain_llama2_70b_torchrun.sh")],
                          env=script_env(NNODES=2, DATA_PATH="x", TOKENIZER_MODEL="y"), cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "NODE_RANK" in proc.stderr


# ---- the real sizes: every flag accepted and consistent at the launch's full world size ---------------
CHECK_FLAGS = r"""
# Stands in for torchrun (TORCHRUN=...): checks pretrain_gpt.py's flags at the world size the launch would
# have, without starting any process, and prints the resulting configuration as JSON.
import dataclasses, json, os, sys
args = sys.argv[1:]
script = next(i for i, a in enumerate(args) if a.endswith("pretrain_gpt.py"))
launch = dict(zip(args[:script:2], args[1:script:2]))        # the scripts give torchrun --name value pairs
world = int(launch["--nproc_per_node"]) * int(launch.get("--nnodes", "1"))
sys.path.insert(0, os.path.dirname(args[script]))
from megalite.train.command_line import parse_args
config = parse_args(args[script + 1:], world_size=world, true_vocab_size=int(os.environ["TRUE_VOCAB_SIZE"]))
print(json.dumps({**dataclasses.asdict(config), "data_parallel_size": config.parallel.data_parallel_size,
                  "num_microbatches": config.num_microbatches}))
"""

FULL_SIZE = {
    # script, extra environment, true vocabulary, expected (layers, hidden, ffn, heads, groups, seq, padded vocab),
    # expected (world, tp, pp, virtual stage layers, dp, micro-batches per step)
    "gpt2_125m": ("pretrain_gpt2_125m.sh", {"VOCAB_FILE": "v", "MERGE_FILE": "m"}, 50257,
                  (12, 768, 3072, 12, 12, 1024, 50304), (8, 1, 1, None, 8, 4)),
    "llama3_8b": ("pretrain_llama3_8b.sh", {"TOKENIZER_MODEL": "t"}, 128256,
                  (32, 4096, 14336, 32, 8, 8192, 128256), (8, 2, 2, 8, 2, 64)),
    "llama2_70b": ("pretrain_llama2_70b_torchrun.sh", {"TOKENIZER_MODEL": "t", "NODE_RANK": 0, "MASTER_ADDR": "n0"},
                   32000, (80, 8192, 28672, 64, 8, 4096, 32768), (64, 8, 4, 5, 2, 512)),
    "mixtral_8x7b": ("pretrain_mixtral_8x7b.sh", {"TOKENIZER_MODEL": "t", "NODE_RANK": 0, "MASTER_ADDR": "n0"},
                     32000, (32, 4096, 14336, 32, 8, 4096, 32000), (64, 2, 4, None, 8, 32)),
    "deepseek_v3": ("pretrain_deepseek_v3.sh", {"TOKENIZER_MODEL": "t", "NODE_RANK": 0, "MASTER_ADDR": "n0"},
                    129280, (61, 7168, 18432, 128, 128, 4096, 129280), (1024, 2, 16, None, 32, 256)),
}
# the MoE scripts' experts: (experts, top-k, aux loss coefficient, dispatcher, EP, expert TP (None: TP))
FULL_SIZE_EXPERTS = {"mixtral_8x7b": (8, 2, 1e-2, "alltoall", 8, None), "deepseek_v3": (256, 8, 1e-4, "alltoall", 64, 1)}


@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.slow] if name == "gpt2_125m" else [])
                                  for name in FULL_SIZE])      # GPT-2's script trains in the default suite
def test_real_size_flags_are_valid_at_the_full_world_size(tmp_path, name):
    """The scripts' own defaults (sizes, layout, batch) pass megalite's validation for the world the
    script launches: 8 GPUs, or 8 nodes x 8 GPUs for 70B. Nothing is started; TORCHRUN is replaced."""
    script, extra, vocab, model, layout = FULL_SIZE[name]
    checker = tmp_path / "check_flags.py"
    checker.write_text(CHECK_FLAGS)
    env = {k: v for k, v in script_env(**extra).items() if k not in TINY}      # the scripts' real sizes
    env.update(TORCHRUN=f"{sys.executable} {checker}", TRUE_VOCAB_SIZE=str(vocab), DATA_PATH="data_text_document",
               CHECKPOINT_PATH=str(tmp_path / "ckpt"))
    proc = subprocess.run(["bash", os.path.join(EXAMPLES, script)], env=env, cwd=str(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads(proc.stdout.strip().splitlines()[-1])
    m, p = config["model"], config["parallel"]
    assert (m["num_layers"], m["hidden_size"], m["ffn_hidden_size"], m["num_attention_heads"], m["num_query_groups"],
            m["seq_length"], m["padded_vocab_size"]) == model
    assert (p["world_size"], p["tensor_model_parallel_size"], p["pipeline_model_parallel_size"],
            p["num_layers_per_virtual_pipeline_stage"], config["data_parallel_size"], config["num_microbatches"]) == layout
    assert config["optimizer"]["bf16"] and p["use_distributed_optimizer"] and p["overlap_grad_reduce"]
    assert p["sequence_parallel"] == (p["tensor_model_parallel_size"] > 1)
    assert (m["num_experts"], m["moe_router_topk"], m["moe_aux_loss_coeff"], m["moe_token_dispatcher_type"],
            p["expert_model_parallel_size"], p["expert_tensor_parallel_size"]) == \
        FULL_SIZE_EXPERTS.get(name, (None, 2, 0.0, "allgather", 1, None))
    assert not os.path.exists(tmp_path / "ckpt")                              # nothing ran


@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["once", "resumed"])
def test_continue_pretraining_from_hf_converts_trains_resumes_and_exports(tmp_path, resume):
    """A tiny HF Llama (GQA, tied embeddings, its own tokenizer) -> megalite -> 2 iterations at TP=2 + SP
    -> HF, loadable by transformers; with ``resume`` (slow tier: a second launch of the script) a second
    run resumes the continued checkpoint, not the HF weights."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "unit", "checkpoint"))     # its tiny HF models
    from test_convert_checkpoint import TEXT, make_hf

    hf_model_dir, work = tmp_path / "hf_model", tmp_path / "work"
    original = make_hf(str(hf_model_dir), "llama_gqa_tied")
    corpus = tmp_path / "corpus.jsonl"
    words = TEXT.split()
    with open(corpus, "w") as f:
        for i in range(200):                 # documents made of the tokenizer's words
            f.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(30))}) + "\n")
    env = script_env(HF_MODEL=hf_model_dir, WORK_DIR=work, CORPUS=corpus, DATA_PATH=tmp_path / "cont_text_document",
                     GPUS_PER_NODE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), TP=2, SEQ_LENGTH=16,
                     LR="1e-3", MIN_LR="1e-4")
    script = os.path.join(EXAMPLES, "continue_pretraining_from_hf.sh")
    proc = run_script(script, env, tmp_path)
    assert_trained(proc.stdout)
    assert_checkpoint(work / "base", 0)
    assert_checkpoint(work / "checkpoints", 2)
    assert_metrics(work / "checkpoints" / "metrics.jsonl")

    exported = transformers.AutoModelForCausalLM.from_pretrained(str(work / "hf")).eval()
    assert type(exported) is type(original)
    assert transformers.AutoTokenizer.from_pretrained(str(work / "hf"))("the cat sat")["input_ids"]
    moved = (exported.model.embed_tokens.weight.float() - original.model.embed_tokens.weight).abs().max().item()
    assert 0 < moved < 0.1                   # two small steps away from the HF weights
    if not resume:
        return

    resumed = run_script(script, {**env, "TRAIN_ITERS": "3", "MASTER_PORT": str(free_port())}, tmp_path)
    assert_trained(resumed.stdout, iterations=(3,))
    assert_checkpoint(work / "checkpoints", 3)
