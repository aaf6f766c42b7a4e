"""billing/ listens to jobs/ and accounts/: a started job accepts its quote and places its hold; an ended job releases
the rest; a new customer gets the demo credit when MUNINN_DEMO_CREDIT is set."""
from django.dispatch import receiver

from accounts.signals import user_signed_up
from jobs.signals import job_ended, job_started

from . import services


@receiver(job_started, dispatch_uid="billing.hold_on_start")
def _hold_on_start(sender, job, quote=None, **kwargs) -> None:
    services.hold_place(job=job, quote_id=quote)


@receiver(job_ended, dispatch_uid="billing.release_on_end")
def _release_on_end(sender, job, **kwargs) -> None:
    services.hold_release(job=job)


@receiver(user_signed_up, dispatch_uid="billing.demo_credit_on_sign_up")
def _demo_credit_on_sign_up(sender, user, **kwargs) -> None:
    services.demo_credit_grant(user=user)
