"""Rate limits on what strangers can flood or guess (muninn/throttles.py): 429 with Retry-After, per address,
per username, per account and per device; honest clients wait it out and keep working."""
from __future__ import annotations

import pytest
from django.test import Client
from muninn_worker import signing
from muninn_worker.api import ApiClient
from rest_framework.test import APIClient

from accounts import services as accounts
from accounts.models import User
from contributors import services as contributors

from .conftest import CAPABILITIES

pytestmark = pytest.mark.django_db


def test_twenty_wrong_passwords_in_a_row_get_429_with_retry_after(customer):
    api = APIClient()
    answers = [api.post("/api/auth/token", {"username": customer.username, "password": f"wrong-{i}"},
                        format="json") for i in range(20)]

    statuses = [a.status_code for a in answers]
    assert statuses[:10] == [400] * 10 and statuses[10:] == [429] * 10  # MUNINN_THROTTLES["login-username"]
    refused = answers[-1]
    assert int(refused["Retry-After"]) > 0
    assert refused.json()["error"]["code"] == "throttled"
    # the right password is refused too until the wait is over: guessing cannot go on by getting it right
    assert api.post("/api/auth/token", {"username": customer.username, "password": "alice-pass-123"},
                    format="json").status_code == 429


def test_another_username_from_the_same_address_is_not_locked_out_by_it(customer, contributor):
    api = APIClient()
    for i in range(12):
        api.post("/api/auth/token", {"username": customer.username, "password": f"wrong-{i}"}, format="json")

    other = api.post("/api/auth/token", {"username": contributor.username, "password": "bob-pass-123"},
                     format="json")

    assert other.status_code == 200, other.content


def test_one_address_guessing_many_usernames_is_limited_too(settings):
    settings.MUNINN_THROTTLES = {**settings.MUNINN_THROTTLES, "login-address": "5/min"}
    api = APIClient()
    statuses = [api.post("/api/auth/token", {"username": f"user{i}", "password": "x" * 8}, format="json").status_code
                for i in range(7)]
    assert statuses == [400] * 5 + [429] * 2


def test_the_login_form_and_the_admin_login_are_limited_with_the_sites_page(customer):
    for path in ("/login/", "/admin/login/"):
        browser = Client()
        answers = [browser.post(path, {"username": f"someone{path}", "password": f"wrong-{i}"}) for i in range(12)]
        assert [a.status_code for a in answers[:10]] == [200] * 10  # the form again, with its error
        assert answers[-1].status_code == 429 and int(answers[-1]["Retry-After"]) > 0
        assert "Too many tries" in answers[-1].content.decode()
        assert "Content-Security-Policy" in answers[-1]  # the site's own page, with its headers


def test_sign_ups_from_one_address_are_limited(settings):
    settings.MUNINN_THROTTLES = {**settings.MUNINN_THROTTLES, "signup-address": "3/hour"}
    api = APIClient()
    statuses = [api.post("/api/auth/signup", {"username": f"new{i}", "password": "long-enough-123",
                                              "role": "customer"}, format="json").status_code for i in range(4)]
    assert statuses == [201, 201, 201, 429]
    assert User.objects.filter(username__startswith="new").count() == 3


def test_device_registrations_are_limited_per_account(contributor, settings):
    settings.MUNINN_THROTTLES = {**settings.MUNINN_THROTTLES, "device-registration": "2/hour"}
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=contributor)}")
    statuses = [api.post("/api/worker/devices", {"name": f"box{i}", "capabilities": CAPABILITIES,
                                                 "public_key": signing.public_key_of(signing.new_private_key())},
                         format="json").status_code for i in range(3)]
    assert statuses == [201, 201, 429]


@pytest.mark.django_db(transaction=True)
def test_the_worker_client_waits_out_its_claim_throttle_and_keeps_working(contributor, settings, live_server):
    settings.MUNINN_THROTTLES = {**settings.MUNINN_THROTTLES, "claim": "2/s"}
    _, token = contributors.device_register(owner=contributor, name="honest", capabilities=CAPABILITIES,
                                            public_key=signing.public_key_of(signing.new_private_key()))
    retries: list[tuple[float, str]] = []
    client = ApiClient(live_server.url, device_token=token, on_retry=lambda n, delay, why: retries.append((delay, why)))

    answers = [client.claim() for _ in range(6)]  # faster than 2 a second: some are throttled, then retried

    assert answers == [None] * 6  # every claim answered (204: nothing queued), none lost to the throttle
    assert retries and all(why == "HTTP 429" and delay >= 1.0 for delay, why in retries)  # Retry-After honoured
