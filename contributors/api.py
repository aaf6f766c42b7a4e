"""The worker API (docs/worker-protocol.md): thin views over contributors.services."""
import json
import re
import threading
from collections.abc import Mapping

from django.conf import settings
from django.core.validators import RegexValidator
from django.http import FileResponse, HttpResponse, QueryDict
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.authentication import TokenAuthentication
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.permissions import IsContributor, IsCustomer
from billing import money
from billing import selectors as ledger
from jobs import selectors as job_selectors
from jobs import services as job_services
from jobs import storage
from jobs.hu import hu_str
from muninn import throttles
from muninn.errors import InvalidInput, NotFound, TooLarge
from muninn.openapi import binary, errors, retry_after_header
from muninn.serializers import StrictSerializer

from muninn_worker.segments import MAX_SEGMENTS

from . import challenges, exposure, peers, push, results, schema, selectors, services
from .checks import load_public_key
from .authentication import DeviceTokenAuthentication, HasDevice


MAX_BYTES = 2**63 - 1  # memory sizes are stored in bigint columns (Device.memory_bytes, gpu_memory_bytes)


class GpuSerializer(StrictSerializer):
    name = serializers.CharField(max_length=200)
    memory_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BYTES)


class CapabilitiesSerializer(StrictSerializer):
    cpu_cores = serializers.IntegerField(min_value=1, max_value=4096)
    ram_bytes = serializers.IntegerField(min_value=0, max_value=MAX_BYTES)
    backends = serializers.ListField(child=serializers.ChoiceField(choices=["cpu", "cuda", "mps", "browser"]),
                                     min_length=1, help_text='what the device trains on; "browser" (alone) for a '
                                     "browser contributing from /contribute/browser/")
    gpus = serializers.ListField(child=GpuSerializer(), required=False, default=list, max_length=64)
    torch_version = serializers.CharField(max_length=64)
    samples_per_s = serializers.FloatField(min_value=0, required=False, default=0.0)
    flops_per_s = serializers.FloatField(min_value=0, required=False, default=0.0)

    def validate_backends(self, value: list[str]) -> list[str]:
        if "browser" in value and len(value) > 1:
            raise serializers.ValidationError('"browser" is a device of its own: a browser registers with '
                                              '["browser"] alone.')
        return value


PUBLIC_KEY = "public_key must be base64 of a 32-byte Ed25519 public key"


class DeviceRegisterSerializer(StrictSerializer):
    name = serializers.CharField(max_length=100)
    capabilities = CapabilitiesSerializer()
    # base64 of 32 bytes, padded: the pattern says it in the schema; load_public_key checks the key
    public_key = serializers.CharField(max_length=64, help_text="base64 Ed25519 public key that signs receipts",
                                       validators=[RegexValidator(r"^[A-Za-z0-9+/]{43}=\Z", message=PUBLIC_KEY)])

    def validate_public_key(self, value: str) -> str:
        try:
            load_public_key(value)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None
        return value


class DeviceRegisterView(APIView):
    throttle_classes = [throttles.DeviceRegistrationThrottle]
    authentication_classes = [TokenAuthentication]
    permission_classes = [IsContributor]

    @extend_schema(summary="Register a device", request=DeviceRegisterSerializer,
                   responses={201: schema.DeviceRegisteredSerializer, **errors(403, 409, codes={
                       403: "`too_many_devices`", 409: "`public_key_taken`"})})
    def post(self, request):
        data = DeviceRegisterSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        device, token = services.device_register(owner=request.user, **data.validated_data)
        return Response({"device_id": device.pk, "device_token": token, "name": device.name,
                         "quarantined": device.quarantined_at is not None}, status=201)


UNIT_ERRORS = errors(409, codes={409: "`lease_lost`, `already_done`, `unit_cancelled`"})
CHECK_ERRORS = errors(409, codes={409: "`lease_lost`"})
# A sensitive dataset's shard goes only to a device trusted with such data now (contributors.exposure).
SHARD_ERRORS = errors(403, codes={403: "`not_trusted`"})


class DeviceView(APIView):
    authentication_classes = [DeviceTokenAuthentication]
    permission_classes = [HasDevice]


def claim_wait(request) -> float:
    """The seconds a claim may be held: the body's "wait", else the query's, else 0 (answer at once). Longer
    than MUNINN_CLAIM_WAIT_MAX is cut to it; anything but a number from 0 up is refused, in the body or the query
    (also a bad query beside a good body)."""
    data = request.data
    if not isinstance(data, Mapping):
        raise InvalidInput("A claim's body is a JSON object: {} or {\"wait\": seconds}.", code="invalid")
    given = [(data["wait"], not isinstance(data, QueryDict))] if "wait" in data else []
    if "wait" in request.query_params:
        given.append((request.query_params["wait"], False))
    waits = [_seconds(value, json=json) for value, json in given]
    return min(waits[0], settings.MUNINN_CLAIM_WAIT_MAX) if waits else 0.0


def _seconds(value, *, json: bool) -> float:
    """A wait from a JSON body must be a number; from the query or a form, a string that reads as one."""
    try:
        if isinstance(value, bool) or (json and not isinstance(value, (int, float))):
            raise ValueError
        wait = float(value)
    except (TypeError, ValueError):
        wait = float("nan")
    if not (0 <= wait < float("inf")):
        raise InvalidInput(f"'wait' must be a number of seconds from 0 to {settings.MUNINN_CLAIM_WAIT_MAX:g} "
                           f"(got {str(value)[:40]!r}).", code="bad_wait",
                           detail={"max": settings.MUNINN_CLAIM_WAIT_MAX})
    return wait


CLAIM_BACKENDS = ("cpu", "cuda", "mps")


def claim_backends(request) -> list[str] | None:
    """The backends a claim asks work for: the body's "backends" (a list), else the query's (comma-separated),
    else None (any of the device's). Anything but a non-empty list of known backends is refused."""
    data = request.data if isinstance(request.data, dict) else {}
    value = data.get("backends", request.query_params.get("backends"))
    if value is None:
        return None
    if isinstance(value, str):
        value = [b.strip() for b in value.split(",") if b.strip()]
    if not isinstance(value, list) or not value or any(b not in CLAIM_BACKENDS for b in value):
        raise InvalidInput(f"'backends' must be a list of {', '.join(CLAIM_BACKENDS)} (got {str(value)[:60]!r}).",
                           code="bad_backends", detail={"known": list(CLAIM_BACKENDS)})
    return value


def unit_payload(claim: services.Claim) -> dict:
    unit, job = claim.unit, claim.unit.round.job
    return {
        "id": unit.pk, "job": job.pk, "round": unit.round.number,
        "lease_expires_at": unit.lease_expires_at.isoformat().replace("+00:00", "Z"),
        "lease_seconds": settings.MUNINN_LEASE_SECONDS,
        "template": job.template, "model_config": job.model_config,
        "algorithm": job.algorithm, "encoding": job.update_encoding,
        "train": {**job_services.unit_train_spec(unit), "segment_steps": claim.lease.segment_steps},
        "weights_sha256": unit.round.weights_sha256, "shard_sha256": unit.shard_sha256, "samples": unit.samples,
        "base_sha256": job.base_weights.sha256 if job.base_weights_id else None,
    }


class ClaimView(DeviceView):
    throttle_classes = [throttles.ClaimThrottle]
    """A claim, held up to `wait` seconds (body {"wait": 25} or ?wait=25) until a unit is queued for the device."""

    @extend_schema(
        summary="Claim a work unit (or a peer check)", request=schema.ClaimSerializer,
        parameters=[OpenApiParameter("wait", {"type": "number", "minimum": 0}, description="As the body's `wait`"),
                    retry_after_header(204, required=False)],
        responses={200: schema.CLAIMED,
                   204: OpenApiResponse(description="Nothing to do now: claim again (after Retry-After, if sent)"),
                   **errors(403, 409, codes={400: "`bad_wait`", 403: "`device_quarantined`", 409: "`lease_limit`"})})
    def post(self, request):
        try:
            claim = push.unit_claim_wait(device=request.auth, wait=claim_wait(request),
                                         backends=claim_backends(request))
        except push.WaitersFull as full:
            return Response(status=204, headers={"Retry-After": str(full.retry_after)})
        if claim is None:
            return Response(status=204)
        if claim.check is not None:
            return Response({"check": peers.check_payload(claim.check)})
        return Response({"unit": unit_payload(claim)})


class CheckStartView(DeviceView):
    """A peer check's start: the checked device's checkpoint at the segment's first boundary."""

    @extend_schema(summary="A peer check's start checkpoint", responses={**binary("The checkpoint"), **CHECK_ERRORS})
    def get(self, request, check_id: int):
        check = peers.leased_check(device=request.auth, check_id=check_id)
        return HttpResponse(peers.start_checkpoint_bytes(check), content_type="application/octet-stream")


class CheckShardView(DeviceView):
    @extend_schema(summary="A peer check's shard",
                   responses={**binary("safetensors: X and y"), **CHECK_ERRORS, **SHARD_ERRORS})
    def get(self, request, check_id: int):
        check = peers.leased_check(device=request.auth, check_id=check_id)
        shard = exposure.shard_download(device=request.auth, unit=check.receipt.unit, peer_check=check)
        return FileResponse(shard, content_type="application/octet-stream")


class CheckBaseView(DeviceView):
    @extend_schema(summary="A peer check's base weights (lora)",
                   responses={**binary("safetensors of the frozen base"), **CHECK_ERRORS})
    def get(self, request, check_id: int):
        job = peers.leased_check(device=request.auth, check_id=check_id).receipt.unit.round.job
        if job.base_weights_id is None:
            raise NotFound("This check's job trains from scratch; it has no base weights.")
        return FileResponse(storage.blob_open(job.base_weights.sha256), content_type="application/octet-stream")


class CheckResultView(DeviceView):
    """A peer check's end checkpoint, with a signed receipt {"check": id, "end": [weights sha, optimizer sha]}."""

    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(summary="A peer check's result", request={"multipart/form-data": schema.CheckResultUploadSerializer},
                   responses={201: schema.CheckResultAnswerSerializer, **CHECK_ERRORS, **errors(400, codes={
                       400: "`no_checkpoint`, `bad_checkpoint`, `bad_receipt`, `bad_signature`, `no_signature`, "
                            "`receipt_mismatch`"})})
    def post(self, request, check_id: int):
        upload = request.FILES.get("checkpoint")
        if upload is None:
            raise InvalidInput("Attach the end checkpoint as the 'checkpoint' file.", code="no_checkpoint")
        if upload.size > 2 * settings.MUNINN_MAX_RESULT_BYTES:
            raise TooLarge(f"The checkpoint is {upload.size:,} bytes; the limit is "
                           f"{2 * settings.MUNINN_MAX_RESULT_BYTES:,}.")
        text = request.data.get("receipt") or ""
        try:
            receipt = json.loads(text)
        except (TypeError, ValueError):
            raise InvalidInput("The 'receipt' field must be a JSON object.", code="bad_receipt") from None
        if not isinstance(receipt, dict):
            raise InvalidInput("The 'receipt' field must be a JSON object.", code="bad_receipt")
        check = peers.peer_check_submit(device=request.auth, check_id=check_id, data=upload.read(), receipt=receipt,
                                        receipt_bytes=text.encode(), signature=str(request.data.get("signature") or ""))
        return Response({"check": check.pk, "status": check.status}, status=201)


class UnitWeightsView(DeviceView):
    @extend_schema(summary="A unit's global weights", responses={**binary("safetensors"), **UNIT_ERRORS})
    def get(self, request, unit_id: int):
        unit, _ = services.leased_unit(device=request.auth, unit_id=unit_id)
        return FileResponse(storage.blob_open(unit.round.weights_sha256), content_type="application/octet-stream")


class UnitShardView(DeviceView):
    @extend_schema(summary="A unit's shard",
                   responses={**binary("safetensors: X and y"), **UNIT_ERRORS, **SHARD_ERRORS})
    def get(self, request, unit_id: int):
        unit, _ = services.leased_unit(device=request.auth, unit_id=unit_id)
        shard = exposure.shard_download(device=request.auth, unit=unit)
        return FileResponse(shard, content_type="application/octet-stream")


class UnitBaseView(DeviceView):
    """LoRA: the job's frozen base weights (safetensors), the same for every unit of the job: cache by hash."""

    @extend_schema(summary="A lora unit's base weights", responses={**binary("safetensors"), **UNIT_ERRORS})
    def get(self, request, unit_id: int):
        unit, _ = services.leased_unit(device=request.auth, unit_id=unit_id)
        job = unit.round.job
        if job.base_weights_id is None:
            raise NotFound("This unit's job trains from scratch; it has no base weights.")
        return FileResponse(storage.blob_open(job.base_weights.sha256), content_type="application/octet-stream")


class HeartbeatView(DeviceView):
    throttle_classes = [throttles.HeartbeatThrottle]

    @extend_schema(summary="Extend a unit's lease", request=None,
                   responses={200: schema.HeartbeatSerializer, **UNIT_ERRORS})
    def post(self, request, unit_id: int):
        expires = services.unit_heartbeat(device=request.auth, unit_id=unit_id)
        return Response({"lease_expires_at": expires.isoformat().replace("+00:00", "Z"),
                         "lease_seconds": settings.MUNINN_LEASE_SECONDS})


class GiveBackView(DeviceView):
    @extend_schema(summary="Give back a unit this device will not finish (queued again at once for another device)",
                   request=None, responses={200: schema.GivenBackSerializer, **UNIT_ERRORS})
    def post(self, request, unit_id: int):
        services.unit_give_back(device=request.auth, unit_id=unit_id)
        return Response({"unit": unit_id, "given_back": True})


# Every number a receipt carries is bounded before anything reaches the database (a 400 naming the field):
# counts fit the columns that store them (PositiveIntegerField: 2**31 - 1), ids a bigint, losses and seconds a
# range no honest run comes near. The unit then bounds them exactly (checks.check_receipt, check_chain).
MAX_COUNT = 2**31 - 1
MAX_LOSS = 1e30
MAX_TRAIN_SECONDS = 366 * 24 * 3600.0


class ReceiptSerializer(serializers.Serializer):
    unit = serializers.IntegerField(min_value=1, max_value=2**63 - 1)
    weights_sha256 = serializers.RegexField(r"^[0-9a-f]{64}$")
    shard_sha256 = serializers.RegexField(r"^[0-9a-f]{64}$")
    output_sha256 = serializers.RegexField(r"^[0-9a-f]{64}$")
    samples = serializers.IntegerField(min_value=1, max_value=MAX_COUNT)
    steps = serializers.IntegerField(min_value=0, max_value=MAX_COUNT)
    # null: not finite (training diverged); NaN and infinities are refused as numbers
    loss_before = serializers.FloatField(allow_null=True, min_value=-MAX_LOSS, max_value=MAX_LOSS)
    loss_after = serializers.FloatField(allow_null=True, min_value=-MAX_LOSS, max_value=MAX_LOSS)
    started_at = serializers.DateTimeField()
    finished_at = serializers.DateTimeField()
    train_seconds = serializers.FloatField(min_value=0, max_value=MAX_TRAIN_SECONDS)
    segment_steps = serializers.IntegerField(min_value=1, max_value=MAX_COUNT)
    checkpoints = serializers.ListField(
        child=serializers.ListField(child=serializers.RegexField(r"^[0-9a-f]{64}$"), min_length=2, max_length=2),
        min_length=2, max_length=MAX_SEGMENTS + 1,
        help_text="[weights sha256, optimizer sha256] at every segment boundary (docs/worker-protocol.md)")


_RECEIPT_FIELDS = threading.local()


def receipt_validated(raw: dict) -> dict:
    """`raw` validated by ReceiptSerializer (its ValidationError's detail maps each bad field to its messages, as a
    serializer's `errors`). One serializer per request thread validates every receipt: a serializer built per
    request deep-copies its declared fields, each rebuilt from its arguments, which was ~11 % of the web's CPU
    under bench/load.py (py-spy). `run_validation` keeps nothing of a receipt on the serializer. A receipt that is
    plainly valid (_plainly_valid) skips the serializer's machinery; anything else, every error included, is the
    serializer's."""
    serializer = getattr(_RECEIPT_FIELDS, "serializer", None)
    if serializer is None:
        serializer = _RECEIPT_FIELDS.serializer = ReceiptSerializer()
    valid = _plainly_valid(raw, serializer)
    return valid if valid is not None else serializer.run_validation(raw)


_HEX64 = re.compile(r"[0-9a-f]{64}")
_COUNTS = {"unit": (1, 2**63 - 1), "samples": (1, MAX_COUNT), "steps": (0, MAX_COUNT), "segment_steps": (1, MAX_COUNT)}


def _plainly_valid(raw: dict, serializer: ReceiptSerializer) -> dict | None:
    """What the serializer validates `raw` to, for a receipt whose every field is of the very type the worker client
    sends and within its bounds (a JSON int for a count, a number or null for a loss, lowercase hex for a hash, ISO
    strings for times, parsed by the serializer's own fields); None for anything else, left to the serializer
    (whose validation of a plain receipt is ~6 % of the web's CPU under load). tests/test_worker_hotpath.py holds
    the two to the same values on valid receipts and their mutations."""
    out = {}
    for name in ReceiptSerializer._declared_fields:
        if name not in raw:
            return None
        value = raw[name]
        if name in _COUNTS:
            low, high = _COUNTS[name]
            if type(value) is not int or not low <= value <= high:
                return None
        elif name.endswith("_sha256"):
            if type(value) is not str or not _HEX64.fullmatch(value):
                return None
        elif name in ("loss_before", "loss_after", "train_seconds"):
            if value is None and name != "train_seconds":
                out[name] = None
                continue
            low, high = (0.0, MAX_TRAIN_SECONDS) if name == "train_seconds" else (-MAX_LOSS, MAX_LOSS)
            if type(value) not in (int, float) or not low <= value <= high:  # (NaN is in no range)
                return None
            value = float(value)
        elif name in ("started_at", "finished_at"):
            if type(value) is not str:
                return None
            try:
                value = serializer.fields[name].run_validation(value)
            except serializers.ValidationError:
                return None
        elif name == "checkpoints":
            if (type(value) is not list or not 2 <= len(value) <= MAX_SEGMENTS + 1 or not all(
                    type(pair) is list and len(pair) == 2 and all(type(h) is str and _HEX64.fullmatch(h) for h in pair)
                    for pair in value)):
                return None
            value = [list(pair) for pair in value]
        out[name] = value
    return out


def credited_payload(receipt) -> dict:
    """What an accepted result was credited: its HU and what its contributor earned (their share of the unit's
    charge), in nanos and as the site shows money, so the worker can say it in money. Nothing while its segments
    are being checked (it is credited when the check passes), nor when it was refused. An accepted result's
    charge is posted moments after the answer, off the request (contributors.credit): until then `credit` is
    "pending" and nothing is earned yet; every charged unit earns something (MUNINN_MIN_EARNING_PER_UNIT)."""
    accepted = receipt.status == receipt.Status.ACCEPTED
    # a receipt still marked credit_pending has no charge yet (the charge and the mark's clearing commit together)
    earned = ledger.unit_earned(unit=receipt.unit) if accepted and not receipt.credit_pending else 0
    payload = {"credited_hu": hu_str(receipt.unit.hu if accepted else 0), "earned_nanos": earned,
               "earned": money.format_money(earned, settings.MUNINN_CURRENCY), "currency": settings.MUNINN_CURRENCY}
    if accepted:
        payload["credit"] = "posted" if earned else "pending"
    return payload


class ResultView(DeviceView):
    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(summary="Upload a unit's result", request={"multipart/form-data": schema.ResultUploadSerializer},
                   responses={201: schema.ResultAnswerSerializer, **UNIT_ERRORS, **errors(400, codes={
                       400: "`no_weights`, `bad_receipt`, `bad_signature`, `no_signature`, `not_safetensors`, "
                            "`too_large`, `wrong_tensors`, ... (docs/worker-protocol.md)"})})
    def post(self, request, unit_id: int):
        # Refused before the body is read: a result can be no larger than an update of this unit's weights.
        results.result_body_check(device=request.auth, unit_id=unit_id,  # BodyLimitMiddleware refused non-numbers
                                  content_length=int(request.META.get("CONTENT_LENGTH") or 0))
        return Response(result_answer(
            device=request.auth, unit_id=unit_id, upload=request.FILES.get("weights"),
            offered=request.FILES.get("checkpoint"),  # the last checkpoint, sent along for a challenge to take
            receipt_text=request.data.get("receipt") or "", signature=str(request.data.get("signature") or "")),
            status=201)


def result_answer(*, device, unit_id: int, upload, offered, receipt_text, signature: str, leased=None) -> dict:
    """A result's form, read (ResultView's, or a small one contributors/hotpath.py read itself): checked, stored
    and answered (201's body). `upload` and `offered` (the weights and the checkpoint sent along) have a `size`
    and a `read()` (Django's uploaded files, hotpath.Part). `leased`: results.result_submit's. MuninnError for
    every refusal."""
    if upload is None:
        raise InvalidInput("Attach the trained weights as the 'weights' file (safetensors).", code="no_weights")
    if upload.size > settings.MUNINN_MAX_RESULT_BYTES:
        raise TooLarge(f"The upload is {upload.size:,} bytes; the limit is {settings.MUNINN_MAX_RESULT_BYTES:,}.")
    try:
        raw = json.loads(receipt_text)
    except (TypeError, ValueError):
        raise InvalidInput("The 'receipt' field must be a JSON object.", code="bad_receipt") from None
    try:
        receipt = receipt_validated(raw if isinstance(raw, dict) else {})
    except serializers.ValidationError as e:
        field, errors = next(iter(e.detail.items()))
        raise InvalidInput(f"receipt.{field}: {errors[0]}", code="bad_receipt", detail=e.detail) from None
    if offered is not None and offered.size > 2 * settings.MUNINN_MAX_RESULT_BYTES:
        raise TooLarge(f"The checkpoint is {offered.size:,} bytes; the limit is "
                       f"{2 * settings.MUNINN_MAX_RESULT_BYTES:,}.")
    stored = results.result_submit(device=device, unit_id=unit_id, weights=upload.read(), receipt=receipt,
                                    receipt_bytes=receipt_text.encode(), signature=signature,
                                    max_bytes=settings.MUNINN_MAX_RESULT_BYTES,
                                    checkpoint=None if offered is None else offered.read(), leased=leased)
    return {"unit": unit_id, "status": stored.status, "reason": stored.reason, "hu": hu_str(stored.unit.hu),
            **credited_payload(stored), "challenge": challenges.challenge_payload(stored)}


class CheckpointView(DeviceView):
    """A challenged segment's checkpoint (muninn_worker.segments.checkpoint_to_bytes), checked against the
    receipt's commitment."""

    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(summary="Upload a challenged checkpoint",
                   request={"multipart/form-data": schema.CheckpointUploadSerializer},
                   responses={200: schema.CheckpointAnswerSerializer, **errors(400, codes={
                       400: "`no_checkpoint`, `bad_checkpoint`, `not_challenged`", 404: "`no_challenge`"})})
    def post(self, request, unit_id: int, boundary: int):
        upload = request.FILES.get("checkpoint")
        if upload is None:
            raise InvalidInput("Attach the checkpoint as the 'checkpoint' file (safetensors).", code="no_checkpoint")
        if upload.size > 2 * settings.MUNINN_MAX_RESULT_BYTES:
            raise TooLarge(f"The checkpoint is {upload.size:,} bytes; the limit is "
                           f"{2 * settings.MUNINN_MAX_RESULT_BYTES:,}.")
        receipt = challenges.checkpoint_submit(device=request.auth, unit_id=unit_id, boundary=boundary,
                                               data=upload.read())
        receipt.refresh_from_db()  # the check may have been decided since (a validator that ran at once)
        return Response({"unit": unit_id, "status": receipt.status, "reason": receipt.reason,
                         "missing": challenges.missing_boundaries(receipt)
                         if receipt.status == receipt.Status.PENDING else [], **credited_payload(receipt)})


class ChallengesView(DeviceView):
    @extend_schema(summary="The device's open challenges", responses=schema.ChallengesSerializer)
    def get(self, request):
        return Response({"challenges": challenges.challenges_open(device=request.auth)})


class JobDevicesView(APIView):
    """For the job's customer: the devices whose work was accepted for the job, with their unit counts."""

    permission_classes = [IsCustomer]

    @extend_schema(summary="The devices whose work the job accepted", responses=schema.JobDevicesSerializer)
    def get(self, request, job_id: int):
        job = job_selectors.job_get(owner=request.user, job_id=job_id)
        return Response({"job": job.pk, "devices": selectors.job_devices(job=job)})


class JobShardDownloadsView(APIView):
    """For the job's customer: every shard of a sensitive dataset a device downloaded for the job, newest first."""

    permission_classes = [IsCustomer]

    @extend_schema(summary="The shard downloads of a sensitive job (who, when, which rows)",
                   responses=schema.JobShardDownloadsSerializer)
    def get(self, request, job_id: int):
        job = job_selectors.job_get(owner=request.user, job_id=job_id)
        return Response(selectors.job_shard_downloads(job=job))


class DeviceStatusView(DeviceView):
    """The device as its owner sees it (`muninn-worker status`): its reputation, today's results and earnings."""

    @extend_schema(summary="This device's standing: reputation, today's results, its owner's earnings",
                   responses=schema.DeviceStatusSerializer)
    def get(self, request):
        return Response(selectors.device_status(device=request.auth))
