"""A device that will not finish a unit gives it back (POST /api/worker/units/<id>/release): the unit is queued
again at once for another device, and, unlike a lease left to expire, nothing is held against the device. The
worker client does it when stopped mid-unit (Ctrl-C, or SIGTERM from a service manager), a browser tab when it
closes (static/muninn/browser/page.js)."""
from __future__ import annotations

import signal

import pytest

from contributors.models import Device, DeviceEvent
from jobs.models import WorkUnit

from .test_spine import create_job
from .test_worker_owner import _device_id, _env, _job, _register, _Running

pytestmark = pytest.mark.django_db(transaction=True)


def claim(device):
    return device.client.post("/api/worker/claim", {}, format="json")


def give_back(device, unit_id: int):
    return device.client.post(f"/api/worker/units/{unit_id}/release")


def test_a_unit_given_back_is_queued_at_once_for_another_device_and_not_held_against_the_giver(
        customer_api, digits_dataset, make_device):
    quitter = make_device("quitter")
    Device.objects.update(verified_streak=40, verified_total=40, flops_per_s=1e9)
    create_job(customer_api, digits_dataset["id"], rounds=1)  # one device online: one unit, the whole set
    unit = claim(quitter).json()["unit"]

    answer = give_back(quitter, unit["id"])

    assert answer.status_code == 200, answer.content
    assert answer.json() == {"unit": unit["id"], "given_back": True}
    queued = WorkUnit.objects.get(pk=unit["id"])
    assert queued.status == WorkUnit.Status.QUEUED and queued.lease_token is None and queued.rejections == 0
    assert not DeviceEvent.objects.filter(device=quitter.device).exists()  # not abandoned, not refused
    assert Device.objects.get(pk=quitter.device.pk).verified_streak == 40
    steady = make_device("steady")
    again = claim(steady).json()["unit"]  # at once: no backoff, no reservation for the giver
    assert again["id"] == unit["id"]
    assert steady.submit(again["id"], *steady.train(again)).status_code == 201


def test_only_the_lease_holder_gives_a_unit_back_and_only_once(customer_api, digits_dataset, make_device):
    holder, other = make_device("holder"), make_device("other")
    create_job(customer_api, digits_dataset["id"], rounds=1)
    unit = claim(holder).json()["unit"]

    stranger = give_back(other, unit["id"])
    assert stranger.status_code == 409 and stranger.json()["error"]["code"] == "lease_lost"
    assert WorkUnit.objects.get(pk=unit["id"]).status == WorkUnit.Status.LEASED  # untouched
    assert give_back(holder, 10**9).status_code == 404
    assert give_back(holder, unit["id"]).status_code == 200
    twice = give_back(holder, unit["id"])
    assert twice.status_code == 409 and twice.json()["error"]["code"] == "lease_lost"
    unauthenticated = customer_api.post(f"/api/worker/units/{unit['id']}/release")
    assert unauthenticated.status_code in (401, 403)


def test_a_worker_client_stopped_mid_unit_gives_it_back(contributor, customer_api, live_server, tmp_path):
    config = _register(contributor, live_server.url, tmp_path)
    job_id = _job(customer_api)
    worker = _Running("run", "--config", str(config), "--cache-dir", str(tmp_path / "cache"),
                      env=_env(MUNINN_WORKER_FAILPOINTS="train.after_epoch=sleep:60"))  # holds it in training
    try:
        worker.wait_for("failpoint train.after_epoch reached")
        unit = WorkUnit.objects.get(round__job_id=job_id)
        assert unit.status == WorkUnit.Status.LEASED and unit.leased_device_id == _device_id(config)

        worker.proc.send_signal(signal.SIGTERM)  # as `systemctl --user stop` does
        assert worker.proc.wait(timeout=30) == 130
    finally:
        worker.stop()

    worker.wait_for(f"interrupted during unit {unit.pk}; gave it back to the site for another device")
    unit.refresh_from_db()
    assert unit.status == WorkUnit.Status.QUEUED and unit.lease_token is None
    assert not DeviceEvent.objects.filter(device_id=_device_id(config), kind=DeviceEvent.Kind.ABANDONED).exists()
