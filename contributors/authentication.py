"""`Authorization: Device <token>`: the per-device token a worker client uses for everything but registration."""
import hashlib

from django.utils import timezone
from rest_framework import authentication, exceptions

from .models import Device


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
        device = (Device.objects.select_related("owner")
                  .filter(token_hash=token_hash(header[1].decode(errors="replace")), is_active=True).first())
        if device is None or not device.owner.is_active:
            raise exceptions.AuthenticationFailed("Unknown or disabled device token.")
        return device.owner, device

    def authenticate_header(self, request) -> str:
        return self.keyword


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
    Device.objects.filter(pk=device.pk).update(last_seen_at=now)
    device.last_seen_at = now
