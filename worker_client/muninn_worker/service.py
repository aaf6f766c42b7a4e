"""`muninn-worker service install`: start the worker at login, in the background, as the user's own service.

Linux gets a systemd user unit (written to ~/.config/systemd/user/muninn-worker.service); macOS a launchd agent
and Windows a Task Scheduler command, printed for the owner to install. Each runs this very Python with `-m
muninn_worker run` and the config and options chosen. The texts are built by pure functions over plain values.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import muninn_worker

__all__ = ["Service", "service_for", "run_command", "service_environment", "systemd_unit", "launchd_plist",
           "schtasks_command"]

UNIT_NAME = "muninn-worker.service"
LAUNCHD_LABEL = "dev.muninn.worker"
TASK_NAME = "Muninn worker"
# Exit statuses after which starting again cannot help: refused by the site (1), a mistake in the options or
# config (2), a client too old for the site (3).
FINAL_EXITS = (1, 2, 3)
INTERRUPTED_EXIT = 130  # Ctrl-C or SIGTERM (cli.main)


@dataclass(frozen=True)
class Service:
    """What `service install` does on this system: `text` written to `path` (None: only printed), then the
    `next_steps` the owner runs."""

    text: str
    path: Path | None
    next_steps: str


def run_command(options: Sequence[str], python: str = sys.executable) -> list[str]:
    """This Python running this package's `run` with `options` (the config and the owner's choices)."""
    return [python, "-m", "muninn_worker", "run", *options]


def service_environment(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What the service needs from this shell: unbuffered output (its log shows each line at once) and, when
    this package is found through PYTHONPATH (a checkout), that folder, since a service starts without it."""
    environment = {"PYTHONUNBUFFERED": "1"}
    package_root = Path(muninn_worker.__file__).resolve().parent.parent
    entries = [Path(p).resolve() for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_root in entries:
        environment["PYTHONPATH"] = str(package_root)
    return environment


def service_for(system: str, command: Sequence[str], environment: Mapping[str, str], *, home: Path,
                config_home: Path | None = None) -> Service:
    """The service for `system` (platform.system(): Linux, Darwin, Windows, ...)."""
    if system == "Linux":
        path = (config_home or home / ".config") / "systemd" / "user" / UNIT_NAME
        return Service(systemd_unit(command, environment), path,
                       "systemctl --user daemon-reload && systemctl --user enable --now muninn-worker\n"
                       "(its log: journalctl --user -u muninn-worker -f; to keep it running while you are logged "
                       "out: loginctl enable-linger $USER)")
    if system == "Darwin":
        plist = home / "Library" / "LaunchAgents" / f"{LAUNCHD_LABEL}.plist"
        return Service(launchd_plist(command, environment, log=home / "Library" / "Logs" / "muninn-worker.log"),
                       None, f"save the text above as {plist}, then: launchctl load -w {plist}")
    if system == "Windows":
        return Service(schtasks_command(command, environment), None,
                       "run the command above in a Command Prompt; it starts the worker at every log-on "
                       f"(schtasks /Run /TN \"{TASK_NAME}\" starts it now)")
    return Service(shlex.join(command), None,
                   f"this system ({system or 'unknown'}) has no service template here: start the command above "
                   "at log-on the way your system does")


def systemd_unit(command: Sequence[str], environment: Mapping[str, str]) -> str:
    """A systemd user unit: started at log-in, niced, restarted after a crash but not after a refusal."""
    lines = [
        "[Unit]",
        "Description=Muninn worker: trains work units of Muninn jobs on this machine",
        "Wants=network-online.target",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=simple",
        f"ExecStart={' '.join(_systemd_quote(a) for a in command)}",
        *(f"Environment={_systemd_quote(f'{k}={v}', exec_word=False)}" for k, v in environment.items()),
        "Nice=10",
        "Restart=on-failure",
        "RestartSec=30",
        f"RestartPreventExitStatus={' '.join(str(s) for s in FINAL_EXITS)}",
        # `systemctl --user stop` sends SIGTERM: the client gives its unit back and exits 130, a clean stop
        f"SuccessExitStatus={INTERRUPTED_EXIT}",
        "",
        "[Install]",
        "WantedBy=default.target",
    ]
    return "\n".join(lines) + "\n"


def launchd_plist(command: Sequence[str], environment: Mapping[str, str], *, log: Path) -> str:
    """A launchd agent (macOS): started at log-in, in the background, kept alive after a crash."""
    arguments = "\n".join(f"    <string>{escape(a)}</string>" for a in command)
    variables = "\n".join(f"    <key>{escape(k)}</key><string>{escape(v)}</string>" for k, v in environment.items())
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<!DOCTYPE plist PUBLIC "-//Apple//DTD PLIST 1.0//EN" "http://www.apple.com/DTDs/PropertyList-1.0.dtd">
<plist version="1.0">
<dict>
  <key>Label</key><string>{LAUNCHD_LABEL}</string>
  <key>ProgramArguments</key>
  <array>
{arguments}
  </array>
  <key>EnvironmentVariables</key>
  <dict>
{variables}
  </dict>
  <key>RunAtLoad</key><true/>
  <key>KeepAlive</key><dict><key>SuccessfulExit</key><false/></dict>
  <key>ProcessType</key><string>Background</string>
  <key>Nice</key><integer>10</integer>
  <key>StandardOutPath</key><string>{escape(str(log))}</string>
  <key>StandardErrorPath</key><string>{escape(str(log))}</string>
</dict>
</plist>
"""


def schtasks_command(command: Sequence[str], environment: Mapping[str, str]) -> str:
    """A Task Scheduler command (Windows) that starts the worker at every log-on, with the user's rights."""
    line = subprocess.list2cmdline(list(command))
    if "PYTHONPATH" in environment:  # a task has no environment of its own: set it in the command line
        line = f'cmd /c "set PYTHONPATH={environment["PYTHONPATH"]}&& {line}"'
    task = line.replace('"', '\\"')  # schtasks takes the task's command line in quotes, its own quotes escaped
    return f'schtasks /Create /TN "{TASK_NAME}" /SC ONLOGON /RL LIMITED /F /TR "{task}"'


def _systemd_quote(arg: str, *, exec_word: bool = True) -> str:
    """One ExecStart word (or Environment= assignment): % doubled (systemd expands specifiers), and $ in an
    ExecStart word (it expands variables there), quoted when it holds spaces or quotes."""
    arg = arg.replace("%", "%%")
    if exec_word:
        arg = arg.replace("$", "$$")
    if arg and not any(c in arg for c in " \t\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'

