"""The contributor's install commands have one source (contributors/install.py): the contributor page shows them,
and README.md and worker_client/README.md say the same."""
from __future__ import annotations

import html
from pathlib import Path

import pytest
from django.test import Client

from contributors import install

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "worker_client" / "README.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_docs_give_the_same_install_commands_as_the_contributor_page(doc):
    text = doc.read_text()
    for command in (*install.commands(), install.RUN):
        assert command in text, command
    assert f"Python {install.PYTHON}+" in text
    assert not any(line.strip().startswith("pip install muninn-worker") for line in text.splitlines())


def test_the_python_version_is_what_the_client_declares():
    assert f'requires-python = ">={install.PYTHON}"' in (ROOT / "worker_client" / "pyproject.toml").read_text()


@pytest.mark.django_db
def test_the_contributor_page_shows_the_install_commands(contributor):
    client = Client()
    client.force_login(contributor)

    page = html.unescape(client.get("/contribute/").content.decode())  # as the page reads (and copies)

    assert "\n".join(install.commands("http://testserver")) + "</pre>" in page
    assert f"Python {install.PYTHON}+" in page and f">{install.RUN}</pre>" in page
