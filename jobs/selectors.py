"""Reads on jobs and datasets. Everything a user reaches by id goes through an owner filter here."""
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404

from .models import Dataset, Job, Round


def datasets_for(*, owner) -> QuerySet[Dataset]:
    return Dataset.objects.filter(owner=owner)


def dataset_get(*, owner, dataset_id: int) -> Dataset:
    return get_object_or_404(datasets_for(owner=owner), pk=dataset_id)


def jobs_for(*, owner) -> QuerySet[Job]:
    return Job.objects.filter(owner=owner).select_related("dataset")


def job_get(*, owner, job_id: int) -> Job:
    return get_object_or_404(jobs_for(owner=owner), pk=job_id)


def job_rounds(*, job: Job) -> QuerySet[Round]:
    return job.round_set.order_by("number")
