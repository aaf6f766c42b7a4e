#!/usr/bin/env python
"""Django's command-line utility for Muninn."""
import os
import sys
from pathlib import Path

# The Django project lives in platform/ (not a package: `platform` would shadow the standard library);
# the importable settings package inside it is `muninn`.
sys.path.insert(1, str(Path(__file__).resolve().parent / "platform"))


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "muninn.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
