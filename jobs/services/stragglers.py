"""Stragglers: past a round's soft deadline, each unit still leased is issued once more to a free device."""
from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction
from django.utils import timezone


from ..models import Job, Round, WorkUnit


log = logging.getLogger(__name__)


def units_reissue_stragglers(*, now: datetime | None = None) -> list[int]:
    """Past an open round's soft deadline, each unit still leased (a straggler) is issued once more, as a
    backup unit open to any free device; whichever of the two gives the first valid result is accepted
    and the other is cancelled (see unit_accept). Idempotent: a unit gets at most one backup. Returns the
    backups' ids."""
    now = now or timezone.now()
    created = []
    for round_id in (Round.objects.filter(status=Round.Status.OPEN, deadline_at__lt=now, job__status=Job.Status.RUNNING)
                     .values_list("id", flat=True)):
        with transaction.atomic():
            rnd = Round.objects.select_for_update().get(pk=round_id)
            if rnd.status != Round.Status.OPEN:
                continue
            stragglers = list(rnd.units.filter(status=WorkUnit.Status.LEASED, backup_of__isnull=True,
                                               backups__isnull=True))
            if not stragglers:
                continue
            next_index = (rnd.units.order_by("-index").values_list("index", flat=True).first() or 0) + 1
            backups = WorkUnit.objects.bulk_create([
                WorkUnit(round=rnd, index=next_index + i, backup_of=unit, shard_start=unit.shard_start,
                         shard_stop=unit.shard_stop, shard_sha256=unit.shard_sha256, shard_offset=unit.shard_offset,
                         shard_size=unit.shard_size, seed=unit.seed, flops=unit.flops,
                         min_memory_bytes=unit.min_memory_bytes, expected_seconds=unit.expected_seconds)
                for i, unit in enumerate(stragglers)
            ])
            created += [b.pk for b in backups]
        log.info("job round %s: re-issued %s straggler unit(s)", round_id, len(stragglers))
    return created
