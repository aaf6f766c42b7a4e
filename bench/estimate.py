"""Quoted HU against the HU actually charged, for every model template in the zoo and several sizes.

Each case gets a quote, accepts it (the hold), and runs the job to its end on the local site with simulated
contributor devices: in-process clients that do real training through the worker API (claim, download,
train, upload with a receipt), as in the test suite. Some cases add trouble: a device that dies mid-unit (its
lease expires and the unit is re-issued) and a result that fails its checks (rejected). Re-issued and
rejected work is the platform's cost; the customer's charge must never pass the quote.

    .venv/bin/python bench/estimate.py [--quick]

Runs on a throw-away SQLite database under a temporary directory. Prints a table; the last line is one JSON
object: `max_overrun` (the largest (charged - quoted) / quoted over all cases, in HU and in money; must be
<= 0) and `median_used` (the median share of the quote charged; close to 1 means quotes are not padded).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "platform"), str(ROOT)]
_VAR = tempfile.mkdtemp(prefix="muninn-bench-estimate-")
os.environ.update(DJANGO_SETTINGS_MODULE="muninn.settings", MUNINN_VAR_DIR=_VAR, MEDIA_ROOT=f"{_VAR}/media",
                  DATABASE_URL=f"sqlite:///{_VAR}/bench.sqlite3", CELERY_BROKER_URL="memory://",
                  LOG_LEVEL="ERROR", DEBUG="1")

import logging  # noqa: E402

import django  # noqa: E402

django.setup()
logging.disable(logging.WARNING)  # the rejected result in one case is logged by design; keep the table clean

import numpy as np  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.utils import timezone  # noqa: E402
from muninn_worker import zoo  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from accounts import services as accounts  # noqa: E402
from accounts.models import User  # noqa: E402
from billing import money, services  # noqa: E402
from billing import selectors as ledger  # noqa: E402
from jobs import services as jobs  # noqa: E402
from jobs.models import Job, WorkUnit  # noqa: E402
from muninn.celery import app as celery_app  # noqa: E402
from tests.conftest import SimulatedDevice  # noqa: E402  (the suite's in-process device: real training, real API)

# (rows of digits, hidden layers, epochs, rounds, devices, trouble[, training algorithm settings])
CASES = [
    (200, [32], 1, 2, 1, ""),
    (200, [128], 2, 3, 2, ""),
    (800, [64], 1, 3, 3, ""),
    (800, [256, 128], 2, 2, 2, "dropout"),
    (1797, [128], 2, 3, 3, ""),
    (1797, [128], 1, 4, 4, "rejected"),
    (1797, [512, 256], 1, 2, 2, "dropout"),
    # DiLoCo pays inner_steps x batch per unit; the quote counts the most units a round can have (n_train // batch),
    # so with a few devices most of it is released: the ceiling holds, the "used" share shows the padding.
    (800, [64], 1, 3, 3, "", {"algorithm": "diloco", "inner_steps": 10, "update_encoding": "int8"}),
    (1797, [128], 1, 2, 4, "dropout", {"algorithm": "diloco", "inner_steps": 20, "update_encoding": "fp16"}),
]
QUICK = CASES[:3] + CASES[-2:]


def digits_npz(rows: int) -> bytes:
    digits = load_digits()
    buf = io.BytesIO()
    np.savez(buf, X=digits.data[:rows].astype(np.float32), y=digits.target[:rows].astype(np.int64))
    return buf.getvalue()


def run_job(devices: list[SimulatedDevice], job_id: int, trouble: str) -> None:
    troubled = False
    for _ in range(500):
        job = Job.objects.get(pk=job_id)
        if job.is_ended:
            return
        worked = False
        for device in devices:
            unit = device.claim()
            if unit is None:
                continue
            weights, receipt = device.train(unit)
            if trouble and not troubled:
                troubled = True
                if trouble == "rejected":  # a result that fails its checks, then the lease runs out
                    device.submit(unit["id"], weights, {**receipt, "output_sha256": "0" * 64})
                # "dropout": the device dies before uploading; either way the lease expires and the unit is re-issued
                WorkUnit.objects.filter(pk=unit["id"]).update(lease_expires_at=timezone.now() - timedelta(seconds=1))
                jobs.units_requeue_expired()
                worked = True
                continue
            response = device.submit(unit["id"], weights, receipt)
            assert response.status_code == 201, response.content
            worked = True
        if not worked:
            raise RuntimeError(f"job {job_id} stalled at round {job.current_round}")
    raise RuntimeError(f"job {job_id} did not finish")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three small cases only")
    options = parser.parse_args()
    celery_app.conf.task_always_eager = True
    call_command("migrate", verbosity=0)
    staff = accounts.user_create(username="staff", password="bench-staff-1", role=User.Role.STAFF)
    customer = accounts.user_create(username="customer", password="bench-customer-1")
    contributor = accounts.user_create(username="contributor", password="bench-contrib-1", role=User.Role.CONTRIBUTOR)
    services.balance_grant(user=customer, amount=money.to_nanos("1000"), reason="benchmark credit", granted_by=staff)
    fleet = [SimulatedDevice(contributor, f"bench-device-{i}") for i in range(4)]
    from contributors.models import Device

    header = (f"{'template':10} {'algorithm':>16} {'rows':>5} {'hidden':>11} {'ep':>2} {'rnd':>3} {'dev':>3} "
              f"{'trouble':>8} "
              f"{'quoted HU':>18} {'charged HU':>18} {'quoted':>14} {'charged':>14} {'used':>6}")
    print(header)
    print("-" * len(header))
    used, overruns = [], []
    for template in zoo.TEMPLATES:
        for rows, hidden, epochs, rounds, n_devices, trouble, *training in (QUICK if options.quick else CASES):
            training = training[0] if training else {}
            devices = fleet[:n_devices]
            Device.objects.update(is_active=False)  # only this case's devices are online
            Device.objects.filter(pk__in=[d.device.pk for d in devices]).update(is_active=True,
                                                                                  last_seen_at=timezone.now())
            dataset = jobs.dataset_create(owner=customer, filename="digits.npz", data=digits_npz(rows))
            try:
                quote = services.quote_issue(customer=customer, dataset=dataset, template=template,
                                             hparams={"hidden": hidden, "epochs": epochs}, rounds=rounds,
                                             training=training)
            except Exception as e:  # a template this data set does not fit (e.g. images only)
                print(f"{template:10} {rows:>5} skipped: {e}")
                continue
            job = services.quote_accept(customer=customer, quote_id=quote.pk)
            run_job(devices, job.pk, trouble)
            m = ledger.job_money(job=job)
            hu_quoted, hu_charged = money.flops_to_hu(quote.flops), money.flops_to_hu(m["flops_charged"])
            share = float(hu_charged / hu_quoted)
            used.append(share)
            overruns += [float((hu_charged - hu_quoted) / hu_quoted), (m["charged"] - quote.price) / quote.price]
            algorithm = (f"diloco H={training['inner_steps']} {training.get('update_encoding', 'fp32')}"
                         if training else "fedavg")
            print(f"{template:10} {algorithm:>16} {rows:>5} {str(hidden):>11} {epochs:>2} {rounds:>3} {n_devices:>3} "
                  f"{trouble or '-':>8} {hu_quoted:>18.15f} {hu_charged:>18.15f} "
                  f"{money.format_money(quote.price):>14} {money.format_money(m['charged']):>14} {share:>6.3f}",
                  flush=True)
    summary = {"cases": len(used), "max_overrun": max(overruns), "median_used": statistics.median(used),
               "min_used": min(used), "price_per_hu": str(Decimal(services.settings.MUNINN_PRICE_PER_HU))}
    print(json.dumps(summary))
    return 0 if summary["max_overrun"] <= 0 else 1


if __name__ == "__main__":
    sys.exit(main())
