"""muninn/db_lifetime.py: connections opened together do not all reach CONN_MAX_AGE, and reconnect, together."""
import time

import pytest
from django.db import DEFAULT_DB_ALIAS, connections

from muninn import db_lifetime


def _lifetimes(max_age, count: int = 20) -> list[float | None]:
    """Open `count` connections one after another, as a web process's threads do as it starts serving, with this
    CONN_MAX_AGE: how long each is to live."""
    settings_dict = {**connections.settings[DEFAULT_DB_ALIAS], "CONN_MAX_AGE": max_age}
    wrapper_class = type(connections[DEFAULT_DB_ALIAS])
    lifetimes = []
    for _ in range(count):
        conn = wrapper_class(settings_dict, DEFAULT_DB_ALIAS)
        try:
            conn.ensure_connection()
            lifetimes.append(None if conn.close_at is None else conn.close_at - time.monotonic())
        finally:
            conn.close()
    return lifetimes


@pytest.mark.django_db
def test_connections_opened_together_live_spread_lifetimes_around_the_max_age():
    lifetimes = _lifetimes(60)

    low, high = 60 * (1 - db_lifetime.SPREAD) - 1, 60 * (1 + db_lifetime.SPREAD)
    assert all(low <= age <= high for age in lifetimes), lifetimes  # never far from the age asked for
    assert max(lifetimes) - min(lifetimes) > 15, lifetimes  # not all at once (uniform over 60 s: a range of ~57)


@pytest.mark.django_db
@pytest.mark.parametrize("max_age", [0, None])
def test_connections_closed_after_each_request_or_kept_for_good_are_left_so(max_age):
    lifetimes = _lifetimes(max_age, count=3)

    if max_age is None:
        assert lifetimes == [None, None, None]
    else:
        assert all(age <= 0 for age in lifetimes), lifetimes
