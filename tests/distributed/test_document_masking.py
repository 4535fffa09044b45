"""Packed documents through pretrain_gpt.py: with --reset-position-ids --reset-attention-mask
--eod-mask-loss, iteration 1's loss on packed samples is transformers' loss on each document run alone
(positions from 0, the EOD position's loss masked), in one process, at TP=2 with sequence parallelism,
at PP=2 and at CP=2 (ring and all-to-all: the documents cross the load-balanced chunks); without the reset flags the documents see each other and the loss differs."""
import pytest
import torch
import torch.nn.functional as F

from harness import logged_losses, run_pretrain
from megalite.checkpoint.hf import hf_to_megalite
from megalite.data.gpt_sample import document_starts
from megalite.data.builder import build_train_valid_test_datasets
from megalite.data.tokenizers import build_tokenizer
from megalite.train.command_line import parse_args
from megalite_test_utils import log_field
from megalite_test_utils import run_pretrain as run_in_process
from unit.checkpoint.test_convert_checkpoint import VOCAB, make_hf

pytest.importorskip("transformers")

EOD = VOCAB - 1           # NullTokenizer: eod is one past --vocab-size
SAMPLES = 4               # one micro-batch of the mock data's packed samples: iteration 1's global batch
FLAGS = ["--use-checkpoint-args", "--finetune", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(EOD), "--micro-batch-size", str(SAMPLES), "--global-batch-size", str(SAMPLES),
         "--seq-length", "32", "--lr", "1e-3", "--train-iters", "1", "--eval-iters", "0", "--num-workers", "0",
         "--log-interval", "1", "--attention-dropout", "0", "--hidden-dropout", "0", "--eod-mask-loss",
         "--seed", "2"]          # whose mock samples hold 1 to 3 documents each
RESET = ["--reset-position-ids", "--reset-attention-mask"]
LAYOUTS = {"tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
           "pp2": ["--pipeline-model-parallel-size", "2"],
           "cp2-ring": ["--context-parallel-size", "2"],
           "cp2-a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(the transformers Llama, argv of a run continuing from its converted checkpoint)."""
    hf_dir, ckpt = (str(tmp_path_factory.mktemp(n)) for n in ("hf", "ckpt"))
    hf_model = make_hf(hf_dir, "llama_gqa_tied")
    hf_to_megalite(hf_dir, ckpt)
    return hf_model, FLAGS + ["--load", ckpt]


def first_samples(argv, count: int) -> list[dict]:
    """The first ``count`` training samples the run ``argv`` reads: iteration 1's global batch."""
    config = parse_args(argv, world_size=1)
    train, _, _ = build_train_valid_test_datasets(config.data, build_tokenizer(config.data), (count, 0, 0),
                                                  config.training.seed)
    return [train[i] for i in range(count)]


def documents_alone_loss(hf_model, argv) -> float:
    """transformers' masked mean loss over iteration 1's samples, each document run on its own."""
    total, count, documents = 0.0, 0.0, 0
    for sample in first_samples(argv, SAMPLES):
        tokens, labels = (torch.as_tensor(sample[k]).long() for k in ("tokens", "labels"))
        mask = torch.as_tensor(sample["loss_mask"])
        bounds = [*document_starts(sample["tokens"], EOD).tolist(), len(tokens)]
        for start, end in zip(bounds[:-1], bounds[1:]):
            with torch.no_grad():
                logits = hf_model(tokens[None, start:end]).logits[0]
            losses = F.cross_entropy(logits, labels[start:end], reduction="none")
            total += float((losses * mask[start:end]).sum())
            count += float(mask[start:end].sum())
            documents += 1
    assert documents >= 2 * SAMPLES           # the samples do pack several documents
    return total / count


def test_packed_documents_loss_equals_each_document_alone_in_one_process(converted):
    hf_model, argv = converted
    expected = documents_alone_loss(hf_model, argv + RESET)
    first = log_field(run_in_process(argv + RESET)[1], 1, "lm loss")
    assert abs(first - expected) <= 1e-5 * expected, (first, expected)
    # without the reset flags every token sees the documents before it in the sample
    across = log_field(run_in_process(argv)[1], 1, "lm loss")
    assert abs(across - expected) > 1e-3 * expected, (across, expected)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_documents_loss_equals_each_document_alone_in_parallel(converted, layout):
    hf_model, argv = converted
    expected = documents_alone_loss(hf_model, argv + RESET)
    proc = run_pretrain(2, argv + RESET + LAYOUTS[layout], timeout=300)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    first = logged_losses(proc.stdout)[1]
    assert abs(first - expected) <= 1e-5 * expected, (layout, first, expected)
