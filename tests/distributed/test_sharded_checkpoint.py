"""Checkpoints written and read in shards: each rank writes only what it owns and reads only what it
holds, and no tensor data crosses ranks while saving or loading.

One 2-rank spawn serves every check: a ZeRO-3 run (DP=2) saves and trains on (the uninterrupted
reference); the checkpoint is resumed at the same layout, at TP=2 and at CP=2 (those two save too),
and a damaged copy is loaded; a bf16 ZeRO-3 run saves, and a run that loads it saves again. Spies
record the bytes of every collective and of every stored piece a rank reads. The test process itself
resumes the ZeRO-3 checkpoint at DP=1 (also rewritten as whole tensors) and inspects the files.

A 4-rank spawn saves a model with learned attention sinks (TP-sharded by heads) and a sliding window at
TP=2 x DP=2, with and without ZeRO-3, and resumes it at TP=1 (PP=2, CP=2, and serially in this process).
"""
import json
import os
import re
import shutil
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from dp_workloads import DP_ARGS, SyntheticTokens, layout_flags
from harness import run_ranks
from megalite.train.command_line import parse_args
from megalite.checkpoint.files import CheckpointReader, as_2d, write_checkpoint
from megalite.checkpoint.tensor_file import TORCH_DTYPES
from megalite.checkpoint.index import IndexShards, holder, index_filename
from megalite.checkpoint.pieces import param_entries
from megalite.checkpoint.save import save_checkpoint
from megalite.checkpoint.sharded import load_checkpoint
from megalite.data.samplers import MegatronPretrainingSampler
from megalite.errors import UserError
from megalite.parallel.param_meta import param_meta
from megalite.train.trainer import build_trainer
from megalite.train.step import train_step
from megalite_test_utils import with_flags

BEFORE, AFTER = 2, 2                       # steps before the save, and after it
ZERO3 = layout_flags("optim_grads_params", overlap=False)      # 20000-element buckets: chunks cut parameters
TP2 = with_flags(DP_ARGS, tensor_model_parallel_size=2)
CP2 = with_flags(DP_ARGS, context_parallel_size=2, use_distributed_optimizer=True)
SERIAL = DP_ARGS
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_tensor", "gather", "scatter", "broadcast", "reduce",
               "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
               "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")


def batches_from(trainer, first_step: int, steps: int):
    """The global batches of steps first_step+1 ... first_step+steps (the data a resumed run sees)."""
    t = trainer.config.training
    total = (BEFORE + AFTER) * t.global_batch_size
    sampler = MegatronPretrainingSampler(total, first_step * t.global_batch_size, t.micro_batch_size,
                                         trainer.parallel.dp_rank, trainer.parallel.dp_size)
    return iter(DataLoader(SyntheticTokens(total), batch_sampler=sampler))


def mark_trained(trainer, steps: int) -> None:
    trainer.state.iteration = steps
    trainer.state.consumed_train_samples = steps * trainer.config.training.global_batch_size


def quiet(*_args, **_kwargs):
    pass


def owned_elements(trainer) -> int:
    """Elements of the flat buffer this rank's optimizer updates: what it may write."""
    return sum(piece.end - piece.start for piece in trainer.optimizer.pieces)


def _nbytes(value) -> int:
    if torch.is_tensor(value):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


@contextmanager
def spies():
    """Records every collective called through torch.distributed as (name, tensor bytes), every stored
    piece a CheckpointReader reads as (tensor name, elements), every index key it looks up and every
    index file it opens. all_gather_object is recorded by name (its internal tensors are pickled
    metadata, not model data)."""
    seen = {"collectives": [], "read": [], "keys": [], "index_files": []}
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    read_piece, entry, read_index = CheckpointReader._read_piece, IndexShards.entry, IndexShards._read

    def recording(name):
        def wrapper(*args, **kwargs):
            seen["collectives"].append((name, _nbytes(list(args) + list(kwargs.values()))))
            return originals[name](*args, **kwargs)
        return wrapper

    def reading(reader, name, piece, wanted):
        (r0, r1), (c0, c1) = piece["box"]
        seen["read"].append((name, (r1 - r0) * (c1 - c0)))
        return read_piece(reader, name, piece, wanted)

    def looking_up(shards, name, band=0):
        seen["keys"].append((name, band))
        return entry(shards, name, band)

    def opening(shards, filename):
        seen["index_files"].append(filename)
        return read_index(shards, filename)

    try:
        for name in originals:
            setattr(dist, name, recording(name))
        CheckpointReader._read_piece, IndexShards.entry, IndexShards._read = reading, looking_up, opening
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        CheckpointReader._read_piece, IndexShards.entry, IndexShards._read = read_piece, entry, read_index


def save_resume_reshard(rank: int, world: int, tmp: str) -> dict:
    out = {}
    # the uninterrupted ZeRO-3 run: saves after BEFORE steps, then goes on
    trainer = build_trainer(parse_args(ZERO3, world_size=world))
    data = batches_from(trainer, 0, BEFORE + AFTER)
    for _ in range(BEFORE):
        train_step(trainer, data)
    mark_trained(trainer, BEFORE)
    with spies() as out["save_zero3"]:
        save_checkpoint(trainer.checkpoint_state, os.path.join(tmp, "zero3"))
    out["owned_zero3"] = owned_elements(trainer)
    out["reference"] = [float(train_step(trainer, data)[0]) for _ in range(AFTER)]

    # resumed at the same layout, at TP=2 and at CP=2 with ZeRO-1 (chunks over the CP ranks); the last two save
    for layout, argv in (("same", ZERO3), ("tp2", TP2), ("cp2", CP2)):
        trainer = build_trainer(parse_args(argv, world_size=world))
        with spies() as out[f"load_{layout}"]:
            load_checkpoint(trainer.checkpoint_state, os.path.join(tmp, "zero3"), log=quiet)
        data = batches_from(trainer, BEFORE, AFTER)
        out[layout] = [float(train_step(trainer, data)[0]) for _ in range(AFTER)]
        if layout != "same":
            mark_trained(trainer, BEFORE + AFTER)
            with spies() as out[f"save_{layout}"]:
                save_checkpoint(trainer.checkpoint_state, os.path.join(tmp, layout))
            out[f"owned_{layout}"] = owned_elements(trainer)
        if layout == "tp2":
            out["tp_sharded"] = {e.global_name for e in param_entries(trainer.chunks)
                                 if param_meta(e.param).tensor_model_parallel}

    # a corrupt piece that only rank 1 reads stops both ranks, with the same one-line error
    if rank == 0:
        damaged = shutil.copytree(os.path.join(tmp, "zero3"), os.path.join(tmp, "damaged"))
        with open(os.path.join(damaged, "iter_0000002", "optimizer-pp000-dp00001.safetensors"), "r+b") as f:
            f.seek(-1, os.SEEK_END)                          # the last byte of the last tensor
            last = f.read(1)[0]
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last ^ 0xFF]))
    dist.barrier()
    try:
        damaged = build_trainer(parse_args(ZERO3, world_size=world))
        load_checkpoint(damaged.checkpoint_state, os.path.join(tmp, "damaged"), log=quiet)
        out["damaged"] = None
    except UserError as e:
        out["damaged"] = str(e)

    # bf16 ZeRO-3 (master weights stored apart from the bf16 weights): save, load, save again
    bf16 = layout_flags("optim_grads_params", overlap=False, bf16=True)
    trainer = build_trainer(parse_args(bf16, world_size=world))
    train_step(trainer, batches_from(trainer, 0, 1))
    mark_trained(trainer, 1)
    save_checkpoint(trainer.checkpoint_state, os.path.join(tmp, "bf16"))
    again = build_trainer(parse_args(bf16, world_size=world))
    load_checkpoint(again.checkpoint_state, os.path.join(tmp, "bf16"), log=quiet)
    save_checkpoint(again.checkpoint_state, os.path.join(tmp, "bf16_again"))
    return out


def bytes_by_writer(directory: str, writer: str) -> dict[str, int]:
    """Stored bytes per writing rank ("dp00001", "tp000"; from the file names) over every tensor."""
    reader = CheckpointReader(directory)
    written = {}
    for entry in reader.all_entries().values():
        itemsize = TORCH_DTYPES[entry["dtype"]].itemsize
        for piece in entry["pieces"]:
            who = re.search(rf"-({writer}\d+)\.", piece["file"]).group(1)
            (r0, r1), (c0, c1) = piece["box"]
            written[who] = written.get(who, 0) + (r1 - r0) * (c1 - c0) * itemsize
    return written


def areas(entry) -> int:
    return sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in (p["box"] for p in entry["pieces"]))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sharded"))
    return tmp, run_ranks(2, save_resume_reshard, tmp)


def test_each_rank_writes_only_its_share(sharded):
    """Every element is stored once, and no rank stores more than the part of the flat buffer it owns
    (x 3 fp32 tensors: weights, Adam's two moments)."""
    tmp, results = sharded
    # ZeRO-3 (DP=2): each rank its chunk of every bucket, parameters cut between the ranks
    directory = os.path.join(tmp, "zero3", "iter_0000002")
    zero3 = CheckpointReader(directory)
    assert all(areas(e) == torch.Size(e["shape"]).numel() for e in zero3.all_entries().values())
    written = bytes_by_writer(directory, "dp")
    assert sorted(written) == ["dp00000", "dp00001"]
    assert all(written[f"dp{r:05d}"] <= results[r]["owned_zero3"] * 3 * 4 for r in range(2)), written
    assert any(len({p["file"] for p in e["pieces"]}) == 2 for e in zero3.all_entries().values())
    # TP=2: no rank stores a whole TP-sharded tensor; replicated ones (norms) come from TP rank 0 only
    tp_sharded = results[0]["tp_sharded"]
    directory = os.path.join(tmp, "tp2", "iter_0000004")
    tp2 = CheckpointReader(directory)
    assert tp_sharded and all(areas(e) == torch.Size(e["shape"]).numel() for e in tp2.all_entries().values())
    for name, entry in tp2.all_entries().items():
        weight = name.split(".", 2)[-1] if name.startswith("optimizer.") else name
        if weight in tp_sharded:
            rows, cols = as_2d(entry["shape"])
            assert all(p["box"] != [[0, rows], [0, cols]] for p in entry["pieces"]), name
            assert {re.search(r"-tp(\d+)", p["file"]).group(1) for p in entry["pieces"]} == {"000", "001"}, name
        else:
            assert all("-tp000" in p["file"] for p in entry["pieces"]), name
    written = bytes_by_writer(directory, "tp")
    assert all(written[f"tp{r:03d}"] <= results[r]["owned_tp2"] * 3 * 4 for r in range(2)), written
    # CP=2 with ZeRO-1: the optimizer's chunks are spread over the CP ranks too, so both write
    directory = os.path.join(tmp, "cp2", "iter_0000004")
    cp2 = CheckpointReader(directory)
    assert all(areas(e) == torch.Size(e["shape"]).numel() for e in cp2.all_entries().values())
    written = bytes_by_writer(directory, "dp")
    assert all(written[f"dp{r:05d}"] <= results[r]["owned_cp2"] * 3 * 4 for r in range(2)), written
    # bf16: the weights in bf16 and an fp32 master copy; a save of the loaded state stores the same tensors
    first, second = (CheckpointReader(os.path.join(tmp, d, "iter_0000001")) for d in ("bf16", "bf16_again"))
    assert first.dtype("decoder.final_layernorm.weight") == torch.bfloat16
    assert first.dtype("optimizer.master.decoder.final_layernorm.weight") == torch.float32
    assert sorted(first.names()) == sorted(second.names())
    assert all(torch.equal(first.tensor(n), second.tensor(n)) for n in first.names())


def test_save_and_load_move_no_tensor_data_between_ranks(sharded):
    """Beyond flags, the only bytes exchanged are a save's index entries (two all-to-alls: the counts,
    then the entries of the rank's own pieces); a load exchanges nothing but a flag."""
    _, results = sharded
    for rank, out in enumerate(results):
        for phase in ("save_zero3", "load_same", "load_tp2", "save_tp2", "load_cp2", "save_cp2"):
            calls = out[phase]["collectives"]
            assert calls, phase
            heavy = [(name, n) for name, n in calls if n > 8 and name != "all_to_all_single"]
            assert not heavy, (rank, phase, heavy)
            index = [n for name, n in calls if name == "all_to_all_single"]
            assert len(index) == (2 if phase.startswith("save") else 0), (rank, phase, index)
            assert sum(index) < 64 << 10, (rank, phase, index)


def test_loading_opens_only_the_index_files_of_the_tensors_it_needs(sharded):
    """Each rank looks up only the tensors it holds (and its RNG file) and opens only their holders'
    index files, each once; the index files of the other keys are never read."""
    tmp, results = sharded
    directory = os.path.join(tmp, "zero3", "iter_0000002")
    assert sorted(f for f in os.listdir(directory) if f.startswith("index-")) == [index_filename(r) for r in range(2)]
    for rank, out in enumerate(results):
        seen = out["load_same"]
        holders = {holder(f"{name}#{band}", 2) for name, band in seen["keys"]} | {
            holder(f"rng-rank{rank:05d}.safetensors", 2)}
        assert sorted(seen["index_files"]) == sorted(index_filename(r) for r in holders), (rank, seen["index_files"])
    reader = CheckpointReader(directory)                      # one tensor: one index file
    with spies() as seen:
        reader.tensor("decoder.final_layernorm.weight")
    assert seen["index_files"] == [index_filename(holder("decoder.final_layernorm.weight#0", 2))]


def test_a_zero3_checkpoint_resumes_at_the_same_layout_at_tp2_and_serially(sharded):
    tmp, results = sharded
    reference = results[0]["reference"]
    for out in results:
        assert out["same"] == reference                     # same layout: bit for bit
        assert out["tp2"] == pytest.approx(reference, rel=1e-5)
        assert out["cp2"] == pytest.approx(reference, rel=1e-5)
    assert serial_losses(os.path.join(tmp, "zero3")) == pytest.approx(reference, rel=1e-5)


def serial_losses(checkpoint: str) -> list[float]:
    """The losses after resuming ``checkpoint`` in this process (DP=1)."""
    trainer = build_trainer(parse_args(SERIAL, world_size=1))
    load_checkpoint(trainer.checkpoint_state, checkpoint, log=quiet)
    data = batches_from(trainer, BEFORE, AFTER)
    return [float(train_step(trainer, data)[0]) for _ in range(AFTER)]


def test_a_checkpoint_of_whole_tensors_loads(sharded, tmp_path):
    """A single writer's checkpoint of whole tensors (as tools/convert_checkpoint.py writes them): the
    ZeRO-3 checkpoint rewritten that way, each tensor assembled by CheckpointReader.tensor, resumes to
    the same losses."""
    tmp, results = sharded
    reader = CheckpointReader(os.path.join(tmp, "zero3"))
    tensors = {n: reader.tensor(n) for n in reader.names()}
    files = {"model-pp000.safetensors": {n: t for n, t in tensors.items() if not n.startswith("optimizer.")},
             "optimizer-pp000.safetensors": {n: t for n, t in tensors.items() if n.startswith("optimizer.")}}
    kept = {k: v for k, v in reader.metadata.items() if k not in ("format", "version", "tensors", "files", "rng_files",
                                                                "index")}
    write_checkpoint(str(tmp_path / "v1"), BEFORE, files, kept)
    meta = json.loads((tmp_path / "v1" / "iter_0000002" / "metadata.json").read_text())
    assert all("pieces" not in entry for entry in meta["tensors"].values())
    assert serial_losses(str(tmp_path / "v1")) == pytest.approx(results[0]["reference"], rel=1e-5)


def test_a_corrupt_piece_read_by_one_rank_stops_every_rank_in_one_line(sharded):
    _, results = sharded
    messages = [out["damaged"] for out in results]
    assert messages[0] == messages[1] and "\n" not in messages[0]
    assert "optimizer-pp000-dp00001.safetensors is corrupt (checksum mismatch)" in messages[0]


def test_loading_at_the_same_layout_reads_only_the_own_share(sharded):
    tmp, results = sharded
    directory = os.path.join(tmp, "zero3", "iter_0000002")
    written = bytes_by_writer(directory, "dp")
    index = CheckpointReader(directory).all_entries()
    for rank, out in enumerate(results):
        read = sum(n * TORCH_DTYPES[index[name]["dtype"]].itemsize for name, n in out["load_same"]["read"]
                   if name in index)                                                # not the RNG states
        assert read == written[f"dp{rank:05d}"], (rank, read, written)


# ---- attention sinks (one learned logit per head, TP-sharded by heads) across layouts ----------------
SINK_ARGS = with_flags(DP_ARGS, global_batch_size=8, softmax_type="learnable", window_size="3,0",
                       window_attn_skip_freq=2, attention_dropout=0.0)      # layer 1 windowed, layer 2 full
SINK_SAVES = {"tp2": with_flags(SINK_ARGS, tensor_model_parallel_size=2),
              "tp2_zero3": with_flags(SINK_ARGS, tensor_model_parallel_size=2, use_distributed_optimizer=True,
                                      data_parallel_sharding_strategy="optim_grads_params", ddp_bucket_size=20000)}
SINK_RESUMES = {"tp2": with_flags(SINK_ARGS, pipeline_model_parallel_size=2),
                "tp2_zero3": with_flags(SINK_ARGS, context_parallel_size=2, use_distributed_optimizer=True)}


def sinks_of(trainer) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's sink parameters by global name, with its TP rank (the shard's place)."""
    return {e.global_name: (trainer.parallel.tp_rank, e.param.detach().clone())
            for e in param_entries(trainer.chunks) if e.global_name.endswith("softmax_offset")}


def sinks_save_and_resume(rank: int, world: int, tmp: str) -> dict:
    """On 4 ranks: each TP=2 x DP=2 run of SINK_SAVES saves after BEFORE steps and goes on (its reference);
    its checkpoint is resumed at the TP=1 layout of SINK_RESUMES (PP=2, or CP=2 with ZeRO-1)."""
    out = {}
    for name, argv in SINK_SAVES.items():
        trainer = build_trainer(parse_args(argv, world_size=world))
        data = batches_from(trainer, 0, BEFORE + AFTER)
        for _ in range(BEFORE):
            train_step(trainer, data)
        mark_trained(trainer, BEFORE)
        save_checkpoint(trainer.checkpoint_state, os.path.join(tmp, name))
        if name == "tp2":                                   # ZeRO-3's parameters are sharded over DP
            out["saved_sinks"] = sinks_of(trainer)
        out[f"{name}_reference"] = [float(train_step(trainer, data)[0]) for _ in range(AFTER)]
    for name, argv in SINK_RESUMES.items():
        trainer = build_trainer(parse_args(argv, world_size=world))
        load_checkpoint(trainer.checkpoint_state, os.path.join(tmp, name), log=quiet)
        out[f"{name}_loaded_sinks"] = sinks_of(trainer)
        data = batches_from(trainer, BEFORE, AFTER)
        out[f"{name}_resumed"] = [float(train_step(trainer, data)[0]) for _ in range(AFTER)]
    return out


@pytest.fixture(scope="module")
def sinks(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("sinks"))
    return tmp, run_ranks(4, sinks_save_and_resume, tmp)


def whole(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Each sink assembled from the ranks' shards, in TP rank order (replicas must agree)."""
    shards = {}
    for found in per_rank:
        for name, (tp_rank, value) in found.items():
            held = shards.setdefault(name, {}).setdefault(tp_rank, value)
            assert torch.equal(held, value), name
    return {name: torch.cat([by_rank[r] for r in sorted(by_rank)]) for name, by_rank in shards.items()}


def assert_same(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(found) == sorted(expected) and all(torch.equal(found[n], expected[n]) for n in found), (found,
                                                                                                      expected)


@pytest.mark.parametrize("name", sorted(SINK_SAVES))
def test_a_tp2_checkpoint_with_sinks_resumes_at_tp1(sinks, name):
    """A model with learned sinks and a sliding window, saved at TP=2 (with and without ZeRO-3): each head's
    stored sink is the one the head's TP rank trained, and the checkpoint resumes serially and at another
    TP=1 layout with the sinks in their heads' places and the uninterrupted run's losses."""
    tmp, results = sinks
    stored = CheckpointReader(os.path.join(tmp, name, f"iter_{BEFORE:07d}"))
    every = {n: stored.tensor(n) for n in stored.names() if n.endswith("softmax_offset")}   # Adam's moments too
    saved = {n: t for n, t in every.items() if n.startswith("decoder.")}
    assert sorted(saved) == [f"decoder.layers.{i}.self_attention.softmax_offset" for i in range(2)]
    assert len(every) == 6 and all(len(set(t.tolist())) == 4 for t in every.values()), every
    if name == "tp2":
        assert_same(whole([out["saved_sinks"] for out in results]), saved)
    assert_same(whole([out[f"{name}_loaded_sinks"] for out in results]), saved)
    reference = results[0][f"{name}_reference"]
    assert all(out[f"{name}_reference"] == reference for out in results)
    assert results[-1][f"{name}_resumed"] == pytest.approx(reference, rel=1e-5)     # the last pipeline stage
    trainer = build_trainer(parse_args(SINK_ARGS, world_size=1))
    load_checkpoint(trainer.checkpoint_state, os.path.join(tmp, name), log=quiet)
    assert_same(whole([sinks_of(trainer)]), saved)
    data = batches_from(trainer, BEFORE, AFTER)
    assert [float(train_step(trainer, data)[0]) for _ in range(AFTER)] == pytest.approx(reference, rel=1e-5)
