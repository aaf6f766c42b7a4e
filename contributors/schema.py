"""The worker API's answers as serializers, for the OpenAPI schema (GET /api/schema): the shapes
docs/worker-protocol.md describes, which contributors/api.py builds as dicts. tests/test_api_contract.py holds the
answers to them, and the multipart forms the device uploads are described here too."""
from drf_spectacular.utils import PolymorphicProxySerializer
from rest_framework import serializers

from jobs.models import Job

from .models import PeerCheck, Receipt

SHA256 = {"min_length": 64, "max_length": 64}


class DeviceRegisteredSerializer(serializers.Serializer):
    device_id = serializers.IntegerField()
    device_token = serializers.CharField(help_text="Shown this once: `Authorization: Device <token>`")
    name = serializers.CharField()
    quarantined = serializers.BooleanField(help_text="true: registered while another of the owner's devices is "
                                                     "quarantined; its claims answer 403 until staff review it")


class TrainSerializer(serializers.Serializer):
    """The arguments of muninn_worker.training.train_local."""

    epochs = serializers.IntegerField()
    batch_size = serializers.IntegerField()
    lr = serializers.FloatField()
    momentum = serializers.FloatField()
    seed = serializers.IntegerField()
    optimizer = serializers.ChoiceField(choices=["sgd", "adam"])
    inner_steps = serializers.IntegerField(allow_null=True, help_text="DiLoCo: the optimizer steps to train")


class UnitTrainSerializer(TrainSerializer):
    segment_steps = serializers.IntegerField(help_text="k: a checkpoint every k optimizer steps")


class UnitSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    job = serializers.IntegerField()
    round = serializers.IntegerField()
    lease_expires_at = serializers.DateTimeField()
    lease_seconds = serializers.IntegerField()
    template = serializers.CharField()
    model_config = serializers.DictField(help_text="What muninn_worker.zoo.build_model(template, ...) takes")
    algorithm = serializers.ChoiceField(choices=Job.Algorithm.choices)
    encoding = serializers.ChoiceField(choices=["fp32", "fp16", "int8"], help_text="How to upload the result")
    train = UnitTrainSerializer()
    weights_sha256 = serializers.CharField(**SHA256)
    shard_sha256 = serializers.CharField(**SHA256)
    samples = serializers.IntegerField()
    base_sha256 = serializers.CharField(allow_null=True, **SHA256, help_text="lora: the frozen base weights")


class PeerCheckSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    unit = serializers.IntegerField()
    job = serializers.IntegerField()
    template = serializers.CharField()
    model_config = serializers.DictField()
    train = TrainSerializer()
    first_step = serializers.IntegerField()
    steps = serializers.IntegerField()
    start_sha256 = serializers.CharField(**SHA256)
    shard_sha256 = serializers.CharField(**SHA256)
    base_sha256 = serializers.CharField(allow_null=True, **SHA256)
    lease_expires_at = serializers.DateTimeField()
    lease_seconds = serializers.IntegerField()


class ClaimedUnitSerializer(serializers.Serializer):
    unit = UnitSerializer()


class ClaimedCheckSerializer(serializers.Serializer):
    check = PeerCheckSerializer()


CLAIMED = PolymorphicProxySerializer(component_name="Claimed", serializers=[ClaimedUnitSerializer,
                                                                            ClaimedCheckSerializer],
                                     resource_type_field_name=None, many=False)


class ClaimSerializer(serializers.Serializer):
    wait = serializers.FloatField(min_value=0, required=False,
                                  help_text="Seconds to hold the claim for a unit (a long poll); longer than the "
                                            "site's MUNINN_CLAIM_WAIT_MAX (30 s) is cut to it")


class HeartbeatSerializer(serializers.Serializer):
    lease_expires_at = serializers.DateTimeField()
    lease_seconds = serializers.IntegerField()


class GivenBackSerializer(serializers.Serializer):
    unit = serializers.IntegerField()
    given_back = serializers.BooleanField()


class ChallengeSerializer(serializers.Serializer):
    unit = serializers.IntegerField()
    segments = serializers.ListField(child=serializers.IntegerField())
    checkpoints = serializers.ListField(child=serializers.IntegerField(), help_text="The boundaries asked for")
    missing = serializers.ListField(child=serializers.IntegerField(), help_text="Those not uploaded yet")
    deadline = serializers.DateTimeField(allow_null=True)
    seconds = serializers.IntegerField(help_text="Left until the deadline")


class ChallengesSerializer(serializers.Serializer):
    challenges = ChallengeSerializer(many=True)


class CreditedSerializer(serializers.Serializer):
    credited_hu = serializers.CharField()
    earned_nanos = serializers.IntegerField(help_text="The contributor's share, in 10^-9 of the currency")
    earned = serializers.CharField(help_text="The same, as the site shows money")
    currency = serializers.CharField()
    credit = serializers.ChoiceField(choices=["posted", "pending"], required=False,
                                     help_text="Accepted results only: whether the charge is posted yet")


class ResultAnswerSerializer(CreditedSerializer):
    unit = serializers.IntegerField()
    status = serializers.ChoiceField(choices=Receipt.Status.choices)
    reason = serializers.CharField(allow_blank=True, help_text="Why it was rejected (only the checkpoint sent "
                                                               "along can reject a stored result); empty otherwise")
    hu = serializers.CharField()
    challenge = ChallengeSerializer(allow_null=True, help_text="The checkpoints to upload, when this result is "
                                                              "checked segment by segment")


class CheckpointAnswerSerializer(CreditedSerializer):
    unit = serializers.IntegerField()
    status = serializers.ChoiceField(choices=Receipt.Status.choices)
    reason = serializers.CharField(allow_blank=True)
    missing = serializers.ListField(child=serializers.IntegerField())


class CheckResultAnswerSerializer(serializers.Serializer):
    check = serializers.IntegerField()
    status = serializers.ChoiceField(choices=PeerCheck.Status.choices)


class JobDeviceSerializer(serializers.Serializer):
    device = serializers.IntegerField()
    name = serializers.CharField()
    units = serializers.IntegerField(help_text="Units whose result was accepted")


class JobDevicesSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    devices = JobDeviceSerializer(many=True)


class ShardDownloadSerializer(serializers.Serializer):
    at = serializers.DateTimeField(help_text="When the device downloaded it")
    device = serializers.IntegerField(help_text="The device's id")
    owner = serializers.CharField(help_text="The username of the device's owner")
    round = serializers.IntegerField()
    unit = serializers.IntegerField()
    check = serializers.IntegerField(allow_null=True, help_text="The peer check it was downloaded for, if any")
    shard_start = serializers.IntegerField(help_text="The first row of the job's training split in the shard")
    shard_stop = serializers.IntegerField(help_text="One past its last row")


class JobShardDownloadsSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    sensitive = serializers.BooleanField(help_text="Whether the job's dataset is sensitive (only those are logged)")
    trust_rule = serializers.CharField(help_text="Which devices may take its shards, in words")
    count = serializers.IntegerField(help_text="How many downloads there were in all")
    downloads = ShardDownloadSerializer(many=True, help_text="The newest first, at most 1,000")


# --- The multipart forms a device uploads ------------------------------------------------------------------

class ResultUploadSerializer(serializers.Serializer):
    weights = serializers.FileField(help_text="The encoded update: deflated safetensors (docs/worker-protocol.md)")
    receipt = serializers.CharField(help_text="A JSON object (the receipt), as text")
    signature = serializers.CharField(help_text="base64 Ed25519 signature of the receipt field's exact bytes")
    checkpoint = serializers.FileField(required=False, help_text=(
        "Optional: the last boundary's checkpoint (muninn_worker.segments.checkpoint_to_bytes), taken when the "
        "site's challenge asks for it, so that the device need not upload it in answer (docs/worker-protocol.md)"))


class CheckpointUploadSerializer(serializers.Serializer):
    checkpoint = serializers.FileField(help_text="muninn_worker.segments.checkpoint_to_bytes(...)")


class CheckResultUploadSerializer(CheckpointUploadSerializer):
    receipt = serializers.CharField(help_text='A JSON object {"check": id, "end": [weights sha256, optimizer '
                                              'sha256]}, as text')
    signature = serializers.CharField(help_text="base64 Ed25519 signature of the receipt field's exact bytes")


class _StatusDeviceSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    backends = serializers.ListField(child=serializers.CharField())
    registered_at = serializers.DateTimeField()
    last_seen_at = serializers.DateTimeField(allow_null=True)


class _ReputationSerializer(serializers.Serializer):
    verified_streak = serializers.IntegerField()
    verified_total = serializers.IntegerField()
    failures = serializers.IntegerField()
    quarantined = serializers.BooleanField()
    quarantined_at = serializers.DateTimeField(allow_null=True)
    quarantine_reason = serializers.CharField(allow_blank=True)


class _TodaySerializer(serializers.Serializer):
    since = serializers.DateTimeField(help_text="The start of the site's day")
    accepted = serializers.IntegerField()
    pending = serializers.IntegerField()
    rejected = serializers.IntegerField()
    earned_nanos = serializers.IntegerField()
    earned = serializers.CharField()


class _EarningsSerializer(serializers.Serializer):
    currency = serializers.CharField()
    pending_nanos = serializers.IntegerField()
    pending = serializers.CharField()
    held_nanos = serializers.IntegerField()
    held = serializers.CharField()
    available_nanos = serializers.IntegerField()
    available = serializers.CharField()


class DeviceStatusSerializer(serializers.Serializer):
    """GET /api/worker/me (contributors.selectors.device_status)."""

    device = _StatusDeviceSerializer()
    reputation = _ReputationSerializer()
    today = _TodaySerializer(help_text="This device's results since the start of the site's day")
    earnings = _EarningsSerializer(help_text="The owner's account, all devices together")
