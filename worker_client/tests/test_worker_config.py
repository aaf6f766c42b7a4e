"""Config: flag > env > file > default, and the token file is private."""

from __future__ import annotations

import stat

import pytest

from muninn_worker.config import Config, ConfigError, config_path, first_set, load_config, save_config


def test_config_path_precedence(tmp_path):
    env = {"MUNINN_WORKER_CONFIG": str(tmp_path / "env.json"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}

    assert config_path(str(tmp_path / "flag.json"), env) == tmp_path / "flag.json"
    assert config_path(None, env) == tmp_path / "env.json"
    assert config_path(None, {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg/muninn-worker/config.json"


def test_first_set_skips_unset_and_empty_values():
    assert first_set(None, "", "env", "file") == "env"
    assert first_set("flag", "env") == "flag"
    assert first_set(None, None) is None


def test_save_then_load_roundtrips_with_private_permissions(tmp_path):
    path = tmp_path / "dir" / "config.json"
    config = Config(server="http://s", device_token="secret", device_id=7, name="laptop", cache_dir="/c")

    save_config(config, path)

    assert load_config(path) == config
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_missing_file_is_an_empty_config(tmp_path):
    assert load_config(tmp_path / "none.json") == Config()


def test_broken_file_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{nope")

    with pytest.raises(ConfigError, match="config.json"):
        load_config(path)
