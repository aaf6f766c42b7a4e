"""Fixed SQL for the worker API's hot path: statements written once, run with values the ORM's own fields prepare.

Every claim, heartbeat and result of every device runs a handful of statements whose shape never changes. Built by
the ORM on each request, building them cost more CPU than running them (query compilation, ~0.5-1 ms each on the
2-core dev machine: bench/api_profile.py). Here they are written once, in SQL both PostgreSQL and SQLite read, and
each value is prepared by its model field (`value`), so a datetime, a UUID or a JSON value is stored exactly as the
ORM would store it on either database. Anything that is not on that path stays with the ORM.

On PostgreSQL these statements are also prepared, once per connection: the values are bound by the server and it
parses and plans each text once, not on every request. Django's own cursors bind on the client (its default, kept
for the ORM: server-side binding changes how some of its queries read), so they go through `_cursor` instead.
"""
from __future__ import annotations

import functools

from django.db import DEFAULT_DB_ALIAS, connection, connections


def value(model, field: str, python_value):
    """`python_value` as the database stores `model.field` (what the ORM's save would send)."""
    return model._meta.get_field(field).get_db_prep_save(python_value, connections[DEFAULT_DB_ALIAS])


def table(model) -> str:
    return _table(model, connection.vendor)


def columns(model, alias: str = "") -> str:
    """The model's concrete columns in field order: what Model.from_db(alias, None, row) reads."""
    return _columns(model, alias, connection.vendor)


# Quoted once per model: some statements are written as they run (a few words around these), and `connection` is a
# proxy that finds this thread's connection on every attribute read.
@functools.cache
def _table(model, vendor: str) -> str:
    return connection.ops.quote_name(model._meta.db_table)


@functools.cache
def _columns(model, alias: str, vendor: str) -> str:
    prefix = f"{alias}." if alias else ""
    return ", ".join(f"{prefix}{connection.ops.quote_name(f.column)}" for f in model._meta.concrete_fields)


def literal(constant: str) -> str:
    """A constant of the code (a status's value, never anything a request sent) as an SQL string literal, for a
    statement's text. On PostgreSQL a prepared statement may be run on one plan made for any values (its generic
    plan), and a partial index (`WHERE status = 'queued'`) serves that plan only when the statement says the same
    constant. Compared with a parameter, the claim's generic plan walked the queue and counted the device's leases
    over the whole table: 15-17 ms a claim on bench/load.py's 8,000 units, against 4 ms with the statuses written
    in, and 0.1 ms with the backends' patterns written in too (jobs.services.leases._backend_pattern). Every
    prepared statement runs its generic plan (settings: plan_cache_mode), so whatever that plan depends on is
    written here."""
    return "'" + str(constant).replace("'", "''") + "'"


def unflushed(vendor: str) -> str:
    """A RETURNING clause's column that lets the statement's transaction commit without waiting for the disk: on
    PostgreSQL, `synchronous_commit` off for that transaction alone (`set_config(..., true)`); "" elsewhere. Only for
    writes whose loss in a crash of the database costs nothing: a lease that vanishes is issued again (its holder's
    next heartbeat or result is answered `lease_lost`), a heartbeat or a last-seen time is sent again. Never for a
    result, a receipt or money (and a durable commit after it makes everything written before it durable too)."""
    return ", set_config('synchronous_commit', 'off', true)" if vendor == "postgresql" else ""


def unflushed_returning(vendor: str) -> str:
    """`unflushed` as a whole RETURNING clause, for a statement that returns nothing else ("" elsewhere)."""
    return f" RETURNING 1{unflushed(vendor)}" if unflushed(vendor) else ""


def execute(statement: str, params) -> int:
    """Run one statement; returns how many rows it changed."""
    return _run(statement, params, lambda cursor: cursor.rowcount)


def insert(obj, *, unflushed: bool = False):
    """INSERT a new model instance as the ORM's save would (defaults and auto_now_add filled in, each value prepared
    by its field), in a statement written once per model; sets its id. Sends no model signals. `unflushed`: outside
    a transaction, the row is committed without waiting for the disk (see `unflushed`: only a row whose loss costs
    nothing); inside one, the transaction's commit is left as it is."""
    model, db = type(obj), connections[DEFAULT_DB_ALIAS]
    statement = _insert_sql(model, db.vendor if unflushed and not db.in_atomic_block else "")
    obj.pk = fetch_one(statement, _insert_params(obj, db))[0]
    obj._state.adding, obj._state.db = False, db.alias
    return obj


def _insert_params(obj, db) -> list:
    """`obj`'s values as the ORM's save would send them (defaults and auto_now_add filled in), in _insert_fields'
    order."""
    return [f.get_db_prep_save(f.pre_save(obj, True), db) for f in _insert_fields(type(obj))]


@functools.cache
def _insert_fields(model) -> list:
    return [f for f in model._meta.concrete_fields if not f.primary_key]


@functools.cache
def _insert_sql(model, unflushed_on: str = "") -> str:
    """`unflushed_on`: the vendor whose `unflushed` column the statement returns after the id ("": none)."""
    name = connection.ops.quote_name
    fields = _insert_fields(model)
    return (f"INSERT INTO {table(model)} ({', '.join(name(f.column) for f in fields)}) "
            f"VALUES ({', '.join(['%s'] * len(fields))}) RETURNING {name(model._meta.pk.column)}"
            f"{unflushed(unflushed_on) if unflushed_on else ''}")


def insert_when(obj, condition: str) -> tuple[str, list]:
    """`insert`'s statement and parameters for `obj`, made to insert it only when `condition` (SQL, read when the
    statement runs) holds: for run_together, where a statement cannot wait on what the one before it returned. Its
    RETURNING gives the new id, or no row. PostgreSQL only (each value cast to its column's type: a SELECT's
    parameters are not typed by the columns they go to)."""
    return _insert_when_sql(type(obj), condition), _insert_params(obj, connections[DEFAULT_DB_ALIAS])


@functools.cache
def _insert_when_sql(model, condition: str) -> str:
    import re

    name = connection.ops.quote_name
    fields = _insert_fields(model)
    # varchar(n) cast as varchar: a cast cuts a longer string short, where the column refuses it
    casts = [re.sub(r"^varchar\(\d+\)$", "varchar", f.cast_db_type(connection)) for f in fields]
    return (f"INSERT INTO {table(model)} ({', '.join(name(f.column) for f in fields)}) "
            f"SELECT {', '.join(f'%s::{cast}' for cast in casts)} WHERE {condition} "
            f"RETURNING {name(model._meta.pk.column)}")


def update(model, values: dict, **where) -> int:
    """UPDATE the model's rows matching `where` (each column equal to a value, none of them None) with `values`
    (None: NULL). Returns how many rows changed. The statement's text is cached by its columns."""
    params = [value(model, f, v) for f, v in values.items()] + [value(model, f, v) for f, v in where.items()]
    return execute(update_sql(model, tuple(values), tuple(where)), params)


@functools.cache
def update_sql(model, columns_set: tuple[str, ...], columns_where: tuple[str, ...]) -> str:
    """`update`'s statement: its parameters are the values set, then those compared, each in the order given."""
    name = connection.ops.quote_name
    column = lambda field: name(model._meta.get_field(field).column)  # noqa: E731
    return (f"UPDATE {table(model)} SET {', '.join(f'{column(f)} = %s' for f in columns_set)} "
            f"WHERE {' AND '.join(f'{column(f)} = %s' for f in columns_where)}")


def fetch_one(statement: str, params) -> tuple | None:
    return _run(statement, params, lambda cursor: cursor.fetchone())


def fetch_all(statement: str, params, *, planned_each_time: bool = False) -> list[tuple]:
    """`planned_each_time`: not prepared, so planned on every run from the table's size now. For a lookup by a
    value that is not unique, on a table that grows from nothing with the site (receipts by output hash): the one
    plan a prepared statement keeps was made from the table it found, and a sequential scan made for an empty table
    took 1.7 ms a lookup once bench/load.py had written 5,000 receipts."""
    return _run(statement, params, lambda cursor: [tuple(row) for row in cursor.fetchall()],
                prepared=not planned_each_time)


def run_together(statements: list[tuple[str, list]]) -> list[list[tuple]]:
    """Run the statements, in order, in one transaction; each one's rows. On PostgreSQL outside a caller's
    transaction, all of them go to the server at once with their BEGIN and COMMIT, and come back in one round trip
    (psycopg's pipeline mode): a transaction that takes a lock many requests wait on (an acceptance, its round's)
    then holds it for the server's own time, not for a round trip and a wait for this process's GIL between each
    two statements and before the COMMIT. A statement therefore cannot depend on what the one before it returned,
    only on what it did (a row it wrote, a transaction-local setting it made). Elsewhere (SQLite, or inside a
    caller's transaction), one after another in a transaction of their own (a savepoint in the caller's). An error
    rolls the whole transaction back and is raised as Django's (IntegrityError, ...)."""
    from django.db import transaction
    from psycopg.pq import TransactionStatus

    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql" or db.in_atomic_block:
        with transaction.atomic():
            return [_run(statement, params, _rows) for statement, params in statements]
    db.close_if_health_check_failed()
    db.ensure_connection()
    raw = db.connection
    cursors = _pipeline_cursors(db, len(statements) + 1)
    try:
        with db.wrap_database_errors, raw.pipeline():
            cursors[0].execute("BEGIN", prepare=False)
            for cursor, (statement, params) in zip(cursors[1:], statements):
                db._prepare_cursor(cursor).execute(statement, params)  # Django's wrapper: captured as its own are
            cursors[0].execute("COMMIT", prepare=False)
    except BaseException:
        if not raw.closed and raw.info.transaction_status != TransactionStatus.IDLE:
            with db.wrap_database_errors:
                raw.rollback()  # the transaction an error aborted: its COMMIT was never run
        raise
    return [_rows(cursor) for cursor in cursors[1:]]


def _rows(cursor) -> list[tuple]:
    """A statement's rows; [] for one that returns none (an UPDATE without RETURNING)."""
    return [tuple(row) for row in cursor.fetchall()] if cursor.description is not None else []


def _pipeline_cursors(db, n: int) -> list:
    """`n` raw cursors of this connection for run_together (a pipeline's results come back to the cursor that sent
    each statement), kept with the connection as `_run`'s is."""
    kept = db.__dict__.get("_muninn_pipeline")
    if kept is None or kept[0].connection is not db.connection or kept[0].closed:
        kept = db._muninn_pipeline = []
    while len(kept) < n:
        cursor = _prepared_cursor_class()(db.connection)
        _compiled_timestamps(cursor, db)
        kept.append(cursor)
    return kept[:n]


def _run(statement: str, params, read, *, prepared: bool = True):
    """Run the statement through Django's cursor wrapper (errors translated to django.db's, queries captured where
    Django captures them) and return `read(cursor)`. On PostgreSQL the cursor under it binds on the server and
    prepares every statement it runs (psycopg keeps up to `prepared_max`, 100, per connection; the hot path has
    about twenty texts), and it is one cursor per connection, kept open: making a psycopg cursor per statement
    (its adapters copied, Django's connection proxy read half a dozen times) was ~5 % of the web's CPU under load.
    `prepared` False: Django's own cursor, which binds on the client (planned on every run)."""
    db = connections[DEFAULT_DB_ALIAS]
    if db.vendor != "postgresql" or not prepared:
        with db.cursor() as cursor:
            cursor.execute(statement, params)
            return read(cursor)
    db.close_if_health_check_failed()
    db.ensure_connection()
    raw = db.__dict__.get("_muninn_prepared")
    if raw is None or raw.connection is not db.connection or raw.closed:
        raw = db._muninn_prepared = _prepared_cursor_class()(db.connection)
        _compiled_timestamps(raw, db)
    cursor = db._prepare_cursor(raw)  # not closed after: the next statement on this connection reuses it
    cursor.execute(statement, params)
    return read(cursor)


def _compiled_timestamps(cursor, db) -> None:
    """Timestamps read by psycopg's compiled loader, not Django's: Django's (its timezone put on every value) is a
    subclass of psycopg's pure-Python one, ~2.5 µs a value against 0.2, and a result's statements read some twenty
    (1.5 % of the web's CPU under bench/load.py). On a UTC connection both give the same values with the same
    tzinfo (datetime.timezone.utc): only there is the compiled one put on this cursor."""
    from datetime import timezone

    import psycopg
    from psycopg.pq import Format
    from psycopg.types.datetime import TimestamptzLoader

    oid = psycopg.adapters.types["timestamptz"].oid
    compiled = psycopg.adapters.get_loader(oid, Format.TEXT)
    if (compiled is not None and compiled is not TimestamptzLoader and db.timezone is timezone.utc
            and db.connection.info.parameter_status("TimeZone") == "UTC"):
        cursor.adapters.register_loader(oid, compiled)


@functools.cache
def _prepared_cursor_class():
    from django.db.backends.postgresql.base import ServerBindingCursor

    class PreparedCursor(ServerBindingCursor):
        def execute(self, query, params=None, *, prepare=True, binary=None):
            return super().execute(query, params, prepare=prepare, binary=binary)

    return PreparedCursor


def instance(model, row):
    """A model instance from a row of `columns(model)`, as the ORM builds one from a query: each value through the
    converters the ORM would apply (JSON decoded, SQLite's datetimes and UUIDs parsed)."""
    db = connections[DEFAULT_DB_ALIAS]
    values = list(row)
    for n, col, converters in _converters(model, db.vendor):
        for convert in converters:
            values[n] = convert(values[n], col, db)
    return model.from_db(db.alias, None, values)


@functools.cache
def _converters(model, vendor: str) -> list[tuple]:
    found = []
    for n, field in enumerate(model._meta.concrete_fields):
        col = field.get_col(model._meta.db_table)
        converters = connection.ops.get_db_converters(col) + col.get_db_converters(connection)
        if converters:
            found.append((n, col, converters))
    return found
