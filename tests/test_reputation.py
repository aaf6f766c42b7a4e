from contributors.reputation import ADAPTIVE_MIN_RATE, draw, quarantine_due, reexecution_rate, should_reexecute


def test_new_devices_are_always_reexecuted():
    assert all(reexecution_rate(s) == 1.0 for s in range(5))
    assert should_reexecute(0, 0.999)


def test_by_default_every_result_is_checked_however_long_the_streak():
    assert all(reexecution_rate(s) == 1.0 for s in (0, 5, 70, 10**6))
    assert should_reexecute(10**6, 0.999)


def test_under_a_lowered_floor_the_rate_falls_with_the_streak_but_never_below_it():
    rates = [reexecution_rate(s, min_rate=ADAPTIVE_MIN_RATE) for s in range(5, 500)]
    assert rates == sorted(rates, reverse=True)
    assert reexecution_rate(9, min_rate=0.05) == 0.5 and reexecution_rate(499, min_rate=0.05) == 0.05


def test_draw_is_uniform_ish_stable_and_secret_dependent():
    values = [draw("s", unit, "lease") for unit in range(2000)]
    assert all(0 <= v < 1 for v in values) and 0.45 < sum(values) / len(values) < 0.55
    assert draw("s", 1, "t") == draw("s", 1, "t") != draw("other", 1, "t")


def test_quarantine_after_repeated_failures():
    assert not quarantine_due(2) and quarantine_due(3)
