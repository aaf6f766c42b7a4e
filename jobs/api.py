"""The customer API for datasets and jobs: thin views over jobs.services and jobs.selectors."""
import io

from django.conf import settings
from django.db import transaction
from django.http import FileResponse, HttpResponse
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.permissions import IsCustomer
from muninn.errors import Conflict, InvalidInput, TooLarge
from muninn.openapi import binary, errors
from muninn.serializers import StrictSerializer
from muninn.throttles import PredictThrottle
from muninn_worker import certificate, zoo

from . import certificates, predictions, selectors, services, storage
from .models import Dataset, Job, PredictionBatch, Round


class DatasetSerializer(serializers.ModelSerializer):
    class Meta:
        model = Dataset
        fields = ["id", "name", "sha256", "size_bytes", "format", "target", "profile", "sensitive", "created_at"]
        extra_kwargs = {"sensitive": {"help_text": "Shards go only to devices the site trusts with sensitive data, "
                                                   "every download is logged, and the data is encrypted at rest"}}


class DatasetUploadSerializer(serializers.Serializer):
    file = serializers.FileField(allow_empty_file=True)  # the service says "the file is empty" itself
    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    target = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    task = serializers.ChoiceField(choices=["", "classification", "regression"], required=False, default="")
    tokenizer = serializers.ChoiceField(choices=["", "char", "byte"], required=False, default="")
    sensitive = serializers.BooleanField(required=False, default=False, help_text=(
        "Mark the data sensitive (chosen at upload, fixed after): its shards go only to devices that meet the "
        "site's trust level, every shard download is logged on the job page, and it is encrypted at rest"))


MAX_ID = 2**63 - 1  # a database id (muninn/converters.py): a larger one names nothing


class DatasetListView(APIView):
    permission_classes = [IsCustomer]
    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(summary="Your datasets", responses=DatasetSerializer(many=True))
    def get(self, request):
        return Response(DatasetSerializer(selectors.datasets_for(owner=request.user), many=True).data)

    @extend_schema(summary="Upload a dataset (CSV, NPZ, a zip of image folders, text, or safetensors base weights)",
                   request={"multipart/form-data": DatasetUploadSerializer},
                   responses={201: DatasetSerializer, **errors(400, codes={
                       400: "`invalid`, `empty_file`, `sensitive_weights`, and the format's own (`bad_csv`, "
                            "`no_target`, ...)"})})
    def post(self, request):
        data = DatasetUploadSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        upload = data.validated_data["file"]
        if upload.size > settings.MUNINN_MAX_UPLOAD_BYTES:
            raise TooLarge(f"The file is {upload.size:,} bytes; the limit is {settings.MUNINN_MAX_UPLOAD_BYTES:,}.")
        dataset = services.dataset_create(owner=request.user, filename=upload.name, data=upload.read(),
                                          name=data.validated_data["name"], target=data.validated_data["target"],
                                          task=data.validated_data["task"], tokenizer=data.validated_data["tokenizer"],
                                          sensitive=data.validated_data["sensitive"])
        return Response(DatasetSerializer(dataset).data, status=201)


class DatasetDetailView(APIView):
    permission_classes = [IsCustomer]

    @extend_schema(summary="A dataset and its profile", responses=DatasetSerializer)
    def get(self, request, dataset_id: int):
        return Response(DatasetSerializer(selectors.dataset_get(owner=request.user, dataset_id=dataset_id)).data)


class RoundSerializer(serializers.ModelSerializer):
    units = serializers.SerializerMethodField()

    class Meta:
        model = Round
        fields = ["number", "status", "metrics", "opened_at", "closed_at", "units"]

    @extend_schema_field(serializers.DictField(child=serializers.IntegerField(), help_text="Units per status"))
    def get_units(self, rnd: Round) -> dict:
        return self.context["unit_counts"].get(rnd.pk, {})  # selectors.round_unit_counts, one query for the job


class JobSerializer(serializers.ModelSerializer):
    hu_estimated = serializers.DecimalField(max_digits=40, decimal_places=16, read_only=True)
    rounds_done = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = ["id", "dataset", "base_weights", "template", "hparams", "model_config", "algorithm",
                  "outer_lr", "outer_momentum", "inner_steps", "update_encoding", "aggregation", "backends", "rounds",
                  "rounds_done",
                  "seed", "status", "flops_estimated", "hu_estimated", "peak_memory_bytes", "n_train", "n_test",
                  "current_round", "metrics", "error", "created_at", "started_at", "finished_at"]

    def get_rounds_done(self, job: Job) -> int:
        return job.round_set.filter(status=Round.Status.CLOSED, result_sha256__gt="").count()


class FlaggedUpdateSerializer(serializers.Serializer):
    round = serializers.IntegerField()
    unit = serializers.IntegerField()
    reason = serializers.CharField()
    in_model = serializers.BooleanField(help_text="Whether the update is in the model (its round was combined)")


class JobDetailSerializer(JobSerializer):
    round_list = serializers.SerializerMethodField()
    waiting = serializers.SerializerMethodField()
    flagged_updates = serializers.SerializerMethodField()

    class Meta(JobSerializer.Meta):
        fields = JobSerializer.Meta.fields + ["round_list", "waiting", "flagged_updates"]

    @extend_schema_field(FlaggedUpdateSerializer(many=True))
    def get_flagged_updates(self, job: Job) -> list:
        """Updates in doubt after the fact: [{round, unit, reason, in_model}] (jobs.selectors.job_flagged_updates)."""
        return selectors.job_flagged_updates(job)

    def get_waiting(self, job: Job) -> str | None:
        """Why a running job is not moving (no online device can run it), or null."""
        capacity = self.context.get("capacity")
        return None if capacity is None else selectors.job_waiting_reason(job, capacity)

    @extend_schema_field(RoundSerializer(many=True))
    def get_round_list(self, job: Job) -> list:
        return RoundSerializer(selectors.job_rounds(job=job), many=True,
                               context={"unit_counts": selectors.round_unit_counts(job=job)}).data


class JobCreateSerializer(StrictSerializer):
    dataset = serializers.IntegerField(min_value=1, max_value=MAX_ID)
    template = serializers.ChoiceField(choices=sorted(zoo.TEMPLATES))
    hparams = serializers.DictField(required=False, default=dict,
                                    help_text="The template's hyper-parameters (GET /api/templates); defaults fill in")
    rounds = serializers.IntegerField(min_value=1)
    base_weights = serializers.IntegerField(min_value=1, max_value=MAX_ID, required=False, allow_null=True,
                                            default=None, help_text="lora: the dataset holding the base weights")
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False)
    aggregation = serializers.ChoiceField(choices=Job.Aggregation.choices, required=False,
                                          default=Job.Aggregation.FEDAVG)
    # The training algorithm (muninn_worker.federated.algorithms checks the values and fills in DiLoCo's defaults).
    algorithm = serializers.ChoiceField(choices=Job.Algorithm.choices, required=False, default=Job.Algorithm.FEDAVG)
    outer_lr = serializers.FloatField(required=False, allow_null=True, default=None)
    outer_momentum = serializers.FloatField(required=False, allow_null=True, default=None)
    inner_steps = serializers.IntegerField(required=False, allow_null=True, default=None)
    update_encoding = serializers.ChoiceField(choices=Job.Encoding.choices, required=False, default=Job.Encoding.FP32)
    start = serializers.BooleanField(required=False, default=False)
    quote = serializers.UUIDField(required=False)  # the quote accepted when the job starts (see /api/quotes)


JOB_ERRORS = errors(400, 402, 409, 410, codes={
    400: "`invalid`, `bad_hparams`, `bad_rounds`, `bad_algorithm`, `incompatible_data`, `bad_quote`, "
         "`quote_mismatch`, ...", 402: "`insufficient_balance`", 404: "`not_found` (the dataset, base weights or quote)",
    409: "`not_startable`, `quote_used`", 410: "`quote_expired`"})


class JobListView(APIView):
    permission_classes = [IsCustomer]

    @extend_schema(summary="Your jobs", responses=JobSerializer(many=True))
    def get(self, request):
        return Response(JobSerializer(selectors.jobs_for(owner=request.user), many=True).data)

    @extend_schema(summary="Create a job (and start it: \"start\": true)", request=JobCreateSerializer,
                   responses={201: JobDetailSerializer, **JOB_ERRORS})
    def post(self, request):
        data = JobCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        dataset = selectors.dataset_get(owner=request.user, dataset_id=v["dataset"])
        base = None
        if v["base_weights"] is not None:
            base = selectors.dataset_get(owner=request.user, dataset_id=v["base_weights"])
        quote = str(v["quote"]) if v.get("quote") else None
        with transaction.atomic():  # a start that is refused (balance, quote) leaves no job behind
            job = services.job_create(owner=request.user, dataset=dataset, template=v["template"],
                                      hparams=v["hparams"], rounds=v["rounds"], seed=v.get("seed"),
                                      aggregation=v["aggregation"], base_weights=base, training=training_choice(v))
            if v["start"]:
                job = services.job_start(job_id=job.pk, quote=quote)
        return Response(JobDetailSerializer(job).data, status=201)


class JobDetailView(APIView):
    permission_classes = [IsCustomer]
    capacity = None  # wired in muninn/urls.py: contributors/ knows which devices are online

    @extend_schema(summary="A job: status, rounds, metrics", responses=JobDetailSerializer)
    def get(self, request, job_id: int):
        job = selectors.job_get(owner=request.user, job_id=job_id)
        return Response(JobDetailSerializer(job, context={"capacity": self.capacity}).data)


class JobStartSerializer(StrictSerializer):
    quote = serializers.UUIDField(required=False)


class JobStartView(APIView):
    permission_classes = [IsCustomer]

    @extend_schema(summary="Start a created job: hold its quoted price", request=JobStartSerializer,
                   responses={200: JobDetailSerializer, **JOB_ERRORS})
    def post(self, request, job_id: int):
        job = selectors.job_get(owner=request.user, job_id=job_id)
        data = JobStartSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        quote = str(data.validated_data["quote"]) if data.validated_data.get("quote") else None
        return Response(JobDetailSerializer(services.job_start(job_id=job.pk, quote=quote)).data)


class JobCancelView(APIView):
    permission_classes = [IsCustomer]

    @extend_schema(summary="Cancel a job: the unused hold is released", request=None,
                   responses={200: JobDetailSerializer, **errors(409, codes={409: "`job_ended`"})})
    def post(self, request, job_id: int):
        job = selectors.job_get(owner=request.user, job_id=job_id)
        return Response(JobDetailSerializer(services.job_cancel(job_id=job.pk)).data)


class JobModelView(APIView):
    """The trained model: safetensors of the final global weights, with the template and model_config in the
    file's metadata. For a LoRA job these are the adapters; `?artefact=merged` gives the merged transformer
    (base + adapters), which can be uploaded again as base weights. `?format=onnx` gives the model as ONNX
    (muninn_worker.onnx_export), for a LoRA job only with `artefact=merged`."""

    permission_classes = [IsCustomer]
    FORMATS = ("safetensors", "onnx")

    @extend_schema(summary="Download the trained model (safetensors or ONNX)",
                   parameters=[OpenApiParameter("artefact", str, enum=["model", "merged"], default="model",
                                                description="`merged`: a lora job's base and adapters in one "
                                                            "transformer (404 for other jobs)"),
                               OpenApiParameter("format", str, enum=list(FORMATS), default="safetensors",
                                                description="`onnx`: an ONNX graph taking the same input tensor as "
                                                            "the torch model, its layout in the metadata_props "
                                                            "(mlp, cnn, resnet18, transformer; lora with "
                                                            "artefact=merged)")],
                   responses={**binary("safetensors of the model's weights, its template and model_config in the "
                                       "metadata; or the ONNX model"),
                              **errors(400, 409, codes={400: "`bad_artefact`, `bad_format`, `not_exportable`",
                                                        409: "`not_ready` (the job has not succeeded)"})})
    def get(self, request, job_id: int):
        job = selectors.job_get(owner=request.user, job_id=job_id)
        artefact = request.query_params.get("artefact", "model")
        fmt = request.query_params.get("format", "safetensors")
        if fmt not in self.FORMATS:
            raise InvalidInput(f"format must be 'safetensors' or 'onnx' (got {fmt!r}).", code="bad_format")
        if fmt == "onnx":
            model = selectors.job_model_onnx(job, artefact=artefact)
        else:
            model = selectors.job_model_file(job, artefact=artefact)
        return FileResponse(io.BytesIO(model.data), as_attachment=True, filename=model.filename,
                            content_type="application/octet-stream")


class CertificateSerializer(serializers.Serializer):
    certificate = serializers.DictField(help_text="What the site certifies (README: \"Checking a certificate\")")
    signature = serializers.CharField(help_text="Ed25519 over the certificate's canonical JSON, base64")
    key = serializers.CharField(help_text="The site's public key, base64 (/.well-known/muninn-signing-key)")
    algorithm = serializers.CharField(help_text="ed25519")


class JobCertificateView(APIView):
    """The job's training certificate, signed by the site (jobs/certificates.py): JSON, as an attachment."""

    permission_classes = [IsCustomer]
    evidence = money = None  # wired in muninn/urls.py: receipts live in contributors/, money in billing/

    @extend_schema(summary="Download the job's training certificate (signed JSON)",
                   responses={200: CertificateSerializer, **errors(404, 409, codes={
                       409: "`not_ready` (the job has not succeeded)"})})
    def get(self, request, job_id: int):
        job = selectors.job_get(owner=request.user, job_id=job_id)
        document = certificates.job_certificate(job, evidence=self.evidence, money=self.money)
        response = HttpResponse(certificate.canonical(document), content_type="application/json")
        response["Content-Disposition"] = f'attachment; filename="muninn-job-{job.pk}-certificate.json"'
        return response


class PredictSerializer(StrictSerializer):
    rows = serializers.ListField(child=serializers.JSONField(), required=False, max_length=100_000,
                                 help_text="Rows to predict: objects {column: value} (any order; null or \"\" is a "
                                           "missing cell), or lists of numbers for a job trained on an .npz")
    csv = serializers.CharField(required=False, trim_whitespace=False,
                                help_text="CSV text with a header naming the columns, as the training file")
    prompt = serializers.CharField(required=False, trim_whitespace=False, max_length=10_000,
                                   help_text="A language model's prompt, to be continued")
    length = serializers.IntegerField(required=False, help_text="Tokens to generate (default 100)")
    temperature = serializers.FloatField(required=False, default=0.0, min_value=0, max_value=10,
                                         help_text="0: the most likely token each step; above: sampled")
    seed = serializers.IntegerField(required=False, default=0, min_value=0, max_value=2**31 - 1)


class PredictFileSerializer(StrictSerializer):
    file = serializers.FileField(help_text="A CSV file, one PNG/JPEG image, a zip of images, or an .npz with an "
                                           "array X")


class PredictionSerializer(serializers.Serializer):
    row = serializers.JSONField(help_text="The CSV line (as a spreadsheet numbers it), the row's position from 1, "
                                          "or the image's file name")
    label = serializers.CharField(required=False, help_text="classification: the most likely class")
    probabilities = serializers.DictField(child=serializers.FloatField(), required=False,
                                          help_text="classification: each class's probability")
    value = serializers.FloatField(required=False, help_text="regression: the predicted value")


class PredictAnswerSerializer(serializers.Serializer):
    task = serializers.ChoiceField(choices=["classification", "regression", "language_model"])
    predictions = PredictionSerializer(many=True, required=False)
    prompt = serializers.CharField(required=False)
    text = serializers.CharField(required=False, help_text="language model: the generated continuation")


class JobPredictView(APIView):
    """Predictions from the job's trained model (jobs/predictions.py): the same package and loader as the
    download, so the answers agree exactly. `?format=csv` answers a CSV of predictions (the batch form)."""

    permission_classes = [IsCustomer]
    parser_classes = [JSONParser, MultiPartParser, FormParser]
    throttle_classes = [PredictThrottle]

    @extend_schema(summary="Predict with the job's trained model",
                   request={"application/json": PredictSerializer, "multipart/form-data": PredictFileSerializer},
                   parameters=[OpenApiParameter("format", str, enum=["json", "csv"], default="json",
                                                description="`csv`: the predictions as a CSV attachment")],
                   responses={(200, "application/json"): PredictAnswerSerializer,
                              (200, "text/csv"): OpenApiTypes.STR, **errors(400, 404, 409, 413, codes={
                       400: "`bad_input`, `bad_number`, `bad_category`, `missing_value`, `missing_column`, "
                            "`bad_image`, `bad_prompt`, `bad_length`, ... (detail names the row and column)",
                       409: "`not_ready` (the job has not succeeded)",
                       413: "`too_large`, `too_many_rows`"})})
    def post(self, request, job_id: int):
        job = selectors.job_get(owner=request.user, job_id=job_id)
        form = request.content_type.startswith("multipart/")
        data = (PredictFileSerializer if form else PredictSerializer)(data=request.data)
        data.is_valid(raise_exception=True)
        given, upload = {"temperature": 0.0, "seed": 0, **data.validated_data}, data.validated_data.get("file")
        if upload is not None and upload.size > settings.MUNINN_PREDICT_MAX_BYTES:
            raise TooLarge(f"The file is {upload.size:,} bytes; predictions on the site take at most "
                           f"{settings.MUNINN_PREDICT_MAX_BYTES:,}. Download the model package to predict on more.")
        answer = predictions.job_predict(
            job, rows=given.get("rows"), text=given.get("csv"), data=upload.read() if upload else None,
            filename=upload.name if upload else "", prompt=given.get("prompt"), length=given.get("length"),
            temperature=given["temperature"], seed=given["seed"])
        if request.query_params.get("format") == "csv" and "predictions" in answer:
            response = HttpResponse(predictions.predictions_csv(answer), content_type="text/csv; charset=utf-8")
            response["Content-Disposition"] = f'attachment; filename="muninn-job-{job.pk}-predictions.csv"'
            return response
        return Response(answer)


class PredictionBatchSerializer(serializers.ModelSerializer):
    csv_url = serializers.SerializerMethodField(help_text="The CSV of predictions, once the batch is done")

    class Meta:
        model = PredictionBatch
        fields = ["id", "job", "status", "filename", "size_bytes", "rows", "done_rows", "error", "created_at",
                  "finished_at", "csv_url"]

    def get_csv_url(self, batch: PredictionBatch) -> str | None:
        return (reverse("job-prediction-csv", kwargs={"job_id": batch.job_id, "batch_id": batch.pk})
                if batch.status == PredictionBatch.Status.DONE else None)


class JobPredictionListView(APIView):
    """A file predicted off the request thread (a Celery task): 202 at once, then its progress by GET."""

    permission_classes = [IsCustomer]
    parser_classes = [MultiPartParser, FormParser]
    throttle_classes = [PredictThrottle]

    @extend_schema(summary="Predict a whole file with the job's model, in the background",
                   request={"multipart/form-data": PredictFileSerializer},
                   responses={202: PredictionBatchSerializer, **errors(400, 404, 409, 413, codes={
                       400: "`empty_file`, `bad_input` (a language model: use predict with a prompt)",
                       409: "`not_ready` (the job has not succeeded)"})})
    def post(self, request, job_id: int):
        job = selectors.job_get(owner=request.user, job_id=job_id)
        data = PredictFileSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        upload = data.validated_data["file"]
        if upload.size > settings.MUNINN_MAX_UPLOAD_BYTES:
            raise TooLarge(f"The file is {upload.size:,} bytes; the limit is {settings.MUNINN_MAX_UPLOAD_BYTES:,}.")
        batch = services.prediction_batch_create(job=job, filename=upload.name, data=upload.read())
        batch.refresh_from_db()  # an eager task (tests, `make run`'s in-process broker) may have finished it
        return Response(PredictionBatchSerializer(batch).data, status=202)


class JobPredictionDetailView(APIView):
    permission_classes = [IsCustomer]

    @extend_schema(summary="A prediction batch: its status and progress (rows done of rows)",
                   responses={200: PredictionBatchSerializer, **errors(404)})
    def get(self, request, job_id: int, batch_id: int):
        batch = selectors.prediction_batch_get(owner=request.user, job_id=job_id, batch_id=batch_id)
        return Response(PredictionBatchSerializer(batch).data)


class JobPredictionCsvView(APIView):
    permission_classes = [IsCustomer]

    @extend_schema(summary="A done prediction batch's predictions (CSV)",
                   responses={(200, "text/csv"): OpenApiTypes.STR, **errors(404, 409, codes={
                       409: "`not_ready` (the batch is not done)"})})
    def get(self, request, job_id: int, batch_id: int):
        batch = selectors.prediction_batch_get(owner=request.user, job_id=job_id, batch_id=batch_id)
        if batch.status != PredictionBatch.Status.DONE:
            raise Conflict(f"The predictions are ready when the batch is done; it is {batch.status}.",
                           code="not_ready")
        response = HttpResponse(storage.blob_get(batch.result_sha256), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = (f'attachment; filename="muninn-job-{job_id}-predictions-{batch.pk}.csv"')
        return response


class HParamSerializer(serializers.Serializer):
    name = serializers.CharField()
    kind = serializers.ChoiceField(choices=["int", "float", "int_list"])
    default = serializers.JSONField(help_text="A number, or a list of integers for int_list")
    minimum = serializers.FloatField(help_text="For int_list, of each item")
    maximum = serializers.FloatField()
    help = serializers.CharField()
    max_items = serializers.IntegerField(required=False, help_text="int_list only")


class TemplateSerializer(serializers.Serializer):
    name = serializers.CharField()
    title = serializers.CharField()
    description = serializers.CharField()
    task = serializers.CharField()
    tasks = serializers.ListField(child=serializers.CharField())
    data = serializers.ListField(child=serializers.CharField(), help_text="Dataset kinds: table, image, text")
    tier = serializers.ChoiceField(choices=["any", "gpu"])
    optimizer = serializers.ChoiceField(choices=["sgd", "adam"])
    needs_base_weights = serializers.BooleanField()
    metrics = serializers.DictField(child=serializers.CharField(), help_text="The held-out metric per task")
    hparams = HParamSerializer(many=True)


class TemplateListView(APIView):
    """The template registry: tasks, metrics, data kinds, device tier, hyper-parameters with defaults and bounds."""

    @extend_schema(summary="The model templates", responses=TemplateSerializer(many=True))
    def get(self, request):
        return Response([t.describe() for t in zoo.TEMPLATES.values()])


TRAINING_FIELDS = ("algorithm", "outer_lr", "outer_momentum", "inner_steps", "update_encoding")


def training_choice(choice: dict) -> dict:
    """The algorithm settings of a validated job choice, as job_plan/job_create take them."""
    return {name: choice.get(name) for name in TRAINING_FIELDS}


def parse_choice(request) -> dict:
    """Shared by the estimate view in billing/: the same validation as job creation."""
    data = JobCreateSerializer(data=request.data)
    data.is_valid(raise_exception=True)
    return data.validated_data

