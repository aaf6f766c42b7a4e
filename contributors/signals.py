"""Events contributors/ raises so that its task layer (contributors/tasks.py) enqueues the work they call for:
services never import tasks. Receivers run inside the sender's transaction and enqueue on its commit."""
from django.dispatch import Signal

reexecution_due = Signal()  # kwargs: unit_id; a result the site's validator checks now (whole, or its segments)
credit_due = Signal()  # kwargs: job_id; accepted results of the job wait for their charge (contributors.credit)
