"""No job waits forever for a capable device: the wait clock and the wait limit."""
from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime

from django.conf import settings
from django.utils import timezone


from .. import selectors
from ..models import Job

from .jobs import job_fail

log = logging.getLogger(__name__)


def jobs_check_waiting(*, capacity_for: Callable[..., dict], now: datetime | None = None) -> list[int]:
    """No job waits forever. Each running job's wait clock (Job.waiting_since) starts when beat first finds no
    capable device online and unquarantined (selectors.job_waiting: devices busy with other work count as
    capable) and stops when one is back; a job whose clock reaches MUNINN_JOB_WAIT_LIMIT fails with the reason,
    and job_fail's job_ended receivers release its unused hold. `capacity_for` is
    contributors.selectors.capacity_for, passed in by the task layer. Returns the ids of the jobs it failed.
    Safe to run any number of times; the clock only runs while beat looks, so a beat that was down starts it
    late, never early."""
    now = now or timezone.now()
    limit = settings.MUNINN_JOB_WAIT_LIMIT
    asked: dict[tuple, dict] = {}

    def capacity(*, min_memory_bytes: int, backends, sensitive: bool = False, template: str | None = None) -> dict:
        key = (min_memory_bytes, tuple(backends), sensitive, template)  # asked once per sweep
        if key not in asked:
            asked[key] = capacity_for(min_memory_bytes=min_memory_bytes, backends=backends, sensitive=sensitive,
                                      template=template)
        return asked[key]

    failed = []
    for job in Job.objects.filter(status=Job.Status.RUNNING).select_related("dataset").order_by("id"):
        waiting = selectors.job_waiting(job, capacity)
        running = Job.objects.filter(pk=job.pk, status=Job.Status.RUNNING)
        if waiting is None or not waiting.without_device:
            if job.waiting_since is not None:
                running.update(waiting_since=None)
        elif job.waiting_since is None:
            running.update(waiting_since=now)
        elif (now - job.waiting_since).total_seconds() >= limit:
            log.warning("job %s: no capable device since %s; failing it", job.pk, job.waiting_since)
            job_fail(job_id=job.pk, error=selectors.job_wait_limit_error(job, waiting, waited_seconds=limit))
            failed.append(job.pk)
    return failed
