"""Training certificates: for a job that succeeded, what the site states and signs about how its model was made.

The data and the settings it was trained with, and every round: the global weights' sha256 before and after, the
accepted updates that made them (device pseudonyms, receipt and output hashes, how each was verified) and the
updates flagged after the fact; the share of the training steps re-trained by someone other than the device; HU
and money; and the model file's sha256. Round r's weights before are round r-1's after, the first round's are the
initial weights and the last round's after are the model's weights, so the certificate chains the model to every
receipt and check behind it. `muninn-worker verify-certificate` checks all of that offline
(muninn_worker/certificate.py, which also fixes the canonical form the site's key signs).

Receipts and money live in contributors/ and billing/, above jobs/: the project's urls.py passes their selectors in
as `evidence` and `money`. Built when asked, so it says what is known now (a later flag shows up); the same state
gives the same certificate but for its `issued_at`.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from django.conf import settings
from django.utils import timezone
from muninn_worker import certificate as certificate_format
from muninn_worker import tensors

from muninn import site_key
from muninn.errors import Conflict

from . import selectors
from .models import Job, Round, WorkUnit

Evidence = Callable[[Job], dict[int, dict]]  # unit id → device, receipt_sha256, output_sha256, steps, verification
Money = Callable[[Job], dict]

# What the less obvious fields mean, inside the signed certificate so it explains itself.
DEFINITIONS = {
    "device": "HMAC-SHA256 of the site's device id under the site's secret (32 hex digits): the same device reads "
              "the same on every certificate of this site, and names neither the device nor its owner",
    "receipt_sha256": "sha256 of the device's signed work receipt, as canonical JSON",
    "output_sha256": "sha256 of the update exactly as the device uploaded it (a delta in the job's update encoding)",
    "result_sha256": "sha256 of the unit's full weights after training, decoded from the upload, as safetensors",
    "weights_sha256": "sha256 of global weights as safetensors without metadata "
                      "(muninn_worker.tensors.state_dict_to_bytes)",
    "model.file_sha256": "sha256 of the exact bytes GET /api/jobs/<id>/model serves: the final weights with metadata",
    "verification.method": "site_reexecution: the site's validator re-trained segments of the unit and agreed; "
                           "peer_check: other devices of its backend did; cheap_checks: signature, hashes, shapes, "
                           "finite values, update norm, loss on its shard and timing only",
    "in_model": "whether the update is in its round's combined weights (a flagged update is left out of a round "
                "not yet combined; a check passed after its round closed is credited but not combined)",
    "retrained_share": "re-trained steps / trained steps, over the updates in the model",
}


def job_certificate(job: Job, *, evidence: Evidence, money: Money, now: datetime | None = None) -> dict:
    """The signed certificate document of a job that succeeded: {"certificate", "signature", "key",
    "algorithm"}. Another status is a Conflict (409), as for the model download."""
    if job.status != Job.Status.SUCCEEDED:
        raise Conflict(f"The certificate is issued when the job has succeeded; it is {job.status}.", code="not_ready")
    model = selectors.job_model_file(job)
    rounds = list(selectors.job_rounds(job=job).filter(status=Round.Status.CLOSED))
    proofs = evidence(job)
    flagged: dict[int, list[dict]] = {}
    for f in selectors.job_flagged_updates(job):
        flagged.setdefault(f["round"], []).append({"unit": f["unit"], "reason": f["reason"], "in_model": f["in_model"]})
    units: dict[int, list[WorkUnit]] = {}
    for unit in WorkUnit.objects.filter(round__job=job, status=WorkUnit.Status.ACCEPTED).order_by("index"):
        units.setdefault(unit.round_id, []).append(unit)
    round_entries = [_round(rnd, units.get(rnd.pk, []), proofs, flagged.get(rnd.number, [])) for rnd in rounds]
    made = [u for r in round_entries for u in r["units"] if u["in_model"]]
    trained = sum(u["steps"] for u in made)
    retrained = sum(u["verification"]["retrained_steps"] for u in made)
    methods = [u["verification"]["method"] for u in made]
    body = {
        "format": certificate_format.FORMAT,
        "site": settings.MUNINN_SITE_URL,
        "issued_at": (now or timezone.now()).replace(microsecond=0).isoformat(),
        "job": _job(job),
        "dataset": {"sha256": job.dataset.sha256, "format": job.dataset.format, "size_bytes": job.dataset.size_bytes,
                    "profile": job.dataset.profile},
        "base_weights": {"sha256": job.base_weights.sha256} if job.base_weights_id else None,
        "initial_weights_sha256": rounds[0].weights_sha256 if rounds else job.global_weights_sha256,
        "rounds": round_entries,
        "verification": {"trained_steps": trained, "retrained_steps": retrained,
                         "retrained_share": round(retrained / trained, 6) if trained else 0.0,
                         "updates": len(made), **{m: methods.count(m) for m in
                                                  ("site_reexecution", "peer_check", "cheap_checks")}},
        "money": money(job),
        "model": {"final_weights_sha256": job.global_weights_sha256,
                  "file_sha256": tensors.sha256_hex(model.data), "file_name": model.filename,
                  "file_bytes": len(model.data), "flagged_rounds": selectors.job_flagged_rounds(job)},
        "definitions": DEFINITIONS,
    }
    return certificate_format.sign(body, site_key.private_key())


def _job(job: Job) -> dict:
    return {"id": job.pk, "template": job.template, "model_config": job.model_config, "hparams": job.hparams,
            "algorithm": job.algorithm, "outer_lr": job.outer_lr, "outer_momentum": job.outer_momentum,
            "inner_steps": job.inner_steps, "aggregation": job.aggregation, "update_encoding": job.update_encoding,
            "rounds": job.rounds, "seed": job.seed, "train_sha256": job.train_sha256, "test_sha256": job.test_sha256,
            "n_train": job.n_train, "n_test": job.n_test, "metrics": job.metrics,
            "started_at": job.started_at.isoformat() if job.started_at else None,
            "finished_at": job.finished_at.isoformat() if job.finished_at else None}


def _round(rnd: Round, units: list[WorkUnit], proofs: dict[int, dict], flagged: list[dict]) -> dict:
    return {"number": rnd.number, "weights_before_sha256": rnd.weights_sha256,
            "weights_after_sha256": rnd.result_sha256,
            "metrics": {k: v for k, v in rnd.metrics.items() if k.startswith("test_") or k == "train_loss"},
            "units": [_unit(u, rnd, proofs.get(u.pk, {})) for u in units], "flagged": flagged}


def _unit(unit: WorkUnit, rnd: Round, proof: dict) -> dict:
    return {"unit": unit.pk, "index": unit.index, "samples": unit.result_samples, "shard_sha256": unit.shard_sha256,
            "result_sha256": unit.result_sha256, "in_model": selectors.unit_in_model(unit, rnd),
            "flagged": unit.flagged, "device": proof.get("device"), "receipt_sha256": proof.get("receipt_sha256"),
            "output_sha256": proof.get("output_sha256"), "steps": proof.get("steps", 0),
            "verification": proof.get("verification") or {"method": "cheap_checks", "segments": [],
                                                           "retrained_steps": 0}}
