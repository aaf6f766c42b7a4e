"""Writes on prediction batches: a file of inputs accepted for predicting off the request thread, then predicted
(in chunks, its progress kept) into a CSV of predictions, or failed with what to fix in the file."""
from __future__ import annotations

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from muninn_worker import package

from muninn.errors import Conflict, InvalidInput, TooLarge

from .. import predictions, storage
from ..models import Job, PredictionBatch
from ..signals import prediction_batch_created

log = logging.getLogger(__name__)
CHUNK_ROWS = 2048  # rows per step: the progress a page shows moves this often


def prediction_batch_create(*, job: Job, filename: str, data: bytes) -> PredictionBatch:
    """Accept a file to predict with the job's model; the task layer predicts it once this commits."""
    if job.status != Job.Status.SUCCEEDED:
        raise Conflict(f"The model is ready when the job has succeeded; it is {job.status}.", code="not_ready")
    if job.dataset.profile.get("kind") == "text":
        raise InvalidInput("A language model continues one prompt at a time: use POST /api/jobs/<id>/predict with "
                           "a prompt.", code="bad_input")
    if not data:
        raise InvalidInput("The file is empty.", code="empty_file")
    if len(data) > settings.MUNINN_MAX_UPLOAD_BYTES:
        raise TooLarge(f"The file is {len(data):,} bytes; the limit is {settings.MUNINN_MAX_UPLOAD_BYTES:,}.")
    sha = storage.blob_put(data)
    with transaction.atomic():
        batch = PredictionBatch.objects.create(job=job, filename=filename[:200] or "input", input_sha256=sha,
                                               size_bytes=len(data))
        prediction_batch_created.send(sender=PredictionBatch, batch_id=batch.pk)
    return batch


def prediction_batch_run(*, batch_id: int) -> PredictionBatch:
    """Predict a queued batch; safe to run twice (a batch another run took, or finished, is left alone)."""
    with transaction.atomic():
        batch = PredictionBatch.objects.select_for_update().select_related("job__dataset").get(pk=batch_id)
        if batch.status != PredictionBatch.Status.QUEUED:
            return batch
        batch.status = PredictionBatch.Status.RUNNING
        batch.save(update_fields=["status"])
    try:
        model = predictions.job_predictor(batch.job)
        inputs, labels = model.encode(storage.blob_get(batch.input_sha256), name=batch.filename)
        PredictionBatch.objects.filter(pk=batch.pk).update(rows=len(labels))
        answered = []
        for start in range(0, len(labels), CHUNK_ROWS):
            answered += model.answer(inputs[start:start + CHUNK_ROWS], labels[start:start + CHUNK_ROWS])
            PredictionBatch.objects.filter(pk=batch.pk).update(done_rows=len(answered))
        result = storage.blob_put(predictions.predictions_csv({"task": model.task, "predictions": answered})
                                  .encode())
    except package.DatasetError as e:
        return _finish(batch, status=PredictionBatch.Status.FAILED,
                       error={"code": e.code, "message": e.message, "detail": e.detail})
    except Exception:
        log.exception("prediction batch %s failed", batch.pk)
        return _finish(batch, status=PredictionBatch.Status.FAILED, error={
            "code": "failed", "message": "Predicting this file failed on the site's side; please try again.",
            "detail": {}})
    return _finish(batch, status=PredictionBatch.Status.DONE, result_sha256=result)


def _finish(batch: PredictionBatch, **fields) -> PredictionBatch:
    fields["finished_at"] = timezone.now()
    PredictionBatch.objects.filter(pk=batch.pk).update(**fields)
    batch.refresh_from_db()
    return batch


def prediction_batches_stalled(older_than: timedelta = timedelta(minutes=2)) -> list[int]:
    """Batches queued for a while (their message lost) or running far too long (their worker killed): put back
    in the queue, their ids returned for the task layer to run again."""
    now = timezone.now()
    running_dead = PredictionBatch.objects.filter(status=PredictionBatch.Status.RUNNING,
                                                  created_at__lt=now - 30 * older_than)
    running_dead.update(status=PredictionBatch.Status.QUEUED, done_rows=0)
    return list(PredictionBatch.objects.filter(status=PredictionBatch.Status.QUEUED,
                                               created_at__lt=now - older_than).values_list("pk", flat=True))
