"""Reads on jobs and datasets. Everything a user reaches by id goes through an owner filter here."""
from collections.abc import Callable

from django.db.models import Count, Q, QuerySet, Sum
from django.shortcuts import get_object_or_404

from .models import Dataset, Job, Round, WorkUnit


def datasets_for(*, owner) -> QuerySet[Dataset]:
    return Dataset.objects.filter(owner=owner)


def dataset_get(*, owner, dataset_id: int) -> Dataset:
    return get_object_or_404(datasets_for(owner=owner), pk=dataset_id)


def jobs_for(*, owner) -> QuerySet[Job]:
    return Job.objects.filter(owner=owner).select_related("dataset")


def job_get(*, owner, job_id: int) -> Job:
    return get_object_or_404(jobs_for(owner=owner), pk=job_id)


def recent_jobs_for(*, owner, limit: int = 10) -> QuerySet[Job]:
    return jobs_for(owner=owner).order_by("-created_at")[:limit]


def job_totals() -> dict[str, int]:
    """Totals over every customer's jobs that name no one: what the public front page may show. Compute
    delivered is the FLOPs of accepted (verified) work units, as each job's "HU used" counts them."""
    jobs = Job.objects.aggregate(run=Count("id", filter=Q(started_at__isnull=False)),
                                 succeeded=Count("id", filter=Q(status=Job.Status.SUCCEEDED)))
    flops = WorkUnit.objects.filter(status=WorkUnit.Status.ACCEPTED).aggregate(f=Sum("flops"))["f"] or 0
    return {"jobs_run": jobs["run"], "jobs_succeeded": jobs["succeeded"], "flops_delivered": flops}


def job_rounds(*, job: Job) -> QuerySet[Round]:
    return job.round_set.order_by("number")


BACKEND_NAMES = {"cpu": "a CPU", "cuda": "a CUDA GPU", "mps": "an Apple GPU"}


def job_waiting_reason(job: Job, capacity_for: Callable[..., dict]) -> str | None:
    """Why a running job is not moving, in words for its customer, or None when some online device can run
    it. `capacity_for` is contributors.selectors.capacity_for, passed in by the caller (jobs/ sits below
    contributors/); it is asked only about running jobs."""
    if job.status != Job.Status.RUNNING:
        return None
    capacity = capacity_for(min_memory_bytes=job.peak_memory_bytes, backends=job.backend_list)
    if capacity["capable"] > 0:
        return None
    need = f"{job.peak_memory_bytes / 2**30:.2f} GiB of memory on " + " or ".join(
        BACKEND_NAMES.get(b, b) for b in job.backend_list)
    if capacity["online"] == 0:
        seen = "no device is online"
    elif job.backend_list == ["cuda"] and capacity["with_cuda"] == 0:
        seen = f"none of the {capacity['online']} device(s) online has a CUDA GPU"
    else:
        most = capacity["max_gpu_memory_bytes"] if job.backend_list == ["cuda"] else capacity["max_ram_bytes"]
        seen = f"the largest of the {capacity['online']} device(s) online offers {most / 2**30:.2f} GiB"
    return (f"No online device can run this job yet: it needs {need}, and {seen}. It waits, and carries on as "
            "soon as a device that can run it comes online.")
