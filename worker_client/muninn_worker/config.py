"""Where the worker's settings come from: CLI flag > environment variable > config file > default.

The config file (JSON) holds what `register` learned: server, device_token, device_id, name, cache_dir.
It holds a secret, so it is written 0600 inside a 0700 directory, atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

__all__ = [
    "CLAIM_WAIT",
    "Config",
    "ConfigError",
    "ENV_SERVER",
    "ENV_TOKEN",
    "ENV_CONFIG",
    "ENV_CACHE_DIR",
    "config_path",
    "default_cache_dir",
    "load_config",
    "save_config",
    "first_set",
]

ENV_SERVER = "MUNINN_SERVER"
ENV_TOKEN = "MUNINN_TOKEN"  # the contributor's account token, for `register`
ENV_CONFIG = "MUNINN_WORKER_CONFIG"
ENV_CACHE_DIR = "MUNINN_CACHE_DIR"
CLAIM_WAIT = 25.0  # seconds a site may hold an empty claim until a unit is queued (a long poll; it allows 30)


class ConfigError(ValueError):
    """The config file exists but cannot be used; the message says which file and why."""


@dataclass
class Config:
    server: str | None = None
    device_token: str | None = None
    device_id: int | None = None
    name: str | None = None
    cache_dir: str | None = None
    signing_key: str | None = None  # the device's Ed25519 private key (base64); receipts are signed with it


def first_set(*values: str | None) -> str | None:
    """The first value that is set (not None and not empty): flag, then env var, then file."""
    return next((v for v in values if v not in (None, "")), None)


def config_path(flag: str | None = None, env: Mapping[str, str] = os.environ) -> Path:
    """--config, else $MUNINN_WORKER_CONFIG, else ~/.config/muninn-worker/config.json."""
    chosen = first_set(flag, env.get(ENV_CONFIG))
    if chosen:
        return Path(chosen).expanduser()
    base = env.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "muninn-worker" / "config.json"


def default_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    base = env.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "muninn-worker"


def load_config(path: Path) -> Config:
    """The saved config, or an empty one when the file does not exist yet."""
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return Config()
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    try:
        data = json.loads(raw)
    except ValueError:
        raise ConfigError(f"the config file {path} is not valid JSON") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the config file {path} must hold a JSON object")
    known = {f.name for f in fields(Config)}
    return Config(**{key: value for key, value in data.items() if key in known})


def save_config(config: Config, path: Path) -> None:
    """Write atomically with mode 0600 (the file holds the device token)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=".config-")
    try:
        os.chmod(tmp_name, 0o600)  # mkstemp already uses 0600 on POSIX; say it anyway
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            json.dump(asdict(config), tmp, indent=2)
            tmp.write("\n")
        os.replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    os.chmod(path, 0o600)
