"""The site's own Ed25519 key, which signs training certificates. Kept out of the database (a leaked dump must not
let anyone sign for the site): MUNINN_SIGNING_KEY (base64 of the 32 raw private bytes), else the file named by
MUNINN_SIGNING_KEY_FILE, else MUNINN_VAR_DIR/signing-key, made on first use (0600) and read on every start after,
so one machine's `make run` keeps its key across restarts. A named file that is missing is an error, never replaced
by a new key: certificates signed before must stay verifiable with the published key."""
from __future__ import annotations

import base64
import binascii
import os
import tempfile
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from muninn_worker import signing

ALGORITHM = "Ed25519"
_LOADED: dict[tuple[str, str, str], str] = {}


def private_key() -> str:
    """The site's private key, base64."""
    source = (settings.MUNINN_SIGNING_KEY, settings.MUNINN_SIGNING_KEY_FILE, str(settings.VAR_DIR))
    if source not in _LOADED:
        _LOADED[source] = _load(*source)
    return _LOADED[source]


def public_key() -> str:
    """The site's public key, base64: what /.well-known/muninn-signing-key serves."""
    return signing.public_key_of(private_key())


def _load(value: str, named_file: str, var_dir: str) -> str:
    if value:
        return _valid(value, "MUNINN_SIGNING_KEY")
    if named_file:
        try:
            return _valid(Path(named_file).read_text(), f"MUNINN_SIGNING_KEY_FILE ({named_file})")
        except OSError as e:
            raise ImproperlyConfigured(f"MUNINN_SIGNING_KEY_FILE {named_file} cannot be read: {e.strerror}") from None
    path = Path(var_dir) / "signing-key"
    if not path.exists():
        _create(path)
    return _valid(path.read_text(), str(path))


def _create(path: Path) -> None:
    """Write a new key so that of several processes starting at once, exactly one key wins and all read it: the key
    goes to a private temporary file first, then is hard-linked into place, which fails when a key is there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".signing-key-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(signing.new_private_key() + "\n")
        os.link(temporary, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(temporary)


def _valid(text: str, where: str) -> str:
    key = text.strip()
    try:
        raw = base64.b64decode(key, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != 32:
        raise ImproperlyConfigured(f"{where} is not an Ed25519 private key: expected base64 of 32 raw bytes")
    return key
