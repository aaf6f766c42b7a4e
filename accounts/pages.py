"""Who may see a page: every page view is wrapped in `role_required`, which sends an anonymous visitor to the
login page and answers 403 to a signed-in user of another role."""
from __future__ import annotations

from collections.abc import Callable
from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied

from .models import User


def is_staff_user(user) -> bool:
    return user.is_active and (user.is_superuser or user.role == User.Role.STAFF)


def role_required(*roles: str) -> Callable:
    """Login required, then one of `roles` (staff means the staff role or a superuser)."""

    def decorator(view):
        @login_required
        @wraps(view)
        def wrapped(request, *args, **kwargs):
            user = request.user
            allowed = user.role in roles or (User.Role.STAFF in roles and is_staff_user(user))
            if not allowed:
                raise PermissionDenied(f"This page is for {' or '.join(roles)} accounts.")
            return view(request, *args, **kwargs)

        return wrapped

    return decorator


def home_for(user) -> str:
    """The URL name of the page a user starts from."""
    if is_staff_user(user):
        return "staff-home"
    if user.role == User.Role.CONTRIBUTOR:
        return "contribute"
    return "jobs-list"
