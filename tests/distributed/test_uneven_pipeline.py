"""Uneven pipeline stages (Megatron's --decoder-first/last-pipeline-num-layers, --account-for-embedding/
loss-in-pipeline-split, --pipeline-model-parallel-layout): the split itself, one-line errors for every bad
combination, training equal to one process, and checkpoints that reshard between splits."""
import shutil

import pytest

from harness import logged_losses, run_pretrain, run_ranks
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags
from megalite.train.command_line import parse_args
from megalite.errors import UserError
from megalite.model.chunks import build_model_chunks
from megalite.config.pipeline_split import SplitFlags, parse_layout, virtual_stage_layers
from megalite.parallel.tensor.layers import TensorParallel

# 7 layers: no pipeline size above 1 divides it
SEVEN = with_flags(TINY_LLAMA_ARGS, num_layers=7, train_iters=4, global_batch_size=8, make_vocab_size_divisible_by=32,
                   lr_warmup_iters=1, lr_decay_style="cosine", clip_grad=0.5, weight_decay=0.1)


# ---- the split -----------------------------------------------------------------------------------------
def test_megatron_splits():
    S = SplitFlags
    # Llama-3.1 405B (126 layers), NVIDIA's recipe: the embedding and the loss each count as a layer
    assert virtual_stage_layers(126, 8, S(2, account_for_embedding=True, account_for_loss=True)) == \
        [1] + [2] * 62 + [1]                                             # PP8 x VPP8, 2 per virtual stage
    assert virtual_stage_layers(126, 16, S(account_for_embedding=True, account_for_loss=True)) == [7] + [8] * 14 + [7]
    assert virtual_stage_layers(126, 16, S(first=7, last=7)) == [7] + [8] * 14 + [7]
    # first/last with virtual stages: each rank's layers divide over its chunks; v = chunk * pp + rank
    assert virtual_stage_layers(10, 3, S(virtual_stages_per_rank=2, first=2, last=4)) == [1, 2, 2, 1, 2, 2]
    assert virtual_stage_layers(7, 2, S(first=3)) == [3, 4]
    assert virtual_stage_layers(7, 4, S(last=1)) == [2, 2, 2, 1]
    assert virtual_stage_layers(7, 2, S(account_for_embedding=True)) == [3, 4]
    # embedding-only and loss-only stages
    assert virtual_stage_layers(2, 4, S(account_for_embedding=True, account_for_loss=True)) == [0, 1, 1, 0]
    # Megatron's documented example (DeepSeek-V3, 61 layers + MTP at PP16 VPP2): the grammar unrolls alike
    stages = parse_layout("Et*3|(tt|)*29,m|L")
    assert len(stages) == 32 and stages[0] == "Ettt" and stages[1:30] == ["tt"] * 29 and stages[30:] == ["m", "L"]
    assert virtual_stage_layers(7, 2, S(layout="Et|tt|tt|ttL")) == [1, 2, 2, 2]
    assert virtual_stage_layers(7, 2, S(layout="E|t*4|(t)*3|L")) == [0, 4, 3, 0]      # embedding, loss alone


def test_every_layer_lives_on_exactly_one_stage_with_its_global_name():
    model = parse_args(SEVEN, world_size=1).model
    for pp, flags in ((2, SplitFlags(first=3)), (4, SplitFlags(first=1, last=2)),
                      (2, SplitFlags(layout="Et|tt|tt|ttL")), (4, SplitFlags(account_for_embedding=True))):
        layers = virtual_stage_layers(7, pp, flags)
        chunks_per_rank = len(layers) // pp
        names = []
        for rank in range(pp):
            chunks = build_model_chunks(model, 1, TensorParallel(), rank, pp, chunks_per_rank, meta=True,
                                        stage_layers=layers)
            names += [c.global_name(n) for c in chunks for n, _ in c.named_parameters() if "layers." in n]
        layer_ids = sorted({int(n.split(".")[2]) for n in names})
        assert layer_ids == list(range(7)) and len(names) == len(set(names)), (pp, flags)


BAD = [
    ({"pipeline_model_parallel_size": 2}, "--num-layers 7 must be divisible by --pipeline-model-parallel-size 2"),
    ({"pipeline_model_parallel_size": 4, "decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3},
     "leaves 3 layers, which the 2 middle pipeline stages must split evenly"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 3, "decoder_last_pipeline_num_layers": 3},
     "must add up to --num-layers 7"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 8}, "must add up to --num-layers 7 or less"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 0}, "must be at least 1"),
    ({"decoder_first_pipeline_num_layers": 3}, "--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size > 1"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 3, "account_for_loss_in_pipeline_split": True},
     "cannot be combined with --account-for-embedding/loss-in-pipeline-split"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 3,
      "num_layers_per_virtual_pipeline_stage": 1}, "needs --num-virtual-stages-per-pipeline-rank instead"),
    ({"pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 3, "num_virtual_stages_per_pipeline_rank": 2},
     "--decoder-first-pipeline-num-layers 3 must be divisible by --num-virtual-stages-per-pipeline-rank 2"),
    ({"pipeline_model_parallel_size": 2, "account_for_embedding_in_pipeline_split": True,
      "account_for_loss_in_pipeline_split": True}, "= 9 must be divisible by --pipeline-model-parallel-size 2"),
    ({"pipeline_model_parallel_size": 2, "num_layers_per_virtual_pipeline_stage": 1,
      "num_virtual_stages_per_pipeline_rank": 2}, "give one"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ettt|tttL",
      "decoder_first_pipeline_num_layers": 3}, "places every layer itself; drop --decoder-first-pipeline-num-layers"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ettt|ttL"},
     "places 5 transformer layers (t) but --num-layers is 7"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ettt|tttt|L"},
     "has 3 stages, not a multiple of --pipeline-model-parallel-size 2"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ettt|t|tt|m,tL"}, "m (multi-token prediction"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "tEtt|ttttL"}, "the embedding E must appear once"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ettt|ttLtt"}, "the loss L must appear once"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ettt||tttt|L"}, "stage 1 is empty"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Ettt|tttx"}, "unknown symbol 'x'"),
    ({"pipeline_model_parallel_layout": "Ettt|ttttL"}, "virtual stages need --pipeline-model-parallel-size > 1"),
    ({"pipeline_model_parallel_size": 2, "pipeline_model_parallel_layout": "Et|tt|tt|ttL", "global_batch_size": 6,
      "micro_batch_size": 2}, "interleaved pipelining needs the number of micro-batches (3)"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_combinations_are_one_line_errors_naming_the_flag(flags, message):
    world = flags.get("pipeline_model_parallel_size", 1)
    with pytest.raises(UserError) as err:
        parse_args(with_flags(SEVEN, **flags), world_size=world)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


# ---- training equals one process -------------------------------------------------------------------------
def _histories(rank, world, layouts):
    from megalite.train.trainer import pretrain
    return [pretrain(parse_args(argv, world_size=world), print_fn=lambda *_: None).history for argv in layouts]


UNEVEN = {
    2: [({"decoder_first_pipeline_num_layers": 3}, False),
        ({"pipeline_model_parallel_layout": "Et|tt|tt|ttL"}, True),                  # interleaved, 1+2 / 2+2
        ({"account_for_embedding_in_pipeline_split": True}, True),                 # 3 / 4
        ({"decoder_last_pipeline_num_layers": 2}, True)],
    4: [({"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 2}, True),   # 1 2 2 2
        ({"decoder_last_pipeline_num_layers": 1}, False)],                                         # 2 2 2 1
}


@pytest.mark.parametrize("pp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_uneven_stages_train_like_one_process(pp):
    """7 layers at PP=2 and PP=4 (every way to split them unevenly), tied and untied embeddings: the losses
    of the last stage equal the single-process run's."""
    layouts = [with_flags(SEVEN, pipeline_model_parallel_size=pp, untie_embeddings_and_output_weights=not tied, **flags)
               for flags, tied in UNEVEN[pp]]
    serial = {tied: _histories(0, 1, [with_flags(SEVEN, untie_embeddings_and_output_weights=not tied)])[0]
              for tied in (False, True)}
    last_rank = run_ranks(pp, _histories, layouts)[-1]
    for argv, (_, tied), history in zip(layouts, UNEVEN[pp], last_rank):
        assert len(history) == 4
        assert history == pytest.approx(serial[tied], rel=1e-5), argv


# ---- checkpoints reshard between splits --------------------------------------------------------------------
CKPT = with_flags(SEVEN, train_iters=6, untie_embeddings_and_output_weights=None)


def _run(nproc, argv):
    proc = run_pretrain(nproc, argv)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    return logged_losses(proc.stdout)


@pytest.fixture(scope="module")
def saved_uneven(tmp_path_factory):
    """The uninterrupted PP=2 run with 3 / 4 layers, saving at iterations 3 and 6."""
    tmp = tmp_path_factory.mktemp("uneven")
    losses = _run(2, CKPT + ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "3",
                             "--save", str(tmp / "ck"), "--save-interval", "3"])
    return tmp, losses


@pytest.mark.parametrize("nproc, split", [
    (4, ["--pipeline-model-parallel-size", "4", "--decoder-first-pipeline-num-layers", "1",
         "--decoder-last-pipeline-num-layers", "2"]),
    pytest.param(2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tt|tt|ttL"],
                 marks=pytest.mark.slow),
    pytest.param(1, [], marks=pytest.mark.slow),
], ids=["pp4-first1-last2", "pp2-interleaved-layout", "serial"])
def test_a_checkpoint_saved_at_one_split_resumes_at_another(saved_uneven, tmp_path, nproc, split):
    tmp, full = saved_uneven
    shutil.copytree(tmp / "ck" / "iter_0000003", tmp_path / "ck")
    resumed = _run(nproc, CKPT + split + ["--load", str(tmp_path / "ck")])
    assert sorted(resumed) == [4, 5, 6]
    worst = max(abs(resumed[i] - full[i]) / abs(full[i]) for i in resumed)
    assert worst <= 1e-5, (full, resumed)
