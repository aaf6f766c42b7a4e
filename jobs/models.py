"""Datasets, jobs, rounds and work units. Money and devices live in billing/ and contributors/."""
from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.db import models
from django.utils import timezone

from .hu import flops_to_hu


class Dataset(models.Model):
    class Format(models.TextChoices):
        CSV = "csv", "CSV"
        NPZ = "npz", "NumPy NPZ"
        IMAGES = "images", "Zip of class-folder images"
        TEXT = "text", "Plain text"
        WEIGHTS = "weights", "Model weights (safetensors)"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="datasets")
    name = models.CharField(max_length=200)
    sha256 = models.CharField(max_length=64, db_index=True)  # content address of the uploaded bytes
    size_bytes = models.BigIntegerField()
    format = models.CharField(max_length=8, choices=Format.choices)
    target = models.CharField(max_length=200, blank=True)
    profile = models.JSONField(default=dict)
    # Sensitive (chosen at upload, fixed after): its shards go only to devices staff trust (contributors.exposure),
    # every shard download is logged, and its data is sealed at rest (jobs/sealing.py) under a key of its own,
    # kept here wrapped under the site's data key (never in plain).
    sensitive = models.BooleanField(default=False)
    wrapped_key = models.BinaryField(null=True, blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.format}, {self.profile.get('rows', '?')} rows)"


class Job(models.Model):
    class Status(models.TextChoices):
        CREATED = "created", "Created"
        RUNNING = "running", "Running"
        SUCCEEDED = "succeeded", "Succeeded"
        FAILED = "failed", "Failed"
        CANCELLED = "cancelled", "Cancelled"

    ENDED = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    class Algorithm(models.TextChoices):
        FEDAVG = "fedavg", "FedAvg"
        DILOCO = "diloco", "DiLoCo (outer Nesterov step on the averaged change)"

    class Encoding(models.TextChoices):
        """How a device uploads its update: the delta against the round's global weights, in this format."""

        FP32 = "fp32", "float32 delta"
        FP16 = "fp16", "float16 delta"
        INT8 = "int8", "int8 delta, one scale per tensor"

    class Aggregation(models.TextChoices):
        """How the round's updates are combined (robust rules resist a share of malicious devices)."""

        FEDAVG = "fedavg", "Weighted mean (FedAvg)"
        TRIMMED_MEAN = "trimmed_mean", "Coordinate-wise trimmed mean"
        MEDIAN = "median", "Coordinate-wise median"
        NORM_CLIP = "norm_clip", "Norm clipping, then FedAvg"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    dataset = models.ForeignKey(Dataset, on_delete=models.PROTECT, related_name="jobs")
    # LoRA: the customer's uploaded base weights (a "weights" dataset); they stay frozen and never travel
    # inside the global weights, which are the adapters only.
    base_weights = models.ForeignKey(Dataset, on_delete=models.PROTECT, null=True, blank=True,
                                     related_name="fine_tunes")
    template = models.CharField(max_length=64)
    hparams = models.JSONField(default=dict)
    model_config = models.JSONField(default=dict)
    algorithm = models.CharField(max_length=16, choices=Algorithm.choices, default=Algorithm.FEDAVG)
    aggregation = models.CharField(max_length=16, choices=Aggregation.choices, default=Aggregation.FEDAVG)
    # Where its units train ("cpu", or "cuda" for GPU-tier templates), comma-separated: a device is leased a
    # unit only when it offers one of these backends with `peak_memory_bytes` of memory on it.
    backends = models.CharField(max_length=32, default="cpu")
    # DiLoCo only (null for FedAvg): the outer Nesterov step's learning rate and momentum, and the local
    # optimizer steps each unit trains (instead of `epochs`).
    outer_lr = models.FloatField(null=True, blank=True)
    outer_momentum = models.FloatField(null=True, blank=True)
    inner_steps = models.PositiveIntegerField(null=True, blank=True)
    update_encoding = models.CharField(max_length=8, choices=Encoding.choices, default=Encoding.FP32)
    # DiLoCo's outer momentum buffers after the last closed round (a content-addressed blob; blank before it).
    outer_momentum_sha256 = models.CharField(max_length=64, blank=True)
    rounds = models.PositiveIntegerField()
    seed = models.BigIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.CREATED, db_index=True)

    # The estimate: FLOPs are counted once here and reused for every unit, so quote and credit agree.
    flops_per_sample = models.BigIntegerField()
    forward_flops_per_sample = models.BigIntegerField(default=0)  # the receipt's evaluation passes, per sample
    flops_estimated = models.BigIntegerField()
    peak_memory_bytes = models.BigIntegerField()

    # Data prepared once per job (fixed-seed held-out split), content-addressed blobs.
    train_sha256 = models.CharField(max_length=64)
    test_sha256 = models.CharField(max_length=64)
    n_train = models.PositiveIntegerField()
    n_test = models.PositiveIntegerField()

    current_round = models.PositiveIntegerField(default=0)
    global_weights_sha256 = models.CharField(max_length=64)
    metrics = models.JSONField(default=dict, blank=True)  # final metrics
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Since when a running job has had no capable device online and in good standing (null: it has one, or
    # nobody has looked yet). Kept by beat (jobs.services.jobs_check_waiting); past MUNINN_JOB_WAIT_LIMIT the
    # job fails and its hold is released.
    waiting_since = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"job {self.pk} ({self.template}, {self.status})"

    @property
    def hu_estimated(self) -> Decimal:
        return flops_to_hu(self.flops_estimated)

    @property
    def is_ended(self) -> bool:
        return self.status in self.ENDED

    @property
    def backend_list(self) -> list[str]:
        return [b for b in self.backends.split(",") if b]


class Round(models.Model):
    class Status(models.TextChoices):
        OPEN = "open", "Open"
        CLOSED = "closed", "Closed"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="round_set")
    number = models.PositiveIntegerField()
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.OPEN, db_index=True)
    weights_sha256 = models.CharField(max_length=64)  # the global weights every unit starts from
    result_sha256 = models.CharField(max_length=64, blank=True)  # the aggregated weights
    # The round's shards as one blob, one after another, each unit's at its shard_offset (jobs/shards.py: one file
    # to write, not one per unit). Empty: each shard is a blob of its own (a sensitive dataset's, sealed one by one).
    shards_sha256 = models.CharField(max_length=64, blank=True)
    # Adaptive, from the plan and the arrivals so far (jobs/deadlines.py): past `deadline_at` the stragglers'
    # units are re-issued to free devices; past `close_at` the round closes with the verified updates it has.
    deadline_at = models.DateTimeField()
    close_at = models.DateTimeField(null=True, blank=True)
    # What the deadlines need of the plan and the arrivals, kept up to date by each arrival in constant time
    # (jobs/deadlines.py: Plan, Arrivals): the plan's slowest unit in seconds and whether every unit has a plan;
    # how many results arrived, the latest (seconds after opening) and their paces, a histogram {bucket: count}.
    plan_seconds = models.FloatField(default=0.0)
    plan_complete = models.BooleanField(default=False)
    arrivals = models.PositiveIntegerField(default=0)
    latest_arrival_seconds = models.FloatField(default=0.0)
    arrival_paces = models.JSONField(default=dict, blank=True)
    metrics = models.JSONField(default=dict, blank=True)
    # The accepted units whose updates `result_sha256` combines, set when the round closes: not a flagged one left
    # out, nor one whose check passed only after the round had closed without it (it is credited all the same).
    combined = models.JSONField(default=list, blank=True)
    opened_at = models.DateTimeField(default=timezone.now)  # deadlines count from here
    closed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="round_unique_number")]

    def __str__(self) -> str:
        return f"job {self.job_id} round {self.number}"


class WorkUnit(models.Model):
    """One shard of one round, leased to one device at a time."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        LEASED = "leased", "Leased"
        VERIFYING = "verifying", "Verifying"  # passed the cheap checks; being re-executed before it counts
        ACCEPTED = "accepted", "Accepted"
        CANCELLED = "cancelled", "Cancelled"  # the round closed without it

    round = models.ForeignKey(Round, on_delete=models.CASCADE, related_name="units")
    index = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    shard_start = models.PositiveIntegerField()
    shard_stop = models.PositiveIntegerField()
    shard_sha256 = models.CharField(max_length=64)  # the shard's bytes as the device downloads them
    # Where they are in the round's shards_sha256 (null: the shard is its own blob, named shard_sha256).
    shard_offset = models.PositiveBigIntegerField(null=True, blank=True)
    shard_size = models.PositiveBigIntegerField(null=True, blank=True)
    seed = models.BigIntegerField()
    # flops_per_sample × (samples × epochs, or DiLoCo's inner_steps × batch) + 2 × samples × forward FLOPs
    flops = models.BigIntegerField()
    min_memory_bytes = models.BigIntegerField(default=0)
    expected_seconds = models.FloatField(default=0.0)  # flops / the planned device's FLOP/s; 0: no estimate
    # A straggler's shard issued again: the first valid result of the two is accepted, the other cancelled.
    backup_of = models.ForeignKey("self", null=True, blank=True, on_delete=models.CASCADE, related_name="backups")
    # The device the shard was sized for (a contributors.Device id, kept as a plain number so that jobs/
    # stays below contributors/). Until `reserved_until` only that device may lease it; then anyone can.
    preferred_device_id = models.BigIntegerField(null=True, blank=True)
    reserved_until = models.DateTimeField(null=True, blank=True)

    # The current lease. A new token per lease, so a result from an expired lease is told apart.
    lease_token = models.UUIDField(null=True, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    leased_device_id = models.BigIntegerField(null=True, blank=True)  # the current (or last) lease holder
    attempts = models.PositiveIntegerField(default=0)
    # Results refused so far; a refused unit waits (exponential backoff) before it is leased again, so two
    # devices never bounce it between them in a loop.
    rejections = models.PositiveIntegerField(default=0)
    not_before = models.DateTimeField(null=True, blank=True)
    # The device whose result was refused last: it waits MUNINN_UNIT_BACKOFF_MAX_SECONDS more than the others, so
    # a device that keeps failing a unit cannot keep it from the rest by asking faster.
    refused_device_id = models.BigIntegerField(null=True, blank=True)

    result_sha256 = models.CharField(max_length=64, blank=True)
    result_samples = models.PositiveIntegerField(null=True, blank=True)
    result_metrics = models.JSONField(default=dict, blank=True)
    # Why an accepted update is in doubt after the fact: its device failed a check on another unit while this
    # one's earnings were still open ('' when not). Its round may be aggregated already (later rounds trained on
    # it); the job's page, its API and its model file say so. Cleared when staff find the device honest.
    flagged = models.CharField(max_length=500, blank=True, default="")
    submitted_at = models.DateTimeField(null=True, blank=True)  # when its result arrived (an arrival, for deadlines)
    accepted_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["round", "index"]
        constraints = [models.UniqueConstraint(fields=["round", "index"], name="unit_unique_index")]
        indexes = [
            models.Index(fields=["status", "id"], name="unit_status_id"),
            models.Index(fields=["status", "lease_expires_at"], name="unit_status_expiry"),
            # the units a device holds (a claim counts them against MUNINN_MAX_LEASES_PER_DEVICE)
            models.Index(fields=["leased_device_id"], condition=models.Q(status="leased"), name="unit_leased_device"),
            # a claim's first pass: the queued units sized for this device, in id order
            models.Index(fields=["preferred_device_id", "id"], condition=models.Q(status="queued"),
                         name="unit_queued_preferred"),
            # its last pass: the queued units whose reservation for another device ran out, the oldest first
            models.Index(fields=["reserved_until", "id"],
                         condition=models.Q(status="queued", preferred_device_id__isnull=False),
                         name="unit_queued_reserved"),
            # a job's latest accepted units, round by round (contributors.results' norm history)
            models.Index(fields=["round", "id"], condition=models.Q(status="accepted"), name="unit_accepted_round"),
        ]

    def __str__(self) -> str:
        return f"unit {self.pk} (job {self.round.job_id} round {self.round.number} #{self.index})"

    @property
    def samples(self) -> int:
        return self.shard_stop - self.shard_start

    @property
    def hu(self) -> Decimal:
        return flops_to_hu(self.flops)


class PredictionBatch(models.Model):
    """A file of inputs predicted by a succeeded job's model off the request thread (jobs/services/predictions.py):
    the upload and the CSV of predictions are blobs; `done_rows` of `rows` is its progress; `error` says what to fix
    in the file (the predict API's error: code, message, detail naming the row and column)."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="prediction_batches")
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.QUEUED)
    filename = models.CharField(max_length=200)
    input_sha256 = models.CharField(max_length=64)
    size_bytes = models.BigIntegerField()
    rows = models.IntegerField(null=True, blank=True)
    done_rows = models.IntegerField(default=0)
    result_sha256 = models.CharField(max_length=64, blank=True, default="")
    error = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["status", "created_at"], name="batch_status_created")]

    def __str__(self) -> str:
        return f"prediction batch {self.pk} (job {self.job_id}, {self.status})"
