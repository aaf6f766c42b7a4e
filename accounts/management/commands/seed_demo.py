"""Create the demo customer, contributor and staff user (idempotent) and print their logins as JSON."""
import json

from django.core.management.base import BaseCommand
from django.db import transaction

from accounts import services
from accounts.models import User
from billing import money
from billing import services as billing

DEMO_USERS = [
    ("customer", "muninn-customer", User.Role.CUSTOMER),
    ("contributor", "muninn-contributor", User.Role.CONTRIBUTOR),
    ("staff", "muninn-staff", User.Role.STAFF),
]
DEMO_CREDIT = money.to_nanos("100.00")


class Command(BaseCommand):
    help = "Create demo users (customer with €100 credit, contributor, staff) and print their tokens as JSON."

    @transaction.atomic
    def handle(self, *args, **options):
        out = {}
        for username, password, role in DEMO_USERS:
            user = User.objects.filter(username=username).first()
            if user is None:
                user = services.user_create(username=username, password=password, role=role)
                if role == User.Role.STAFF:
                    user.is_superuser = True
                    user.save(update_fields=["is_superuser"])
            out[username] = {"password": password, "token": services.token_for(user=user)}
        staff = User.objects.get(username="staff")
        billing.balance_grant(user=User.objects.get(username="customer"), amount=DEMO_CREDIT,
                              reason="demo credit", granted_by=staff, key="grant:demo-customer")
        self.stdout.write(json.dumps(out))
