"""`mtp-gateway demo --speed S`: the turns' waits on the simulated device follow its speed.

Found by running the agent CLIs against `demo --speed 0.2 --memory turns` (docs/clients.md):
the simulated release took longer than the real 60 s `turns.release_timeout_s`, so every turn
failed and new requests got 503s for a minute."""

from __future__ import annotations

from gateway.cli import device_time_at_speed
from gateway.config import Settings


def test_a_slow_simulated_pair_gets_device_waits_in_its_own_time() -> None:
    settings = Settings()
    slow = device_time_at_speed(settings, 0.2).turns
    real = settings.turns
    assert slow.release_timeout_s == real.release_timeout_s * 5
    assert slow.resume_timeout_s == real.resume_timeout_s * 5
    assert slow.ready_within_s == real.ready_within_s * 5
    assert slow.call_timeout_s == real.call_timeout_s * 5
    # What the clients wait for is the gateway's promise, not the device's: unchanged.
    assert (slow.wait_max_s, slow.finish_within_s) == (real.wait_max_s, real.finish_within_s)


def test_a_pair_at_or_above_the_modelled_speed_keeps_the_real_waits() -> None:
    settings = Settings()
    for speed in (1.0, 20.0):
        assert device_time_at_speed(settings, speed).turns == settings.turns
