"""What the job page shows and polls: the job's status, each round's metrics and units, and a note on what the
job is waiting for. Reads only; one place, so the page's first render and its live updates agree."""
from __future__ import annotations

from .models import Job, Round, WorkUnit
from .selectors import job_rounds, round_unit_counts

# The metrics the chart draws, by round (train_loss comes from the devices, test_* from the held-out split).
CHART_METRICS = ("train_loss", "test_loss", "test_accuracy", "test_rmse", "test_perplexity")


def job_note(job: Job, rounds: list[dict]) -> str:
    """A sentence on what a running job waits for (empty when there is nothing to say)."""
    if job.status == Job.Status.CREATED:
        return "This job is created but not started."
    if job.status == Job.Status.FAILED:
        return f"The job failed: {job.error}" if job.error else "The job failed."
    if job.status != Job.Status.RUNNING:
        return ""
    current = next((r for r in rounds if r["status"] == Round.Status.OPEN), None)
    if current is None:
        return "Opening the next round…"
    units = current["units"]
    if units.get(WorkUnit.Status.LEASED) or units.get(WorkUnit.Status.VERIFYING):
        return f"Round {current['number']}: devices are training."
    if units.get(WorkUnit.Status.QUEUED):
        return f"Round {current['number']}: waiting for a device to claim the work."
    return f"Round {current['number']}: aggregating the results."


def job_progress(job: Job) -> dict:
    rounds = []
    counts = round_unit_counts(job=job)
    for rnd in job_rounds(job=job):
        rounds.append({"number": rnd.number, "status": rnd.status,
                       "metrics": {k: v for k, v in rnd.metrics.items() if isinstance(v, (int, float))},
                       "units": counts.get(rnd.pk, {}), "devices": rnd.metrics.get("units")})
    return {
        "id": job.pk, "status": job.status, "status_display": job.get_status_display(), "ended": job.is_ended,
        "rounds": job.rounds, "current_round": job.current_round,
        "rounds_done": sum(1 for r in rounds if r["status"] == Round.Status.CLOSED and r["metrics"]),
        "round_list": rounds, "metrics": {k: v for k, v in job.metrics.items() if isinstance(v, (int, float))},
        "note": job_note(job, rounds),
    }
