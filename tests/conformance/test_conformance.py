"""docs/worker-protocol.md stays true: a client written from the document alone (tests/conformance/client.py, which
refuses to import the reference client or the site) works units of four real `mlp` jobs on a live stack
(the web server and a Celery worker on PostgreSQL and Redis), as a separate process over HTTP: FedAvg in fp32 with
momentum, FedAvg in int8 without momentum, DiLoCo in fp16, and a regression. Every result is challenged; the client
answers, and each unit must end accepted after its segment check with its earnings posted."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from django.utils import timezone
from sklearn.datasets import load_diabetes

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
# One job of each encoding, optimizer state, algorithm and task (mlp segments are 8 steps): fp32 trains ~20 steps
# (three segments, the last one short); int8 fewer than 8, so its one segment is challenged and the device sends its
# last checkpoint, whose weights the site must encode to exactly the upload; DiLoCo's 12 inner steps make two
# segments; the regression (a table with a numeric target) trains ~6.
JOBS = {
    "fp32": ("digits", {"update_encoding": "fp32",
                        "hparams": {"hidden": [32], "epochs": 2, "batch_size": 32, "momentum": 0.9}}),
    "int8": ("digits", {"update_encoding": "int8",
                        "hparams": {"hidden": [32, 16], "epochs": 1, "batch_size": 64, "momentum": 0.0}}),
    "diloco-fp16": ("digits", {"update_encoding": "fp16", "algorithm": "diloco", "inner_steps": 12,
                               "hparams": {"hidden": [32], "batch_size": 32}}),
    "regression": ("diabetes", {"update_encoding": "fp32",
                                "hparams": {"hidden": [16], "epochs": 1, "batch_size": 64, "lr": 0.005}}),
}


def diabetes_csv() -> bytes:
    diabetes = load_diabetes()
    rows = [",".join([*map(repr, x), str(int(t))]) for x, t in zip(diabetes.data.tolist(), diabetes.target)]
    return ("\n".join([",".join([*diabetes.feature_names, "progression"]), *rows]) + "\n").encode()


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
    datasets = {name: api.post(f"{url}/api/datasets", files={"file": upload}).json()["id"]
                for name, upload in (("digits", ("digits.npz", digits_npz(400))),
                                     ("diabetes", ("diabetes.csv", diabetes_csv())))}

    started = {}
    for name, (dataset, fields) in JOBS.items():
        response = api.post(f"{url}/api/jobs", json={"dataset": datasets[dataset], "template": "mlp", "rounds": 1,
                                                     "seed": 3, "start": True, **fields})
        assert response.status_code == 201, response.text
        started[response.json()["id"]] = name
    try:
        rc = client.wait(timeout=90)
    except subprocess.TimeoutExpired:
        rc = None
    out = stack.log("conformance")
    logs = f"{out}\n--- web\n{stack.log('web')[-3000:]}\n--- celery\n{stack.log('celery-worker')[-3000:]}"

    assert rc == 0, logs
    units = [json.loads(line[len("UNIT "):]) for line in out.splitlines() if line.startswith("UNIT ")]
    by_job = {started[u["job"]]: u for u in units}
    assert sorted(by_job) == sorted(JOBS), out
    assert all(u["status"] == "accepted" and u["earned_nanos"] > 0 for u in units), out
    assert by_job["fp32"]["steps"] % 8 and by_job["int8"]["segments"] == [0], units
    assert by_job["regression"]["task"] == "regression" and by_job["diloco-fp16"]["algorithm"] == "diloco", units
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
    for job_id in started:
        ended = wait_until_ended(api, url, {"id": job_id, "status": "running"}, timeout=30)
        assert ended["status"] == "succeeded", (ended, logs)
        invariants.assert_ledger_invariants(Job.objects.get(pk=job_id))
