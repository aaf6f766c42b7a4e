"""What the site gives a browser device (contributors/browser.py): CPU-class units of the templates the browser
trains (mlp), within the memory a tab can count on; never a peer check; judged at the browser's tolerance."""
from __future__ import annotations

import pytest
from django.test import Client
from muninn_worker import signing

from accounts import services as accounts
from contributors import browser, selectors
from contributors import services as contributors
from jobs import selectors as job_selectors
from jobs import services as jobs
from jobs.models import Job, WorkUnit

from .conftest import CAPABILITIES, digits_npz

pytestmark = pytest.mark.django_db
BROWSER = {"cpu_cores": 4, "ram_bytes": 8 * 2**30, "backends": ["browser"], "torch_version": "none (browser)",
           "samples_per_s": 20000.0, "flops_per_s": 1e9}


def _device(owner, capabilities, name):
    key = signing.new_private_key()
    return contributors.device_register(owner=owner, name=name, capabilities=capabilities,
                                        public_key=signing.public_key_of(key))[0]


def _queued_unit(customer, *, template: str = "mlp", memory: int | None = None) -> WorkUnit:
    dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz(300))
    job = jobs.job_create(owner=customer, dataset=dataset, template="mlp", hparams={"hidden": [16]}, rounds=1, seed=5)
    Job.objects.filter(pk=job.pk).update(status=Job.Status.RUNNING)
    unit = jobs.round_open(job_id=job.pk, devices=[]).units.get()
    # Routing reads the job's template and the unit's memory only: stand-ins for a cnn job or a large model.
    Job.objects.filter(pk=job.pk).update(template=template)
    if memory is not None:
        WorkUnit.objects.filter(pk=unit.pk).update(min_memory_bytes=memory)
    return unit


def test_a_browser_is_leased_mlp_units_and_never_a_template_it_cannot_train(customer, contributor):
    cnn = _queued_unit(customer, template="cnn")
    mlp = _queued_unit(customer)
    device = _device(contributor, BROWSER, "tab")

    claim = contributors.unit_claim(device=device)

    assert claim.unit.pk == mlp.pk
    assert contributors.unit_claim(device=device) is None  # the older cnn unit stays queued for others
    assert WorkUnit.objects.get(pk=cnn.pk).status == WorkUnit.Status.QUEUED
    python = _device(contributor, CAPABILITIES, "laptop")
    assert contributors.unit_claim(device=python).unit.pk == cnn.pk


def test_a_browser_is_not_leased_a_unit_larger_than_a_tab_can_hold(customer, contributor):
    _queued_unit(customer, memory=browser.MAX_MEMORY_BYTES + 1)
    device = _device(contributor, BROWSER, "tab")

    assert contributors.unit_claim(device=device) is None
    assert selectors.device_resources(device) == {"cpu": browser.MAX_MEMORY_BYTES}


def test_round_planning_counts_a_browser_only_for_the_templates_it_trains(contributor):
    device = _device(contributor, BROWSER, "tab")

    assert device.pk in [d for d, _ in selectors.device_capacities_online(template="mlp")]
    assert device.pk not in [d for d, _ in selectors.device_capacities_online(template="cnn")]


def test_a_browser_registers_with_browser_alone_and_says_so_in_its_status(contributor):
    api = Client(HTTP_AUTHORIZATION=f"Token {accounts.token_for(user=contributor)}")
    key = signing.public_key_of(signing.new_private_key())

    mixed = api.post("/api/worker/devices", {"name": "tab", "public_key": key,
                                             "capabilities": {**BROWSER, "backends": ["browser", "cpu"]}},
                     content_type="application/json")
    alone = api.post("/api/worker/devices", {"name": "tab", "public_key": key, "capabilities": BROWSER},
                     content_type="application/json")

    assert mixed.status_code == 400 and "browser" in mixed.content.decode()
    assert alone.status_code == 201, alone.content
    me = Client(HTTP_AUTHORIZATION=f"Device {alone.json()['device_token']}").get("/api/worker/me")
    assert me.json()["device"]["backends"] == ["browser"]


def test_the_contribute_with_this_browser_page_runs_its_scripts_from_the_site(contributor):
    page = Client()
    page.force_login(contributor)

    answer = page.get("/contribute/browser/")

    html = answer.content.decode()
    assert answer.status_code == 200 and "Contribute with this browser" in html
    assert '<script type="module" src="/static/muninn/browser/page.js">' in html
    assert 'data-worker="/static/muninn/browser/worker.js"' in html
    assert "<script>" not in html  # nothing inline: the Content-Security-Policy allows none


def test_a_job_a_browser_cannot_train_does_not_count_it_as_capable(customer, contributor):
    device = _device(contributor, BROWSER, "tab")
    cnn = Job.objects.get(pk=_queued_unit(customer, template="cnn").round.job_id)
    mlp = Job.objects.get(pk=_queued_unit(customer).round.job_id)

    for_cnn = selectors.capacity_for(min_memory_bytes=0, backends=["cpu"], template=cnn.template)
    for_mlp = selectors.capacity_for(min_memory_bytes=0, backends=["cpu"], template=mlp.template)

    assert for_cnn["capable"] == 0 and for_mlp["capable"] == 1  # the waiting message and the job page say so
    waiting = job_selectors.job_waiting(cnn, selectors.capacity_for)
    assert waiting is not None and waiting.without_device, waiting
    assert device.pk in [d for d, _ in selectors.device_capacities_online(template="mlp")]
    # and a quote's "seen lately" count, which warns a customer whose job would wait
    assert selectors.capable_devices_seen(min_memory_bytes=0, backends=["cpu"], template="cnn") == 0
    assert selectors.capable_devices_seen(min_memory_bytes=0, backends=["cpu"], template="mlp") == 1
