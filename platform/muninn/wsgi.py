import os

import torch
from django.core.wsgi import get_wsgi_application

# The web only evaluates tiny batches (a result's loss check on 64 samples). One torch thread per request
# thread: the server's threads × torch's own pool would oversubscribe the cores and make every request wait.
torch.set_num_threads(int(os.environ.get("MUNINN_WEB_TORCH_THREADS", "1")))

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "muninn.settings")
application = get_wsgi_application()

# The Celery app's tasks bound now, not inside the first request that queues one (its first accepted result):
# binding reads every task's options from the settings, 17 ms alone but ~7 % of the web's sampled CPU over 15 s
# under bench/load.py, held under the GIL beside busy threads.
from muninn import celery_app  # noqa: E402

celery_app.finalize(auto=True)

# Held long-poll claims end at once when gunicorn tells this worker to stop (jobs/wakeups.py says what granian does).
from jobs import wakeups  # noqa: E402  (after Django is set up)

wakeups.stop_waiting_on_sigterm()
wakeups.warm_up()  # the wake-up carrier (its Redis client) made now, not inside the first waiting claim

# A customer's first quote counts FLOPs, whose first count imports torch._dynamo (~1.1 s under the GIL): now.
from muninn_worker import flops  # noqa: E402

flops.warm_up()

# Everything start-up made is exempt from the garbage collector's full passes, which walked it all every few
# seconds under load (120-240 ms each, the whole process stopped; muninn_worker.heap).
from muninn_worker import heap  # noqa: E402

heap.freeze()
