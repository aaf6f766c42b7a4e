from django.urls import path

from muninn import converters  # noqa: F401  registers <id:...>

from . import api

urlpatterns = [
    path("devices", api.DeviceRegisterView.as_view(), name="worker-device-register"),
    path("claim", api.ClaimView.as_view(), name="worker-claim"),
    path("units/<id:unit_id>/weights", api.UnitWeightsView.as_view(), name="worker-unit-weights"),
    path("units/<id:unit_id>/shard", api.UnitShardView.as_view(), name="worker-unit-shard"),
    path("units/<id:unit_id>/base", api.UnitBaseView.as_view(), name="worker-unit-base"),
    path("units/<id:unit_id>/heartbeat", api.HeartbeatView.as_view(), name="worker-unit-heartbeat"),
    path("units/<id:unit_id>/result", api.ResultView.as_view(), name="worker-unit-result"),
    path("units/<id:unit_id>/release", api.GiveBackView.as_view(), name="worker-unit-release"),
    path("units/<id:unit_id>/checkpoints/<id:boundary>", api.CheckpointView.as_view(),
         name="worker-unit-checkpoint"),
    path("challenges", api.ChallengesView.as_view(), name="worker-challenges"),
    path("me", api.DeviceStatusView.as_view(), name="worker-me"),
    path("checks/<id:check_id>/start", api.CheckStartView.as_view(), name="worker-check-start"),
    path("checks/<id:check_id>/shard", api.CheckShardView.as_view(), name="worker-check-shard"),
    path("checks/<id:check_id>/base", api.CheckBaseView.as_view(), name="worker-check-base"),
    path("checks/<id:check_id>/result", api.CheckResultView.as_view(), name="worker-check-result"),
]
