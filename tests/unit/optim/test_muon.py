"""The Muon update rule against torch.optim.Muon (+ torch.optim.AdamW for the rest), its logical
matrices (Q, K, V and gate, up split from the fused weights, each expert apart) and its named state."""
import pytest
import torch
from torch import nn

from megalite.config.muon_fields import NS_COEFFICIENTS
from megalite.config.schema import ModelConfig, OptimizerConfig
from megalite.optim.mixed_precision import MixedPrecisionOptimizer
from megalite.optim.muon_matrices import is_muon_matrix, logical_blocks
from megalite.optim.rules.muon import newton_schulz
from megalite.parallel.data.grad_buffer import ParamAndGradBuffer

def model_config(**kw):
    base = dict(num_layers=1, hidden_size=12, num_attention_heads=4, ffn_hidden_size=8, kv_channels=3,
                num_query_groups=2, seq_length=8, max_position_embeddings=8, padded_vocab_size=16)
    return ModelConfig(**{**base, **kw})


MUON_TORCH = dict(muon_coefficient_type="simple", muon_scale_mode="spectral", muon_extra_scale_factor=0.2)


class Toy(nn.Module):
    """Two weight matrices (one tall, one wide), a norm weight and a bias."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(6, 9, bias=True)
        self.norm = nn.LayerNorm(9, bias=False)
        self.down = nn.Linear(9, 6, bias=False)

    def forward(self, x):
        return self.down(self.norm(torch.relu(self.up(x))))


def loss_of(model, step):
    torch.manual_seed(100 + step)
    x, target = torch.randn(5, 4, 6), torch.randn(5, 4, 6)
    return ((model(x) - target) ** 2).mean()


@pytest.mark.parametrize("nesterov", [False, True])
def test_muon_rule_steps_as_torch_muon_and_adamw(nesterov):
    config = OptimizerConfig(lr=2e-2, weight_decay=0.1, clip_grad=0.0, adam_beta2=0.95, optimizer="muon",
                             muon_momentum=0.9, muon_nesterov=nesterov, **MUON_TORCH)
    model, reference = Toy(), Toy()
    named = list(model.named_parameters())
    optimizer = MixedPrecisionOptimizer(ParamAndGradBuffer(named), named, config, model=model_config())
    assert optimizer.matrix_names == {"up.weight", "down.weight"}
    ref = dict(reference.named_parameters())
    torch_muon = torch.optim.Muon([ref["up.weight"], ref["down.weight"]], lr=2e-2, weight_decay=0.1, momentum=0.9, nesterov=nesterov,
                                  adjust_lr_fn="match_rms_adamw")
    torch_adamw = torch.optim.AdamW([ref["up.bias"], ref["norm.weight"]], lr=2e-2, betas=(0.9, 0.95), eps=1e-8,
                                    weight_decay=0.0, fused=True)
    for step in range(4):
        optimizer.zero_grad()
        loss_of(model, step).backward()
        assert optimizer.step(2e-2).update_successful
        torch_muon.zero_grad()
        torch_adamw.zero_grad()
        loss_of(reference, step).backward()
        torch_muon.step()
        torch_adamw.step()
    for name, mine in model.named_parameters():      # the same operations in the same order: bit for bit
        torch.testing.assert_close(mine, ref[name], rtol=0, atol=0, msg=name)
    # named state: a matrix's momentum is torch's momentum buffer; the rest has AdamW's moments
    assert optimizer.state_names_of("up.weight") == ("momentum",)
    assert optimizer.state_names_of("up.bias") == ("exp_avg", "exp_avg_sq")
    pieces = {p.start: m for p, m in zip(optimizer.pieces, optimizer.master_pieces)}
    slot = optimizer.buffer.slots["down.weight"]
    state = optimizer.named_state(pieces[slot.start])
    torch.testing.assert_close(state["momentum"].view(slot.shape), torch_muon.state[ref["down.weight"]]["momentum_buffer"],
                               rtol=0, atol=0)
    assert optimizer.step_count == 4.0


def test_fp32_matmul_prec_low_is_megatrons_value_for_the_runs_precision():
    """low (Megatron's value that torch's set_float32_matmul_precision ignores) steps as high, fp32 at the
    run's precision, bit for bit; medium (bf16) differs."""
    from megalite.train.command_line import parse_args
    from megalite_test_utils import TINY_LLAMA_ARGS
    assert parse_args(TINY_LLAMA_ARGS + ["--optimizer", "muon", "--muon-fp32-matmul-prec", "low"],
                      world_size=1).optimizer.muon_fp32_matmul_prec == "low"
    weights = {}
    for prec in ("low", "high", "medium"):
        model = Toy()
        named = list(model.named_parameters())
        config = OptimizerConfig(lr=2e-2, optimizer="muon", muon_fp32_matmul_prec=prec)
        optimizer = MixedPrecisionOptimizer(ParamAndGradBuffer(named), named, config, model=model_config())
        for step in range(2):
            optimizer.zero_grad()
            loss_of(model, step).backward()
            optimizer.step(2e-2)
        weights[prec] = model.up.weight.detach().clone()
    assert torch.equal(weights["low"], weights["high"])
    assert not torch.equal(weights["high"], weights["medium"])


def test_muon_state_is_about_half_of_adamw_for_matrices():
    """An fp32 model's optimizer state: AdamW keeps 8 bytes per parameter, Muon 4 per matrix element and
    AdamW's 8 for the rest."""
    model = Toy()
    named = list(model.named_parameters())
    sizes = {}
    for rule in ("adam", "muon"):
        config = OptimizerConfig(lr=1e-2, optimizer=rule)
        sizes[rule] = MixedPrecisionOptimizer(ParamAndGradBuffer(named), named, config, model=model_config()).state_bytes()
    matrices = sum(p.numel() for n, p in named if n in ("up.weight", "down.weight"))
    total = sum(p.numel() for _, p in named)
    assert sizes["adam"] == 8 * total + 4              # two moments, and AdamW's step counter (fp32)
    assert sizes["muon"] == 4 * matrices + 8 * (total - matrices) + 4      # the norm and bias: one piece


def test_newton_schulz_fp32_orthogonalises_and_matches_torch_in_bf16():
    torch.manual_seed(0)
    m = torch.randn(12, 30)
    ours = newton_schulz(m, NS_COEFFICIENTS["simple"], 5, bf16=True)
    theirs = torch.optim._muon._zeropower_via_newtonschulz(m, NS_COEFFICIENTS["simple"][0], 5, 1e-7).float()
    assert torch.equal(ours, theirs)
    assert torch.equal(newton_schulz(m.T, NS_COEFFICIENTS["simple"], 5, bf16=True), theirs.T)   # tall: transposed
    # fp32 quintic: singular values of the result lie near 1 (the coefficients' fixed band), unlike m's
    s = torch.linalg.svdvals(newton_schulz(m, NS_COEFFICIENTS["quintic"], 5, bf16=False))
    assert s.min() > 0.6 and s.max() < 1.3, s
    assert not torch.equal(newton_schulz(m, NS_COEFFICIENTS["quintic"], 5, bf16=False),
                           newton_schulz(m, NS_COEFFICIENTS["quintic"][:1], 5, bf16=False))   # cycles five sets


def test_logical_matrices_of_fused_and_stacked_weights():
    model = model_config(swiglu=True, num_experts=2)
    config = OptimizerConfig(lr=1e-3)
    # per KV group [q, q, k, v] x 3 rows: Q = rows 0-5 and 12-17, K = 6-8 and 18-20, V = 9-11 and 21-23
    assert logical_blocks("l.self_attention.linear_qkv.weight", 24, model, config) == [
        [(0, 6), (12, 18)], [(6, 9), (18, 21)], [(9, 12), (21, 24)]]
    fused = OptimizerConfig(lr=1e-3, muon_split_qkv=False, muon_fused_gate_up=True)
    assert logical_blocks("l.self_attention.linear_qkv.weight", 24, model, fused) == [[(0, 24)]]
    assert logical_blocks("l.mlp.linear_fc1.weight", 10, model, config) == [[(0, 5)], [(5, 10)]]
    assert logical_blocks("l.mlp.linear_fc1.weight", 10, model, fused) == [[(0, 10)]]
    assert logical_blocks("l.mlp.experts.linear_fc1.weight", 8, model, config) == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]]
    assert logical_blocks("l.mlp.experts.linear_fc2.weight", 24, model, config) == [[(0, 12)], [(12, 24)]]
    assert logical_blocks("l.self_attention.linear_proj.weight", 12, model, config) == [[(0, 12)]]
    matrix = nn.Parameter(torch.zeros(3, 4))
    assert is_muon_matrix("decoder.layers.0.mlp.linear_fc2.weight", matrix)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.layers.0.mlp.router.weight"):
        assert not is_muon_matrix(name, matrix)
    assert not is_muon_matrix("decoder.layers.0.input_layernorm.weight", nn.Parameter(torch.zeros(3)))


@pytest.mark.parametrize("extra, fragment", [
    (["--muon-tp-mode", "rowwise"],
     "invalid choice: 'rowwise' (choose from 'duplicated', 'distributed', 'blockwise')"),
    (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps: must be a positive integer"),
    (["--fp16", "--loss-scale", "1"], "--optimizer muon with --fp16 needs loss scaling"),
])
def test_muon_bad_input_is_one_line(extra, fragment, capsys):
    from megalite.errors import UserError
    from megalite.train.command_line import parse_args
    from megalite_test_utils import TINY_LLAMA_ARGS
    with pytest.raises((UserError, SystemExit)) as caught:
        parse_args(TINY_LLAMA_ARGS + ["--optimizer", "muon", *extra], world_size=1)
    message = str(caught.value) if caught.type is UserError else capsys.readouterr().err
    assert fragment in message and len(message.strip().splitlines()) == 1, message


def test_muon_selects_the_whole_parameter_zero_layout():
    from megalite.train.command_line import parse_args
    from megalite_test_utils import TINY_LLAMA_ARGS
    config = parse_args(TINY_LLAMA_ARGS + ["--optimizer", "muon", "--use-distributed-optimizer",
                                           "--global-batch-size", "4"], world_size=2)
    assert config.parallel.use_layer_wise_distributed_optimizer
    zero3 = parse_args(TINY_LLAMA_ARGS + ["--optimizer", "muon", "--data-parallel-sharding-strategy", "optim_grads_params",
                                          "--global-batch-size", "4"], world_size=2)
    assert zero3.parallel.use_layer_wise_distributed_optimizer
    assert not parse_args(TINY_LLAMA_ARGS + ["--use-distributed-optimizer"], world_size=2).parallel.use_layer_wise_distributed_optimizer
