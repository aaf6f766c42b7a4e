"""Segment checks: the trusted side re-trains the challenged segments of a unit from the device's own
checkpoints and compares with the checkpoints the device committed to.

Honest hardware differs in its last bits, and training amplifies that over many steps (shared measurements: an
honest H100 lands 1e-1 from a CPU after 64 resnet18 steps, farther than a skipped step). Over one short segment
it stays within an envelope measured per template and segment length (contributors.tolerances), while every
cheat that saves work lands far outside it. A result whose training diverged (non-finite weights or loss) is
re-trained whole instead: if the validator's training diverges too, the job's hyper-parameters are at fault
and the job fails with a reason its customer can act on, and no device is penalised.

Runs in a Celery task on its own queue ("validation"), inside the trust boundary.
"""
from __future__ import annotations

import logging
import math

import torch
from django.db import transaction
from django.utils import timezone
from muninn_worker import segments, tensors, training, zoo

from jobs import services as jobs
from jobs import storage
from jobs.models import WorkUnit
from muninn import sql
from muninn.failpoints import failpoint

from . import browser, challenges, checks, peers, results, tolerances
from .models import PeerCheck, Receipt

log = logging.getLogger(__name__)
VALIDATOR = "site:cpu"


# Results of one round re-trained in one task, at most: a burst of results at a round's end (every device finishing
# together) costs the validator one lock of the round and one transaction, not one each, and its later tasks find
# their units done. A batch of the digits MLP's segments takes ~10 ms a result.
BATCH_MAX = 32
_RECEIPT_WITH = ("device", "unit__round__job__dataset")  # the dataset: the shard's key (jobs.unit_shard_xy)


def unit_verify(*, unit_id: int) -> Receipt | None:
    """Check the unit's pending result and accept (and credit) or reject it, together with the other results of
    its round that wait for the site's check with every checkpoint in (see BATCH_MAX). Idempotent: a unit with
    no pending result, or whose challenged checkpoints are not all in yet, is left alone."""
    if _pending_sql(unit_id) is None:  # most often: a batch beside another unit checked it already
        return None
    pending = (Receipt.objects.select_related(*_RECEIPT_WITH)
               .filter(unit_id=unit_id, status=Receipt.Status.PENDING).first())
    if pending is None:
        return None
    unit = pending.unit
    if unit.status == WorkUnit.Status.CANCELLED:  # its shard's other copy was accepted first: nothing to check
        return _superseded(pending.pk)
    if not pending.challenge_segments:
        return _check_divergence(pending)
    if challenges.missing_boundaries(pending):
        return None
    if not peers.site_validates(peers.unit_backend(unit)) and not pending.peer_checks.filter(
            status=PeerCheck.Status.EXPIRED).exists():
        peers.peer_checks_create(receipt=pending)  # a second device of its kind re-trains the segments
        return None
    return _check_batch(pending)


def _pending_sql(unit_id: int) -> tuple | None:
    """The unit's pending receipt's id, if any, in one fixed statement (muninn/sql.py: building the ORM's query
    for every task, most of which find nothing left, cost more than running it)."""
    return sql.fetch_one(f"SELECT id FROM {sql.table(Receipt)} WHERE unit_id = %s AND status = %s LIMIT 1",
                         [unit_id, Receipt.Status.PENDING])


def _check_batch(first: Receipt) -> Receipt:
    """Re-train the challenged segments of `first` and of the round's other results ready beside it; the
    failures settle one by one, the passes are accepted in one transaction. Returns `first` as it ends."""
    ended, passed = {}, []
    batch = [first, *_ready_beside(first)]
    if len(batch) > 1:
        log.info("round %s: %d results checked together (units %s)", first.unit.round_id, len(batch),
                 ", ".join(str(r.unit_id) for r in batch))
    for receipt in batch:
        try:
            outcome = _check_segments(receipt)
        except Exception:
            if receipt is first:
                raise
            # One result's trouble (its blobs unreadable, say) is not its neighbours': left to its own task.
            log.exception("unit %s: its check beside unit %s's failed; left to its own task", receipt.unit_id,
                          first.unit_id)
            continue
        if isinstance(outcome, Receipt):
            ended[receipt.pk] = outcome
        else:
            passed.append((receipt, outcome))
    ended.update(accept_all(passed))
    return ended[first.pk]


def _ready_beside(first: Receipt) -> list[Receipt]:
    """The other results of `first`'s round that wait for the site's check with every challenged checkpoint in
    (those of backends the site does not validate go to peers, one by one)."""
    if not peers.site_validates(peers.unit_backend(first.unit)):
        return []
    others = (Receipt.objects.select_related(*_RECEIPT_WITH)
              .filter(unit__round_id=first.unit.round_id, unit__status=WorkUnit.Status.VERIFYING,
                      status=Receipt.Status.PENDING)
              .exclude(pk=first.pk).exclude(challenge_segments=[]).order_by("pk")[:BATCH_MAX - 1])
    return [r for r in others if not challenges.missing_boundaries(r)]


def _check_segments(receipt: Receipt) -> Receipt | dict:
    """Re-train the receipt's challenged segments: the evidence (a dict) when they agree, for the caller to
    accept; otherwise the receipt, settled (rejected, or its job failed for diverging)."""
    unit, job = receipt.unit, receipt.unit.round.job
    spec = jobs.unit_train_spec(unit)
    X, y = jobs.unit_shard_xy(unit)
    k = receipt.segment_steps
    bounds = segments.boundaries(jobs.unit_steps(unit), k)
    tolerance = tolerances.tolerance(job.template, k, backend=browser.backend_of(receipt.device))
    report, failed, diverged = [], None, False
    for j in receipt.challenge_segments:
        start = _checkpoint(receipt, j)
        end = _checkpoint(receipt, j + 1)
        model = jobs.job_model(job, start.weights)
        try:
            validator_end, losses = training.train_segment(model, X, y, start, first_step=bounds[j],
                                                           steps=bounds[j + 1] - bounds[j], **spec)
        except (ValueError, RuntimeError) as e:  # committed checkpoints that do not fit the model
            report.append({"segment": j, "error": str(e)[:200]})
            failed = failed or (j, float("inf"))
            continue
        if not all(math.isfinite(v) for v in losses):
            diverged = True
        distance = checks.checkpoint_distance(end, validator_end, start)
        entry = {"segment": j, "steps": [bounds[j], bounds[j + 1]], "distance": checks.finite_or_none(distance)}
        agrees = distance <= tolerance
        if not agrees and not diverged:
            entry["second_opinion"] = _second_opinion(job, X, y, start, end, validator_end, first_step=bounds[j],
                                                      steps=bounds[j + 1] - bounds[j], spec=spec,
                                                      tolerance=tolerance, distance=distance)
            agrees = entry["second_opinion"]["passed_by"] is not None
        report.append(entry)
        if not agrees and failed is None:
            failed = (j, distance)
    evidence = {"passed": failed is None and not diverged, "validator": VALIDATOR, "tolerance": tolerance,
                "segment_steps": k, "segments": report, "at": timezone.now().isoformat()}
    if diverged:
        return _diverged(receipt, evidence, job)
    if failed is not None:
        try:
            checks.check_segment(failed[1], tolerance, segment=failed[0])
        except checks.ResultRejected as e:
            record(receipt, evidence)
            return challenges.fail(receipt_id=receipt.pk, code=e.code, message=e.message)
    return evidence


# The other honest arithmetic a segment is re-trained in before it fails: another torch thread count (CPU kernels
# split their sums by it) and the float64-rounded stand-in the tolerances were calibrated with (a GPU's rounding).
SECOND_OPINIONS = (("threads", 2), ("numerics", "f64"))


def _second_opinion(job, X, y, start: segments.Checkpoint, end: segments.Checkpoint,
                    validator_end: segments.Checkpoint, *, first_step: int, steps: int, spec: dict,
                    tolerance: float, distance: float) -> dict:
    """A segment outside the tolerance (`distance` from the validator's `validator_end`), re-trained under each of
    SECOND_OPINIONS before it may fail. The tolerance is the worst honest drift seen over many segments, and some
    segments drift far more: in a step of high loss and a large learning rate, one different rounding crosses a
    ReLU's kink and the whole segment goes another way
    (measured: an honest 2-thread CPU device 5.4e-4 from the 1-thread validator on a cnn segment whose tolerance
    is 1.5e-5, while the 2-thread and float64 re-trainings agreed with the device within 1e-5). It passes when
    another honest arithmetic reproduces the device within the tolerance, or when the validator's own honest
    re-trainings disagree with each other as much (`checks.sensitive_tolerance`: a multiple of their spread,
    never above the ceiling that keeps every measured cheat ten times away). Costs a cheat's check two more
    re-trainings of its segment; an honest segment inside the tolerance never gets here."""
    opinions, spread = {}, 0.0
    threads = torch.get_num_threads()
    for kind, value in SECOND_OPINIONS:
        if kind == "threads":  # the other count than the validator's own
            value = value if threads == 1 else 1
        name = f"{kind}:{value}"
        torch.set_num_threads(value if kind == "threads" else threads)
        try:
            model = jobs.job_model(job, start.weights)
            other, losses = training.train_segment(model, X, y, start, first_step=first_step, steps=steps,
                                                   numerics=value if kind == "numerics" else "native", **spec)
        except (ValueError, RuntimeError) as e:
            opinions[name] = str(e)[:200]
            continue
        finally:
            torch.set_num_threads(threads)
        if not all(math.isfinite(v) for v in losses):
            opinions[name] = "diverged"
            continue
        opinions[name] = checks.finite_or_none(checks.checkpoint_distance(end, other, start))
        spread = max(spread, checks.checkpoint_distance(other, validator_end, start))
    allowed = checks.sensitive_tolerance(tolerance, spread)
    spread = checks.finite_or_none(spread)
    matched = min((d for d in opinions.values() if isinstance(d, float)), default=math.inf)
    passed_by = ("reproduced" if matched <= tolerance else "sensitive segment" if distance <= allowed else None)
    return {"distances": opinions, "spread": spread, "allowed": allowed, "passed_by": passed_by}


def _checkpoint(receipt: Receipt, boundary: int) -> segments.Checkpoint:
    """Boundary 0 is the round's global weights with a fresh optimizer (the receipt's chain was checked to
    start there); any other was uploaded and checked against its commitment."""
    if boundary == 0:
        return first_checkpoint(receipt)
    return segments.bytes_to_checkpoint(storage.blob_get(receipt.checkpoint_blobs[str(boundary)]))


def first_checkpoint(receipt: Receipt) -> segments.Checkpoint:
    unit = receipt.unit
    spec = jobs.unit_train_spec(unit)
    reference = tensors.bytes_to_state_dict(storage.blob_get(unit.round.weights_sha256))
    model = zoo.build_model(unit.round.job.template, unit.round.job.model_config)
    return segments.Checkpoint(reference, training.initial_optimizer_state(model, spec["optimizer"],
                                                                           spec["momentum"]))


def _check_divergence(receipt: Receipt) -> Receipt:
    """A non-finite result: re-train the unit whole. Diverging here too → the job's problem; training to
    finite weights here → the device's result was wrong."""
    unit, job = receipt.unit, receipt.unit.round.job
    reference = tensors.bytes_to_state_dict(storage.blob_get(unit.round.weights_sha256))
    X, y = jobs.unit_shard_xy(unit)
    result = training.train_local(jobs.job_model(job, reference), X, y, **jobs.unit_train_spec(unit))
    finite = math.isfinite(result.loss_after) and all(
        bool(v.isfinite().all()) for v in result.state_dict.values() if v.is_floating_point())
    evidence = {"passed": False, "validator": VALIDATOR, "whole_unit": True, "finite": finite,
                "loss_before": result.loss_before, "loss_after": result.loss_after if finite else None,
                "at": timezone.now().isoformat()}
    if not finite:
        return _diverged(receipt, evidence, job)
    record(receipt, evidence)
    return challenges.fail(receipt_id=receipt.pk, code="reexecution_mismatch",
                           message="Re-training the unit gave finite weights and loss; the result's are not.")


def _diverged(receipt: Receipt, evidence: dict, job) -> Receipt:
    """The training itself diverges: fail the job (its unused hold is released), penalise no device."""
    message = jobs.diverging_message(job, receipt.unit.round.number)
    with transaction.atomic():
        locked = Receipt.objects.select_for_update().get(pk=receipt.pk)
        if locked.status == Receipt.Status.PENDING:
            locked.status, locked.reason = Receipt.Status.REJECTED, f"training_diverges: {message}"[:500]
            locked.verification = {**locked.verification, "segment_check": evidence}
            locked.save(update_fields=["status", "reason", "verification"])
    jobs.job_fail(job_id=job.pk, error=message)
    log.warning("job %s fails: %s", job.pk, message)
    return locked


def record(receipt: Receipt, evidence: dict) -> None:
    Receipt.objects.filter(pk=receipt.pk, status=Receipt.Status.PENDING).update(
        verification={**receipt.verification, "segment_check": evidence})
    receipt.verification = {**receipt.verification, "segment_check": evidence}


def accept(pending: Receipt, evidence: dict) -> Receipt:
    return accept_all([(pending, evidence)])[pending.pk]


def accept_all(passed: list[tuple[Receipt, dict]]) -> dict[int, Receipt]:
    """Accept pending results of one round whose check agreed, with its evidence, in one transaction under one
    lock of the round (jobs.units_verified). Returns each receipt as it ends, by id: accepted, superseded (its
    shard's other copy was accepted first), or as another check had left it."""
    if not passed:
        return {}
    evidence = {receipt.pk: found for receipt, found in passed}
    rnd = passed[0][0].unit.round
    with transaction.atomic():
        ended = {receipt.pk: receipt for receipt in  # locked in id order, accepted in the order passed
                 Receipt.objects.select_for_update().filter(pk__in=list(evidence)).order_by("pk")}
        pending = [ended[r.pk] for r, _ in passed if ended[r.pk].status == Receipt.Status.PENDING]
        if not pending:
            return ended
        # Stored as accepted before the round's lock, which every result of the round waits on until this
        # transaction ends: under it, only the units' two statements (jobs.units_verified).
        for receipt in pending:
            receipt.verification = {**receipt.verification, "segment_check": evidence[receipt.pk]}
            # Charged off the check, in the job's next credit batch (contributors.credit), as results accepted at
            # once are: the validator moves on to the next check instead of posting to the ledger first.
            receipt.status, receipt.credit_pending = Receipt.Status.ACCEPTED, True
        Receipt.objects.bulk_update(pending, ["status", "verification", "credit_pending"])
        verified, round_complete = jobs.units_verified(round_id=rnd.pk, unit_ids=[r.unit_id for r in pending])
        for receipt in pending:
            if receipt.unit_id not in verified:  # its shard's other copy was accepted first
                _mark_superseded(receipt)
        if verified:
            results.credit_on_commit(rnd.job_id)
        if round_complete:
            results.aggregate_on_commit(rnd.pk)
        failpoint("verify.before_commit")
    return ended


def _superseded(receipt_id: int) -> Receipt:
    """The first valid result for the shard came from the other copy (straggler or backup): this receipt is
    kept, not credited, and not held against the device (it was not wrong, only late)."""
    with transaction.atomic():
        receipt = Receipt.objects.select_for_update().get(pk=receipt_id)
        if receipt.status == Receipt.Status.PENDING:
            _mark_superseded(receipt)
    return receipt


def _mark_superseded(receipt: Receipt) -> None:
    receipt.status, receipt.reason = Receipt.Status.REJECTED, f"superseded: {jobs.SUPERSEDED}"[:500]
    receipt.credit_pending = False
    receipt.save(update_fields=["status", "reason", "credit_pending"])


def pending_units(*, older_than_s: float | None = None) -> list[int]:
    """Units whose check has waited too long with everything it needs (a lost task; by default
    2 × MUNINN_STALL_SECONDS): the sweep enqueues them again."""
    from django.conf import settings

    if older_than_s is None:
        older_than_s = 2 * settings.MUNINN_STALL_SECONDS
    cutoff = timezone.now() - timezone.timedelta(seconds=older_than_s)
    return [r.unit_id for r in Receipt.objects.filter(status=Receipt.Status.PENDING, created_at__lt=cutoff)
            if not challenges.missing_boundaries(r)]
