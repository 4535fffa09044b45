"""--optimizer muon through pretrain_gpt.py: a tiny Llama imported from transformers, trained 20 iterations,
equals transformers + torch.optim.Muon (q, k, v, o, gate, up, down separately) + torch.optim.AdamW (the
rest) with the same schedule and clipping, serially and at DP=2 ZeRO-1, DP=2 ZeRO-3, TP=2 + SP (--muon-tp-mode
duplicated and distributed), PP=2 and hybrid sharding (DP=4 in 2 instances, ZeRO-1 and ZeRO-3 with overlap);
AdamW differs, and so does blockwise mode at TP=2 (at TP=1 it is the serial rule).
A Muon checkpoint saved at DP=2 resumes serially with the uninterrupted losses; resuming it with AdamW is
refused in one line."""
import os

import pytest
import torch
import torch.nn.functional as F

from harness import logged_losses, run_pretrain
from megalite.checkpoint.hf import hf_to_megalite, megalite_to_hf
from safetensors.torch import load_file
from test_continue_pretraining import TRAIN_FLAGS
from unit.checkpoint.test_convert_checkpoint import make_hf

ITERS, LR, MIN_LR, WARMUP, WD = 20, 1e-3, 1e-4, 2, 0.1
MUON_FLAGS = ["--optimizer", "muon", "--lr", str(LR), "--muon-coefficient-type", "simple",
              "--muon-extra-scale-factor", "0.2",
              "--weight-decay", str(WD), "--lr-decay-style", "linear", "--lr-warmup-iters", str(WARMUP),
              "--min-lr", str(MIN_LR), "--clip-grad", "1.0", "--seed", "5", "--muon-fp32-matmul-prec", "high"]
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYOUTS = {"dp2-zero1": (2, ["--use-distributed-optimizer"]),
           "dp2-zero3": (2, ["--data-parallel-sharding-strategy", "optim_grads_params"]),
           "tp2-sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
           "tp2-sp-distributed": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                      "--muon-tp-mode", "distributed"])}
SLOW_LAYOUTS = {"pp2": (2, ["--pipeline-model-parallel-size", "2"]),
                "hsdp-dp4": (4, ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
                                 "--micro-batch-size", "1"]),
                "hsdp-dp4-zero3": (4, ["--data-parallel-sharding-strategy", "optim_grads_params",
                                       "--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce",
                                       "--overlap-param-gather", "--micro-batch-size", "1"])}


def lr_at(step):
    """The learning rate of iteration step + 1: linear warm-up from 0, then linear decay to MIN_LR."""
    if step <= WARMUP:
        return LR * step / WARMUP
    return MIN_LR + (LR - MIN_LR) * (1 - (step - WARMUP) / (ITERS - WARMUP))


def batches(argv):
    """The global batches of the 20 iterations, from megalite's own data pipeline."""
    from megalite.train.command_line import parse_args
    from megalite.data.builder import build_train_valid_test_datasets
    from megalite.data.tokenizers import build_tokenizer
    config = parse_args(argv, world_size=1)
    train, _, _ = build_train_valid_test_datasets(config.data, build_tokenizer(config.data), (4 * ITERS, 0, 0),
                                                  config.training.seed)
    for i in range(ITERS):
        samples = [train[4 * i + j] for j in range(4)]
        yield (torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long(),
               torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long())


def torch_newton_schulz_in_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz (torch/optim/_muon.py) with its bf16 cast made fp32: a bf16 iteration
    turns the fp32 rounding differences of two implementations' gradients into bf16 ones, which 20 steps
    grow past the comparison's tolerance (the rule is compared with torch's bf16 one bit for bit in
    tests/unit/optim/test_muon.py)."""
    a, b, c = ns_coefficients
    x = grad.float().clone()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def reference_run(model, argv):
    """transformers + torch.optim.Muon (matrices) + torch.optim.AdamW (embedding: decayed; norms: not)."""
    named = dict(model.named_parameters())
    matrices = [p for n, p in named.items() if n.endswith(tuple(f"{m}.weight" for m in MATRICES))]
    muon = torch.optim.Muon(matrices, lr=LR, weight_decay=WD, momentum=0.9, nesterov=False,
                            adjust_lr_fn="match_rms_adamw")
    embedding = [p for n, p in named.items() if "embed_tokens" in n or "lm_head" in n]
    norms = [p for n, p in named.items() if p.dim() == 1]
    adamw = torch.optim.AdamW([{"params": embedding, "weight_decay": WD}, {"params": norms, "weight_decay": 0.0}],
                              lr=LR, betas=(0.9, 0.999), eps=1e-8)
    assert len(matrices) + len(embedding) + len(norms) == len(named)
    losses = []
    for step, (tokens, labels) in enumerate(batches(argv)):
        for opt in (muon, adamw):
            opt.zero_grad()
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
        loss = F.cross_entropy(model(tokens).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        muon.step()
        adamw.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon")
    hf_dir, ckpt = str(tmp / "hf"), str(tmp / "ckpt")
    model = make_hf(hf_dir, "llama_gqa_tied")
    hf_to_megalite(hf_dir, ckpt)
    argv = TRAIN_FLAGS + MUON_FLAGS + ["--load", ckpt, "--train-iters", str(ITERS)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", torch_newton_schulz_in_fp32)
        losses, weights = reference_run(model.train(), argv)
    return tmp, argv, losses, weights


def train(tmp, argv, name, ranks=1, extra=()):
    out, hf_out = str(tmp / name), str(tmp / f"{name}_hf")
    proc = run_pretrain(ranks, argv + ["--save", out, *extra], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    megalite_to_hf(out, hf_out)
    losses = logged_losses(proc.stdout)
    return [losses[i + 1] for i in range(ITERS)], load_file(os.path.join(hf_out, "model.safetensors"))


def assert_matches(losses, weights, ref_losses, ref_weights):
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 5e-5, list(zip(losses, ref_losses))
    worst = max((weights[n] - ref_weights[n]).abs().max().item() for n in weights)
    assert worst <= 1e-3, worst


def test_muon_serial_equals_transformers_with_torch_muon_and_adamw(setup):
    tmp, argv, ref_losses, ref_weights = setup
    losses, weights = train(tmp, argv, "serial")
    assert sorted(weights) == sorted(n for n in ref_weights if n != "lm_head.weight")
    assert_matches(losses, weights, ref_losses, ref_weights)
    adam_losses, _ = train(tmp, [a if a != "muon" else "adam" for a in argv], "adam")
    assert max(abs(a - b) for a, b in zip(adam_losses, ref_losses)) > 1e-3      # the comparison can fail


@pytest.mark.parametrize("layout", list(LAYOUTS) + [pytest.param(name, marks=pytest.mark.slow)
                                                      for name in SLOW_LAYOUTS])
def test_muon_layouts_equal_transformers_with_torch_muon(setup, layout):
    tmp, argv, ref_losses, ref_weights = setup
    ranks, extra = {**LAYOUTS, **SLOW_LAYOUTS}[layout]
    losses, weights = train(tmp, argv, layout, ranks, extra)
    assert_matches(losses, weights, ref_losses, ref_weights)


@pytest.mark.slow
def test_muon_blockwise_changes_the_result_with_tp_only(setup):
    """--muon-tp-mode blockwise orthogonalises each TP rank's part of a matrix on its own: at TP=1 it is the
    whole-matrix rule (equal to the reference), at TP=2 its weights leave the reference's tolerance (by
    about 5x). The rule-level check runs by default (tests/distributed/test_muon_tp_modes.py)."""
    tmp, argv, ref_losses, ref_weights = setup
    blockwise = ["--muon-tp-mode", "blockwise"]
    assert_matches(*train(tmp, argv, "blockwise-tp1", 1, blockwise), ref_losses, ref_weights)
    _, weights = train(tmp, argv, "blockwise-tp2", 2, blockwise + LAYOUTS["tp2-sp"][1])
    worst = max((weights[n] - ref_weights[n]).abs().max().item() for n in weights)
    assert worst > 1e-3, worst


def test_muon_checkpoint_saved_at_dp2_resumes_serially_and_refuses_adamw(setup):
    tmp, argv, _, _ = setup
    out = str(tmp / "dp2_saved")
    full = run_pretrain(2, argv + ["--use-distributed-optimizer", "--save", out, "--save-interval", "10"])
    assert full.returncode == 0, full.stderr[-3000:]
    resume = [a for a in argv if a != "--finetune"]
    resume[resume.index("--load") + 1] = out
    # the saved run is at iteration 20: resume from its iteration-10 checkpoint
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("10")
    resumed = run_pretrain(1, resume)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    ours, uninterrupted = logged_losses(resumed.stdout), logged_losses(full.stdout)
    assert sorted(ours) == list(range(11, ITERS + 1))
    assert all(abs(ours[i] - uninterrupted[i]) <= 5e-6 for i in ours), (ours, uninterrupted)
    refused = run_pretrain(1, [a if a != "muon" else "adam" for a in resume])
    assert refused.returncode != 0
    assert "holds --optimizer muon state but this run uses --optimizer adam" in refused.stderr
    assert "--no-load-optim" in refused.stderr
