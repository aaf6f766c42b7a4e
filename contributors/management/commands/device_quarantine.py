"""Show a device's standing, or lift its quarantine (staff, with a reason on record): the same service as the
staff page's "Lift and release". `make run` prints this command when its local demo worker was quarantined."""
from django.core.management.base import BaseCommand, CommandError

from accounts.models import User
from contributors import selectors, services
from contributors.models import Device
from muninn.errors import MuninnError


class Command(BaseCommand):
    help = ("Print whether a device is quarantined (first word: 'quarantined' or 'ok'), or lift its quarantine "
            "with --lift --reason ... --by STAFF (its held earnings are released, as on /staff/).")

    def add_arguments(self, parser):
        parser.add_argument("device", type=int, help="the device's id (the worker client's config has it)")
        parser.add_argument("--lift", action="store_true", help="lift the quarantine")
        parser.add_argument("--reason", default="", help="why it is safe now: kept in the device's record")
        parser.add_argument("--by", default="", help="the staff member lifting it")

    def handle(self, *args, device: int, lift: bool, reason: str, by: str, **options):
        found = selectors.device_by_id(device_id=device)
        if found is None:
            raise CommandError(f"No device #{device}.")
        if not lift:
            self.stdout.write(self._standing(found))
            return
        if not reason.strip():
            raise CommandError("Say why the quarantine is lifted (--reason): it is kept in the device's record.")
        staff = User.objects.filter(username=by).first() if by else None
        if staff is None or not (staff.is_superuser or staff.role == User.Role.STAFF):
            raise CommandError(f"--by must name a staff account (got {by!r}).")
        try:
            lifted = services.device_lift_quarantine(device=found, staff=staff, reason=reason.strip())
        except MuninnError as e:
            raise CommandError(e.message) from e
        self.stdout.write(f"lifted the quarantine of device #{lifted.pk} ({lifted.name}); it starts again as a new "
                          "device (every result checked)")

    @staticmethod
    def _standing(device: Device) -> str:
        if device.quarantined_at is None:
            return f"ok: device #{device.pk} ({device.name}) is not quarantined"
        return (f"quarantined: device #{device.pk} ({device.name}) since "
                f"{device.quarantined_at:%Y-%m-%d %H:%M:%S} UTC: {device.quarantine_reason}")
