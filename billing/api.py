"""The money API: estimates and quotes, balances and statements, a job's charges, top-ups, Stripe's webhook,
and contributors' payouts. Thin views over billing's services and selectors."""
from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field
from rest_framework import serializers
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.permissions import IsContributor, IsCustomer
from jobs import selectors as job_selectors
from jobs import services as job_services
from jobs.api import TRAINING_FIELDS, JobCreateSerializer, JobDetailSerializer, parse_choice, training_choice
from jobs.hu import hu_str
from muninn.openapi import errors
from muninn.serializers import StrictSerializer

from . import money, payments, payouts, selectors, services, stripe_gateway
from .models import Account, Payout, Quote, TopUp, Transaction


def _money(nanos: int) -> dict:
    currency = settings.MUNINN_CURRENCY
    return {"nanos": nanos, "currency": currency, "display": money.format_money(nanos, currency),
            "exact": money.format_money(nanos, currency, exact=True)}


def _base_weights(request, choice: dict):
    """The customer's base model for a LoRA job, looked up through their own datasets."""
    if choice.get("base_weights") is None:
        return None
    return job_selectors.dataset_get(owner=request.user, dataset_id=choice["base_weights"])


# --- The shapes of the answers (for the OpenAPI schema; the views build them as dicts) ----------------------

HU = serializers.CharField(help_text="Hardware units, a plain decimal string (1 HU = 10^16 FLOPs)")


class MoneySerializer(serializers.Serializer):
    nanos = serializers.IntegerField(help_text="In 10^-9 of the currency")
    currency = serializers.CharField()
    display = serializers.CharField(help_text="As the site shows it, e.g. €1.23")
    exact = serializers.CharField(help_text="Every digit, e.g. €1.230000001")


class TrainingSerializer(serializers.Serializer):
    """The training algorithm's settings (muninn_worker.federated.algorithms)."""

    algorithm = serializers.CharField()
    outer_lr = serializers.FloatField(allow_null=True)
    outer_momentum = serializers.FloatField(allow_null=True)
    inner_steps = serializers.IntegerField(allow_null=True)
    update_encoding = serializers.CharField()


class EstimateSerializer(TrainingSerializer):
    template = serializers.CharField()
    hparams = serializers.DictField(help_text="The hyper-parameters, defaults filled in")
    rounds = serializers.IntegerField()
    flops = serializers.IntegerField()
    flops_per_round = serializers.IntegerField()
    hu = HU
    price = MoneySerializer(help_text="The most the job costs (its hold): its work at the rate, at least the minimum")
    work_price = MoneySerializer(help_text="The quoted work at the rate, rounded up")
    minimum_charge = MoneySerializer(help_text="The least a job that succeeds pays; one that fails or is cancelled "
                                               "pays only for its verified work")
    price_per_hu = serializers.CharField(help_text="A decimal string")
    peak_memory_bytes = serializers.IntegerField()


class DeviceTierSerializer(serializers.Serializer):
    name = serializers.CharField()
    memory_bytes = serializers.IntegerField()
    backends = serializers.ListField(child=serializers.CharField())
    description = serializers.CharField()
    line = serializers.CharField()
    warning = serializers.CharField(allow_null=True, help_text="Set when no device able to run the job was seen "
                                                               "lately: its price would be held while it waits")


class QuoteSerializer(TrainingSerializer):
    id = serializers.UUIDField()
    expires_at = serializers.DateTimeField()
    dataset = serializers.IntegerField()
    template = serializers.CharField()
    hparams = serializers.DictField()
    rounds = serializers.IntegerField()
    aggregation = serializers.CharField()
    flops = serializers.IntegerField()
    hu = HU
    price = MoneySerializer(help_text="The most the job costs (its hold): its work at the rate, at least the minimum")
    work_price = MoneySerializer(help_text="The quoted work at the rate, rounded up")
    minimum_charge = MoneySerializer(help_text="The least a job that succeeds pays; one that fails or is cancelled "
                                               "pays only for its verified work")
    price_per_hu = serializers.CharField(help_text="A decimal string")
    peak_memory_bytes = serializers.IntegerField()
    device_tier = DeviceTierSerializer()
    devices_online = serializers.IntegerField()
    devices_recent = serializers.IntegerField(allow_null=True)
    expected_seconds = serializers.FloatField(allow_null=True, help_text="null: no capable device online")
    job = serializers.IntegerField(allow_null=True, help_text="The job, once the quote is accepted")
    accepted_at = serializers.DateTimeField(allow_null=True)


class StatementLineSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    at = serializers.DateTimeField()
    account = serializers.ChoiceField(choices=Account.Kind.choices)
    kind = serializers.ChoiceField(choices=Transaction.Kind.choices)
    amount = MoneySerializer()
    memo = serializers.CharField()
    job = serializers.IntegerField(allow_null=True)
    round = serializers.IntegerField(allow_null=True)
    unit = serializers.IntegerField(allow_null=True)
    payout = serializers.IntegerField(allow_null=True)


class BalanceSerializer(serializers.Serializer):
    balances = serializers.DictField(child=MoneySerializer(), help_text="Per account kind the user has")
    statement = StatementLineSerializer(many=True, help_text="The latest 200 entries, newest first")


class JobChargesSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    quoted = MoneySerializer()
    charged = MoneySerializer(help_text="Its verified work, and what the minimum charge per job added")
    minimum = MoneySerializer(help_text="What the minimum charge per job added (a job that succeeded)")
    released = MoneySerializer()
    held = MoneySerializer()
    hu_estimated = HU
    hu_charged = HU


class TopUpLimitsSerializer(serializers.Serializer):
    enabled = serializers.BooleanField(help_text="false: Stripe is not configured on this site")
    minimum = serializers.CharField(help_text="A decimal string, in the currency")
    maximum = serializers.CharField(help_text="A decimal string, in the currency")


class TopUpSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    amount = MoneySerializer()
    checkout_url = serializers.URLField(help_text="Stripe's payment page")
    status = serializers.ChoiceField(choices=TopUp.Status.choices)


class WebhookResultSerializer(serializers.Serializer):
    event = serializers.CharField(help_text="Stripe's event id")
    status = serializers.CharField()


class PayoutSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    amount = MoneySerializer()
    status = serializers.ChoiceField(choices=Payout.Status.choices)
    requested_at = serializers.DateTimeField()
    reviewed_at = serializers.DateTimeField(allow_null=True)
    reason = serializers.CharField(help_text="Why it was rejected, or why the transfer failed; else empty")
    stripe_transfer_id = serializers.CharField()


class OnboardingSerializer(serializers.Serializer):
    url = serializers.URLField(help_text="Stripe's page for setting up the payout account")


QUOTE_ERRORS = errors(400, 404, codes={400: "`invalid`, `bad_hparams`, `bad_rounds`, `bad_algorithm`, "
                                            "`incompatible_data`, `too_big`, ...", 404: "`not_found` (the dataset)"})
HOLD_ERRORS = errors(402, 409, 410, codes={402: "`insufficient_balance`", 409: "`quote_used`, `not_startable`",
                                           410: "`quote_expired`"})


class EstimateView(APIView):
    """What a job would cost, before anything is created: FLOPs, HU, price, peak memory."""

    permission_classes = [IsCustomer]

    @extend_schema(summary="Estimate a job", request=JobCreateSerializer,
                   responses={200: EstimateSerializer, **QUOTE_ERRORS})
    def post(self, request):
        choice = parse_choice(request)
        dataset = job_selectors.dataset_get(owner=request.user, dataset_id=choice["dataset"])
        plan = job_services.job_plan(dataset=dataset, template=choice["template"], hparams=choice["hparams"],
                                     rounds=choice["rounds"], base_weights=_base_weights(request, choice),
                                     training=training_choice(choice))
        est = plan.estimate
        minimum = money.to_nanos(settings.MUNINN_MIN_CHARGE_PER_JOB)
        price = money.quote_price(est.flops_total, settings.MUNINN_PRICE_PER_HU, minimum=minimum)
        return Response({
            "template": choice["template"], "hparams": plan.hparams, "rounds": choice["rounds"],
            **plan.scheme.fields(), "flops": est.flops_total, "flops_per_round": est.flops_per_round,
            "hu": hu_str(est.hu),
            "price": _money(price), "minimum_charge": _money(minimum),
            "price_per_hu": str(settings.MUNINN_PRICE_PER_HU),
            "work_price": _money(money.price_for_flops(est.flops_total, settings.MUNINN_PRICE_PER_HU, round_up=True)),
            "peak_memory_bytes": est.peak_memory_bytes,
        })


def quote_body(quote: Quote) -> dict:
    return {
        "id": str(quote.pk), "expires_at": quote.expires_at, "dataset": quote.dataset_id, "template": quote.template,
        "hparams": quote.hparams, "rounds": quote.rounds, "aggregation": quote.aggregation,
        **{name: getattr(quote, name) for name in TRAINING_FIELDS}, "flops": quote.flops,
        "hu": hu_str(money.flops_to_hu(quote.flops)), "price": _money(quote.price),
        "work_price": _money(quote.work_price), "minimum_charge": _money(quote.minimum_charge),
        "price_per_hu": str(quote.price_per_hu), "peak_memory_bytes": quote.peak_memory_bytes,
        "device_tier": selectors.quote_tier(quote),
        "devices_online": quote.devices_online, "devices_recent": quote.devices_recent,
        "expected_seconds": quote.expected_seconds,
        "job": quote.job_id, "accepted_at": quote.accepted_at,
    }


class QuoteListView(APIView):
    """A binding quote: HU, price, device tier and expected wall time. Accepting it starts the job."""

    permission_classes = [IsCustomer]
    online_capacity = None  # wired in muninn/urls.py: contributors/ knows the devices online
    recent_capable = None  # and the capable devices seen lately

    @extend_schema(summary="The latest 100 quotes", responses=QuoteSerializer(many=True))
    def get(self, request):
        return Response([quote_body(q) for q in selectors.quotes_for(customer=request.user)[:100]])

    @extend_schema(summary="Get a binding quote", request=JobCreateSerializer,
                   responses={201: QuoteSerializer, **QUOTE_ERRORS})
    def post(self, request):
        choice = parse_choice(request)
        dataset = job_selectors.dataset_get(owner=request.user, dataset_id=choice["dataset"])
        quote = services.quote_issue(customer=request.user, dataset=dataset, template=choice["template"],
                                     hparams=choice["hparams"], rounds=choice["rounds"],
                                     base_weights=_base_weights(request, choice), aggregation=choice["aggregation"],
                                     training=training_choice(choice), online_capacity=self.online_capacity,
                                     recent_capable=self.recent_capable)
        return Response(quote_body(quote), status=201)


class QuoteDetailView(APIView):
    permission_classes = [IsCustomer]

    @extend_schema(summary="A quote", responses=QuoteSerializer)
    def get(self, request, quote_id):
        return Response(quote_body(selectors.quote_get(customer=request.user, quote_id=quote_id)))


class QuoteAcceptView(APIView):
    permission_classes = [IsCustomer]

    @extend_schema(summary="Accept a quote: create the job and start it", request=None,
                   responses={201: JobDetailSerializer, **errors(400), **HOLD_ERRORS})
    def post(self, request, quote_id):
        job = services.quote_accept(customer=request.user, quote_id=quote_id)
        return Response(JobDetailSerializer(job).data, status=201)


class BalanceView(APIView):
    @extend_schema(summary="Balances and statement", responses=BalanceSerializer)
    def get(self, request):
        balances = selectors.balances_for(user=request.user)
        statement = []
        for e in selectors.statement_for(user=request.user)[:200]:
            txn = e.transaction
            statement.append({
                "id": e.pk, "at": txn.created_at, "account": e.account.kind, "kind": txn.kind,
                "amount": _money(e.amount), "memo": txn.memo, "job": txn.job_id,
                "round": txn.unit.round.number if txn.unit_id else None, "unit": txn.unit_id,
                "payout": txn.payout_id})
        return Response({"balances": {k: _money(v) for k, v in balances.items()}, "statement": statement})


class JobChargesView(APIView):
    permission_classes = [IsCustomer]

    @extend_schema(summary="A job's money: quoted, charged, released, held", responses=JobChargesSerializer)
    def get(self, request, job_id: int):
        job = job_selectors.job_get(owner=request.user, job_id=job_id)
        m = selectors.job_money(job=job)
        return Response({"job": job.pk, "quoted": _money(m["quoted"]), "charged": _money(m["charged"]),
                         "minimum": _money(m["minimum"]), "released": _money(m["released"]), "held": _money(m["held"]),
                         "hu_estimated": hu_str(job.hu_estimated),
                         "hu_charged": hu_str(money.flops_to_hu(m["flops_charged"]))})


@extend_schema_field({"type": "string", "format": "decimal", "pattern": r"^[0-9]{1,12}(\.[0-9]{1,2})?$",
                     "example": "20.00"})
class AmountField(serializers.DecimalField):
    """An amount in the currency, whole cents, as a decimal string ("20.00")."""


class AmountSerializer(StrictSerializer):
    amount = AmountField(max_digits=14, decimal_places=2, min_value=0)  # in the currency, e.g. "20.00"


class TopUpView(APIView):
    """Start a Stripe Checkout top-up; the balance is credited when Stripe tells us the payment succeeded."""

    permission_classes = [IsCustomer]

    @extend_schema(summary="Whether top-ups are on, and their limits", responses=TopUpLimitsSerializer)
    def get(self, request):
        return Response({"enabled": stripe_gateway.is_configured(),
                         "minimum": str(settings.MUNINN_TOPUP_MIN), "maximum": str(settings.MUNINN_TOPUP_MAX)})

    @extend_schema(summary="Start a top-up (Stripe Checkout)", request=AmountSerializer,
                   responses={201: TopUpSerializer, **errors(
                       400, 502, 503, codes={400: "`invalid`, `below_minimum`, `above_maximum`, `bad_amount`"})})
    def post(self, request):
        stripe_gateway.require_configured("Top-ups")
        data = AmountSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        topup = payments.topup_start(customer=request.user, amount=data.validated_data["amount"])
        return Response({"id": topup.pk, "amount": _money(topup.amount), "checkout_url": topup.checkout_url,
                         "status": topup.status}, status=201)


class StripeWebhookView(APIView):
    """Stripe's signed events. No session or token: the signature is the authentication."""

    authentication_classes: list = []
    permission_classes = [AllowAny]

    @extend_schema(summary="Stripe's webhook", request=OpenApiTypes.OBJECT,
                   parameters=[OpenApiParameter("Stripe-Signature", str, OpenApiParameter.HEADER, required=True,
                                                description="Stripe's signature of the body")],
                   responses={200: WebhookResultSerializer, **errors(400, 503, codes={
                       400: "`bad_signature`, `bad_payload`, `unknown_event_type`"})})
    def post(self, request):
        event = payments.webhook_receive(payload=request.body,
                                         signature=request.META.get("HTTP_STRIPE_SIGNATURE", ""))
        return Response({"event": event.stripe_id, "status": event.status})


def payout_body(payout: Payout) -> dict:
    return {"id": payout.pk, "amount": _money(payout.amount), "status": payout.status,
            "requested_at": payout.requested_at, "reviewed_at": payout.reviewed_at,
            "reason": payout.review_reason if payout.status == Payout.Status.REJECTED else payout.failure,
            "stripe_transfer_id": payout.stripe_transfer_id}


class PayoutOnboardingView(APIView):
    permission_classes = [IsContributor]

    @extend_schema(summary="Set up the Stripe payout account", request=None,
                   responses={201: OnboardingSerializer, **errors(502, 503)})
    def post(self, request):
        return Response({"url": payouts.payout_account_onboard(contributor=request.user)}, status=201)


class PayoutListView(APIView):
    permission_classes = [IsContributor]

    @extend_schema(summary="The latest 100 payouts", responses=PayoutSerializer(many=True))
    def get(self, request):
        return Response([payout_body(p) for p in selectors.payouts_for(contributor=request.user)[:100]])

    @extend_schema(summary="Ask for a payout of available earnings", request=AmountSerializer,
                   responses={201: PayoutSerializer, **errors(400, 402, 409, codes={
                       400: "`invalid`, `below_minimum`, `bad_amount`", 402: "`above_available`",
                       409: "`payout_account_not_ready`"})})
    def post(self, request):
        data = AmountSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        payout = payouts.payout_request(contributor=request.user,
                                        amount=money.to_nanos(data.validated_data["amount"]))
        return Response(payout_body(payout), status=201)
