"""--optimizer muon with Newton-Schulz in bf16 (--muon-fp32-matmul-prec medium, the default), as
torch.optim.Muon runs it, against transformers + torch.optim.Muon + torch.optim.AdamW over 20 iterations.

A bf16 Newton-Schulz rounds its input to 8 mantissa bits, so two implementations whose fp32 gradients
differ by rounding alone round a few elements of the momentum differently, and 20 steps grow those into
loss differences of order 1e-5 to 1e-4. transformers itself shows it: the same model with its sdpa and its
eager attention, both stepped by torch.optim.Muon, drifts apart by that much. So the yardstick is measured
in the same run: megalite's loss gap to the reference is at most twice transformers' own sdpa-vs-eager
gap (plus 1e-5), and its final weights are within 1e-3. With Newton-Schulz in fp32 on both sides the two
agree to fp32 rounding (test_muon_training.py). The rule itself equals torch's bf16 one bit for bit on the
same input (tests/unit/optim/test_muon.py)."""
import copy

import pytest
import torch

from megalite.checkpoint.hf import hf_to_megalite
from test_muon_training import ITERS, MUON_FLAGS, TRAIN_FLAGS, reference_run, train
from unit.checkpoint.test_convert_checkpoint import make_hf


def _without_fp32_newton_schulz(flags):
    i = flags.index("--muon-fp32-matmul-prec")
    return flags[:i] + flags[i + 2:]


def _reference(model, argv, attention):
    model = copy.deepcopy(model).train()
    model.config._attn_implementation = attention
    return reference_run(model, argv)


def _gaps(run, other):
    loss = max(abs(a - b) for a, b in zip(run[0], other[0]))
    weight = max((run[1][n] - other[1][n]).abs().max().item() for n in run[1] if n in other[1])
    return loss, weight


def test_muon_bf16_newton_schulz_drifts_no_more_than_transformers_from_itself(tmp_path):
    model = make_hf(str(tmp_path / "hf"), "llama_gqa_tied")
    hf_to_megalite(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    argv = TRAIN_FLAGS + _without_fp32_newton_schulz(MUON_FLAGS) + ["--load", str(tmp_path / "ckpt"),
                                                                    "--train-iters", str(ITERS)]
    sdpa, eager = _reference(model, argv, "sdpa"), _reference(model, argv, "eager")
    peer_loss_gap, _ = _gaps(sdpa, eager)
    assert peer_loss_gap > 0                                  # the peer's own runs do round differently
    ours = train(tmp_path, argv, "bf16")
    loss_gap, weight_gap = _gaps(ours, sdpa)
    assert loss_gap <= 2 * peer_loss_gap + 1e-5, (loss_gap, peer_loss_gap)
    assert weight_gap <= 1e-3, weight_gap
