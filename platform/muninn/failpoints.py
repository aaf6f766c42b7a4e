"""The site's failpoints, named by MUNINN_FAILPOINTS (see muninn_worker/failpoints.py for the syntax).

Used by the fault suite (tests/test_faults.py) to pause a web or Celery process at a chosen place and then kill
or restart something; unset (always, outside that suite) each call is one dictionary lookup. The names:

    aggregate.before_commit   jobs.services.round_aggregate: the new global model is computed, not yet committed
    verify.before_commit      contributors.verification.unit_verify: re-executed, the verdict not yet committed
    result.before_commit      contributors.results: a device's result checked, its acceptance not yet sent
    credit.before_commit      contributors.credit: a batch of accepted units charged, not yet committed
    claim.before_lease_row    contributors.services.unit_claim: a unit leased, its Lease row not yet written
    blob.created              jobs.storage: a blob's file created (exclusively), its bytes not yet written
"""
from muninn_worker.failpoints import Failpoints

SITE_ENV = "MUNINN_FAILPOINTS"

_site = Failpoints(SITE_ENV)


def failpoint(name: str) -> None:
    _site.hit(name)
