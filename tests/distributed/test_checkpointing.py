"""Checkpoints through pretrain_gpt.py: exact resume, resharding across layouts, crash safety, bad files.

The reference for every resume is the *uninterrupted* run: it saves along the way, and a resumed run
starts from one of its intermediate checkpoints, so both follow the same flags (LR schedule included)
and the resumed losses must equal the uninterrupted run's later losses.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from harness import ROOT, logged_losses, run_pretrain
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

SERIAL = with_flags(TINY_LLAMA_ARGS, train_iters=6, hidden_dropout=0.1, attention_dropout=0.1)
# 4 layers so that PP2 x virtual stages works; tied embeddings so the last stage holds a copy
PARALLEL = with_flags(TINY_LLAMA_ARGS, num_layers=4, global_batch_size=8, train_iters=6,
                      untie_embeddings_and_output_weights=None)
LAYOUT_3D = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]


def run_single(argv, timeout=300):
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv], capture_output=True,
                          text=True, timeout=timeout, env=env)


def run(nproc, argv):
    proc = run_single(argv) if nproc == 1 else run_pretrain(nproc, argv)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    return proc


def exact_losses(metrics_file) -> dict[int, float]:
    """Full-precision losses from the JSON-lines metrics (the stdout line rounds to 7 digits)."""
    losses = {}
    with open(metrics_file) as f:
        for line in f:
            record = json.loads(line)
            if "lm loss" in record:
                losses[record["iteration"]] = record["lm loss"]
    return losses


def one_line_error(proc, fragment):
    assert proc.returncode == 1, proc.stdout[-1000:] + proc.stderr[-2000:]
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert fragment in err, err


# ---- exact resume --------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "1024"]],
                         ids=["fp32", "bf16", "fp16"])
def test_resuming_at_the_same_layout_repeats_the_losses_bitwise(tmp_path, precision):
    """Dropout is on, so the RNG states must come back too; fp16 also restores the loss scaler."""
    save = str(tmp_path / "ck")
    run(1, SERIAL + precision + ["--save", save, "--save-interval", "3", "--metrics-file", str(tmp_path / "a.jsonl")])
    resumed = run(1, SERIAL + precision + ["--load", os.path.join(save, "iter_0000003"),
                                           "--metrics-file", str(tmp_path / "b.jsonl")])
    assert "loaded checkpoint" in resumed.stdout and "RNG state not restored" not in resumed.stdout
    full, tail = exact_losses(tmp_path / "a.jsonl"), exact_losses(tmp_path / "b.jsonl")
    assert sorted(tail) == [4, 5, 6]
    assert all(tail[i] == full[i] for i in tail), (full, tail)


def test_the_same_save_and_load_directory_starts_fresh_then_resumes(tmp_path):
    """The job script a cluster re-runs after a failure: --save X --load X from the first run on."""
    save = str(tmp_path / "ck")
    first = run(1, with_flags(SERIAL, train_iters=3) + ["--save", save, "--load", save])
    assert "starting from scratch" in first.stdout
    second = run(1, SERIAL + ["--save", save, "--load", save])
    assert "at iteration 3" in second.stdout and sorted(logged_losses(second.stdout)) == [4, 5, 6]
    assert open(os.path.join(save, "latest_checkpointed_iteration.txt")).read() == "6"


# ---- resharding ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_3d(tmp_path_factory):
    """The uninterrupted TP2 x PP2 x DP2 run (distributed optimizer), saving at iterations 3 and 6."""
    tmp = tmp_path_factory.mktemp("reshard")
    proc = run(8, PARALLEL + LAYOUT_3D + ["--save", str(tmp / "ck"), "--save-interval", "3"])
    return tmp, logged_losses(proc.stdout)


# The default tier resumes at the same layout (bitwise) and serially (every axis resharded); the slow tier
# also at the other layouts.
@pytest.mark.parametrize("nproc, layout", [
    pytest.param(8, LAYOUT_3D, id="same-layout"),
    pytest.param(1, [], id="serial"),
    pytest.param(8, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"], id="pp2-dp4-zero1",
                 marks=pytest.mark.slow),
    pytest.param(4, ["--data-parallel-sharding-strategy", "optim_grads_params"], id="dp4-zero3",
                 marks=pytest.mark.slow),
    pytest.param(4, ["--tensor-model-parallel-size", "4", "--sequence-parallel"], id="tp4-replicated-kv-sp",
                 marks=pytest.mark.slow),
    pytest.param(4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                 id="pp2-interleaved-dp2", marks=pytest.mark.slow),
])
def test_a_3d_checkpoint_resumes_at_any_layout(saved_3d, tmp_path, nproc, layout):
    tmp, full = saved_3d
    checkpoint = tmp_path / "ck"
    shutil.copytree(tmp / "ck" / "iter_0000003", checkpoint)
    proc = run(nproc, PARALLEL + layout + ["--load", str(checkpoint)])
    resumed = logged_losses(proc.stdout)
    assert sorted(resumed) == [4, 5, 6]
    worst = max(abs(resumed[i] - full[i]) / abs(full[i]) for i in resumed)
    assert worst <= (0.0 if layout == LAYOUT_3D else 1e-5), (full, resumed)


def test_load_model_gives_the_same_logits_from_a_sharded_and_a_serial_checkpoint(saved_3d, tmp_path):
    from megalite.checkpoint.sharded import load_model
    tmp, _ = saved_3d
    run(1, PARALLEL + ["--save", str(tmp_path / "serial"), "--save-interval", "3"])   # same LR schedule
    sharded = load_model(str(tmp / "ck" / "iter_0000003"))
    serial = load_model(str(tmp_path / "serial" / "iter_0000003"))
    assert not sharded.training
    ids = torch.randint(0, 200, (2, 16))
    logits = sharded(ids)
    assert logits.shape == (2, 16, 201)           # NullTokenizer: 200 ids + eod, padding trimmed
    torch.testing.assert_close(logits, serial(ids), rtol=1e-4, atol=1e-4)


# ---- crash safety ----------------------------------------------------------------------------------
KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
import megalite.checkpoint.save as ckpt
saves = {{"n": 0}}
rank = int(os.environ.get("RANK", "0"))
def die_in(module, name, on_rank, nth):
    original = getattr(module, name)
    def wrapped(*args, **kwargs):
        if name == "publish" or args[1].startswith("rng-"):
            saves["n"] += 1
        if rank == on_rank and saves["n"] == nth:
            if name == "write_tensor_file":       # leave a half-written file behind
                open(os.path.join(args[0], args[1]), "wb").write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)
    setattr(module, name, wrapped)
where = os.environ["KILL_IN"]
die_in(ckpt, where, int(os.environ["KILL_RANK"]), 2)
import pretrain_gpt
sys.exit(pretrain_gpt.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("kill_in, kill_rank", [("write_tensor_file", 1),
                                               pytest.param("publish", 0, marks=pytest.mark.slow)])
def test_a_run_killed_while_saving_restarts_from_the_previous_checkpoint(tmp_path, kill_in, kill_rank):
    """SIGKILL in the middle of the second save (a half-written tensor file on one rank, or just before
    publishing): the tracker still names the first checkpoint, and re-running resumes from it."""
    argv = with_flags(PARALLEL, num_layers=2) + ["--use-distributed-optimizer", "--save", str(tmp_path / "ck"),
                                                  "--load", str(tmp_path / "ck"), "--save-interval", "2"]
    reference = logged_losses(run(2, with_flags(PARALLEL, num_layers=2) + ["--use-distributed-optimizer"]).stdout)
    script = tmp_path / "killer.py"
    script.write_text(KILLER.format(root=ROOT))
    env = {**os.environ, "KILL_IN": kill_in, "KILL_RANK": str(kill_rank), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ROOT}
    killed = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(script), *argv], capture_output=True, text=True, timeout=300, env=env)
    assert killed.returncode != 0
    assert open(tmp_path / "ck" / "latest_checkpointed_iteration.txt").read() == "2"
    restarted = run(2, argv)
    assert "at iteration 2" in restarted.stdout
    resumed = logged_losses(restarted.stdout)
    assert sorted(resumed) == [3, 4, 5, 6]
    assert all(abs(resumed[i] - reference[i]) <= 1e-6 * abs(reference[i]) for i in resumed)
    assert not any(name.endswith(".tmp") for name in os.listdir(tmp_path / "ck"))


# ---- bad checkpoints ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def serial_checkpoint(tmp_path_factory):
    """A 3-iteration serial run's checkpoint; its losses from scratch in metrics.jsonl beside it."""
    tmp = tmp_path_factory.mktemp("serial")
    run(1, with_flags(SERIAL, train_iters=3, save=str(tmp / "ck"), metrics_file=str(tmp / "metrics.jsonl")))
    return tmp / "ck"


def damaged_copy(serial_checkpoint, tmp_path):
    target = tmp_path / "ck"
    shutil.copytree(serial_checkpoint, target)
    return target, target / "iter_0000003"


def flip_a_byte_of(path, tensor):
    with safe_open(str(path), "pt") as f:
        names = list(f.keys())
    assert tensor in names
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    start = 8 + header_len + header[tensor]["data_offsets"][0]
    with open(path, "r+b") as f:
        f.seek(start + 5)
        byte = f.read(1)
        f.seek(start + 5)
        f.write(bytes([byte[0] ^ 0xFF]))


def drop_from_index(iteration_dir, tensor):
    index_path = iteration_dir / "index-rank00000.json"       # a serial save: one index file
    index = json.loads(index_path.read_text())
    del index["headers"][tensor]
    index["tensors"] = {key: entry for key, entry in index["tensors"].items() if entry["name"] != tensor}
    index_path.write_text(json.dumps(index))


TENSOR = "decoder.layers.1.mlp.linear_fc2.weight"


@pytest.mark.parametrize("damage, flags, fragment", [
    (lambda d: open(d / "model-pp000.safetensors", "r+b").truncate(1000), {}, "model-pp000.safetensors is truncated"),
    (lambda d: flip_a_byte_of(d / "model-pp000.safetensors", TENSOR), {"no_load_optim": True},
     f"checkpoint tensor '{TENSOR}'"),
    (lambda d: drop_from_index(d, TENSOR), {}, f"has no tensor '{TENSOR}'"),
    (lambda d: (d / "metadata.json").write_text("{not json"), {}, "metadata.json is corrupt"),
    (lambda d: (d.parent / "latest_checkpointed_iteration.txt").write_text("ten"), {}, "not an iteration number"),
    (lambda d: None, {"hidden_size": 128}, "'embedding.word_embeddings.weight' has shape [201, 64] but the model "
                                           "expects [201, 128] (--hidden-size: 64 in the checkpoint, 128 in this run"),
    (lambda d: None, {"num_layers": 1}, "--num-layers: 2 in the checkpoint, 1 in this run"),
    (lambda d: None, {"vocab_size": 300}, "tokenizer's vocabulary: 201 in the checkpoint, 301 in this run"),
], ids=["truncated", "corrupt-bytes", "missing-tensor", "corrupt-metadata", "bad-tracker", "wrong-shape",
        "fewer-layers", "other-vocabulary"])
def test_bad_checkpoints_give_one_line_naming_the_problem(serial_checkpoint, tmp_path, damage, flags, fragment):
    root, iteration_dir = damaged_copy(serial_checkpoint, tmp_path)
    damage(iteration_dir)
    before = {p.name: p.read_bytes() for p in iteration_dir.iterdir()}
    proc = run_single(with_flags(SERIAL, **flags) + ["--load", str(root)])
    one_line_error(proc, fragment)
    assert {p.name: p.read_bytes() for p in iteration_dir.iterdir()} == before     # nothing touched


# ---- loading options ---------------------------------------------------------------------------------
def test_no_load_optim_keeps_the_weights_and_position_but_not_adam(serial_checkpoint, tmp_path):
    exact = logged_losses(run(1, SERIAL + ["--load", str(serial_checkpoint), "--no-load-rng"]).stdout)
    fresh_adam = logged_losses(run(1, SERIAL + ["--load", str(serial_checkpoint), "--no-load-optim",
                                                "--no-load-rng"]).stdout)
    assert sorted(fresh_adam) == [4, 5, 6]
    assert fresh_adam[4] == exact[4]          # same weights, same batch: the update has not happened yet
    assert fresh_adam[5] != exact[5]          # Adam restarted from zero moments


def test_finetune_with_checkpoint_args_needs_no_model_flags(serial_checkpoint):
    model_flags = {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
                   "num_query_groups", "max_position_embeddings", "position_embedding_type", "normalization",
                   "swiglu", "disable_bias_linear", "untie_embeddings_and_output_weights", "seq_length",
                   "tokenizer_type", "vocab_size"}
    argv = with_flags(SERIAL, **{flag: None for flag in model_flags}, train_iters=2)
    proc = run(1, argv + ["--load", str(serial_checkpoint), "--use-checkpoint-args", "--finetune"])
    losses = logged_losses(proc.stdout)
    assert sorted(losses) == [1, 2] and "--finetune: starting at iteration 0" in proc.stdout
    scratch = exact_losses(serial_checkpoint.parent / "metrics.jsonl")     # the checkpoint's run, from scratch
    assert losses[1] < scratch[1] - 0.1          # the trained weights were loaded
    conflict = run_single(argv + ["--load", str(serial_checkpoint), "--use-checkpoint-args", "--hidden-size", "32"])
    one_line_error(conflict, "--hidden-size 32 contradicts the checkpoint's 64")
