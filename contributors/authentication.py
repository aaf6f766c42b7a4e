"""`Authorization: Device <token>`: the per-device token a worker client uses for everything but registration."""
import functools
import hashlib

from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone
from django.utils.functional import SimpleLazyObject
from muninn import sql
from rest_framework import authentication, exceptions

from .models import Device, DeviceEvent


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class DeviceTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Device"

    def authenticate(self, request):
        found = self._device_row(request, _device_sql(), [])
        return None if found is None else found[:2]

    def authenticate_with_lease(self, request, unit_id: int):
        """`authenticate`, with the device's current lease on the unit read in the same statement (a result needs
        both: one round trip instead of two): (user, device, row), `row` the lease's and the unit's columns
        (contributors.services.leased_from_row) or None when the device holds no lease on the unit."""
        found = self._device_row(request, _device_with_lease_sql(), [unit_id])
        if found is None:
            return None
        user, device, rest = found
        return user, device, (None if rest[0] is None else rest)

    def _device_row(self, request, statement: str, params: list):
        """(user, device, the row's columns after the device's) for `statement` (_device_sql's, with `params`
        between its two), None when the request names no device token."""
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].decode(errors="replace") != self.keyword:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Send the device token as 'Authorization: Device <token>'.")
        row = sql.fetch_one(statement, [DeviceEvent.Kind.FAILURE, *params,
                                        token_hash(header[1].decode(errors="replace"))])
        if row is None:
            raise exceptions.AuthenticationFailed("Unknown or disabled device token.")
        n = len(Device._meta.concrete_fields)
        device = sql.instance(Device, row[:n])
        device.owner_flagged = bool(row[n])
        owner_id = device.owner_id
        return SimpleLazyObject(lambda: get_user_model().objects.get(pk=owner_id)), device, row[n + 1:]

    def authenticate_header(self, request) -> str:
        return self.keyword


@functools.cache
def _device_sql() -> str:
    """One statement, written once: every request of every device runs it, and the ORM's query building costs more
    than the query. The device (active, and its owner active) by its token's hash, with `owner_flagged`
    (selectors.owner_flagged_before) alongside, which claims and results need."""
    select, tables, where = _device_parts()
    return f"SELECT {select} FROM {tables} WHERE {where}"


@functools.cache
def _device_with_lease_sql() -> str:
    """_device_sql's statement, then the device's current lease on a unit and the unit (NULLs when it holds none)."""
    from jobs.models import WorkUnit

    from .models import Lease

    select, tables, where = _device_parts()
    return (f"SELECT {select}, {sql.columns(Lease, 'l')}, {sql.columns(WorkUnit, 'w')} FROM {tables} "
            f"LEFT JOIN ({sql.table(Lease)} l JOIN {sql.table(WorkUnit)} w ON w.id = l.unit_id "
            f"AND w.lease_token = l.token) ON l.device_id = d.id AND l.unit_id = %s WHERE {where}")


def _device_parts() -> tuple[str, str, str]:
    """The device statement's select list (one %s: the failure event's kind), tables and condition (one %s: the
    token's hash)."""
    device, user, event = sql.table(Device), sql.table(get_user_model()), sql.table(DeviceEvent)
    return (f"{sql.columns(Device, 'd')}, EXISTS (SELECT 1 FROM {device} o JOIN {event} e ON e.device_id = o.id "
            f"WHERE o.owner_id = d.owner_id AND o.id <> d.id AND (o.quarantined_at IS NOT NULL OR o.failures > 0) "
            f"AND e.kind = %s AND e.at < d.created_at) AS owner_flagged",
            f"{device} d JOIN {user} u ON u.id = d.owner_id",
            "d.token_hash = %s AND d.is_active AND u.is_active")


class HasDevice:
    """Permission: the request was authenticated with a device token."""

    message = "This endpoint needs a device token ('Authorization: Device <token>')."

    def has_permission(self, request, view) -> bool:
        return isinstance(request.auth, Device)

    def has_object_permission(self, request, view, obj) -> bool:
        return True


TOUCH_EVERY_S = 5  # "online" means seen in the last MUNINN_DEVICE_ONLINE_SECONDS (60): finer is wasted writes


def touch(device: Device) -> None:
    """Mark the device seen now, unless it was marked less than TOUCH_EVERY_S ago: every request of every
    device would otherwise write its row (most of the writes of a busy site, and all of a heartbeat's but one)."""
    now = timezone.now()
    if device.last_seen_at is not None and (now - device.last_seen_at).total_seconds() < TOUCH_EVERY_S:
        return
    sql.execute(_touch_sql(connection.vendor, alone=not connection.in_atomic_block),
                [sql.value(Device, "last_seen_at", now), device.pk])
    device.last_seen_at = now


@functools.cache
def _touch_sql(vendor: str, *, alone: bool) -> str:
    """Written once (muninn/sql.py: why). Run in a transaction of its own (`alone`), its commit does not wait for
    the disk: a last-seen time lost is sent again by the device's next request. Inside a caller's transaction
    it leaves that transaction's commit as it is."""
    returning = sql.unflushed_returning(vendor) if alone else ""
    return f"UPDATE {sql.table(Device)} SET last_seen_at = %s WHERE id = %s{returning}"
