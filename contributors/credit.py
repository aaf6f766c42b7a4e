"""Paying for verified work: the unit's charge through the ledger, and the device's record.

A result accepted without a re-execution is stored and answered at once (contributors.results), and one whose
segments were checked is accepted when its check passes (contributors.verification); either is marked
`credit_pending`, and its charge is posted here, off the request, in batches (the `credit_results` task, one per job
with results waiting, and beat's sweep for a message that was lost). One batch is one database transaction:
every unit still gets its own double-entry charge (billing.unit_charge: idempotent per unit, never above the
job's hold), so a batch killed half way rolls back whole and its next run credits each unit once.

Before anything can change what a pending credit is owed, the pending credits concerned are posted first:
a job that ends (its hold is released next; jobs.signals.job_ending) and a device with a confirmed failure (its
unverified earnings are held next; services.device_record_failure).
"""
from __future__ import annotations

from django.db import connection, transaction
from django.db.models import F, QuerySet

from billing import services as billing
from jobs import services as jobs
from muninn.failpoints import failpoint
from muninn_worker import segments

from .models import Device, Receipt

THROUGHPUT_SMOOTHING = 0.3  # weight of the newest measurement in the moving estimate
BATCH = 500  # receipts credited in one transaction


def credit_pending(*, job_id: int | None = None, device_id: int | None = None, wait: bool = False) -> int:
    """Credit the accepted results still waiting for their charge (of one job, or one device, or all), up to
    BATCH of them in one transaction. Receipts another transaction is crediting now are skipped, unless `wait`:
    then this waits for it (the caller must see every pending credit posted before it goes on). Returns how many
    it credited."""
    pending = Receipt.objects.filter(credit_pending=True, status=Receipt.Status.ACCEPTED)
    if job_id is not None:
        pending = pending.filter(unit__round__job_id=job_id)
    if device_id is not None:
        pending = pending.filter(device_id=device_id)
    with transaction.atomic():
        receipts = list(_locked(pending, skip_locked=not wait)
                        .select_related("unit__round__job", "device__owner").order_by("id")[:BATCH])
        by_job: dict[int, list[Receipt]] = {}
        for receipt in receipts:
            by_job.setdefault(receipt.unit.round.job_id, []).append(receipt)
        for batch in by_job.values():
            billing.unit_charges(job=batch[0].unit.round.job, charges=[(r.unit, r.device.owner) for r in batch])
        devices_record_successes([(r.device_id, jobs.unit_work_samples(r.unit), r.unit.flops, r.train_seconds or 0.0)
                                  for r in receipts])
        Receipt.objects.filter(pk__in=[r.pk for r in receipts]).update(credit_pending=False)
        if receipts:
            failpoint("credit.before_commit")
    return len(receipts)


def credit_all_pending(*, job_id: int | None = None, wait: bool = False) -> int:
    """credit_pending, a batch after another, until none is left (of one job, or all). Returns how many."""
    total = 0
    while (credited := credit_pending(job_id=job_id, wait=wait)):
        total += credited
        if credited < BATCH:
            break
    return total


def jobs_with_pending_credit() -> list[int]:
    """The jobs whose accepted results wait for their charge: beat's sweep credits them (a lost message)."""
    return list(Receipt.objects.filter(credit_pending=True, status=Receipt.Status.ACCEPTED)
                .values_list("unit__round__job_id", flat=True).distinct().order_by("unit__round__job_id"))


def _locked(receipts: QuerySet[Receipt], *, skip_locked: bool) -> QuerySet[Receipt]:
    if connection.features.has_select_for_update_skip_locked and skip_locked:
        return receipts.select_for_update(skip_locked=True, of=("self",))
    return receipts.select_for_update(of=("self",))


def credit_peer_check(*, check) -> None:
    """A peer device's run of another device's segment, in the majority: paid as verified work (its share of
    the unit's FLOPs), and its record grows."""
    unit = check.receipt.unit
    steps = segments.boundaries(jobs.unit_steps(unit), check.receipt.segment_steps)
    flops = unit.flops * (steps[check.segment + 1] - steps[check.segment]) // max(steps[-1], 1)
    billing.check_charge(job=unit.round.job, check_id=check.pk, flops=flops, contributor=check.device.owner,
                         memo=f"job {unit.round.job.pk} unit {unit.pk}: peer check of segment {check.segment}")
    device_record_success(device=check.device, seconds=0.0, flops=flops, work_samples=0)


def device_record_success(*, device: Device, work_samples: int, flops: int, seconds: float) -> None:
    """A result passed every check: the streak grows and the speed estimates (samples/s, FLOP/s) learn from it."""
    devices_record_successes([(device.pk, work_samples, flops, seconds)])


def devices_record_successes(successes: list[tuple[int, int, int, float]]) -> None:
    """device_record_success for many results, [(device id, work samples, FLOPs, seconds), ...] in the order they
    are credited: one read of the devices and one update per device."""
    if not successes:
        return
    now = {pk: [total, samples, flops] for pk, total, samples, flops in Device.objects.filter(
        pk__in={s[0] for s in successes}).values_list("pk", "verified_total", "samples_per_s", "flops_per_s")}
    counts: dict[int, int] = {}
    for pk, work_samples, flops, seconds in successes:
        total, samples_now, flops_now = now[pk]
        if seconds > 0:
            now[pk][1] = _throughput(samples_now, measured=work_samples / seconds, replace=total == 0)
            now[pk][2] = _throughput(flops_now, measured=flops / seconds, replace=total == 0)
        now[pk][0] = total + 1
        counts[pk] = counts.get(pk, 0) + 1
    for pk, n in counts.items():
        Device.objects.filter(pk=pk).update(verified_streak=F("verified_streak") + n,
                                            verified_total=F("verified_total") + n,
                                            samples_per_s=now[pk][1], flops_per_s=now[pk][2])


def _throughput(current: float, *, measured: float, replace: bool) -> float:
    """Moving estimate of a speed; the first real unit replaces the probe's benchmark outright."""
    if current <= 0 or replace:
        return measured
    return (1 - THROUGHPUT_SMOOTHING) * current + THROUGHPUT_SMOOTHING * measured
