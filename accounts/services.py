"""Writes on users: sign-up and API tokens."""
from django.db import IntegrityError, transaction
from rest_framework.authtoken.models import Token

from muninn.errors import Conflict

from .models import User
from .signals import user_signed_up


@transaction.atomic
def user_create(*, username: str, password: str, role: str = User.Role.CUSTOMER, email: str = "") -> User:
    user = User(username=username, email=email, role=role, is_staff=(role == User.Role.STAFF))
    user.set_password(password)
    user.full_clean(exclude=["password"])
    user.save()
    return user


@transaction.atomic
def user_sign_up(*, username: str, password: str, role: str = User.Role.CUSTOMER, email: str = "") -> User:
    """A visitor signs up (the page or the API): the account, then `user_signed_up` (billing gives a new customer
    the demo credit when MUNINN_DEMO_CREDIT is set). A username already taken is a Conflict, also when another
    sign-up takes it at the same moment."""
    if User.objects.filter(username=username).exists():
        raise Conflict("This username is taken.", code="username_taken")
    try:
        with transaction.atomic():  # a savepoint: the unique index decides a race
            user = user_create(username=username, password=password, role=role, email=email)
    except IntegrityError:
        if not User.objects.filter(username=username).exists():
            raise
        raise Conflict("This username is taken.", code="username_taken") from None
    user_signed_up.send(sender=User, user=user)
    return user


def token_for(*, user: User) -> str:
    """The user's API token (created on first use)."""
    token, _ = Token.objects.get_or_create(user=user)
    return token.key
