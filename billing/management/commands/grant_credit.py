"""Staff credit a customer's balance by hand (no payment provider): the reason and the staff member are recorded."""
from django.core.management.base import BaseCommand, CommandError

from accounts.models import User
from billing import money, services
from muninn.errors import MuninnError


class Command(BaseCommand):
    help = "Credit a customer's balance by hand, with a reason on record (e.g. when Stripe is not configured)."

    def add_arguments(self, parser):
        parser.add_argument("username", help="the customer to credit")
        parser.add_argument("amount", help="in the currency, e.g. 20.00")
        parser.add_argument("--reason", required=True, help="why: kept on the ledger transaction")
        parser.add_argument("--by", required=True, help="the staff member granting it")

    def handle(self, *args, username: str, amount: str, reason: str, by: str, **options):
        try:
            user = User.objects.get(username=username)
            staff = User.objects.get(username=by, role=User.Role.STAFF)
        except User.DoesNotExist as e:
            raise CommandError(f"No such user: {e}") from e
        try:
            txn = services.balance_grant(user=user, amount=money.to_nanos(amount), reason=reason, granted_by=staff)
        except (MuninnError, ValueError, ArithmeticError) as e:
            raise CommandError(getattr(e, "message", str(e))) from e
        self.stdout.write(f"credited {money.format_money(txn.entries.get(amount__gt=0).amount)} to {user} "
                          f"(transaction {txn.pk})")
