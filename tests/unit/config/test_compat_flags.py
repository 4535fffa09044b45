"""Megatron flags accepted with a start-up line saying what megalite does instead (kernel choices,
--ckpt-format, fp8, --tiktoken-pattern)."""

import pytest

from megalite.config.megatron_cli import startup_notes
from megalite.train.command_line import parse_args
from megalite.errors import UserError
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags


def test_accepted_flags_say_once_what_megalite_does_instead():
    argv = with_flags(TINY_LLAMA_ARGS, attention_backend="flash", no_create_attention_mask_in_dataloader=True,
                      ckpt_format="torch_dist", fp8_format="hybrid", fp8_recipe="rowwise", fp8_param_gather=True, use_distributed_optimizer=True,
                      tiktoken_pattern="v2",
                      decoupled_lr="5e-4")
    config = parse_args(argv, world_size=1)
    notes = startup_notes(argv)
    assert len(notes) == 4, notes
    assert any("scaled_dot_product_attention" in n and "never builds an attention mask" in n for n in notes)
    assert any(n.startswith("--ckpt-format torch_dist: megalite writes its own reshardable format") for n in notes)
    assert any(n.startswith("--fp8-param-gather: --fp8-recipe rowwise's weights are gathered in their own dtype")
               and "one FP8 copy cannot serve both" in n for n in notes)
    assert any(n.startswith("--tiktoken-pattern v2: only Megatron's TikTokenizer") for n in notes)
    assert config.optimizer.decoupled_lr == 5e-4 and config.optimizer.decoupled_min_lr == 0.0   # --min-lr
    assert startup_notes(TINY_LLAMA_ARGS) == []
    with pytest.raises(UserError, match="--decoupled-min-lr needs --decoupled-lr"):
        parse_args(with_flags(TINY_LLAMA_ARGS, decoupled_min_lr="1e-5"), world_size=1)


def test_no_position_embedding_changes_nothing_as_in_megatron_core_models():
    """Megatron's Mixtral example passes it beside --position-embedding-type rope; its core models ignore
    it (only the legacy model read it), and so does megalite, saying so at start-up."""
    argv = with_flags(TINY_LLAMA_ARGS, no_position_embedding=True)
    assert parse_args(argv, world_size=1) == parse_args(TINY_LLAMA_ARGS, world_size=1)
    assert startup_notes(argv) == ["accepted with no effect (megalite chooses its kernels itself): "
                                   "--no-position-embedding"]


def test_no_load_flags_without_load_are_a_note_not_an_error():
    """Megatron's example scripts keep --no-load-optim / --no-load-rng with their --load line commented out."""
    argv = TINY_LLAMA_ARGS + ["--no-load-optim", "--no-load-rng"]
    parse_args(argv, world_size=1)
    assert startup_notes(argv) == ["--no-load-optim --no-load-rng: no --load, so nothing is loaded; they apply once "
                                   "--load DIR is given"]
