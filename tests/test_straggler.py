"""Straggler detection: noise never re-plans, a real slowdown re-plans once, and the shares follow speed."""

import random

import pytest

from titan.parallel.balance import data_shares
from titan.straggler import StragglerDetector


@pytest.mark.parametrize("seed", range(5))
def test_noise_never_replans_and_a_step_change_replans_exactly_once(seed):
    rng = random.Random(seed)
    detector = StragglerDetector(ranks=4)
    noisy = lambda: [rng.uniform(0.8, 1.2) for _ in range(4)]  # noqa: E731
    assert [detector.update(noisy()) for _ in range(1000)] == [None] * 1000
    plans = []
    for _ in range(1000):  # rank 2 now takes 3x as long, with the same noise
        times = noisy()
        times[2] *= 3.0
        weights = detector.update(times)
        if weights is not None:
            plans.append(weights)
    assert len(plans) == 1
    weights = plans[0]
    # The slow rank at about its speed; the others stay well above it (a noisy median can itself pass the
    # 1.2x threshold at the moment of the plan, and then keeps its measured speed).
    assert weights[2] == pytest.approx(1 / 3, abs=0.08) and min(weights[:2] + weights[3:]) > 2 * weights[2]
    assert data_shares(64, weights)[2] < 64 // 4 // 2  # the slow rank now reads well under half its even share


def test_recovery_returns_to_even_shares():
    detector = StragglerDetector(ranks=2, window=3)
    for _ in range(3):
        detector.update([1.0, 3.0])
    assert detector.weights == pytest.approx([1.0, 1 / 3])
    changes = [detector.update([1.0, 1.05]) for _ in range(3)]
    assert [c for c in changes if c is not None] == [[1.0, 1.0]]
