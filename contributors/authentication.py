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
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].decode(errors="replace") != self.keyword:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Send the device token as 'Authorization: Device <token>'.")
        row = sql.fetch_one(_device_sql(), [DeviceEvent.Kind.FAILURE, token_hash(header[1].decode(errors="replace"))])
        if row is None:
            raise exceptions.AuthenticationFailed("Unknown or disabled device token.")
        device = sql.instance(Device, row[:-1])
        device.owner_flagged = bool(row[-1])
        owner_id = device.owner_id
        return SimpleLazyObject(lambda: get_user_model().objects.get(pk=owner_id)), device

    def authenticate_header(self, request) -> str:
        return self.keyword


@functools.cache
def _device_sql() -> str:
    """One statement, written once: every request of every device runs it, and the ORM's query building costs more
    than the query. The device (active, and its owner active) by its token's hash, with `owner_flagged`
    (selectors.owner_flagged_before) alongside, which claims and results need."""
    device, user, event = sql.table(Device), sql.table(get_user_model()), sql.table(DeviceEvent)
    return (f"SELECT {sql.columns(Device, 'd')}, EXISTS (SELECT 1 FROM {device} o JOIN {event} e ON e.device_id = o.id "
            f"WHERE o.owner_id = d.owner_id AND o.id <> d.id AND (o.quarantined_at IS NOT NULL OR o.failures > 0) "
            f"AND e.kind = %s AND e.at < d.created_at) AS owner_flagged "
            f"FROM {device} d JOIN {user} u ON u.id = d.owner_id "
            f"WHERE d.token_hash = %s AND d.is_active AND u.is_active")


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
