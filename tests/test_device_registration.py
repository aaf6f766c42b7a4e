"""Registering devices: a limit per account, one device per public key, and no way around a quarantine."""
from __future__ import annotations

import threading

import pytest
from django.db import IntegrityError, connection, transaction
from muninn_worker import signing
from rest_framework.test import APIClient

from accounts import services as accounts
from accounts.models import User
from contributors import reputation, selectors
from contributors import services as contributors
from contributors.models import Device
from muninn.errors import Conflict

from .conftest import CAPABILITIES, register_device

pytestmark = pytest.mark.django_db(transaction=True)


def api_for(user: User) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=user)}")
    return client


def register(client: APIClient, public_key: str | None = None):
    key = public_key or signing.public_key_of(signing.new_private_key())
    return client.post("/api/worker/devices", {"name": "box", "capabilities": CAPABILITIES, "public_key": key},
                       format="json")


def test_devices_beyond_the_account_limit_are_refused_until_one_is_retired(contributor, settings):
    settings.MUNINN_MAX_DEVICES_PER_ACCOUNT = 2
    client = api_for(contributor)
    assert [register(client).status_code for _ in range(2)] == [201, 201]

    refused = register(client)

    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "too_many_devices" and refused.json()["error"]["detail"]["limit"] == 2
    assert Device.objects.filter(owner=contributor).count() == 2
    Device.objects.filter(pk=Device.objects.filter(owner=contributor).earliest("id").pk).update(is_active=False)
    assert register(client).status_code == 201  # a retired device no longer counts


def test_a_public_key_already_registered_is_refused_on_any_account(contributor):
    other = accounts.user_create(username="other", password="other-pass-123", role=User.Role.CONTRIBUTOR)
    key = signing.public_key_of(signing.new_private_key())
    assert register(api_for(contributor), key).status_code == 201

    again = register(api_for(contributor), key)
    elsewhere = register(api_for(other), key)

    for response in (again, elsewhere):
        assert response.status_code == 409 and response.json()["error"]["code"] == "public_key_taken"
    assert Device.objects.filter(public_key=key).count() == 1


def test_the_database_refuses_a_second_device_with_a_taken_public_key(contributor):
    """The service's check runs before its insert; two registrations racing past it meet the unique constraint."""
    other = accounts.user_create(username="other", password="other-pass-123", role=User.Role.CONTRIBUTOR)
    key = signing.public_key_of(signing.new_private_key())
    Device.objects.create(owner=contributor, name="first", token_hash="a" * 64, public_key=key)

    with pytest.raises(IntegrityError), transaction.atomic():
        Device.objects.create(owner=other, name="second", token_hash="b" * 64, public_key=key)

    assert Device.objects.filter(public_key=key).count() == 1


def test_two_registrations_racing_with_one_key_end_in_one_device_and_a_409(contributor):
    """Another owner's registration has inserted the key but not committed when this one checks: this one's check
    sees nothing, its insert waits on the unique index, and once the other commits it is refused as taken."""
    if connection.vendor != "postgresql":
        pytest.fail("this test needs PostgreSQL: run it through `make test` (DATABASE_URL=postgres://...)")
    other = accounts.user_create(username="other", password="other-pass-123", role=User.Role.CONTRIBUTOR)
    key = signing.public_key_of(signing.new_private_key())
    inserted, commit = threading.Event(), threading.Event()

    def racer():
        try:
            with transaction.atomic():
                Device.objects.create(owner=other, name="racer", token_hash="r" * 64, public_key=key)
                inserted.set()
                commit.wait(10)
        finally:
            connection.close()

    thread = threading.Thread(target=racer)
    thread.start()
    assert inserted.wait(10)
    threading.Timer(0.5, commit.set).start()  # commits while this registration waits on the index
    with pytest.raises(Conflict) as refused:
        contributors.device_register(owner=contributor, name="box", capabilities=CAPABILITIES, public_key=key)
    thread.join(10)

    assert refused.value.code == "public_key_taken"
    assert list(Device.objects.filter(public_key=key).values_list("owner", flat=True)) == [other.pk]


def test_devices_with_no_public_key_do_not_collide(contributor):
    """Devices from before keys (public_key "") are not one key: the constraint leaves them alone."""
    Device.objects.create(owner=contributor, name="old", token_hash="a" * 64)
    Device.objects.create(owner=contributor, name="older", token_hash="b" * 64)

    assert Device.objects.filter(public_key="").count() == 2


def test_a_quarantined_owners_new_device_is_quarantined_too(contributor):
    old = register_device(contributor, "old")
    for unit_id in range(reputation.QUARANTINE_AFTER):
        contributors.device_record_failure(device=old, reason="forged receipt", unit_id=unit_id + 1)
    old.refresh_from_db()
    assert old.quarantined_at is not None

    response = register(api_for(contributor))

    assert response.status_code == 201 and response.json()["quarantined"] is True
    new = Device.objects.get(pk=response.json()["device_id"])
    assert f"device #{old.pk} is quarantined" in new.quarantine_reason
    assert new.events.filter(kind="quarantined").exists()
    device_client = APIClient()
    device_client.credentials(HTTP_AUTHORIZATION=f"Device {response.json()['device_token']}")
    claim = device_client.post("/api/worker/claim", {}, format="json")
    assert claim.status_code == 403 and claim.json()["error"]["code"] == "device_quarantined"


def test_a_flagged_owners_new_device_gets_no_trust(contributor):
    earlier = register_device(contributor, "earlier")
    flagged = register_device(contributor, "flagged")
    contributors.device_record_failure(device=flagged, reason="checkpoint mismatch", unit_id=1)
    fresh = register_device(contributor, "fresh")
    Device.objects.filter(pk__in=[earlier.pk, fresh.pk]).update(verified_streak=100)
    earlier.refresh_from_db()
    fresh.refresh_from_db()

    assert selectors.device_trust_streak(fresh) == 0  # checked every time while the owner's case is open
    assert reputation.reexecution_rate(selectors.device_trust_streak(fresh)) == 1.0
    assert selectors.device_trust_streak(earlier) == 100  # registered before the failure: its own record stands
    Device.objects.filter(pk=flagged.pk).update(failures=0)  # the failure cleared (a lifted quarantine)
    assert selectors.device_trust_streak(fresh) == 100
