"""The password hasher of the suite's own users."""
from django.contrib.auth.hashers import PBKDF2PasswordHasher


class SuitePBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """The site's hasher (Django's PBKDF2-SHA256) at a thousandth of its iterations: the suite makes a few users
    for most of its ~950 tests, and each at the site's 1,000,000 iterations costs 0.6 s of CPU on the 2-core dev
    machine. Its hashes carry the algorithm's name and their own iteration count, so the live stacks' sites,
    which run on the real settings, verify them as they are (and upgrade one on its first login)."""

    iterations = 1_000
