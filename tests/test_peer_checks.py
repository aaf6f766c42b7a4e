"""Peer checks in-process: where no validator of the site runs a unit's backend, a second device of that backend
class re-trains the challenged segment; two agreeing runs accept it, a third device decides a disagreement, the
minority has failed, and the peers are paid for their runs as verified work."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from accounts import services as accounts
from accounts.models import User
from billing import selectors as ledger
from billing.models import Transaction
from contributors import peers
from contributors.models import Device, PeerCheck, Receipt
from contributors.verification import unit_verify
from jobs.models import Job

from .conftest import CAPABILITIES, SimulatedDevice, named_file
from .test_spine import assert_ledger_consistent
from .test_templates_flow import shapes_zip

pytestmark = pytest.mark.django_db(transaction=True)
CUDA = {**CAPABILITIES, "backends": ["cpu", "cuda"], "gpus": [{"name": "simulated", "memory_bytes": 8 * 2**30}]}


@pytest.fixture
def gpu_market(customer_api, contributor, settings):
    """The site's validators run CPU segments only; three CUDA devices of three owners, the peers trusted."""
    settings.MUNINN_VALIDATOR_BACKENDS = ["cpu"]
    trained = SimulatedDevice(contributor, "gpu-0", capabilities=CUDA)
    dataset = customer_api.post("/api/datasets", {"file": named_file(shapes_zip(), "shapes.zip")},
                                format="multipart").json()
    job = customer_api.post("/api/jobs", {"dataset": dataset["id"], "template": "resnet18", "rounds": 1, "seed": 4,
                                          "hparams": {"base_width": 8, "image_size": 16, "batch_size": 4,
                                                      "epochs": 1}, "start": True}, format="json")
    assert job.status_code == 201, job.content
    # the peers come online after the round opened: its one unit is the first device's
    checkers = [SimulatedDevice(accounts.user_create(username=f"peer{i}", password="peer-pass-123",
                                                     role=User.Role.CONTRIBUTOR), f"gpu-{i}", capabilities=CUDA)
                for i in (1, 2)]
    Device.objects.filter(pk__in=[d.device.pk for d in checkers]).update(verified_streak=50, verified_total=50)
    return trained, checkers, job.json()


def _submit(device: SimulatedDevice, *, honest: bool = True) -> Receipt:
    unit = device.claim()
    if not honest:  # trained in another order than its seed gives: every segment differs
        unit = {**unit, "train": {**unit["train"], "seed": unit["train"]["seed"] + 1}}
    assert device.submit(unit["id"], *device.train(unit)).status_code == 201
    return Receipt.objects.get(unit_id=unit["id"], device=device.device)


def _drain(device: SimulatedDevice, *, lie_first: bool = False) -> list[dict]:
    """The device runs every peer check it is handed (a result a cheap check found odd has every segment
    challenged); `lie_first`: it reports the first one falsely."""
    verdicts = []
    while (response := device.client.post("/api/worker/claim", {}, format="json")).status_code == 200 \
            and "check" in response.json():
        verdicts.append(device.run_check(response.json()["check"], lie=lie_first and not verdicts))
    return verdicts


def _next_check(device: SimulatedDevice) -> dict:
    response = device.client.post("/api/worker/claim", {}, format="json")
    assert response.status_code == 200 and "check" in response.json(), response.content
    return response.json()["check"]


def test_a_second_device_of_the_kind_agrees_and_both_are_paid(gpu_market):
    trained, (peer, _), job = gpu_market

    receipt = _submit(trained)
    assert receipt.status == Receipt.Status.PENDING  # all checkpoints in: waiting for a peer, not the site
    assert receipt.peer_checks.count() == len(receipt.challenge_segments)
    assert trained.client.post("/api/worker/claim", {}, format="json").status_code == 204  # never its own
    verdicts = _drain(peer)

    assert verdicts and all(v["status"] == "agreed" for v in verdicts)
    check = verdicts[0]
    receipt.refresh_from_db()
    assert receipt.status == Receipt.Status.ACCEPTED and receipt.verification["segment_check"]["validator"] == "peers"
    assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit=receipt.unit).count() == 1
    peer_pay = Transaction.objects.get(idempotency_key=f"charge:check:{check['check']}")
    assert 0 < peer_pay.flops < receipt.unit.flops
    assert ledger.balances_for(user=peer.device.owner)["contributor_pending"] > 0
    done = Job.objects.get(pk=job["id"])
    assert done.status == Job.Status.SUCCEEDED
    assert_ledger_consistent(done)


def test_a_disagreement_goes_to_a_third_device_and_the_minority_fails(gpu_market):
    trained, (peer, third), _ = gpu_market
    receipt = _submit(trained)

    first, *rest = _drain(peer, lie_first=True)  # a dishonest peer, once
    assert first["status"] == "disagreed" and all(v["status"] == "agreed" for v in rest)
    assert receipt.peer_checks.filter(tie_break=True).count() == 1
    second = third.run_check(_next_check(third))

    assert second["status"] == "agreed"
    receipt.refresh_from_db()
    assert receipt.status == Receipt.Status.ACCEPTED
    assert Device.objects.get(pk=peer.device.pk).failures == 1  # the minority
    assert Device.objects.get(pk=trained.device.pk).failures == 0
    assert not Transaction.objects.filter(idempotency_key=f"charge:check:{first['check']}").exists()
    assert Transaction.objects.filter(idempotency_key=f"charge:check:{second['check']}").exists()


def test_a_device_both_peers_disagree_with_fails_its_check(gpu_market):
    trained, (peer, third), _ = gpu_market
    receipt = _submit(trained, honest=False)

    verdicts = []
    while any(PeerCheck.objects.filter(status=PeerCheck.Status.QUEUED)):  # every segment, then each tie-break
        for device in (peer, third):
            response = device.client.post("/api/worker/claim", {}, format="json")
            if response.status_code == 200 and "check" in response.json():
                verdicts.append(device.run_check(response.json()["check"])["status"])

    assert verdicts and set(verdicts) == {"disagreed"}

    receipt.refresh_from_db()
    assert receipt.status == Receipt.Status.REJECTED and receipt.reason.startswith("reexecution_mismatch")
    assert Device.objects.get(pk=trained.device.pk).failures == 1
    assert Device.objects.get(pk=peer.device.pk).failures == Device.objects.get(pk=third.device.pk).failures == 0
    assert Transaction.objects.filter(idempotency_key__startswith="charge:check:").count() == len(verdicts)
    assert ledger.ledger_total() == 0


def test_when_no_peer_comes_the_sites_validator_decides(gpu_market, settings):
    trained, _, _ = gpu_market
    receipt = _submit(trained)
    assert receipt.status == Receipt.Status.PENDING

    units = peers.peer_checks_sweep(now=timezone.now() + timedelta(seconds=settings.MUNINN_PEER_CHECK_SECONDS + 1))
    for unit_id in units:
        unit_verify(unit_id=unit_id)

    assert units == [receipt.unit_id]
    receipt.refresh_from_db()
    assert receipt.status == Receipt.Status.ACCEPTED and receipt.verification["segment_check"]["validator"] == "site:cpu"
    assert set(PeerCheck.objects.values_list("status", flat=True)) == {PeerCheck.Status.EXPIRED}


def test_untrusted_devices_get_no_peer_checks(gpu_market):
    trained, (peer, _), _ = gpu_market
    Device.objects.filter(pk=peer.device.pk).update(verified_streak=0)
    _submit(trained)

    assert peer.client.post("/api/worker/claim", {}, format="json").status_code == 204
