"""The API keeps its contract with whoever builds on its schema: schemathesis (`st run`, pinned in the dev extras)
generates requests for every operation of GET /api/schema and sends them to a live site (pytest-django's
live_server, the tests' eager Celery, Stripe played by tests/fake_stripe.py), with all its checks: no 500, only
declared statuses, content types and headers, answers that match their schemas, schema-valid requests accepted
and invalid ones refused, credentials needed where the schema says so, 405 for a method not declared.

It runs as a customer, a contributor and staff (account tokens), each run with a device's token for the worker
operations. The site first holds what realistic requests need: a dataset, a finished job (a model to download), a
created one (to start), a running one whose unit the device holds (weights and shard to download, a heartbeat), a
quote, and a contributor with earnings and a payout account. Their ids are in schemathesis's dictionaries: about
half the generated ids name real objects, the rest are drawn from the whole declared range.

A failure in the test's output comes with a curl command that reproduces it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from decimal import Decimal
from pathlib import Path
from xml.etree import ElementTree

import pytest

from accounts import services as accounts
from billing import money
from billing import services as billing
from billing.models import PayoutAccount
from jobs.models import Job

from .conftest import _named, cleared, digits_npz

# reset_sequences: the site's ids are the same whatever ran before, and so is the run (its seed is fixed)
pytestmark = [pytest.mark.contract, pytest.mark.django_db(transaction=True, reset_sequences=True)]

ST = Path(sys.executable).with_name("st")
# Per operation and phase: the test takes about 2.5 minutes on 2 cores. Another seed, or more examples, explores
# other requests (MUNINN_CONTRACT_SEED=7 MUNINN_CONTRACT_EXAMPLES=50 make test ...).
EXAMPLES = int(os.environ.get("MUNINN_CONTRACT_EXAMPLES", "12"))
SEED = int(os.environ.get("MUNINN_CONTRACT_SEED", "16"))

DEVICE_OPERATIONS = r"^/api/worker/(?!devices$)"  # all but registration, which takes the account token
CUSTOMER_OPERATIONS = r"^/api/(datasets|estimates|quotes|jobs|topups)"
CONTRIBUTOR_OPERATIONS = r"^/api/(payouts|worker/devices$)"
# Each account runs every operation through every phase, but the coverage phase (hundreds of boundary cases per
# operation) only for its own role's: another role's answer it 403 whatever the body. Staff have no operation
# of their own. The worker operations run once, with the customer.
NOT_MINE = {"customer": [CONTRIBUTOR_OPERATIONS], "contributor": [CUSTOMER_OPERATIONS], "staff": [r"^/api/"]}

# Where positive_data_acceptance (a schema-valid request must not be refused with a 4xx other than
# 401/403/404/409/429) cannot apply: the request is valid only with something a schema cannot say.
VALID_ONLY_WITH = {
    # bytes in a format the site reads (CSV with its target column, NPZ with X and y, ...): "binary" to a schema
    "/api/datasets": "a dataset file the site can read",
    # safetensors of an update of this unit's weights (or the checked segment's end), and a receipt that
    # describes them, signed with the device's private key
    "/api/worker/units/{unit_id}/result": "trained weights and a receipt signed with the device's key",
    "/api/worker/checks/{check_id}/result": "a checkpoint and a receipt signed with the device's key",
    "/api/stripe/webhook": "a body signed with the site's webhook secret, which only Stripe holds",
    "/api/auth/token": "an account's password",
    # hyper-parameters within the chosen template's bounds (GET /api/templates) and a dataset of a kind it
    # trains; a started job's price must fit the customer's balance
    "/api/estimates": "a template that can train the dataset",
    "/api/quotes": "a template that can train the dataset",
    "/api/jobs": "a template that can train the dataset, and the money to start it",
    "/api/jobs/{job_id}/start": "the money to start it",
    # exactly one input, of the kind the job's model takes (rows with its columns, an image, a prompt in its vocabulary)
    "/api/jobs/{job_id}/predict": "input the job's model reads",
    "/api/jobs/{job_id}/predictions": "a file of input the job's model reads",
    "/api/quotes/{quote_id}/accept": "the money to start the job, before the quote expires",
    # the site's limits (MUNINN_TOPUP_MIN/MAX, GET /api/topups; MUNINN_PAYOUT_MIN) and the earnings available
    "/api/topups": "an amount within the site's limits",
    "/api/payouts": "an amount within the site's limits and the contributor's available earnings",
}


@pytest.fixture
def site(live_server, customer, contributor, staff, customer_api, make_device, fake_stripe, settings) -> dict:
    """What realistic requests need, and the credentials: {"url", "tokens": {...}, "ids": {...}}."""
    settings.MUNINN_CLAIM_WAIT_MAX = 0.05  # a claim's long poll answers within the run's request timeout
    settings.MUNINN_PRICE_PER_HU = Decimal(10**11)  # the contributor earns more than the smallest payout
    # Sign-ups reach their own logic (their limit's 429 is tests/test_throttling.py's)
    settings.MUNINN_THROTTLES = {**settings.MUNINN_THROTTLES, "signup-address": "10000/hour"}
    billing.balance_grant(user=customer, amount=money.to_nanos("1000"), reason="contract test", granted_by=staff)
    dataset = customer_api.post("/api/datasets", {"file": _named(digits_npz(300), "digits.npz")}, format="multipart")
    assert dataset.status_code == 201, dataset.content
    dataset = dataset.json()["id"]
    device = make_device("contract")
    finished = _job(customer_api, dataset)
    while device.work_one():
        pass
    assert Job.objects.get(pk=finished).status == Job.Status.SUCCEEDED
    created = _job(customer_api, dataset, start=False)
    running = _job(customer_api, dataset)
    unit = device.claim()  # held by the device through the run
    assert unit is not None
    quote = customer_api.post("/api/quotes", {"dataset": dataset, "template": "mlp", "rounds": 1}, format="json")
    assert quote.status_code == 201, quote.content
    PayoutAccount.objects.create(contributor=contributor, stripe_account_id="acct_contract", payouts_enabled=True)
    assert cleared(contributor) > money.to_nanos(settings.MUNINN_PAYOUT_MIN)
    return {"url": live_server.url,
            "tokens": {"customer": accounts.token_for(user=customer), "contributor": accounts.token_for(user=contributor),
                       "staff": accounts.token_for(user=staff),
                       "device": device.token},
            "ids": {"dataset_id": [dataset], "job_id": [finished, created, running], "unit_id": [unit["id"]],
                    "quote_id": [quote.json()["id"]]}}


def _job(api, dataset: int, *, start: bool = True) -> int:
    response = api.post("/api/jobs", {"dataset": dataset, "template": "mlp", "rounds": 1, "start": start,
                                      "hparams": {"epochs": 1}}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def config(site: dict, account: str) -> str:
    """schemathesis.toml for one run: the account's token for the account operations, the device's for the worker
    operations, the real ids, and the checks' and phases' exceptions."""
    lines = [f'base-url = "{site["url"]}"', "workers = 1", f"seed = {SEED}", "",
             "[checks]", "enabled = true", "",  # every check (`--checks all` would override the exceptions below)
             # each run on its own: no failures replayed, no examples kept from an earlier run
             "[cache]", "enabled = false", "",
             "[generation]", f"max-examples = {EXAMPLES}", 'database = "none"', "",
             "[auth.openapi.tokenAuth]", f'api_key = "Token {site["tokens"][account]}"', "",
             "[auth.openapi.deviceAuth]", f'api_key = "Device {site["tokens"]["device"]}"', ""]
    for name, values in site["ids"].items():
        lines += [f"[dictionaries.{name}]", f"values = {json.dumps(values)}", ""]
    lines += ["[parameters]"]
    lines += [f'"path.{name}" = {{ dictionary = "{name}", probability = 0.5 }}' for name in site["ids"]]
    lines += ['"body.dataset" = { dictionary = "dataset_id", probability = 0.5 }', ""]
    for path, valid_only_with in VALID_ONLY_WITH.items():
        lines += [f"# valid only with {valid_only_with}", "[[operations]]", f'include-path = "{path}"',
                  "checks.positive_data_acceptance.enabled = false", ""]
    for pattern in NOT_MINE[account]:
        lines += ["[[operations]]", f"include-path-regex = '{pattern}'", "phases.coverage.enabled = false", ""]
    return "\n".join(lines)


def test_the_live_site_keeps_to_its_openapi_schema(site, tmp_path):
    failures, started = {}, time.monotonic()
    for account in ("customer", "contributor", "staff"):
        path = tmp_path / f"{account}.toml"
        path.write_text(config(site, account))
        junit = tmp_path / f"{account}.xml"
        only = [] if account == "customer" else ["--exclude-path-regex", DEVICE_OPERATIONS]
        run = subprocess.run([str(ST), "--config-file", str(path), "--no-color", "run", f"{site['url']}/api/schema",
                              *only, "--report", "junit", "--report-junit-path", str(junit)],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path)
        failed = _failures(junit)
        if run.returncode != 0 or failed:
            failures[account] = (failed, run.stdout[-20000:] + run.stderr[-4000:])
    print(f"schemathesis ran for {time.monotonic() - started:.0f} s")

    assert failures == {}, "\n\n".join(f"--- as {account}: {len(failed)} failing\n{output}"
                                       for account, (failed, output) in failures.items())


def _failures(junit: Path) -> list[str]:
    """The operations the run's JUnit report marks failed or errored."""
    if not junit.exists():
        return ["no report"]
    return [case.get("name") for case in ElementTree.parse(junit).iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None]
