import os

import torch
from django.core.wsgi import get_wsgi_application

# The web only evaluates tiny batches (a result's loss check on 64 samples). One torch thread per request
# thread: gunicorn's threads × torch's own pool would oversubscribe the cores and make every request wait.
torch.set_num_threads(int(os.environ.get("MUNINN_WEB_TORCH_THREADS", "1")))

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "muninn.settings")
application = get_wsgi_application()

# Held long-poll claims end at once when gunicorn tells this worker to stop (jobs/wakeups.py).
from jobs.wakeups import stop_waiting_on_sigterm  # noqa: E402  (after Django is set up)

stop_waiting_on_sigterm()
