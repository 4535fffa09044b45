"""--window-size, --window-attn-skip-freq and --softmax-type: Megatron's spellings, which layers get the
window, and one-line refusals of windows the model cannot use."""
import pytest

from megalite.errors import UserError
from megalite.train.command_line import parse_args
from megalite_test_utils import TINY_LLAMA_ARGS, with_flags


def _model(**flags):
    return parse_args(with_flags(TINY_LLAMA_ARGS, **flags), world_size=1).model


def test_megatron_spellings_of_the_window():
    assert _model(window_size="7,0").window_size == [7, 0]
    assert _model(window_size="(7,0)").window_size == [7, 0]
    plain = _model()
    assert plain.window_size is None and plain.softmax_type == "vanilla"
    assert [plain.attention_window(n) for n in (1, 2)] == [(-1, -1)] * 2


def test_every_nth_layer_stays_full_as_megatron_counts():
    m = _model(num_layers=6, window_size="7,0", window_attn_skip_freq="3")
    assert [m.attention_window(n) for n in range(1, 7)] == [(7, 0), (7, 0), (-1, -1)] * 2
    m = _model(num_layers=4, window_size="7,0", window_attn_skip_freq="[1,0]*2")
    assert [m.attention_window(n) for n in range(1, 5)] == [(7, 0), (-1, -1)] * 2
    m = _model(num_layers=2, window_size="7,0")
    assert [m.attention_window(n) for n in (1, 2)] == [(7, 0)] * 2


@pytest.mark.parametrize("flags, message", [
    (dict(window_size="(-2,0)"), "argument --window-size: each side must be >= 0, or -1"),
    (dict(window_size="7"), 'argument --window-size: expected "LEFT,RIGHT"'),
    (dict(window_size="32,0"), "--window-size 32,0: the window is longer than --seq-length 32"),
    (dict(window_size="7,3"), "--window-size 7,3: a causal model sees no key to the right"),
    (dict(window_attn_skip_freq="2"), "--window-attn-skip-freq picks the layers without a window; add --window-size"),
    (dict(window_size="7,0", window_attn_skip_freq="[1,0,1]"), "--window-attn-skip-freq lists 3 layers but"),
    (dict(softmax_type="sigmoid"), "argument --softmax-type: invalid choice"),
    (dict(softmax_type="learnable", attention_dropout="0.1"), "--softmax-type learnable runs the masked attention"),
    (dict(window_size="7,0", attention_dropout="0.1"), "--window-size runs the masked attention kernel, which has"),
])
def test_bad_windows_are_one_line(flags, message):
    with pytest.raises(UserError) as err:
        _model(**flags)
    assert message in str(err.value) and "\n" not in str(err.value)
