from __future__ import annotations

import pytest

import torchfix
from torchfix.deepcache import DeepCacheConfig, full_steps, is_full_step


def test_defaults_and_exports():
    cfg = torchfix.DeepCacheConfig()
    assert (cfg.interval, cfg.branch, cfg.schedule) == (3, 0, "uniform")
    assert torchfix.deepcache.DeepCacheConfig is DeepCacheConfig


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"interval": 0}, "interval"),
        ({"branch": -1}, "branch"),
        ({"schedule": "fast"}, "schedule"),
        ({"start": 0.5, "stop": 0.5}, "start"),
        ({"stop": 1.5}, "stop"),
        ({"power": 0.5}, "power"),
        ({"num_steps": 0}, "num_steps"),
        ({"num_steps": True}, r"num_steps=True must be a positive int"),
    ],
)
def test_validation_is_a_clear_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DeepCacheConfig(**kwargs)
    with pytest.raises(TypeError, match="int"):
        DeepCacheConfig(interval=2.5)


def test_uniform_schedule():
    assert sorted(full_steps(10, DeepCacheConfig(interval=3, forecast=0))) == [0, 3, 6, 9]
    assert sorted(full_steps(10, DeepCacheConfig(interval=1))) == list(range(10))
    assert sorted(full_steps(10, DeepCacheConfig(interval=5, forecast=0))) == [0, 5]
    assert sorted(full_steps(10, DeepCacheConfig(interval=2, forecast=0))) == [0, 2, 4, 6, 8]
    assert sorted(full_steps(10, DeepCacheConfig(interval=2, warm_up=False))) == [0, 2, 4, 6, 8]


@pytest.mark.parametrize("forecast", [None, 1, 2])
def test_a_forecast_warms_up_with_a_second_full_step_at_2(forecast):
    """A forecast needs two full steps: the second comes at step 2, then every interval (the same count
    of full steps as DeepCache's 0, interval, 2·interval, ... wherever the window allows)."""
    assert sorted(full_steps(10, DeepCacheConfig(interval=3, forecast=forecast))) == [0, 2, 5, 8]
    assert sorted(full_steps(20, DeepCacheConfig(interval=4, forecast=forecast))) == [0, 2, 6, 10, 14, 18]
    assert [is_full_step(i, None, DeepCacheConfig(interval=3, forecast=forecast)) for i in range(9)] == [
        True, False, True, False, False, True, False, False, True
    ]  # fmt: skip
    # at interval 2 the warm-up runs steps 0, 1 and 2 in full: no cached step reuses step 0's feature or
    # forecasts across the first steps (one more full step than 0, 2, 4, ...)
    assert sorted(full_steps(10, DeepCacheConfig(interval=2, forecast=forecast))) == [0, 1, 2, 4, 6, 8]
    assert [is_full_step(i, None, DeepCacheConfig(interval=2, forecast=forecast)) for i in range(7)] == [
        True, True, True, False, True, False, True
    ]  # fmt: skip
    assert sorted(full_steps(10, DeepCacheConfig(interval=2, forecast=forecast, stop=0.9))) == [0, 1, 2, 4, 6, 8, 9]
    # a window that starts later already has full steps before it: no warm-up
    assert sorted(full_steps(10, DeepCacheConfig(interval=3, forecast=forecast, start=0.2))) == [0, 1, 2, 5, 8]


@pytest.mark.parametrize("interval", [2, 3, 4, 5])
@pytest.mark.parametrize("total", [7, 10, 25, 50])
def test_nonuniform_spends_the_same_number_of_full_steps_earlier(interval, total):
    uni = full_steps(total, DeepCacheConfig(interval=interval, forecast=0))
    non = full_steps(total, DeepCacheConfig(interval=interval, schedule="nonuniform", forecast=0))
    assert len(non) == len(uni) and 0 in non and max(non) < total
    assert sum(non) <= sum(uni)  # packed towards the start


def test_window_keeps_the_ends_full():
    cfg = DeepCacheConfig(interval=4, start=0.2, stop=0.8)
    f = full_steps(10, cfg)
    assert {0, 1, 8, 9} <= f and 2 in f
    assert not is_full_step(3, 10, cfg)


def test_unknown_total_is_uniform():
    cfg = DeepCacheConfig(interval=3, schedule="nonuniform", forecast=0)
    assert [is_full_step(i, None, cfg) for i in range(7)] == [True, False, False, True, False, False, True]
