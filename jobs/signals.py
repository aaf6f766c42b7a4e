"""Events jobs/ raises so that billing/ can act without jobs/ importing it (apps depend downward only).

Receivers run inside the sender's transaction: a receiver that raises (e.g. the balance is short) aborts it.
"""
from django.dispatch import Signal

job_started = Signal()  # kwargs: job, quote (the id of the quote the customer accepts, or None)
job_ending = Signal()  # kwargs: job; sent before its status changes, so work already done is settled first
job_ended = Signal()  # kwargs: job (status is SUCCEEDED, FAILED or CANCELLED)
round_complete = Signal()  # kwargs: round_id; every unit of the open round is done: the task layer aggregates it
prediction_batch_created = Signal()  # kwargs: batch_id; a file to predict: the task layer predicts it on commit
