"""The customer's pages for datasets and jobs: thin doors into jobs.services and jobs.selectors.

The job page also shows money and devices, which live in apps above jobs/ (billing/, contributors/): the
project's urls.py passes their `panels` in, functions (job) -> dict, so jobs/ never imports them."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from django.conf import settings
from django.contrib import messages
from django.http import JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_POST

from accounts.pages import role_required
from muninn.errors import MuninnError, TooLarge

from . import predictions, progress, selectors, services
from .forms import DatasetUploadForm

Panel = Callable[..., dict]


def _upload_limit() -> int:
    return settings.MUNINN_MAX_UPLOAD_BYTES


@role_required("customer")
def datasets(request):
    """The customer's datasets and the upload form. The page's script posts the file to /api/datasets to show
    progress; without the script the form posts here, to the same service."""
    posted = request.method == "POST"
    form = DatasetUploadForm(request.POST if posted else None, request.FILES if posted else None)
    error = None
    if request.method == "POST" and form.is_valid():
        upload, data = form.cleaned_data["file"], form.cleaned_data
        try:
            if upload.size > _upload_limit():
                raise TooLarge(f"The file is {upload.size:,} bytes; the limit is {_upload_limit():,}.")
            dataset = services.dataset_create(owner=request.user, filename=upload.name, data=upload.read(),
                                              name=data["name"], target=data["target"], task=data["task"],
                                              tokenizer=data["tokenizer"], sensitive=data["sensitive"])
        except MuninnError as e:
            error = e
        else:
            messages.success(request, f"Uploaded {dataset.name}.")
            return redirect("dataset-page", dataset_id=dataset.pk)
    context = {"form": form, "error": error, "limit": _upload_limit(),
               "datasets": selectors.datasets_for(owner=request.user)}
    return render(request, "jobs/datasets.html", context, status=400 if error or form.errors else 200)


@role_required("customer")
def dataset_detail(request, dataset_id: int):
    dataset = selectors.dataset_get(owner=request.user, dataset_id=dataset_id)
    return render(request, "jobs/dataset.html", {"dataset": dataset, "profile": dataset.profile,
                                                 "missing": selectors.missing_values_notes(dataset.profile)})


@role_required("customer")
def jobs_list(request):
    return render(request, "jobs/jobs.html", {"jobs": selectors.jobs_for(owner=request.user)})


def _panels(job, panels: Sequence[Panel]) -> dict:
    out: dict = {}
    for panel in panels:
        out.update(panel(job))
    return out


@role_required("customer")
def job_detail(request, job_id: int, panels: Sequence[Panel] = (), sections: Sequence[Panel] = ()):
    """`panels` feed the page's live state (polled by job_progress too); `sections` are drawn once, with the page
    (the shard-download log of a sensitive job, from contributors/)."""
    job = selectors.job_get(owner=request.user, job_id=job_id)
    state = {**progress.job_progress(job), **_panels(job, panels)}
    return render(request, "jobs/job.html", {**_panels(job, sections),
                                             "job": job, "state": state, "chart_metrics": progress.CHART_METRICS,
                                             "model_input": selectors.model_input_note(job),
                                             "flagged": selectors.job_flagged_updates(job),
                                             "try_model": predictions.try_panel(job),
                                             "model_filename": selectors.model_filename(job)})


@role_required("customer")
def job_progress(request, job_id: int, panels: Sequence[Panel] = ()):
    """What the job page polls every two seconds."""
    job = selectors.job_get(owner=request.user, job_id=job_id)
    return JsonResponse({**progress.job_progress(job), **_panels(job, panels)})


@require_POST
@role_required("customer")
def job_cancel(request, job_id: int):
    job = selectors.job_get(owner=request.user, job_id=job_id)
    try:
        services.job_cancel(job_id=job.pk)
    except MuninnError as e:
        messages.error(request, e.message)
    else:
        messages.success(request, f"Job {job.pk} is cancelled; what it did not use of its hold is back in your "
                                  "balance.")
    return redirect("job-page", job_id=job.pk)
