"""training.warm_up pays torch's first-use costs before any round waits on them (the worker client calls it
before its first claim, the site's Celery processes when they start: platform/muninn/celery.py). It must leave
nothing behind that a unit's training could notice: the random state, the thread count, the grad mode."""
from __future__ import annotations

import torch

from muninn_worker import training


def test_warm_up_leaves_the_random_state_threads_and_grad_mode_as_they_were():
    torch.manual_seed(1234)
    state, threads, grad = torch.get_rng_state(), torch.get_num_threads(), torch.is_grad_enabled()

    seconds = training.warm_up()

    assert seconds > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.get_num_threads() == threads and torch.is_grad_enabled() == grad
