"""fp16 dynamic loss scaling (Megatron's rule, hysteresis included)."""
from megalite.optim.loss_scaler import ConstantLossScaler, DynamicLossScaler


def test_overflow_halves_the_scale_once_hysteresis_is_used_up():
    s = DynamicLossScaler(1024.0, min_scale=1.0, window=3, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 1024.0                  # first overflow absorbed by hysteresis
    s.update(found_inf=True)
    assert s.scale == 512.0
    s.update(found_inf=True)
    assert s.scale == 256.0                   # hysteresis stays exhausted until a growth


def test_growth_after_a_window_of_clean_steps_refills_hysteresis():
    s = DynamicLossScaler(8.0, window=3, hysteresis=2)
    for _ in range(3):
        s.update(False)
    assert s.scale == 16.0
    s.update(True)
    assert s.scale == 16.0                    # hysteresis refilled by the growth
    s.update(True)
    assert s.scale == 8.0


def test_scale_never_below_min():
    s = DynamicLossScaler(4.0, min_scale=2.0, hysteresis=1)
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0


def test_state_round_trip_and_constant():
    s = DynamicLossScaler(64.0, window=5, hysteresis=3)
    s.update(True); s.update(False)
    t = DynamicLossScaler(1.0)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    c = ConstantLossScaler(128.0)
    c.update(True)
    assert c.scale == 128.0
