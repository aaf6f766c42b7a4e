"""Money pages: the balance and statement, Stripe Checkout top-ups, and the new-job form with its live quote.
Thin doors into billing's services and selectors (and jobs' for the datasets and templates)."""
from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib import messages
from django.core.paginator import InvalidPage, Paginator
from django.http import Http404
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from accounts.pages import role_required
from jobs import suggest
from jobs import selectors as job_selectors
from jobs.hu import flops_to_hu, hu_str
from jobs.models import Job
from muninn.errors import InvalidInput, MuninnError
from muninn_worker import zoo
from muninn_worker.federated import algorithms

from . import money, payments, selectors, services, stripe_gateway
from .forms import AmountForm, CreditForm
from .models import Account, Quote

CUSTOMER_ACCOUNTS = (Account.Kind.CUSTOMER_AVAILABLE, Account.Kind.CUSTOMER_HELD)
CONTRIBUTOR_ACCOUNTS = (Account.Kind.CONTRIBUTOR_PENDING, Account.Kind.CONTRIBUTOR_HELD,
                        Account.Kind.CONTRIBUTOR_AVAILABLE, Account.Kind.CONTRIBUTOR_IN_REVIEW,
                        Account.Kind.CONTRIBUTOR_PAID_OUT)


def _fmt(nanos: int) -> str:
    return money.format_money(nanos, settings.MUNINN_CURRENCY)


STATEMENT_PAGE_SIZE = 50


def _statement_page(request, user):
    """One page of the statement (?page=N, newest first); a page that is not there is a 404."""
    paginator = Paginator(selectors.statement_for(user=user), STATEMENT_PAGE_SIZE)
    try:
        return paginator.page(request.GET.get("page", 1))
    except InvalidPage as e:
        raise Http404(f"The statement has no page {request.GET.get('page')!r}.") from e


@role_required("customer", "contributor")
def balance(request):
    """Balances and the statement of every ledger entry on the user's accounts; customers top up here."""
    user = request.user
    balances = selectors.balances_for(user=user)
    kinds = CUSTOMER_ACCOUNTS if user.role == "customer" else CONTRIBUTOR_ACCOUNTS
    topup = None
    if request.GET.get("topup", "").isdigit():
        topup = selectors.topups_for(customer=user).filter(pk=int(request.GET["topup"])).first()
    context = {
        "balances": [(Account.Kind(kind).label, balances.get(kind, 0)) for kind in kinds],
        "statement": _statement_page(request, user), "topup": topup,
        "form": AmountForm(initial={"amount": "20.00"}), "stripe_enabled": stripe_gateway.is_configured(),
        "topup_min": settings.MUNINN_TOPUP_MIN, "topup_max": settings.MUNINN_TOPUP_MAX,
        "currency": settings.MUNINN_CURRENCY,
    }
    return render(request, "billing/balance.html", context)


@require_POST
@role_required("customer")
def topup(request):
    """Start a Checkout top-up and send the customer to Stripe's payment page; the webhook credits the balance."""
    form = AmountForm(request.POST)
    if not form.is_valid():
        messages.error(request, " ".join(form.errors["amount"]))
        return redirect("balance-page")
    try:
        started = payments.topup_start(customer=request.user, amount=form.cleaned_data["amount"])
    except MuninnError as e:
        messages.error(request, e.message)
        return redirect("balance-page")
    return redirect(started.checkout_url)


# --- Staff: credit a customer's balance by hand -------------------------------------------------------

@require_http_methods(["GET", "POST"])
@role_required("staff")
def staff_credit(request):
    """Credit a customer's balance (a `grant` on the ledger, audited: who, when, why), e.g. when Stripe is off; the
    latest credits are listed under the form."""
    form = CreditForm(request.POST if request.method == "POST" else None)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        customer = selectors.customer_named(username=data["customer"])
        if customer is None:
            form.add_error("customer", f"No customer is called {data['customer']!r} (check the username; only "
                                       "customer accounts have a balance to credit).")
        else:
            try:
                services.balance_grant(user=customer, amount=money.to_nanos(data["amount"]), reason=data["reason"],
                                       granted_by=request.user)
            except MuninnError as e:
                form.add_error(None, e.message)
            else:
                messages.success(request, f"Credited {_fmt(money.to_nanos(data['amount']))} to "
                                          f"{customer.username}: {data['reason']}")
                return redirect("staff-credit-page")
    return render(request, "billing/staff_credit.html", {"form": form, "credits": selectors.credits_recent()},
                  status=400 if form.errors else 200)


# --- New job: choose, see the quote, accept ---------------------------------------------------------

def _parse_value(kind: str, text: str):
    """A form field's text as the hyper-parameter's type; a value that does not parse is passed on as text,
    so the template's validation names the field."""
    text = text.strip()
    try:
        if kind == "int_list":
            return [int(part) for part in text.replace("[", "").replace("]", "").split(",") if part.strip()]
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        return text
    return text


DILOCO_FIELDS = {"outer_lr": "float", "outer_momentum": "float", "inner_steps": "int"}


def _choice_from_post(post, datasets) -> dict:
    template = post.get("template", "")
    hparams = {}
    if template in zoo.TEMPLATES:
        for h in zoo.get_template(template).hparams:
            text = post.get(f"hp-{template}-{h.name}", "")
            if text.strip():
                hparams[h.name] = _parse_value(h.kind, text)
    algorithm = post.get("algorithm", "") or "fedavg"
    training = {"algorithm": algorithm, "update_encoding": post.get("update_encoding", "") or None}
    if algorithm == "diloco":  # DiLoCo's settings only: the form disables them for FedAvg, which refuses them
        for name, kind in DILOCO_FIELDS.items():
            text = post.get(name, "")
            training[name] = _parse_value(kind, text) if text.strip() else None
    return {"dataset": post.get("dataset", ""), "template": template, "rounds": post.get("rounds", ""),
            "aggregation": post.get("aggregation", Job.Aggregation.FEDAVG), "hparams": hparams,
            "base_weights": post.get("base_weights", ""), "training": training}


def _issue(request, choice: dict, online_capacity, recent_capable) -> Quote:
    try:
        dataset_id, rounds = int(choice["dataset"]), int(choice["rounds"])
        base_id = int(choice["base_weights"]) if choice["base_weights"] else None
    except (TypeError, ValueError):
        raise InvalidInput("Choose a dataset and a whole number of rounds.", code="invalid",
                           detail={"field": "rounds" if choice["dataset"] else "dataset"}) from None
    dataset = job_selectors.dataset_get(owner=request.user, dataset_id=dataset_id)
    base = None if base_id is None else job_selectors.dataset_get(owner=request.user, dataset_id=base_id)
    if choice["aggregation"] not in Job.Aggregation.values:
        raise InvalidInput("Choose an aggregation rule from the list.", code="invalid", detail={"field": "aggregation"})
    return services.quote_issue(customer=request.user, dataset=dataset, template=choice["template"],
                                hparams=choice["hparams"], rounds=rounds, base_weights=base,
                                aggregation=choice["aggregation"], training=choice["training"],
                                online_capacity=online_capacity,
                                recent_capable=recent_capable)


def quote_view(quote: Quote | None) -> dict | None:
    """The quote as the page shows it (the same numbers as GET /api/quotes/<id>)."""
    if quote is None:
        return None
    tier = selectors.quote_tier(quote)
    return {"id": str(quote.pk), "flops": quote.flops, "price_nanos": quote.price,
            "minimum_charge_nanos": quote.minimum_charge,
            "device_tier": quote.device_tier, "tier_line": tier["line"], "warning": tier["warning"],
            "expected_seconds": quote.expected_seconds,
            "devices_online": quote.devices_online, "expires_at": quote.expires_at}


@role_required("customer")
def job_new(request, online_capacity=None, recent_capable=None):
    """Pick a dataset, a model template and its hyper-parameters (defaults from the data's profile); the quote
    (HU, price, device tier, expected time, capable devices online) follows the form as it changes (the page's
    script asks POST /api/quotes); accepting it holds the price and starts the job. Without the script the
    form's "Get a quote" button does the same here."""
    all_datasets = list(job_selectors.datasets_for(owner=request.user))
    datasets = [d for d in all_datasets if d.profile.get("kind") != "weights"]
    weights = [d for d in all_datasets if d.profile.get("kind") == "weights"]
    post = request.POST if request.method == "POST" else None
    selected = next((d for d in datasets if str(d.pk) == (post or request.GET).get("dataset", "")),
                    datasets[0] if datasets else None)
    profile = selected.profile if selected else {}
    quote, error = None, None
    choice = _choice_from_post(post, datasets) if post else None
    if post is not None and selected is None:
        error = MuninnError("Upload a dataset first: a job trains on one of your datasets.", code="no_dataset")
    elif post is not None:
        try:
            if post.get("action") == "accept":
                if not _is_uuid(post.get("quote", "")):
                    raise InvalidInput("Get a quote first: the job starts when you accept its quote.",
                                       code="no_quote")
                job = services.quote_accept(customer=request.user, quote_id=post.get("quote", ""))
                messages.success(request, f"Job {job.pk} started: its quoted price is held from your balance.")
                return redirect("job-page", job_id=job.pk)
            quote = _issue(request, choice, online_capacity, recent_capable)
        except MuninnError as e:
            error = e
            if post.get("action") == "accept" and post.get("quote"):
                quote = selectors.quotes_for(customer=request.user).filter(pk=post["quote"]).first() \
                    if _is_uuid(post["quote"]) else None
    templates = [zoo.get_template(name).describe() for name in suggest.templates_for(profile)] if selected else []
    for t in templates:
        defaults = suggest.hparams_for(t["name"], profile)
        for h in t["hparams"]:
            value = choice["hparams"].get(h["name"]) if choice and choice["template"] == t["name"] else None
            value = defaults[h["name"]] if value is None else value
            h["value"] = ", ".join(str(v) for v in value) if isinstance(value, list) else value
    context = {
        "datasets": datasets, "weights": weights, "selected": selected, "profile": profile, "templates": templates,
        "template": (choice or {}).get("template") or (templates[0]["name"] if templates else ""),
        "rounds": (choice or {}).get("rounds") or suggest.DEFAULT_ROUNDS,
        "aggregations": Job.Aggregation.choices, "aggregation": (choice or {}).get("aggregation", "fedavg"),
        **_training_context((choice or {}).get("training") or {}),
        "quote": quote_view(quote), "error": error,
        "balance": selectors.balances_for(user=request.user).get(Account.Kind.CUSTOMER_AVAILABLE, 0),
    }
    return render(request, "billing/job_new.html", context, status=400 if error else 200)


def _training_context(training: dict) -> dict:
    """The algorithm and update-encoding controls: the choices, what is chosen, and DiLoCo's settings with the
    defaults the site would use (muninn_worker.federated.algorithms)."""
    chosen = {name: training.get(name) for name in DILOCO_FIELDS}
    defaults = {"outer_lr": algorithms.DEFAULT_OUTER_LR, "outer_momentum": algorithms.DEFAULT_OUTER_MOMENTUM,
                "inner_steps": algorithms.DEFAULT_INNER_STEPS}
    return {"algorithms": ALGORITHM_CHOICES, "algorithm": training.get("algorithm") or "fedavg",
            "encodings": ENCODING_CHOICES, "update_encoding": training.get("update_encoding")
            or algorithms.DEFAULT_ENCODING,
            "diloco": {name: defaults[name] if value is None else value for name, value in chosen.items()},
            "max_inner_steps": algorithms.MAX_INNER_STEPS, "max_outer_lr": algorithms.MAX_OUTER_LR}


ALGORITHM_LABELS = {
    "fedavg": "FedAvg: each device trains `epochs` passes over its shard; the updates are averaged",
    "diloco": "DiLoCo: each device trains `inner_steps` steps; an outer Nesterov step applies the averaged change"}
ENCODING_LABELS = {"fp32": "fp32: exact", "fp16": "fp16: about half the upload",
                   "int8": "int8: about a quarter of the upload (one scale per tensor)"}
ALGORITHM_CHOICES = [(name, ALGORITHM_LABELS[name]) for name in algorithms.ALGORITHMS]
ENCODING_CHOICES = [(name, ENCODING_LABELS[name]) for name in algorithms.ENCODINGS]


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def job_money_panel(job: Job) -> dict:
    """For the job page (passed in by muninn/urls.py): the work used against the quote, and the money, as exact
    figures (HU strings, FLOPs and nano-units): the page's filters and its script (Muninn.figures) round them."""
    m = selectors.job_money(job=job)
    return {"money": {"hu_quoted": hu_str(job.hu_estimated), "hu_used": hu_str(flops_to_hu(m["flops_charged"])),
                      "flops_quoted": job.flops_estimated, "flops_used": m["flops_charged"],
                      "currency": settings.MUNINN_CURRENCY,
                      **{f"{kind}_nanos": m[kind] for kind in ("quoted", "charged", "released", "held", "minimum")}}}
