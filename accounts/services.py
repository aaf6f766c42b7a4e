"""Writes on users: sign-up and API tokens."""
from django.db import transaction
from rest_framework.authtoken.models import Token

from .models import User


@transaction.atomic
def user_create(*, username: str, password: str, role: str = User.Role.CUSTOMER, email: str = "") -> User:
    user = User(username=username, email=email, role=role, is_staff=(role == User.Role.STAFF))
    user.set_password(password)
    user.full_clean(exclude=["password"])
    user.save()
    return user


def token_for(*, user: User) -> str:
    """The user's API token (created on first use)."""
    token, _ = Token.objects.get_or_create(user=user)
    return token.key
