"""Contributor devices, the leases they hold, and the receipts they sign for their work."""
from django.conf import settings
from django.db import models


class Device(models.Model):
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="devices")
    name = models.CharField(max_length=100)
    token_hash = models.CharField(max_length=64, unique=True)  # sha256 of the device token; the token is shown once
    public_key = models.CharField(max_length=64, default="")  # base64 Ed25519 public key: verifies the device's receipts
    capabilities = models.JSONField(default=dict)
    memory_bytes = models.BigIntegerField(default=0)  # RAM: what a CPU (or Apple MPS) unit may use
    gpu_memory_bytes = models.BigIntegerField(default=0)  # the largest CUDA GPU's memory: what a CUDA unit may use
    # Moving estimates, from the probe's benchmark then from real verified units. FLOP/s sizes shards and
    # deadlines (comparable across models); samples/s is shown to people.
    flops_per_s = models.FloatField(default=0.0)
    samples_per_s = models.FloatField(default=0.0)
    # Reputation: consecutive results that passed every check (segment checks included) set how often the
    # device's work is checked; confirmed failures on distinct units since the last lifted quarantine decide
    # quarantine (a check that honest training can fail, a rising loss or an odd norm, is evidence, not one).
    verified_streak = models.PositiveIntegerField(default=0)
    verified_total = models.PositiveIntegerField(default=0)
    failures = models.PositiveIntegerField(default=0)
    quarantined_at = models.DateTimeField(null=True, blank=True)
    quarantine_reason = models.CharField(max_length=500, blank=True)
    is_active = models.BooleanField(default=True)
    last_seen_at = models.DateTimeField(null=True, blank=True, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        # A key signs for one device only (services.device_register refuses a taken one; this holds under a race).
        constraints = [models.UniqueConstraint(fields=["public_key"], condition=~models.Q(public_key=""),
                                               name="device_public_key_unique")]

    def __str__(self) -> str:
        return f"{self.name} (#{self.pk}, {self.owner})"


class Lease(models.Model):
    """One lease of a unit to a device. The token matches WorkUnit.lease_token while the lease is current."""

    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="leases")
    unit = models.ForeignKey("jobs.WorkUnit", on_delete=models.CASCADE, related_name="leases")
    token = models.UUIDField(unique=True)
    # The segment length k of this lease's training (contributors.tolerances): the receipt commits to a
    # checkpoint every k steps, and a check re-trains segments of k steps.
    segment_steps = models.PositiveIntegerField(default=1)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["device", "unit"], name="lease_device_unit")]


class Receipt(models.Model):
    """What a device says it did for a unit, kept as evidence whether it was accepted or not."""

    class Status(models.TextChoices):
        PENDING = "pending", "Passed the cheap checks; its challenged segments are being checked"
        ACCEPTED = "accepted", "Accepted"
        REJECTED = "rejected", "Rejected"

    unit = models.ForeignKey("jobs.WorkUnit", on_delete=models.PROTECT, related_name="receipts")
    device = models.ForeignKey(Device, on_delete=models.PROTECT, related_name="receipts")
    lease = models.ForeignKey(Lease, null=True, on_delete=models.PROTECT, related_name="receipts")
    status = models.CharField(max_length=16, choices=Status.choices)
    reason = models.CharField(max_length=500, blank=True)
    payload = models.JSONField(default=dict)  # the receipt exactly as sent
    signature = models.CharField(max_length=128, blank=True)  # base64 Ed25519 over the receipt's JSON bytes
    weights_sha256 = models.CharField(max_length=64, blank=True)
    shard_sha256 = models.CharField(max_length=64, blank=True)
    output_sha256 = models.CharField(max_length=64, blank=True)
    samples = models.PositiveIntegerField(default=0)
    steps = models.PositiveIntegerField(default=0)
    loss_before = models.FloatField(null=True)
    loss_after = models.FloatField(null=True)
    train_seconds = models.FloatField(null=True)
    started_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)
    verification = models.JSONField(default=dict, blank=True)  # how it was verified: checks, segment checks
    # The chain the receipt commits to: k, and [weights sha256, optimizer sha256] at every boundary.
    segment_steps = models.PositiveIntegerField(default=0)
    checkpoints = models.JSONField(default=list, blank=True)
    # A challenge: the segments drawn for re-training, the boundaries' checkpoints received so far
    # ({boundary: blob sha256}), and when an unanswered challenge counts as a failed check.
    challenge_segments = models.JSONField(default=list, blank=True)
    checkpoint_blobs = models.JSONField(default=dict, blank=True)
    challenge_deadline = models.DateTimeField(null=True, blank=True, db_index=True)
    # Accepted, and its charge not posted yet: contributors.credit posts it off the request, in a batch.
    credit_pending = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [models.Index(fields=["id"], condition=models.Q(credit_pending=True),
                                name="receipt_credit_pending"),
                   # every result looks up the receipts of its very bytes (a repeat, a replay, a copy)
                   models.Index(fields=["output_sha256"], name="receipt_output")]
        constraints = [
            # at most one live result per unit: pending re-execution, or accepted
            models.UniqueConstraint(fields=["unit"], condition=models.Q(status__in=["pending", "accepted"]),
                                    name="receipt_one_live_per_unit"),
        ]

    def __str__(self) -> str:
        return f"receipt {self.pk} unit {self.unit_id} ({self.status})"


class DeviceEvent(models.Model):
    """The audit trail of a device's standing: failed results, quarantines and who lifted them, what happened to
    the earnings held while it was quarantined and who decided, and why."""

    class Kind(models.TextChoices):
        FAILURE = "failure", "Failed result"
        REFUSED = "refused", "Refused request (not its unit, too large)"
        QUARANTINED = "quarantined", "Quarantined"
        LIFTED = "lifted", "Quarantine lifted"
        EARNINGS_HELD = "earnings_held", "Unverified earnings held for review"
        RELEASED = "released", "Held earnings released"
        FORFEITED = "forfeited", "Held earnings forfeited (fraud)"
        ABANDONED = "abandoned", "Lease expired without a result"

    device = models.ForeignKey(Device, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    reason = models.CharField(max_length=500)
    unit_id = models.BigIntegerField(null=True, blank=True)  # the unit a failure was confirmed on
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                              related_name="+")
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-at", "-id"]


class PeerCheck(models.Model):
    """A challenged segment re-trained by a second device of the unit's backend class, where no validator of the
    site runs that backend (BOINC's homogeneous redundancy). Two agreeing devices accept the segment; when they
    disagree, a third device's run decides, and the minority failed."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Waiting for a peer device"
        LEASED = "leased", "Being re-trained by a peer device"
        AGREED = "agreed", "The peer's run agrees with the device's"
        DISAGREED = "disagreed", "The peer's run disagrees with the device's"
        EXPIRED = "expired", "No peer device took it in time (the site's validator decided)"

    receipt = models.ForeignKey(Receipt, on_delete=models.CASCADE, related_name="peer_checks")
    segment = models.PositiveIntegerField()
    tie_break = models.BooleanField(default=False)  # the third device's run, after two disagreed
    backend = models.CharField(max_length=16)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    device = models.ForeignKey(Device, null=True, blank=True, on_delete=models.PROTECT, related_name="peer_checks")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    distance = models.FloatField(null=True, blank=True)
    result_sha256 = models.CharField(max_length=64, blank=True)  # the peer's end checkpoint
    created_at = models.DateTimeField(auto_now_add=True)
    decided_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"peer check {self.pk} of receipt {self.receipt_id} segment {self.segment} ({self.status})"


class ExposurePolicy(models.Model):
    """Who may see a sensitive dataset's rows (Dataset.sensitive): the trust level staff set, one row for the site
    (contributors.exposure.policy_current makes it with these defaults; staff edit it in the admin). A device is
    trusted when it has at least `min_verified_units` verified results, was registered `min_device_age_days` ago,
    is in good standing (not quarantined, no failure on record, not a flagged owner's new device) and, when
    `require_approved_owner`, its owner is one of `approved_owners`."""

    min_verified_units = models.PositiveIntegerField(
        default=20, help_text="Verified results a device must have (its verified record) before it sees sensitive data")
    min_device_age_days = models.PositiveIntegerField(
        default=7, help_text="Days since the device was registered")
    require_approved_owner = models.BooleanField(
        default=False, help_text="Only devices of the owners listed below (approved by staff) see sensitive data")
    approved_owners = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="+",
                                             limit_choices_to={"role": "contributor"},
                                             help_text="Contributors staff approved for sensitive data")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = verbose_name_plural = "sensitive-data trust policy"

    def __str__(self) -> str:
        return "The sensitive-data trust policy"


class ShardDownload(models.Model):
    """A shard of a sensitive dataset that a device downloaded: who (the device and its owner), when, for which
    job and unit (or peer check), and which rows of the job's training split (shard_start up to shard_stop). Kept
    for the customer (the job page, GET /api/jobs/<id>/shard-downloads); append-only."""

    device = models.ForeignKey(Device, on_delete=models.PROTECT, related_name="shard_downloads")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    job = models.ForeignKey("jobs.Job", on_delete=models.CASCADE, related_name="shard_downloads")
    unit = models.ForeignKey("jobs.WorkUnit", on_delete=models.CASCADE, related_name="shard_downloads")
    peer_check = models.ForeignKey(PeerCheck, null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    shard_start = models.PositiveIntegerField()
    shard_stop = models.PositiveIntegerField()
    shard_sha256 = models.CharField(max_length=64)
    at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["job", "-at"], name="shard_download_job_at")]

    def __str__(self) -> str:
        return f"device {self.device_id} downloaded rows {self.shard_start}-{self.shard_stop} of job {self.job_id}"
