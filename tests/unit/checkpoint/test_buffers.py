"""Every persistent buffer of the model is saved and restored under its global name, with no checkpoint
code naming it: the MoE routers' expert biases under the names checkpoints have always used, and a new
stateful buffer a module registers; non-persistent buffers (rotary tables, per-step counters) are not."""
import torch

from megalite_test_utils import TINY_LLAMA_ARGS, with_flags

from megalite.checkpoint.files import CheckpointReader
from megalite.checkpoint.save import save_checkpoint
from megalite.checkpoint.sharded import load_checkpoint
from megalite.train.command_line import parse_args
from megalite.train.trainer import build_trainer

MOE_ARGS = with_flags(TINY_LLAMA_ARGS, num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                      moe_layer_freq="[1,0]", moe_router_score_function="sigmoid",
                      moe_router_load_balancing_type="none", moe_router_enable_expert_bias=True)


def quiet(*_):
    pass


def test_every_persistent_buffer_is_saved_and_loaded(tmp_path):
    trainer = build_trainer(parse_args(MOE_ARGS, world_size=1), quiet)
    layer = trainer.model.decoder.layers[1]
    layer.register_buffer("tally", torch.arange(6.0).view(2, 3))              # a new stateful buffer
    layer.register_buffer("scratch", torch.ones(3), persistent=False)
    bias = trainer.model.decoder.layers[0].mlp.router.expert_bias
    bias.copy_(torch.tensor([0.5, -0.25, 0.125, 2.0]))
    path = save_checkpoint(trainer.checkpoint_state, str(tmp_path))

    reader = CheckpointReader(path)
    buffers = {n for n in reader.names() if not n.endswith(".weight")}
    assert buffers == {"decoder.layers.0.mlp.router.expert_bias", "decoder.layers.1.tally"}
    assert torch.equal(reader.tensor("decoder.layers.0.mlp.router.expert_bias"), bias)
    assert torch.equal(reader.tensor("decoder.layers.1.tally"), layer.tally)

    again = build_trainer(parse_args(MOE_ARGS, world_size=1), quiet)
    again.model.decoder.layers[1].register_buffer("tally", torch.zeros(2, 3))
    load_checkpoint(again.checkpoint_state, path, log=quiet)
    assert torch.equal(again.model.decoder.layers[0].mlp.router.expert_bias, bias)
    assert torch.equal(again.model.decoder.layers[1].tally, layer.tally)
