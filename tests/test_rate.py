"""The one token bucket (fleetheal.rate), on a clock the test names."""

from __future__ import annotations

from fleetheal.rate import TokenBucket


def test_a_bucket_holds_a_seconds_worth_and_refills_with_time() -> None:
    b = TokenBucket(10, now=0.0)
    assert sum(b.take(0.0) for _ in range(20)) == 10  # a second's burst, no more
    assert not b.take(0.05)  # half a token
    assert b.take(0.1)
    assert b.has(100.0, 10) and not b.has(100.0, 11)  # never more than a second's worth


def test_a_debt_is_repaid_before_anything_is_taken_again() -> None:
    b = TokenBucket(100, now=0.0)
    b.spend(0.0, 1000)  # far past what is there: the debt stops at a second's worth
    assert b.tokens == -100
    assert not b.has(1.0)  # one second repays the debt to zero, nothing more
    assert b.take(1.02)
