"""Writes on datasets, jobs, rounds and work units. Views and tasks are thin doors into these; these never call
tasks (the task layer listens to jobs.signals instead).

One file per concept, and everything importable from here (`from jobs import services as jobs`):

- datasets.py: an upload checked, profiled and stored; a job's splits read back
- jobs.py: a job's life (planned, created, started, ended) and its maths (a unit's FLOPs, its model)
- rounds.py: rounds opened (shards sized by throughput), their deadlines kept, aggregated, closed or resumed
- stragglers.py: backups for the units still leased past a round's soft deadline
- leases.py: claims, heartbeats, expired leases
- units.py: a unit's result accepted, verified, refused or rejected; how a unit trains
- waiting.py: no job waits forever for a capable device
- predictions.py: files predicted by a job's model off the request thread
"""
from .datasets import dataset_create, load_xy, unit_shard_bytes, unit_shard_open, unit_shard_xy
from .jobs import (
    JobPlan, template_backends, job_plan, job_create, job_start, job_cancel, job_fail, diverging_message,
    job_scheme, unit_flops, job_model,
)
from .rounds import (jobs_stalled, round_aggregate, round_open, rounds_overdue, rounds_stalled,
                     units_statistics_refresh)
from .stragglers import units_reissue_stragglers
from .leases import (
    units_held, unit_lease, unit_heartbeat_holder, unit_heartbeat, units_requeue_expired, leases_expire,
)
from .units import (
    unit_train_spec, unit_steps, unit_work_samples, SUPERSEDED, unit_accept, unit_accept_with, unit_verified,
    units_verified,
    unit_backoff_seconds, unit_give_back, unit_release, unit_reject, units_flag, units_unflag,
)
from .waiting import jobs_check_waiting
from .predictions import prediction_batch_create, prediction_batch_run, prediction_batches_stalled

__all__ = [
    "dataset_create",
    "load_xy",
    "unit_shard_bytes",
    "unit_shard_open",
    "unit_shard_xy",
    "JobPlan",
    "template_backends",
    "job_plan",
    "job_create",
    "job_start",
    "job_cancel",
    "job_fail",
    "diverging_message",
    "job_scheme",
    "unit_flops",
    "job_model",
    "round_open",
    "units_statistics_refresh",
    "round_aggregate",
    "rounds_overdue",
    "rounds_stalled",
    "jobs_stalled",
    "units_reissue_stragglers",
    "unit_lease",
    "unit_heartbeat_holder",
    "unit_heartbeat",
    "units_requeue_expired",
    "units_held",
    "leases_expire",
    "unit_train_spec",
    "unit_steps",
    "unit_work_samples",
    "SUPERSEDED",
    "unit_accept",
    "unit_accept_with",
    "units_flag",
    "units_unflag",
    "unit_verified",
    "units_verified",
    "unit_backoff_seconds",
    "unit_give_back",
    "unit_release",
    "unit_reject",
    "jobs_check_waiting",
    "prediction_batch_create",
    "prediction_batch_run",
    "prediction_batches_stalled",
]
