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


def touch(device: Device) -> None:
    Device.objects.filter(pk=device.pk).update(last_seen_at=timezone.now())
