"""Rate limits on what a stranger can flood or guess: logins and tokens (per address and per username), sign-ups
(per address), device registrations (per account), and a device's claims and heartbeats (per device).

DRF's throttles over Django's cache (`CACHE_URL`: Redis shared by every web process; the default, a per-process
memory cache, suits one machine). The rates are `settings.MUNINN_THROTTLES` (per scope, DRF's "N/period"; a
scope set to "" is not limited). A throttled API request gets DRF's 429 with `Retry-After` in the API's error
shape; the login, sign-up and admin login forms get the site's 429 page with the same header
(`LoginThrottleMiddleware`). Honest clients stay far below: the worker client claims after each unit or long
poll and heartbeats every few seconds, and it waits out a 429's Retry-After (muninn_worker.retry).
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

from django.conf import settings
from django.shortcuts import render
from django.urls import reverse
from rest_framework.throttling import SimpleRateThrottle


class _Scoped(SimpleRateThrottle):
    """A throttle whose rate is settings.MUNINN_THROTTLES[scope]; only the methods in `methods` count."""

    methods = ("POST",)

    def get_rate(self):
        return settings.MUNINN_THROTTLES.get(self.scope) or None

    def get_cache_key(self, request, view):
        if request.method not in self.methods:
            return None
        ident = self.identity(request)
        return None if ident is None else self.cache_format % {"scope": self.scope, "ident": ident}

    def identity(self, request) -> str | None:
        return self.get_ident(request)


class LoginAddressThrottle(_Scoped):
    scope = "login-address"


class LoginUsernameThrottle(_Scoped):
    """Per username, whatever the address: guessing one account's password from many machines is bounded too."""

    scope = "login-username"

    def identity(self, request) -> str | None:
        data = getattr(request, "data", None) or request.POST
        if not isinstance(data, Mapping):  # a JSON body that is not an object names no username (the view says 400)
            return None
        username = str(data.get("username", "")).strip().lower()[:150]
        # hashed: a cache key holds no character a cache backend refuses (memcached: controls, spaces, > 250)
        return hashlib.sha256(username.encode()).hexdigest() if username else None


class SignupAddressThrottle(_Scoped):
    scope = "signup-address"


class DeviceRegistrationThrottle(_Scoped):
    """Per account: MUNINN_MAX_DEVICES_PER_ACCOUNT bounds how many, this how fast (keys are generated offline)."""

    scope = "device-registration"

    def identity(self, request) -> str | None:
        return str(request.user.pk) if request.user and request.user.is_authenticated else None


class PredictThrottle(DeviceRegistrationThrottle):
    """Per account: prediction requests compute on the site's CPUs."""

    scope = "predict"


class _PerDevice(_Scoped):
    def identity(self, request) -> str | None:
        device = getattr(request, "auth", None)
        return str(device.pk) if getattr(device, "pk", None) is not None else None


class ClaimThrottle(_PerDevice):
    scope = "claim"


class HeartbeatThrottle(_PerDevice):
    scope = "heartbeat"


LOGIN_THROTTLES = (LoginAddressThrottle, LoginUsernameThrottle)
FORM_THROTTLES = {"login": LOGIN_THROTTLES, "admin:login": LOGIN_THROTTLES, "signup-page": (SignupAddressThrottle,)}


class LoginThrottleMiddleware:
    """The HTML forms that guess or create accounts (login, admin login, sign-up) under the API's limits."""

    def __init__(self, get_response):
        self.get_response = get_response
        self._paths: dict[str, tuple] | None = None

    def __call__(self, request):
        if request.method == "POST":
            throttles = self._throttles_for(request.path)
            waits = [t.wait() for t in (cls() for cls in throttles) if not t.allow_request(request, None)]
            if waits:
                wait = max(0, math.ceil(max(w or 0 for w in waits)))
                response = render(request, "429.html", {"wait": wait}, status=429)
                response["Retry-After"] = str(wait)
                return response
        return self.get_response(request)

    def _throttles_for(self, path: str) -> tuple:
        if self._paths is None:  # URLs resolved at the first request (the URLconf is loaded by then)
            self._paths = {reverse(name): throttles for name, throttles in FORM_THROTTLES.items()}
        return self._paths.get(path, ())
