"""docs/worker-protocol.md stays true: a client written from the document alone (tests/conformance/client.py, which
refuses to import the reference client or the site) works units of three real `mlp` jobs on a live stack
(gunicorn and a Celery worker on PostgreSQL and Redis), as a separate process over HTTP: FedAvg in fp32 with
momentum, FedAvg in int8 without momentum, DiLoCo in fp16. Every result is challenged; the client answers, and
each unit must end accepted after its segment check with its earnings posted."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from django.utils import timezone

from accounts import services as accounts
from billing import selectors as ledger
from billing.models import Transaction
from contributors.models import Device, Receipt
from jobs.models import Job
from scripts.stack import free_port

from .. import invariants
from ..conftest import digits_npz
from ..test_e2e import customer_session, market, stack, wait_until_ended, wait_until_polling  # noqa: F401

HERE = Path(__file__).resolve().parent
CLIENT = HERE / "client.py"
CLIENT_FILES = ("client.py", "mlp.py", "wire.py")
FORBIDDEN = ("muninn_worker", "muninn", "contributors", "jobs", "accounts", "billing", "worker_client", "tests")
# One job of each encoding, optimizer state and algorithm (mlp segments are 8 steps): fp32 trains ~20 steps (three
# segments, the last one short); int8 fewer than 8, so its one segment is challenged and the device sends its last
# checkpoint, whose weights the site must encode to exactly the upload; DiLoCo's 12 inner steps make two segments.
JOBS = {
    "fp32": {"hparams": {"hidden": [32], "epochs": 2, "batch_size": 32, "momentum": 0.9}},
    "int8": {"hparams": {"hidden": [32, 16], "epochs": 1, "batch_size": 64, "momentum": 0.0}},
    "fp16": {"hparams": {"hidden": [32], "batch_size": 32}, "algorithm": "diloco", "inner_steps": 12},
}


def test_the_client_imports_nothing_of_the_repository():
    """Static half of the guard (client.py also refuses such imports at run time)."""
    for name in CLIENT_FILES:
        tree = ast.parse((HERE / name).read_text())
        imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                     and node.level == 0}
        assert not {m for m in imported if m.split(".")[0] in FORBIDDEN}, (name, imported)


def test_the_documented_canonical_bytes_are_what_safetensors_writes():
    """The document's layout of canonical bytes (written out by hand in wire.py) against the serializer the site
    hashes with, on every dtype the layout names, a scalar and no tensors at all."""
    from safetensors.torch import save

    from . import wire

    g = torch.Generator().manual_seed(0)
    tensors = {"layers.0.weight": torch.randn(3, 4, generator=g), "step:b": torch.tensor(3.0),
               "half": torch.randn(2, generator=g).half(), "count": torch.tensor(3, dtype=torch.int64),
               "q": torch.tensor([-5, 7], dtype=torch.int8), "bf": torch.randn(5, generator=g).bfloat16(),
               "f64": torch.randn(2, generator=g).double(), "i32": torch.tensor([1, 2], dtype=torch.int32),
               "u8": torch.tensor([1], dtype=torch.uint8), "flag": torch.tensor([True]),
               "i16": torch.tensor([4], dtype=torch.int16), "a.weight": torch.zeros(1)}

    assert wire.canonical_bytes(tensors) == save(tensors)
    assert wire.canonical_bytes(tensors, {"encoding": "int8"}) == save(tensors, metadata={"encoding": "int8"})
    assert wire.canonical_bytes({}) == save({}) and len(save({})) == 16


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_client_written_from_the_protocol_document_is_credited_for_every_unit(stack, market, tmp_path):  # noqa: F811
    customer, contributor = market
    url = stack.web(free_port())
    stack.celery_worker()
    client = stack.spawn("conformance", [sys.executable, "-I", str(CLIENT), "--server", url, "--name", "conformance",
                                         "--units", str(len(JOBS)), "--dir", str(tmp_path / "checkpoints"),
                                         "--timeout", "75"],
                         env={**stack.env, "MUNINN_ACCOUNT_TOKEN": accounts.token_for(user=contributor)})
    wait_until_polling(["conformance"], timezone.now() - timezone.timedelta(seconds=1), timeout=60)
    api = customer_session(customer)
    dataset = api.post(f"{url}/api/datasets", files={"file": ("digits.npz", digits_npz(400))}).json()["id"]

    started = {}
    for encoding, fields in JOBS.items():
        response = api.post(f"{url}/api/jobs", json={"dataset": dataset, "template": "mlp", "rounds": 1, "seed": 3,
                                                     "update_encoding": encoding, "start": True, **fields})
        assert response.status_code == 201, response.text
        started[encoding] = response.json()
    try:
        rc = client.wait(timeout=90)
    except subprocess.TimeoutExpired:
        rc = None
    out = stack.log("conformance")
    logs = f"{out}\n--- web\n{stack.log('web')[-3000:]}\n--- celery\n{stack.log('celery-worker')[-3000:]}"

    assert rc == 0, logs
    units = [json.loads(line[len("UNIT "):]) for line in out.splitlines() if line.startswith("UNIT ")]
    assert sorted(u["encoding"] for u in units) == sorted(JOBS), out
    assert all(u["status"] == "accepted" and u["earned_nanos"] > 0 for u in units), out
    by_encoding = {u["encoding"]: u for u in units}
    assert by_encoding["fp32"]["steps"] % 8 and by_encoding["int8"]["segments"] == [0], units
    device = Device.objects.get(name="conformance")
    for unit in units:
        receipt = Receipt.objects.get(unit_id=unit["unit"], device=device)
        check = receipt.verification["segment_check"]
        assert receipt.status == Receipt.Status.ACCEPTED and check["passed"], receipt.verification
        assert [s["segment"] for s in check["segments"]] == unit["segments"], check
        assert Transaction.objects.filter(kind=Transaction.Kind.CHARGE, unit_id=unit["unit"]).count() == 1
        assert ledger.unit_earned(unit=receipt.unit) == unit["earned_nanos"]
    assert ledger.balances_for(user=contributor)["contributor_pending"] == sum(u["earned_nanos"] for u in units)
    assert device.failures == 0 and device.quarantined_at is None
    for job in started.values():
        ended = wait_until_ended(api, url, job, timeout=30)
        assert ended["status"] == "succeeded", (ended, logs)
        invariants.assert_ledger_invariants(Job.objects.get(pk=job["id"]))
