"""A sliding-window model trains as transformers computes it: a Mistral with a 4-token window, converted,
gives iteration 1's loss equal to transformers' loss on the same samples, in one process and at CP=2
(ring and all-to-all), whose chunks the window crosses."""
import pytest
import torch
import torch.nn.functional as F

from harness import logged_losses, run_pretrain
from megalite.checkpoint.hf import hf_to_megalite
from megalite_test_utils import log_field
from megalite_test_utils import run_pretrain as run_in_process
from test_document_masking import first_samples
from unit.checkpoint.test_convert_checkpoint import VOCAB, make_hf

pytest.importorskip("transformers")

SAMPLES = 4
FLAGS = ["--use-checkpoint-args", "--finetune", "--mock-data", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", str(VOCAB - 1), "--micro-batch-size", str(SAMPLES), "--global-batch-size", str(SAMPLES),
         "--seq-length", "32", "--lr", "1e-3", "--train-iters", "1", "--eval-iters", "0", "--num-workers", "0",
         "--log-interval", "1", "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "2"]
LAYOUTS = {"serial": [], "cp2-ring": ["--context-parallel-size", "2"],
           "cp2-a2a": ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    hf_dir, ckpt = (str(tmp_path_factory.mktemp(n)) for n in ("hf", "ckpt"))
    hf_model = make_hf(hf_dir, "mistral")
    assert hf_model.config.sliding_window == 4
    hf_to_megalite(hf_dir, ckpt)
    return hf_model, FLAGS + ["--load", ckpt]


def transformers_loss(hf_model, argv) -> float:
    samples = first_samples(argv, SAMPLES)
    tokens, labels = (torch.stack([torch.as_tensor(s[k]).long() for s in samples]) for k in ("tokens", "labels"))
    with torch.no_grad():
        logits = hf_model(tokens).logits
    return float(F.cross_entropy(logits.flatten(0, 1), labels.flatten()))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_windowed_mistral_trains_as_transformers_computes_it(converted, layout):
    hf_model, argv = converted
    expected = transformers_loss(hf_model, argv)
    if layout == "serial":
        first = log_field(run_in_process(argv)[1], 1, "lm loss")
    else:
        proc = run_pretrain(2, argv + LAYOUTS[layout], timeout=300)
        assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
        first = logged_losses(proc.stdout)[1]
    assert abs(first - expected) <= 1e-5 * expected, (layout, first, expected)
