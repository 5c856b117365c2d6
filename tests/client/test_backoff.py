"""`client.backoff`: every retry loop's delays double to a cap and are jittered, so a fleet that lost Redis at
one instant does not retry in lockstep."""

from __future__ import annotations

from client.backoff import Backoff, jittered


def test_each_delay_lies_in_the_upper_half_of_the_doubling_and_stops_at_the_cap() -> None:
    backoff = Backoff(0.05, 1.0)
    doubling = [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    for full in doubling:
        assert full / 2 <= backoff.next() <= full
    backoff.reset()
    assert 0.025 <= backoff.next() <= 0.05


def test_two_clients_that_failed_together_do_not_retry_together() -> None:
    """A thousand clients' first retries spread over the half-delay window rather than landing on one instant."""
    firsts = [Backoff(1.0, 8.0).next() for _ in range(1000)]
    assert min(firsts) >= 0.5 and max(firsts) <= 1.0
    assert len({round(first, 3) for first in firsts}) > 100
    assert max(firsts) - min(firsts) > 0.4


def test_jittered_keeps_zero_at_zero() -> None:
    assert jittered(0.0) == 0.0
