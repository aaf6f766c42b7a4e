"""A device's result for a unit: every check, then acceptance (or re-execution first); credit follows
(contributors.credit)."""
from __future__ import annotations

import functools
import logging
import threading
import time

import torch
from django.conf import settings
from django.db import IntegrityError, connection
from django.utils import timezone
from muninn_worker import segments, tensors, training, zoo

from jobs import services as jobs
from jobs import storage
from jobs.models import Round, WorkUnit
from jobs.signals import round_complete
from muninn import sql
from muninn.errors import Conflict, InvalidInput, NotFound, TooLarge
from muninn.failpoints import failpoint
from muninn.lru import SizedLRU

from . import challenges, checks, reputation, selectors, services
from .authentication import touch
from .checks import Expected, ResultRejected
from .models import Device, DeviceEvent, Lease, Receipt
from .signals import credit_due, reexecution_due

log = logging.getLogger(__name__)
LOSS_CHECK_SAMPLES = 64
NORM_HISTORY_UNITS = 200  # the job's latest accepted units whose update norms bound a new one (not all: O(job))
SPEED_RECORD_UNITS = 3  # verified units before a device's measured speed is held against its claims


FORM_SLACK_BYTES = 1_000_000  # the receipt, the signature and the multipart framing around the weights


def result_body_check(*, device: Device, unit_id: int, content_length: int) -> None:
    """Refuse a result from its Content-Length alone, before a byte is read, when it is larger than an update
    of this unit's weights can be (checks.max_update_bytes, never above the site's limit) plus the form around
    it; a unit the device does not hold is refused as result_submit would (NotFound, Conflict). Each refusal
    is recorded on the device, as result_submit's are."""
    if content_length <= _body_limit(weights_bytes=0):  # within any unit's limit: no lookup on the hot path
        return
    try:
        unit, _ = services.leased_unit(device=device, unit_id=unit_id)
        limit = _body_limit(weights_bytes=storage.blob_size(unit.round.weights_sha256))
        if content_length > limit:
            raise TooLarge(f"The request is {content_length:,} bytes; a result for unit {unit_id} is at most "
                           f"{limit:,} (an update of its weights, its last checkpoint and the receipt).")
    except (Conflict, NotFound, TooLarge) as e:
        _refused(device, unit_id, e)
        raise


def _body_limit(*, weights_bytes: int) -> int:
    """The update, and the last checkpoint that may come with it (result_submit's `checkpoint`)."""
    return (min(checks.max_update_bytes(weights_bytes), settings.MUNINN_MAX_RESULT_BYTES)
            + min(checks.max_checkpoint_bytes(weights_bytes), 2 * settings.MUNINN_MAX_RESULT_BYTES)
            + FORM_SLACK_BYTES)


def _refused(device: Device, unit_id: int, error) -> None:
    """A result refused before its checks (not this device's unit, too large), kept on the device's record."""
    DeviceEvent.objects.create(device=device, kind=DeviceEvent.Kind.REFUSED,
                               reason=f"result for unit {unit_id}: {error.code}: {error.message}"[:500])


def result_submit(*, device: Device, unit_id: int, weights: bytes, receipt: dict, receipt_bytes: bytes,
                  signature: str, max_bytes: int, checkpoint: bytes | None = None,
                  leased: tuple[WorkUnit, Lease] | None = None) -> Receipt:
    """Check a device's result for a unit it holds; accept it (credited at once) or, when the device's
    reputation or the evidence calls for it, challenge segments of it (credited only if their check passes:
    contributors.challenges, verification, peers).

    `weights` is the update as uploaded: the delta against the round's global weights in the job's encoding
    (muninn_worker.codec). It is decoded before every check on the tensors, and the decoded full state is what
    is stored for aggregation (the unit's result_sha256); the receipt's output hash is over the uploaded
    bytes, and its chain of checkpoints must end at the decoded state.

    The signature is checked over `receipt_bytes`, the receipt JSON exactly as uploaded. A result that
    fails a check no honest client fails is refused with the reason (kept as a rejected receipt), counts as a
    failure confirmed on this unit, earns nothing, and its unit goes back to the queue after its backoff.
    Posting a live result again (a client retrying after a lost answer) returns the original receipt.

    `checkpoint`: the last boundary's checkpoint, offered with the result (the device committed to it already, so
    offering it early tells it nothing). When the challenge asks for it, it is checked as an upload in answer would
    be (contributors.challenges.checkpoint_checked) and stored with the receipt, in its transaction: a unit of one
    segment, whose every check needs exactly it, is then checked without the device's second request and its
    round trip.

    `leased`: the unit and the device's current lease on it, read already with the device's authentication (the
    hot path's); None: looked up here, with the exact refusal when the device does not hold it."""
    touch(device)
    output_sha = storage.sha256_hex(weights)
    live = _live_with(output_sha)
    repeat = _live_receipt(device, unit_id, output_sha, live)
    if repeat is not None:  # the same upload again (the first answer was lost on the way): same answer
        return repeat
    try:
        unit, lease = leased or services.leased_unit(device=device, unit_id=unit_id)
        reference_bytes = storage.blob_get_cached(unit.round.weights_sha256)
        if len(weights) > checks.max_update_bytes(len(reference_bytes)) or len(weights) > max_bytes:
            raise TooLarge(f"The upload is {len(weights):,} bytes; this unit's weights are "
                           f"{len(reference_bytes):,}.")
    except (Conflict, NotFound, TooLarge) as e:
        _refused(device, unit_id, e)
        raise
    try:
        evidence, state, state_bytes, reference = _check(
            device=device, unit=unit, lease=lease, weights=weights, output_sha=output_sha,
            reference_bytes=reference_bytes, receipt=receipt, receipt_bytes=receipt_bytes, signature=signature,
            live=live)
    except ResultRejected as e:
        Receipt.objects.create(unit=unit, device=device, lease=lease, status=Receipt.Status.REJECTED,
                               reason=f"{e.code}: {e.message}"[:500], payload=_jsonable(receipt),
                               signature=signature[:128])
        jobs.unit_release(unit_id=unit.pk, lease_token=lease.token)
        # Only lies an honest client never tells reach here (a forged or inconsistent receipt, a broken chain,
        # no training, a replay): each is a confirmed failure on this unit.
        services.device_record_failure(device=device, reason=f"{e.code}: {e.message}", unit_id=unit.pk)
        log.warning("device %s unit %s rejected: %s", device.pk, unit.pk, e.message)
        raise InvalidInput(e.message, code=e.code) from None

    storage.blob_put(weights)  # the upload as sent, which the receipt's output hash names
    state_sha = storage.blob_put(state_bytes)
    suspect = evidence["suspect"]
    draw = reputation.draw(settings.SECRET_KEY, unit.pk, str(lease.token))
    streak = selectors.device_trust_streak(device)
    floor = settings.MUNINN_MIN_CHECK_RATE
    verify = (bool(suspect) or "same_bytes_as_receipt" in evidence
              or reputation.should_reexecute(streak, draw, min_rate=floor))
    n_segments = segments.segment_count(jobs.unit_steps(unit), lease.segment_steps)
    challenged = []
    if verify and "not_finite" not in suspect:  # a diverged result is re-trained whole (verification.py)
        challenged = reputation.draw_segments(settings.SECRET_KEY, unit.pk, str(lease.token), n_segments,
                                              suspect=bool(suspect))
    evidence["check"] = {"rate": reputation.reexecution_rate(streak, min_rate=floor), "chosen": verify,
                         "segments": challenged, "of": n_segments}
    metrics = {"loss_before": receipt["loss_before"], "loss_after": receipt["loss_after"], "steps": receipt["steps"],
               "train_seconds": receipt["train_seconds"], "update_norm": evidence.get("update_norm"),
               "update_norm_per_step": evidence.get("update_norm_per_step")}
    taken, mismatch = ({}, "") if checkpoint is None or not challenged else _offered_checkpoint(
        unit, receipt, challenged, checkpoint, reference)
    try:
        stored = _accept(device=device, unit=unit, lease=lease, receipt=receipt, signature=signature,
                         evidence=evidence, output_sha=output_sha, result_sha=state_sha, metrics=metrics,
                         verify=verify, challenged=challenged, checkpoint_blobs=taken)
    except Conflict:
        # The same upload, delivered twice at once (a client that timed out and sent it again while this one was
        # being checked): the other delivery won the unit's lock; this one gets the same answer.
        repeat = _live_receipt(device, unit_id, output_sha)
        if repeat is not None:
            return repeat
        raise
    if mismatch:  # as its upload in answer would: the check has failed
        return challenges.fail(receipt_id=stored.pk, code="checkpoint_mismatch", message=mismatch)
    if taken:  # its check was queued at the commit, and may be done (an eager Celery's is): answer what is so now
        stored.refresh_from_db(fields=["status", "reason", "verification", "credit_pending"])
    return stored


def _offered_checkpoint(unit: WorkUnit, receipt: dict, challenged: list[int], data: bytes,
                        reference: dict) -> tuple[dict, str]:
    """The last checkpoint that came with the result, checked before the result is stored, so that it goes into
    the receipt's own transaction (not a second one, and a second commit, after it): ({boundary: blob sha256})
    when the challenge asks for it, and '' or why it is not the committed one (the check then fails, as its upload
    would). A file that is not a checkpoint is left out: the challenge still asks for it, and the device may
    upload it before the deadline."""
    pending = Receipt(unit=unit, checkpoints=receipt["checkpoints"], challenge_segments=challenged)
    last = len(pending.checkpoints) - 1
    if last not in challenges.needed_boundaries(pending):
        return {}, ""
    try:
        sha, mismatch = challenges.checkpoint_checked(pending, last, data, reference=reference)
    except InvalidInput as e:
        log.info("unit %s: the checkpoint offered with its result is left out: %s", unit.pk, e.message)
        return {}, ""
    return ({} if mismatch else {str(last): sha}), mismatch


def _live_with(output_sha: str) -> list[tuple[int, int, int]]:
    """(receipt id, device id, unit id) of the live receipts (not rejected) for exactly these bytes, oldest first."""
    return sql.fetch_all(f"SELECT id, device_id, unit_id FROM {sql.table(Receipt)} "  # muninn/sql.py: why
                         "WHERE output_sha256 = %s AND status <> %s ORDER BY id",
                         [output_sha, Receipt.Status.REJECTED], planned_each_time=True)


def _live_receipt(device: Device, unit_id: int, output_sha: str,
                  live: list[tuple[int, int, int]] | None = None) -> Receipt | None:
    """This device's live receipt for these bytes and this unit (the same upload delivered again), if any."""
    live = _live_with(output_sha) if live is None else live
    same = next((rid for rid, device_id, uid in live if device_id == device.pk and uid == unit_id), None)
    return None if same is None else Receipt.objects.select_related("unit").filter(
        pk=same, status__in=[Receipt.Status.ACCEPTED, Receipt.Status.PENDING]).first()


def _accept(*, device: Device, unit: WorkUnit, lease: Lease, receipt: dict, signature: str, evidence: dict,
            output_sha: str, result_sha: str, metrics: dict, verify: bool, challenged: list[int],
            checkpoint_blobs: dict) -> Receipt:
    """Store the receipt and accept the unit in one transaction (jobs.unit_accept_with: on PostgreSQL one round
    trip, so that the round's lock, which every result of the round waits on, is held for the database's time
    alone). A concurrent delivery of the same result that committed first makes this one a Conflict: the unit is
    no longer leased, or its one live receipt is taken (the insert fails on the constraint)."""
    stored = Receipt(
        unit=unit, device=device, lease=lease, signature=signature, verification=evidence,
        status=Receipt.Status.PENDING if verify else Receipt.Status.ACCEPTED, credit_pending=not verify,
        payload=_jsonable(receipt),
        weights_sha256=receipt["weights_sha256"], shard_sha256=receipt["shard_sha256"],
        output_sha256=output_sha, samples=receipt["samples"], steps=receipt["steps"],
        loss_before=receipt["loss_before"], loss_after=receipt["loss_after"],
        train_seconds=receipt["train_seconds"], started_at=receipt["started_at"],
        finished_at=receipt["finished_at"], segment_steps=receipt["segment_steps"],
        checkpoints=receipt["checkpoints"], challenge_segments=challenged,
        checkpoint_blobs=checkpoint_blobs,
        challenge_deadline=(timezone.now() + timezone.timedelta(seconds=settings.MUNINN_CHALLENGE_SECONDS)
                            if challenged else None),
    )
    failpoint("result.before_commit")  # checked and its blobs stored; nothing of it committed
    try:
        unit, round_complete = jobs.unit_accept_with(stored, unit=unit, lease_token=lease.token,
                                                     result_sha256=result_sha, samples=receipt["samples"],
                                                     metrics=metrics, verify=verify)
    except IntegrityError:
        if not Receipt.objects.filter(unit_id=unit.pk, status__in=LIVE).exists():
            raise
        raise Conflict("This unit already has a result.", code="already_done") from None
    stored.unit = unit
    # Committed: what follows is queued now (each receiver's transaction.on_commit runs at once, or at the commit
    # of a caller's transaction).
    if verify and (not challenged  # a diverged result: the validator re-trains the unit whole, at once
                   or not challenges.missing_boundaries(stored)):  # every checkpoint came along
        reexecution_due.send(sender=Receipt, unit_id=unit.pk)
    elif not verify:  # charged off the request, in a batch per job (contributors.credit)
        credit_on_commit(unit.round.job_id)
    if round_complete:
        aggregate_on_commit(unit.round_id)
    return stored


LIVE = (Receipt.Status.PENDING, Receipt.Status.ACCEPTED)  # a unit has at most one such receipt (a constraint)


def credit_on_commit(job_id: int) -> None:
    credit_due.send(sender=Receipt, job_id=job_id)


def aggregate_on_commit(round_id: int) -> None:
    round_complete.send(sender=Receipt, round_id=round_id)


def _check(*, device: Device, unit: WorkUnit, lease: Lease, weights: bytes, output_sha: str, reference_bytes: bytes,
           receipt: dict, receipt_bytes: bytes, signature: str,
           live: list[tuple[int, int, int]] | None = None) -> tuple[dict, dict, bytes, dict]:
    """Every cheap check, cheapest first. A lie an honest client never tells raises ResultRejected; a check that
    honest training can fail (a rising loss on the shard, an unusual norm, a diverged result, a surprising
    speed) is evidence, listed in `evidence["suspect"]`, and sends the result to a segment check instead.
    Returns the evidence kept on the receipt, the decoded state and its safetensors bytes (what is stored for
    aggregation; made once: they are the receipt's last commitment too), and the round's weights decoded (read
    only: a checkpoint offered with the result is checked against them)."""
    checks.check_signature(device.public_key, receipt_bytes, signature)
    checks.check_receipt(receipt, expected=Expected(unit.pk, unit.round.weights_sha256, unit.shard_sha256,
                                                    unit.samples, jobs.unit_steps(unit)), output_sha256=output_sha)
    live = _live_with(output_sha) if live is None else live  # (result_submit looked them up already)
    # Another unit's: the same unit's is this very upload delivered twice, which result_submit answers as a repeat.
    # Another unit with the very same work (a job run again with the same seed, data and settings: the same
    # weights, shard, seed and training) has the very same honest result: that is no replay.
    others = [unit_id for _, device_id, unit_id in live if device_id == device.pk and unit_id != unit.pk]
    if others and any(_work_of(other) != _work_of(unit) for other in
                      WorkUnit.objects.select_related("round__job").filter(pk__in=others)):
        raise ResultRejected("replayed_result", "These exact weights were already submitted for another unit.")
    # The same bytes from another device: one of the two claims is false, and hashes cannot say which
    # (training is deterministic, so a cheater can submit a unit's honest result for another unit first).
    # A segment check decides; the newcomer is never refused on the other device's word.
    collision = next((receipt_id for receipt_id, device_id, _ in live if device_id != device.pk), None)
    reference = _reference(unit.round.weights_sha256, reference_bytes)
    state = checks.decode_update(weights, reference, unit.round.job.update_encoding,
                                 max_inflated_bytes=checks.max_update_bytes(len(reference_bytes)))
    state_bytes = tensors.state_dict_to_bytes(state)
    checks.check_chain(receipt, segment_steps=lease.segment_steps,
                       segments=segments.segment_count(jobs.unit_steps(unit), lease.segment_steps),
                       first=first_commitment(unit), last_weights=storage.sha256_hex(state_bytes))
    evidence: dict = {"suspect": []}
    if collision is not None:
        evidence["same_bytes_as_receipt"] = collision
    try:
        checks.check_state(state, reference)
    except ResultRejected as e:
        if e.code != "not_finite":
            raise
        evidence["suspect"].append("not_finite")  # diverged training, or a lie: re-training the unit tells
        return evidence, state, state_bytes, reference
    if receipt["loss_after"] is None or receipt["loss_before"] is None:
        evidence["suspect"].append("not_finite")
        return evidence, state, state_bytes, reference
    norm = checks.update_norm(state, reference)
    # Per optimizer step: shards are sized by speed, so an honest fast device's update is as many times longer
    # as it took steps; compared whole, a ten-times-faster device looked like a scaling attack.
    per_step = norm / max(jobs.unit_steps(unit), 1)
    bound = _norm_bound(unit.round.job_id)
    _as_evidence(evidence, checks.check_update_norm, norm, bound, per_step=per_step)
    held = (timezone.now() - lease.created_at).total_seconds()
    checks.check_timing(train_seconds=receipt["train_seconds"], held_seconds=held)
    # The probe's benchmark can be far off (a busy machine measures slow); only speeds learned from this
    # device's verified units count as its record.
    record = device.samples_per_s if device.verified_total >= SPEED_RECORD_UNITS else 0.0
    if checks.implausibly_fast(train_seconds=receipt["train_seconds"], device_speed=record,
                               work_samples=jobs.unit_work_samples(unit)):
        evidence["suspect"].append("implausibly_fast")
    before, after = _shard_losses(unit, reference, state)
    _as_evidence(evidence, checks.check_shard_loss, before, after)
    evidence.update({"update_norm": norm, "update_norm_per_step": per_step, "norm_bound_per_step": bound,
                     "shard_loss_before": checks.finite_or_none(before),
                     "shard_loss_after": checks.finite_or_none(after), "held_seconds": round(held, 3)})
    return evidence, state, state_bytes, reference


# A round's weights sha256 → its tensors, decoded once: up to 64 MB a process, none over 8 MB (the blobs
# storage.blob_get_cached keeps). Bounded by a count of eight, bench/load.py's 40 jobs' rounds were decoded again
# and again.
REFERENCES_BYTES = 64 * 2**20
_REFERENCES: SizedLRU[str, dict] = SizedLRU(REFERENCES_BYTES, largest=REFERENCES_BYTES // 8)


def _reference(sha256: str, data: bytes) -> dict:
    """The round's global weights decoded, shared by every result of the round this process checks: decoding them
    for each result was 2.7 % of the web's CPU under bench/load.py (py-spy). Blobs are named by their content, so
    a kept copy is never stale. READ ONLY: every check reads it (codec.decode_update makes new tensors;
    _check_model copies it into its own), and tests/test_results_reference.py holds that to a result's whole
    path."""
    found = _REFERENCES.get(sha256)
    if found is not None:
        return found
    return _REFERENCES.put(sha256, tensors.bytes_to_state_dict(data), len(data))


# A job's bound, once the median of NORM_BOUND_STABLE_UNITS or more, is recomputed at most every NORM_BOUND_TTL_S per
# process: a few results more or less barely move such a median. A young job's is computed for every result.
NORM_BOUND_TTL_S = 10.0
NORM_BOUND_STABLE_UNITS = 20
_NORM_BOUNDS: dict[int, tuple[float, float]] = {}  # job id → (computed at, monotonic; bound)


def _norm_bound(job_id: int) -> float:
    """The bound on a new update's norm per step, from the job's latest accepted units (checks.norm_bound)."""
    now = time.monotonic()
    cached = _NORM_BOUNDS.get(job_id)
    if cached is not None and now - cached[0] < NORM_BOUND_TTL_S:
        return cached[1]
    norms = [float(norm or 0.0) for norm, in sql.fetch_all(_norms_sql(connection.vendor),
                                                           _norms_params(connection.vendor, job_id))]
    bound = checks.norm_bound(norms)
    if len(norms) >= NORM_BOUND_STABLE_UNITS:
        if len(_NORM_BOUNDS) > 1024:
            _NORM_BOUNDS.clear()
        _NORM_BOUNDS[job_id] = (now, bound)
    return bound


def _norms_params(vendor: str, job_id: int) -> list:
    if vendor == "postgresql":
        return [job_id, NORM_HISTORY_UNITS + 1, NORM_HISTORY_UNITS, NORM_HISTORY_UNITS]
    return [job_id, NORM_HISTORY_UNITS]


@functools.cache
def _norms_sql(vendor: str) -> str:
    """The update norms per step of the job's latest accepted units, read out of their metrics by the database
    (each result of a young job asks: decoding 200 rows' JSON here cost more than the query). On PostgreSQL the
    job's latest rounds are read one by one, each round's accepted units by the `unit_accepted_round` index: the
    plain join's plan walked every job's accepted units backwards until this job's filled the limit (5 ms a call
    under bench/load.py's 40 jobs, a quarter of PostgreSQL's CPU). A later round's units all have higher ids (it
    opens when the one before has closed), so the order is the same; and the latest limit + 1 rounds hold the
    latest `limit` accepted units (a round closes with at least one; only the open one may have none)."""
    accepted = sql.literal(WorkUnit.Status.ACCEPTED)  # unit_accepted_round serves the generic plan too
    if vendor == "postgresql":
        return (f"SELECT x.norm FROM (SELECT id FROM {sql.table(Round)} WHERE job_id = %s ORDER BY id DESC LIMIT %s) r "
                "CROSS JOIN LATERAL "
                f"(SELECT u.id, u.result_metrics ->> 'update_norm_per_step' AS norm FROM {sql.table(WorkUnit)} u "
                f"WHERE u.round_id = r.id AND u.status = {accepted} ORDER BY u.id DESC LIMIT %s) x "
                "ORDER BY r.id DESC, x.id DESC LIMIT %s")
    return (f"SELECT json_extract(u.result_metrics, '$.update_norm_per_step') FROM {sql.table(WorkUnit)} u "
            f"JOIN {sql.table(Round)} r ON r.id = u.round_id WHERE r.job_id = %s AND u.status = {accepted} "
            "ORDER BY u.id DESC LIMIT %s")


def _work_of(unit: WorkUnit) -> tuple:
    """Everything that decides a unit's trained weights: two units with the same train the same."""
    job = unit.round.job
    return (unit.round.weights_sha256, unit.shard_sha256, unit.samples, job.template, job.model_config,
            jobs.unit_train_spec(unit), job.update_encoding, job.base_weights_id)


# Cheap checks that honest training can fail: evidence that calls for a segment check, never a refusal.
HONEST_CAN_FAIL = frozenset({"update_too_large", "loss_not_improved"})


def _as_evidence(evidence: dict, check, *args, **kwargs) -> None:
    try:
        check(*args, **kwargs)
    except ResultRejected as e:
        if e.code not in HONEST_CAN_FAIL:
            raise
        evidence["suspect"].append(e.code)
        evidence.setdefault("notes", []).append(e.message)


_FIRST_COMMITMENTS: dict[tuple, list[str]] = {}


def first_commitment(unit: WorkUnit) -> list[str]:
    """What boundary 0 of every unit of the round commits to: its global weights and a fresh optimizer.
    Computed once per round and process."""
    job, key = unit.round.job, (unit.round_id, unit.round.weights_sha256)
    if key not in _FIRST_COMMITMENTS:
        spec = jobs.unit_train_spec(unit)
        model = zoo.build_model(job.template, job.model_config)
        reference = tensors.bytes_to_state_dict(storage.blob_get(unit.round.weights_sha256))
        if len(_FIRST_COMMITMENTS) > 256:
            _FIRST_COMMITMENTS.clear()
        _FIRST_COMMITMENTS[key] = segments.commitment(
            reference, training.initial_optimizer_state(model, spec["optimizer"], spec["momentum"]))
    return _FIRST_COMMITMENTS[key]


def _shard_losses(unit: WorkUnit, reference: dict, state: dict) -> tuple[float, float]:
    """Loss of the global and of the submitted weights on a few samples of the unit's own shard."""
    X, y = jobs.unit_shard_xy(unit)
    X, y = X[:LOSS_CHECK_SAMPLES], y[:LOSS_CHECK_SAMPLES]
    job = unit.round.job
    model = _check_model(job, reference)
    before = training.loss_on(model, X, y)
    if job.base_weights_id is None:  # the same model with the new weights (a LoRA job's base goes on after them)
        model = _check_model(job, state)
    else:
        model = jobs.job_model(job, state)
    return before, training.loss_on(model, X, y)


_CHECK_MODELS = threading.local()  # per request thread: job id → its model, weights loaded afresh for each result
CHECK_MODELS_BYTES = 64 * 2**20  # a thread's models' tensors at most (one resnet18 is ~45 MB; a digits MLP ~40 KB)


def _check_model(job, state: dict):
    """The job's model with `state` loaded: built once per job and thread (building it was ~2 % of a result's CPU
    under load), its weights replaced for each result. A LoRA job's (a frozen base under the weights) is built
    each time."""
    if job.base_weights_id is not None:
        return jobs.job_model(job, state)
    kept = getattr(_CHECK_MODELS, "by_job", None)
    if kept is None:
        kept = _CHECK_MODELS.by_job = SizedLRU(CHECK_MODELS_BYTES)
    entry = kept.get(job.pk)
    if entry is None:
        model = zoo.build_model(job.template, job.model_config).eval()  # kept in eval mode: loss_on need not walk it
        slots = model.state_dict(keep_vars=True)
        entry = kept.put(job.pk, (model, slots), sum(t.numel() * t.element_size() for t in slots.values()))
    model, slots = entry
    if state.keys() != slots.keys() or any(state[k].shape != t.shape for k, t in slots.items()):
        model.load_state_dict(state)  # not this model's tensors: load_state_dict says how
        return model
    with torch.no_grad():  # what load_state_dict does for exactly the model's keys, without its walk of the modules
        for name, tensor in slots.items():
            tensor.copy_(state[name])
    return model


def _jsonable(receipt: dict) -> dict:
    return {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in receipt.items()}
