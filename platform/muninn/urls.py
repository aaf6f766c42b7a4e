from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView

from accounts import api as accounts_api
from billing import api as billing_api
from billing import selectors as billing_selectors
from billing import views as billing_views
from contributors import api as contributors_api
from contributors import selectors as contributors_selectors
from contributors import views as contributors_views
from jobs import api as jobs_api
from jobs import views as jobs_views

from . import views
from . import converters  # noqa: F401  registers <id:...>

api = [
    path("auth/signup", accounts_api.SignupView.as_view(), name="signup"),
    path("auth/token", accounts_api.TokenView.as_view(), name="token"),
    path("me", accounts_api.MeView.as_view(), name="me"),
    path("templates", jobs_api.TemplateListView.as_view(), name="templates"),
    path("datasets", jobs_api.DatasetListView.as_view(), name="datasets"),
    path("datasets/<id:dataset_id>", jobs_api.DatasetDetailView.as_view(), name="dataset"),
    path("estimates", billing_api.EstimateView.as_view(), name="estimate"),
    # Quotes need the devices online: contributors/ sits above billing/, so the project wires them here.
    path("quotes", billing_api.QuoteListView.as_view(online_capacity=contributors_selectors.device_capacities_online,
                                                     recent_capable=contributors_selectors.capable_devices_seen),
         name="quotes"),
    path("quotes/<uuid:quote_id>", billing_api.QuoteDetailView.as_view(), name="quote"),
    path("quotes/<uuid:quote_id>/accept", billing_api.QuoteAcceptView.as_view(), name="quote-accept"),
    path("jobs", jobs_api.JobListView.as_view(), name="jobs"),
    path("jobs/<id:job_id>", jobs_api.JobDetailView.as_view(capacity=contributors_selectors.capacity_for),
         name="job"),
    path("jobs/<id:job_id>/start", jobs_api.JobStartView.as_view(), name="job-start"),
    path("jobs/<id:job_id>/cancel", jobs_api.JobCancelView.as_view(), name="job-cancel"),
    path("jobs/<id:job_id>/model", jobs_api.JobModelView.as_view(), name="job-model"),
    path("jobs/<id:job_id>/predict", jobs_api.JobPredictView.as_view(), name="job-predict"),
    path("jobs/<id:job_id>/predictions", jobs_api.JobPredictionListView.as_view(), name="job-predictions"),
    path("jobs/<id:job_id>/predictions/<id:batch_id>", jobs_api.JobPredictionDetailView.as_view(),
         name="job-prediction"),
    path("jobs/<id:job_id>/predictions/<id:batch_id>/csv", jobs_api.JobPredictionCsvView.as_view(),
         name="job-prediction-csv"),
    # The certificate states receipts (contributors/) and money (billing/), which sit above jobs/.
    path("jobs/<id:job_id>/certificate",
         jobs_api.JobCertificateView.as_view(evidence=contributors_selectors.job_units_evidence,
                                             money=billing_selectors.job_charges), name="job-certificate"),
    path("jobs/<id:job_id>/charges", billing_api.JobChargesView.as_view(), name="job-charges"),
    path("jobs/<id:job_id>/devices", contributors_api.JobDevicesView.as_view(), name="job-devices"),
    path("jobs/<id:job_id>/shard-downloads", contributors_api.JobShardDownloadsView.as_view(),
         name="job-shard-downloads"),
    path("balance", billing_api.BalanceView.as_view(), name="balance"),
    path("topups", billing_api.TopUpView.as_view(), name="topups"),
    path("stripe/webhook", billing_api.StripeWebhookView.as_view(), name="stripe-webhook"),
    path("payouts", billing_api.PayoutListView.as_view(), name="payouts"),
    path("payouts/onboarding", billing_api.PayoutOnboardingView.as_view(), name="payout-onboarding"),
    path("schema", SpectacularAPIView.as_view(), name="schema"),
    # Swagger UI from static/ (drf-spectacular-sidecar); its start-up script is /api/docs?script, not inline
    path("docs", SpectacularSwaggerSplitView.as_view(template_name="api_docs.html"), name="api-docs"),
]

# The web UI. The job page shows money and devices, which live above jobs/: the project wires them in, as it
# wires the devices online into quotes.
job_panels = {"panels": (billing_views.job_money_panel, contributors_views.job_devices_panel)}
pages = [
    path("datasets/", jobs_views.datasets, name="datasets-page"),
    path("datasets/<id:dataset_id>/", jobs_views.dataset_detail, name="dataset-page"),
    path("jobs/", jobs_views.jobs_list, name="jobs-list"),
    path("jobs/new/", billing_views.job_new, {"online_capacity": contributors_selectors.device_capacities_online,
                                              "recent_capable": contributors_selectors.capable_devices_seen},
         name="job-new"),
    path("jobs/<id:job_id>/", jobs_views.job_detail,
         {**job_panels, "sections": (contributors_views.job_exposure_section,)}, name="job-page"),
    path("jobs/<id:job_id>/progress", jobs_views.job_progress, job_panels, name="job-progress"),
    path("jobs/<id:job_id>/cancel", jobs_views.job_cancel, name="job-cancel-page"),
    path("balance/", billing_views.balance, name="balance-page"),
    path("balance/topup", billing_views.topup, name="topup-page"),
    path("contribute/", contributors_views.contribute, name="contribute"),
    path("contribute/browser/", contributors_views.contribute_browser, name="contribute-browser"),
    path("downloads/<str:filename>", contributors_views.worker_wheel, name="worker-wheel"),
    path("contribute/payouts/onboarding", contributors_views.payout_onboarding, name="payout-onboarding-page"),
    path("contribute/payouts/request", contributors_views.payout_request, name="payout-request-page"),
    path("staff/", contributors_views.staff_home, name="staff-home"),
    path("staff/credits/", billing_views.staff_credit, name="staff-credit-page"),
    path("staff/devices/<id:device_id>/lift", contributors_views.device_lift_quarantine, name="device-lift-page"),
    path("staff/devices/<id:device_id>/release-held", contributors_views.device_release_held,
         name="device-release-held-page"),
    path("staff/devices/<id:device_id>/forfeit-held", contributors_views.device_forfeit_held,
         name="device-forfeit-held-page"),
]

urlpatterns = [
    # First: the worker API is most of the site's requests, and URLs are matched in order (one regular expression
    # per pattern tried: ~5 % of a worker request's CPU when it came after the other sixty).
    path("api/worker/", include("contributors.urls")),
    path("", views.home, name="home"),
    path("", include("accounts.urls")),
    *pages,
    path("healthz", views.healthz, name="healthz"),
    path(".well-known/muninn-signing-key", views.signing_key, name="signing-key"),
    path("admin/", admin.site.urls),
    path("api/", include(api)),
]

handler404 = "muninn.views.not_found"  # JSON under /api/, the site's page elsewhere
