"""Events accounts/ raises so that apps above it (billing/) can act without accounts/ importing them."""
from django.dispatch import Signal

# kwargs: user. Sent inside the sign-up's transaction (a receiver that raises undoes the sign-up).
user_signed_up = Signal()
