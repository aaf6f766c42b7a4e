"""contributors/ listens to jobs/: a job that ends has its accepted work charged first (contributors.credit), so
that billing's release of the rest of its hold, which follows, leaves nothing owed to a contributor unpaid."""
from django.dispatch import receiver

from jobs.signals import job_ending

from . import credit


@receiver(job_ending, dispatch_uid="contributors.credit_on_job_end")
def _credit_before_end(sender, job, **kwargs) -> None:
    credit.credit_all_pending(job_id=job.pk, wait=True)
