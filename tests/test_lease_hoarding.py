"""Holding units costs the holder (issue: a device reporting 1e18 FLOP/s claimed 9 units at once, never uploaded,
got the biggest shards and slowed rounds 2-4x): a device holds at most MUNINN_MAX_LEASES_PER_DEVICE units, a
lease it lets expire is kept on its record, halves its streak and keeps shards from being reserved for it, and no
device is planned on the speed it reports itself."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from contributors.models import Device, DeviceEvent
from contributors.selectors import device_capacities_online
from jobs import tasks
from jobs.models import WorkUnit

from .test_spine import create_job

pytestmark = pytest.mark.django_db(transaction=True)


def claim(device):
    return device.client.post("/api/worker/claim", {}, format="json")


def test_a_device_holds_at_most_the_limit_and_claims_again_once_it_uploads(settings, customer_api, digits_dataset,
                                                                          make_device):
    settings.MUNINN_MAX_LEASES_PER_DEVICE = 2
    hoarder, other = make_device("hoarder"), make_device("other")
    for i in range(3):  # three jobs: more units queued than the limit
        create_job(customer_api, digits_dataset["id"], rounds=1, hidden=[8 + i])
    held = [claim(hoarder) for _ in range(2)]
    assert [r.status_code for r in held] == [200, 200]

    refused = claim(hoarder)

    assert refused.status_code == 409, refused.content
    error = refused.json()["error"]
    assert error["code"] == "lease_limit" and error["detail"] == {"held": 2, "limit": 2}
    assert claim(other).status_code == 200  # the units it did not take are there for others
    unit = held[0].json()["unit"]
    assert hoarder.submit(unit["id"], *hoarder.train(unit)).status_code == 201
    assert claim(hoarder).status_code == 200


def test_an_abandoned_lease_is_on_the_record_halves_the_streak_and_reserves_nothing_for_it(
        settings, customer_api, digits_dataset, make_device):
    quitter, steady = make_device("quitter"), make_device("steady")
    Device.objects.update(verified_streak=40, verified_total=40, flops_per_s=1e9)
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = claim(quitter).json()["unit"]
    WorkUnit.objects.filter(pk=unit["id"]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))

    assert tasks.requeue_expired_leases() == 1

    assert WorkUnit.objects.get(pk=unit["id"]).status == WorkUnit.Status.QUEUED
    event = DeviceEvent.objects.get(device=quitter.device, kind=DeviceEvent.Kind.ABANDONED)
    assert event.unit_id == unit["id"]
    assert Device.objects.get(pk=quitter.device.pk).verified_streak == 20
    assert Device.objects.get(pk=steady.device.pk).verified_streak == 40
    planned = dict(device_capacities_online(min_memory_bytes=0, backends=["cpu"]))
    assert quitter.device.pk not in planned and steady.device.pk in planned
    settings.MUNINN_ABANDON_COOLDOWN_SECONDS = 0  # once the cool-down is over it is planned again
    assert quitter.device.pk in dict(device_capacities_online(min_memory_bytes=0, backends=["cpu"]))


def test_no_device_is_planned_on_the_speed_it_reports_itself(make_device):
    honest = [make_device(f"honest-{i}") for i in range(2)]
    liar = make_device("liar")
    for device, reported in ((honest[0], 1e9), (honest[1], 2e9), (liar, 1e18)):
        Device.objects.filter(pk=device.device.pk).update(flops_per_s=reported)

    planned = dict(device_capacities_online(min_memory_bytes=0, backends=["cpu"]))

    assert planned[liar.device.pk] == planned[honest[0].device.pk] == 2e9  # the probes' median, for every newcomer
