"""muninn.sql.run_together: statements sent to PostgreSQL together (psycopg's pipeline, with their BEGIN and COMMIT)
commit together or not at all, give each statement's rows, and leave the connection ready for the next request."""
from __future__ import annotations

import pytest
from django.db import IntegrityError, connection, transaction

from muninn import sql

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def table():
    if connection.vendor != "postgresql":
        pytest.fail("needs PostgreSQL: run it through `make test`")
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE together_test (id serial PRIMARY KEY, v integer UNIQUE)")
    yield "together_test"
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE together_test")


def values() -> list[int]:
    return [v for v, in sql.fetch_all("SELECT v FROM together_test ORDER BY v", [])]


def test_each_statement_sees_the_ones_before_it_and_gives_its_rows(table):
    rows = sql.run_together([("INSERT INTO together_test (v) VALUES (%s) RETURNING v", [1]),
                             ("UPDATE together_test SET v = v + 10", []),
                             ("SELECT v FROM together_test", [])])
    assert rows == [[(1,)], [], [(11,)]]
    assert values() == [11]


@pytest.mark.parametrize("inside_a_transaction", [False, True])
def test_an_error_rolls_back_every_statement_and_the_connection_goes_on(table, inside_a_transaction):
    sql.execute("INSERT INTO together_test (v) VALUES (%s)", [2])
    failing = [("INSERT INTO together_test (v) VALUES (%s) RETURNING v", [5]),
               ("INSERT INTO together_test (v) VALUES (%s)", [2])]  # the unique value taken
    if inside_a_transaction:  # one after another, in a savepoint of the caller's transaction
        with transaction.atomic():
            with pytest.raises(IntegrityError):
                sql.run_together(failing)
            sql.execute("INSERT INTO together_test (v) VALUES (%s)", [3])  # the caller's transaction goes on
    else:
        with pytest.raises(IntegrityError):
            sql.run_together(failing)
        assert not connection.in_atomic_block
        assert connection.connection.info.transaction_status == 0  # idle: the aborted transaction was ended
    assert values() == ([2, 3] if inside_a_transaction else [2])
    assert sql.run_together([("INSERT INTO together_test (v) VALUES (%s) RETURNING v", [7])]) == [[(7,)]]
    assert 7 in values()
