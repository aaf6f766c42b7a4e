"""Reads on jobs and datasets. Everything a user reaches by id goes through an owner filter here."""
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from django.conf import settings
from django.core.cache import cache
from django.db.models import Count, Q, QuerySet, Sum
from django.shortcuts import get_object_or_404
from muninn_worker import onnx_export, package, tensors, zoo

from muninn.errors import Conflict, InvalidInput, NotFound

from . import sealing, storage
from .models import Dataset, Job, PredictionBatch, Round, WorkUnit


_FIXED: dict[int, Round] = {}
FIXED_ROUNDS_KEPT = 4096


def round_fixed(round_id: int) -> Round:
    """The round with its job, read once per process for the worker API's hot path (every claim and result of the
    round needs them). Only what is fixed once the round is open may be read from it: its number, weights and
    opening time, the job's owner, template, configuration and hyper-parameters, and its dataset (whose data and
    sensitivity never change after upload). Its status, deadlines and
    results, and the job's status and progress, are stale at once: read those fresh (unit_accept locks the round)."""
    rnd = _FIXED.get(round_id)
    if rnd is None:
        rnd = Round.objects.select_related("job__dataset").get(pk=round_id)
        if len(_FIXED) >= FIXED_ROUNDS_KEPT:
            _FIXED.clear()
        _FIXED[round_id] = rnd
    return rnd


def dataset_key(dataset: Dataset) -> bytes | None:
    """The key a sensitive dataset's blobs are sealed with (jobs/sealing.py), unwrapped; None for any other."""
    if not dataset.sensitive:
        return None
    return sealing.unwrap_key(dataset.wrapped_key, site_key=sealing.site_data_key(), label=dataset.sha256)


def job_data_key(job: Job) -> bytes | None:
    """The key of the job's training data (its split, test set and shards are sealed with its dataset's key)."""
    return dataset_key(job.dataset)


def datasets_for(*, owner) -> QuerySet[Dataset]:
    return Dataset.objects.filter(owner=owner)


def dataset_get(*, owner, dataset_id: int) -> Dataset:
    return get_object_or_404(datasets_for(owner=owner), pk=dataset_id)


MISSING_ROWS_NAMED = 5


def missing_values_notes(profile: dict) -> list[dict]:
    """The profile's filled missing values as the dataset page shows them, one per column: how many rows, the
    first few of them (the file's line numbers), how many more, and what they were filled with."""
    notes = []
    for column, found in (profile.get("missing") or {}).items():
        rows = list(found.get("rows") or [])[:MISSING_ROWS_NAMED]
        count = found.get("count", len(rows))
        fill = found.get("filled_with")
        notes.append({"column": column, "count": count, "rows": rows, "more": max(0, count - len(rows)),
                      "fill": f"{fill:.6g}" if isinstance(fill, float) else str(fill),
                      "fill_kind": "the median" if isinstance(fill, (int, float)) else "the category"})
    return notes


def jobs_for(*, owner) -> QuerySet[Job]:
    return Job.objects.filter(owner=owner).select_related("dataset")


def job_get(*, owner, job_id: int) -> Job:
    return get_object_or_404(jobs_for(owner=owner), pk=job_id)


def prediction_batch_get(*, owner, job_id: int, batch_id: int) -> PredictionBatch:
    return get_object_or_404(PredictionBatch.objects.filter(job__in=jobs_for(owner=owner)), job_id=job_id, pk=batch_id)


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


def round_unit_counts(*, job: Job) -> dict[int, dict[str, int]]:
    """{round id: {unit status: units}} for every round of the job, counted by the database in one grouped query.
    The job page's progress poll and GET /api/jobs/<id> loaded every unit of every round to count them: a poll
    of a 14-round job of 10 devices cost 13 ms of CPU, and one of 100 rounds on 1,000 devices would load 100,000
    rows."""
    counts: dict[int, dict[str, int]] = {}
    rows = (WorkUnit.objects.filter(round__job=job).order_by().values_list("round_id", "status")
            .annotate(n=Count("id")))
    for round_id, status, n in rows:
        counts.setdefault(round_id, {})[status] = n
    return counts


BACKEND_NAMES = {"cpu": "a CPU", "cuda": "a CUDA GPU", "mps": "an Apple GPU"}


@dataclass(frozen=True)
class Waiting:
    """Why a running job is not moving. `no_device`: no capable device is online; `quarantined`: the only
    capable devices online are quarantined; `untrusted`: the job's dataset is sensitive and no capable device
    online meets the site's trust level for such data; `busy`: capable devices are online, every one busy with
    other work. All but the last are time without a capable device, which MUNINN_JOB_WAIT_LIMIT bounds."""
    NO_DEVICE, QUARANTINED, UNTRUSTED, BUSY = "no_device", "quarantined", "untrusted", "busy"

    kind: str
    message: str
    need: str  # "3.00 GiB of memory on a CUDA GPU"
    quarantined: int = 0  # capable devices online but quarantined
    trust_rule: str = ""  # a sensitive job's: who may take its shards (contributors.exposure.policy_words)

    @property
    def without_device(self) -> bool:
        return self.kind != self.BUSY


def job_flagged_updates(job: Job) -> list[dict]:
    """The job's accepted updates put in doubt after the fact (WorkUnit.flagged: their device was caught on
    other work), by round: whether each is in the model (aggregated before it was flagged, or nothing else came
    in its round) or was left out."""
    return [{"round": unit.round.number, "unit": unit.pk, "reason": unit.flagged,
             "in_model": unit_in_model(unit, unit.round)}
            for unit in (WorkUnit.objects.filter(round__job=job).exclude(flagged="").select_related("round")
                         .order_by("round__number", "index"))]


def unit_in_model(unit: WorkUnit, rnd: Round) -> bool:
    """Whether the unit's update is in its round's combined weights (Round.combined). A round closed before that
    was kept: accepted by the time the round closed and not left out for a flag."""
    if rnd.status != Round.Status.CLOSED:
        return False
    if rnd.combined:
        return unit.pk in rnd.combined
    return (unit.pk not in (rnd.metrics.get("flagged_left_out") or []) and unit.accepted_at is not None
            and rnd.closed_at is not None and unit.accepted_at <= rnd.closed_at)


@dataclass(frozen=True)
class ModelFile:
    data: bytes
    filename: str


def job_model_file(job: Job, *, artefact: str = "model") -> ModelFile:
    """The trained model as the customer downloads it: safetensors of the final global weights, with the template,
    model_config, job and classes or vocabulary in the file's metadata, and the rounds holding an update flagged
    after the fact (muninn_flagged_rounds). For a LoRA job these are the adapters; artefact "merged" is the merged
    transformer (base + adapters), which can be uploaded again as base weights. The same job gives the same bytes
    (a certificate states their sha256) until a flag on one of its updates is set or cleared."""
    if job.status != Job.Status.SUCCEEDED:
        raise Conflict(f"The model is ready when the job has succeeded; it is {job.status}.", code="not_ready")
    state = tensors.bytes_to_state_dict(storage.blob_get(job.global_weights_sha256))
    template, config = job.template, job.model_config
    if artefact == "merged":
        if job.base_weights_id is None:  # a valid choice (the schema lists it), for a job that has no such file
            raise NotFound("Only a lora job has a merged model.")
        base = tensors.bytes_to_state_dict(storage.blob_get(job.base_weights.sha256))
        state = zoo.merge_lora(config, base, state)
        template, config = "transformer", {k: v for k, v in config.items() if k not in ("rank", "alpha")}
    elif artefact != "model":
        raise InvalidInput("artefact must be 'model' or 'merged'.", code="bad_artefact")
    metadata = {"muninn_template": template, "muninn_model_config": json.dumps(config, sort_keys=True),
                "muninn_job": str(job.pk), "muninn_data": json.dumps(job.metrics.get("classes") or
                                                                      job.metrics.get("vocab") or []),
                "muninn_preprocess": json.dumps(package.preprocess_spec(job.dataset.profile, template, config),
                                                sort_keys=True)}
    in_doubt = job_flagged_rounds(job)
    if in_doubt:  # rounds whose aggregate holds an update of a device caught cheating on other work
        metadata["muninn_flagged_rounds"] = json.dumps(in_doubt)
    return ModelFile(tensors.state_dict_to_bytes(state, metadata=metadata), model_filename(job, artefact=artefact))


def model_filename(job: Job, *, artefact: str = "model") -> str:
    """The name the model download is saved under (the job page shows it in the loader's example too)."""
    return f"muninn-job-{job.pk}-{job.template}{'-merged' if artefact == 'merged' else ''}.safetensors"


def job_flagged_rounds(job: Job) -> list[int]:
    """The rounds whose combined weights hold an update flagged after the fact, in order."""
    return sorted({f["round"] for f in job_flagged_updates(job) if f["in_model"]})


def span(seconds: float) -> str:
    """A length of time in words: "4 hours", "90 minutes", "30 seconds"."""
    seconds = round(seconds)
    if seconds >= 3600 and seconds % 360 == 0:
        hours = seconds / 3600
        return "1 hour" if hours == 1 else f"{hours:g} hours"
    if seconds >= 60 and seconds % 60 == 0:
        return "1 minute" if seconds == 60 else f"{seconds // 60} minutes"
    return "1 second" if seconds == 1 else f"{seconds} seconds"


def job_needs(job: Job) -> str:
    return f"{job.peak_memory_bytes / 2**30:.2f} GiB of memory on " + " or ".join(
        BACKEND_NAMES.get(b, b) for b in job.backend_list)


def _work_untouched(job: Job) -> bool:
    """The job's open round has work queued and none being trained or checked: nobody has picked it up."""
    statuses = set(WorkUnit.objects.filter(round__job=job, round__status=Round.Status.OPEN)
                   .values_list("status", flat=True))
    return WorkUnit.Status.QUEUED in statuses and not statuses & {WorkUnit.Status.LEASED, WorkUnit.Status.VERIFYING}


def job_waiting(job: Job, capacity_for: Callable[..., dict]) -> Waiting | None:
    """Why a running job is not moving, or None when it is (or could be: an idle capable device is online).
    `capacity_for` is contributors.selectors.capacity_for, passed in by the caller (jobs/ sits below
    contributors/); it is asked only about running jobs. The one place the reason is worded: the API's
    `waiting`, the job page's note and the wait limit's failure all come from here."""
    if job.status != Job.Status.RUNNING:
        return None
    sensitive = job.dataset.sensitive
    capacity = capacity_for(min_memory_bytes=job.peak_memory_bytes, backends=job.backend_list, sensitive=sensitive,
                            template=job.template)
    need = job_needs(job)
    limit = (f"It waits up to {span(settings.MUNINN_JOB_WAIT_LIMIT)} for one, then fails and the unused hold is "
             "released; you can cancel it at any time.")
    trusted = "trusted " if sensitive else ""
    if capacity["capable"] > 0:
        if capacity["busy"] >= capacity["capable"] and _work_untouched(job):
            return Waiting(Waiting.BUSY, need=need, message=(
                f"All {capacity['capable']} online {trusted}device(s) that can run this job are busy with other "
                "work; it carries on as soon as one is free."))
        return None
    rule = capacity.get("trust_rule", "")
    if sensitive and capacity.get("untrusted_capable"):
        n = capacity["untrusted_capable"]
        return Waiting(Waiting.UNTRUSTED, need=need, trust_rule=rule, message=(
            f"No trusted device is online: this dataset is marked sensitive, so its shards go only to {rule}. "
            f"{n} online device(s) could run this job but do not meet that yet. It carries on as soon as a trusted "
            f"device that can run it comes online. {limit}"))
    only = f" This dataset is marked sensitive: its shards go only to {rule}." if sensitive else ""
    if capacity["quarantined_capable"]:
        n = capacity["quarantined_capable"]
        return Waiting(Waiting.QUARANTINED, need=need, quarantined=n, message=(
            f"No device that can run this job is available: it needs {need}, and the {n} online device(s) that "
            f"could are quarantined (their results failed checks) and get no work until staff review them.{only} "
            f"{limit}"))
    available, quarantined = capacity["available"], capacity["quarantined"]
    if available == 0:
        seen = (f"the only device(s) online ({quarantined}) are quarantined" if quarantined
                else "no device is online")
    elif job.backend_list == ["cuda"] and capacity["with_cuda"] == 0:
        seen = f"none of the {available} device(s) online has a CUDA GPU"
    else:
        most = capacity["max_gpu_memory_bytes"] if job.backend_list == ["cuda"] else capacity["max_ram_bytes"]
        seen = f"the largest of the {available} device(s) online offers {most / 2**30:.2f} GiB"
    return Waiting(Waiting.NO_DEVICE, need=need, trust_rule=rule, message=(
        f"No online device can run this job yet: it needs {need}, and {seen}.{only} It carries on as soon as a "
        f"{trusted}device that can run it comes online. {limit}"))


def job_waiting_reason(job: Job, capacity_for: Callable[..., dict]) -> str | None:
    """job_waiting's message (see there), or None."""
    waiting = job_waiting(job, capacity_for)
    return waiting.message if waiting else None


def job_wait_limit_error(job: Job, waiting: Waiting, *, waited_seconds: float) -> str:
    """The error of a job failed for having had no capable device for MUNINN_JOB_WAIT_LIMIT: what it needed,
    how long it waited, that its money is back, and what to try instead."""
    quarantined = (f" ({waiting.quarantined} online device(s) that could are quarantined)"
                   if waiting.kind == Waiting.QUARANTINED else "")
    if waiting.trust_rule:  # a sensitive dataset's job
        quarantined += f" (its dataset is sensitive: only {waiting.trust_rule} may take its shards)"
    advice = ("Try a smaller model or a CPU template." if "cpu" not in job.backend_list
              else "Try a smaller model, or start it again when more devices are online.")
    return (f"No {'trusted ' if waiting.trust_rule else ''}device able to run this job (needs {waiting.need}) was "
            f"online for {span(waited_seconds)}"
            f"{quarantined}; the unused hold was released. {advice}")


def model_input_note(job: Job) -> str:
    """What the downloaded model of an image job takes, said where the customer downloads it: pixels as uploaded, in
    the same scale and layout. The model standardises each channel itself (with the training split's mean and std,
    kept in its buffers), so inputs scaled to 0–1 beforehand silently give chance-level predictions. Empty for
    tables and text."""
    shape = (job.dataset.profile or {}).get("image_shape")
    if not shape:
        return ""
    c, h, w = (job.model_config.get(k, d) for k, d in (("channels", shape[0]), ("height", shape[1]),
                                                         ("width", shape[2])))
    if job.dataset.format == job.dataset.Format.IMAGES:
        scale = (f"raw 0–255 pixel values ({'grey, 1 channel' if c == 1 else 'RGB'}), each image resized to {h}×{w} "
                 "(bilinear)")
    else:
        scale = "the same scale as the X array you uploaded (e.g. 0–255, or 0–16 for scikit-learn's digits)"
    if "channels" in job.model_config:  # an image template: channels first, whatever the upload's layout
        layout = f"float32 [batch, {c}, {h}, {w}] (channels first)"
    elif job.dataset.format == job.dataset.Format.IMAGES:
        layout = f"float32 [batch, {c * h * w}] (each image's [{c}, {h}, {w}] pixels flattened, channels first)"
    else:
        layout = f"float32 [batch, {c * h * w}] (each image flattened as the rows of your X were)"
    return (f"This model takes {layout} with {scale}. Do not divide by 255 or normalise: the model standardises "
            "each channel itself with your training data's mean and spread, and pixels scaled to 0–1 silently give "
            "chance-level predictions.")


def job_model_onnx(job: Job, *, artefact: str = "model") -> ModelFile:
    """The trained model as ONNX (muninn_worker.onnx_export): a graph that takes the same tensor as the torch model
    (its normalisation inside) and carries the template, model_config, input and output layouts, job and classes or
    vocabulary in its metadata_props. A lora job's adapters are no model on their own: artefact "merged" exports the
    merged transformer. An export takes up to seconds for large models, so it is kept as a blob, found again through
    the cache by everything its bytes depend on (weights, base, metadata, torch); the same job gives the same bytes."""
    if job.status != Job.Status.SUCCEEDED:
        raise Conflict(f"The model is ready when the job has succeeded; it is {job.status}.", code="not_ready")
    if artefact not in ("model", "merged"):
        raise InvalidInput("artefact must be 'model' or 'merged'.", code="bad_artefact")
    if artefact == "merged" and job.base_weights_id is None:
        raise NotFound("Only a lora job has a merged model.")
    if artefact == "model" and not onnx_export.supported(job.template):
        merged = " Ask for artefact=merged: the merged transformer can be." if job.base_weights_id else ""
        raise InvalidInput(f"Models of the {job.template} template cannot be exported to ONNX.{merged}",
                           code="not_exportable")
    metadata = {"muninn_job": str(job.pk), "muninn_data": json.dumps(job.metrics.get("classes") or
                                                                      job.metrics.get("vocab") or [])}
    in_doubt = job_flagged_rounds(job)
    if in_doubt:
        metadata["muninn_flagged_rounds"] = json.dumps(in_doubt)
    base_sha = job.base_weights.sha256 if artefact == "merged" else None
    key = "muninn:onnx:" + hashlib.sha256(json.dumps(
        [job.global_weights_sha256, base_sha, job.template, job.model_config, metadata, torch.__version__,
         onnx_export.OPSET], sort_keys=True).encode()).hexdigest()
    filename = f"muninn-job-{job.pk}-{job.template}{'-merged' if artefact == 'merged' else ''}.onnx"
    sha = cache.get(key)
    if sha is not None and storage.blob_exists(sha):
        return ModelFile(storage.blob_get(sha), filename)
    state = tensors.bytes_to_state_dict(storage.blob_get(job.global_weights_sha256))
    template, config = job.template, job.model_config
    if base_sha:
        state = zoo.merge_lora(config, tensors.bytes_to_state_dict(storage.blob_get(base_sha)), state)
        template, config = "transformer", {k: v for k, v in config.items() if k not in ("rank", "alpha")}
    try:
        data = onnx_export.export(template, config, state, metadata=metadata)
    except onnx_export.NotExportable as exc:  # weights past one ONNX file's 2 GiB
        raise InvalidInput(str(exc), code="not_exportable") from None
    cache.set(key, storage.blob_put(data), timeout=None)
    return ModelFile(data, filename)
