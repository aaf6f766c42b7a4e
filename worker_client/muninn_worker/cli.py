"""`muninn-worker register | run | status | service install | probe | verify-certificate | simulate`.

Settings come from CLI flag > environment variable > config file > default. A mistake the user can fix
(bad flag, no registered device, unreadable config) exits 2 with one sentence; a refusal by the server, or a
certificate that fails its check, exits 1; Ctrl-C exits 130. Heavy imports (torch) happen after parsing, so flag
errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from muninn_worker import __version__, simulate_command
from muninn_worker.config import (
    CLAIM_WAIT,
    ENV_CACHE_DIR,
    ENV_SERVER,
    ENV_TOKEN,
    ConfigError,
    config_path,
    default_cache_dir,
    first_set,
    load_config,
    save_config,
)

if TYPE_CHECKING:
    from muninn_worker.api import ApiClient

__all__ = ["main"]

PROG = "muninn-worker"
NO_DEVICE = f"no device registered: run `{PROG} register --server URL --token T` first"

log = logging.getLogger("muninn_worker")


class _Exit(Exception):
    """Stop with a one-sentence message and an exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse's default prints the whole usage block; one sentence is easier to act on.
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command is None:
        print(f"{PROG}: error: choose a command: register, run, status, service, probe, verify-certificate or "
              f"simulate (see `{PROG} --help`)",
              file=sys.stderr)
        return 2
    _configure_logging()
    from muninn_worker.api import ClientTooOld

    try:
        return args.handler(args)
    except _Exit as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.code
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except ClientTooOld as exc:  # the site answered 426: nothing this version sends will do
        print(f"{PROG}: {exc.message}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted; a unit in progress was given back to the site (or goes back to the queue "
              "when its lease expires)", file=sys.stderr)
        return 130


# ----------------------------------------------------------------------------------------- commands


def _cmd_register(args: argparse.Namespace) -> int:
    path = config_path(args.config)
    config = load_config(path)
    server = _require(first_set(args.server, os.environ.get(ENV_SERVER), config.server),
                      f"no server: pass --server URL or set {ENV_SERVER}")
    token = _require(first_set(args.token, os.environ.get(ENV_TOKEN)),
                     f"no account token: pass --token T (from your account page) or set {ENV_TOKEN}")
    name = first_set(args.name, config.name) or socket.gethostname()
    client = _client(server, account_token=token)

    # torch-heavy imports only now that the flags are good
    from muninn_worker.api import ApiError
    from muninn_worker.probe import probe_device

    from muninn_worker.signing import new_private_key, public_key_of

    log.info("probing this device…")
    capabilities = probe_device(quick=True)
    signing_key = new_private_key()  # a new device, a new key pair; the public half goes to the site
    try:
        answer = client.register_device(name, capabilities, public_key_of(signing_key))
    except ApiError as exc:
        raise _Exit(f"registration failed: {exc}", 1) from None

    config.server = client.server_url
    config.device_token = answer["device_token"]
    config.device_id = answer["device_id"]
    config.name = answer.get("name") or name
    config.signing_key = signing_key
    save_config(config, path)
    print(f"registered device {config.device_id} ({config.name}) with {config.server}; config saved to {path}")
    return 0


def _registered(args: argparse.Namespace):
    """The registered device's config and the server to talk to (--server, the environment, or the config's)."""
    config = load_config(config_path(args.config))
    if not config.device_token:
        raise _Exit(NO_DEVICE, 2)
    server = _require(first_set(args.server, os.environ.get(ENV_SERVER), config.server),
                      f"no server: pass --server URL or set {ENV_SERVER}")
    return config, server


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def _cmd_run(args: argparse.Namespace) -> int:
    config, server = _registered(args)
    cache_dir = first_set(args.cache_dir, os.environ.get(ENV_CACHE_DIR), config.cache_dir) or str(default_cache_dir())
    if not config.signing_key:
        raise _Exit(f"the config {config_path(args.config)} has no signing key (registered by an older client): "
                    "run `muninn-worker register` again", 2)
    client = _client(server, device_token=config.device_token, signing_key=config.signing_key)
    gate = _gate(args)
    backends = _gpu_only_backends() if args.gpu_only else None

    from muninn_worker.runner import DeviceRejected, run

    signal.signal(signal.SIGTERM, _interrupted)  # a service manager's stop ends a unit as Ctrl-C does: given back

    log.info("muninn-worker %s: device %s on %s, cache %s", __version__, config.device_id, client.server_url,
             cache_dir)
    if gate is not None:
        log.info("the owner's rules: %s", _rules_line(args))
        for warning in gate.warnings():
            log.warning("%s", warning)
    try:
        run(client, cache_dir=cache_dir, max_units=args.max_units, exit_when_idle=args.exit_when_idle,
            poll_interval=args.poll_interval, threads=args.max_threads, claim_wait=args.claim_wait,
            numerics=args.numerics or os.environ.get("MUNINN_WORKER_NUMERICS") or "native", gate=gate,
            backends=backends, freeze_heap=True)
    except DeviceRejected as exc:
        raise _Exit(str(exc), 1) from None
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    config, server = _registered(args)
    client = _client(server, device_token=config.device_token)

    from muninn_worker.api import ApiError
    from muninn_worker.status import format_status

    try:
        answer = client.me()
    except ApiError as exc:
        if exc.status == 404:
            raise _Exit(f"{client.server_url} does not answer `status` (GET /api/worker/me): the site is older "
                        "than this client", 1) from None
        raise _Exit(f"status failed: {exc}", 1) from None
    print(json.dumps(answer, indent=2) if args.json else format_status(answer, client.server_url))
    return 0


def _cmd_service_install(args: argparse.Namespace) -> int:
    import platform

    from muninn_worker.service import run_command, service_environment, service_for

    path = config_path(args.config).resolve()
    if not load_config(path).device_token:
        raise _Exit(NO_DEVICE, 2)
    if args.gpu_only:
        _gpu_only_backends()  # refuse now rather than in a service that cannot start
    options = ["--config", str(path)]
    if args.server:
        options += ["--server", args.server]
    if args.cache_dir:
        options += ["--cache-dir", str(Path(args.cache_dir).expanduser().resolve())]
    if args.max_threads:
        options += ["--max-threads", str(args.max_threads)]
    if args.schedule:
        options += ["--schedule", _schedule_text(args.schedule)]
    if args.pause_when_busy is not None:
        options += ["--pause-when-busy", f"{args.pause_when_busy:g}"]
    options += [flag for flag, on in (("--gpu-only", args.gpu_only), ("--pause-on-battery", args.pause_on_battery))
                if on]
    config_home = os.environ.get("XDG_CONFIG_HOME")
    service = service_for(platform.system(), run_command(options), service_environment(), home=Path.home(),
                          config_home=Path(config_home) if config_home else None)
    if args.print or service.path is None:
        print(service.text, end="" if service.text.endswith("\n") else "\n")
        if service.path is None:
            print(f"\n{service.next_steps}")
        return 0
    service.path.parent.mkdir(parents=True, exist_ok=True)
    service.path.write_text(service.text, encoding="utf-8")
    print(f"wrote {service.path}; start it now and at every log-in with:\n{service.next_steps}")
    return 0


def _cmd_probe(args: argparse.Namespace) -> int:
    from muninn_worker.probe import probe_device

    print(json.dumps(probe_device(quick=False), indent=2))
    return 0


def _cmd_verify_certificate(args: argparse.Namespace) -> int:
    """Check a training certificate offline: the site's signature, the chain of every round's weights, and the
    model file against it (muninn_worker.certificate). One sentence and exit 1 when a check fails."""
    from muninn_worker import certificate

    key_text = _read_text(args.key, "key") if os.path.isfile(args.key) else args.key
    try:
        key = certificate.public_key_from(key_text)
    except ValueError as exc:
        raise _Exit(f"{exc}; pass the base64 key, a file holding it, or the site's "
                    "/.well-known/muninn-signing-key JSON", 2) from None
    try:
        document = json.loads(_read_text(args.certificate, "certificate"))
    except ValueError:
        raise _Exit(f"the certificate {args.certificate} is not JSON", 1) from None
    model = _read_bytes(args.model, "model")
    try:
        summary = certificate.check(document, model, key)
    except certificate.CertificateInvalid as exc:
        raise _Exit(str(exc), 1) from None
    share = summary["retrained_steps"] / summary["trained_steps"] if summary["trained_steps"] else 0.0
    print(f"certificate OK: job {summary['job']} ({summary['template']}), signed by the site's key {key[:12]}…")
    print(f"  {summary['rounds']} round(s) chained from the initial weights to this model's weights "
          f"({summary['final_weights_sha256'][:16]}…); model file sha256 {summary['file_sha256'][:16]}…")
    print(f"  {summary['units']} update(s): {summary['site_checked']} re-trained in part by the site's validator, "
          f"{summary['peer_checked']} by peer devices, {summary['cheap_checks_only']} on cheap checks only; "
          f"{summary['retrained_steps']} of {summary['trained_steps']} training steps re-trained ({share:.1%})")
    if summary["flagged"]:
        print(f"  {summary['flagged']} update(s) flagged after the fact: see each round's \"flagged\"")
    return 0


# ------------------------------------------------------------------------------------------ helpers


def _read_bytes(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise _Exit(f"cannot read the {what} file {path}: {exc.strerror or exc}", 2) from None


def _read_text(path: str, what: str) -> str:
    try:
        return _read_bytes(path, what).decode()
    except UnicodeDecodeError:
        raise _Exit(f"the {what} file {path} is not UTF-8 text", 2) from None


def _gate(args: argparse.Namespace):
    """The gate of the owner's rules, or None when the owner set none (the loop then never pauses)."""
    from muninn_worker.owner import Rules
    from muninn_worker.pause import Gate

    rules = Rules(schedule=args.schedule or (), busy_above=args.pause_when_busy,
                  pause_on_battery=args.pause_on_battery)
    return Gate(rules) if rules.any else None


def _rules_line(args: argparse.Namespace) -> str:
    parts = []
    if args.schedule:
        parts.append(f"works {_schedule_text(args.schedule)} (local time)")
    if args.pause_when_busy is not None:
        parts.append(f"pauses while other processes use more than {args.pause_when_busy:g}% CPU")
    if args.pause_on_battery:
        parts.append("pauses on battery")
    return "; ".join(parts)


def _gpu_only_backends() -> list[str]:
    """--gpu-only: claim CUDA work only, on a machine where torch sees a CUDA GPU; refuse to start elsewhere."""
    import torch

    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else f"CUDA {torch.version.cuda}, but no GPU found"
        raise _Exit(f"error: --gpu-only, but torch sees no CUDA GPU on this machine (torch {torch.__version__}, "
                    f"{build}); run without --gpu-only to lend the CPU", 2)
    return ["cuda"]


def _require(value: str | None, message: str) -> str:
    if not value:
        raise _Exit(message, 2)
    return value


def _client(server: str, **tokens: str) -> ApiClient:
    from muninn_worker.api import ApiClient

    try:
        return ApiClient(server, on_retry=_log_retry, **tokens)
    except ValueError as exc:
        raise _Exit(str(exc), 2) from None


def _log_retry(attempt: int, delay: float, reason: str) -> None:
    log.warning("request failed (%s); retry %d in %.1f s", reason, attempt, delay)


def _configure_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be more than 0 seconds")
    return value


def _schedule(text: str):
    from muninn_worker.owner import parse_schedule

    try:
        return parse_schedule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _schedule_text(schedule) -> str:
    from muninn_worker.owner import format_schedule

    return format_schedule(schedule)


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage of the machine's CPU, got {text!r}") from None
    if not 0 <= value < 100:
        raise argparse.ArgumentTypeError(f"must be a percentage from 0 up to (not including) 100, got {text}")
    return value


def _owner_options(parser: argparse.ArgumentParser) -> None:
    """The owner's choices of how the worker uses the machine: shared by `run` and `service install`."""
    parser.add_argument("--max-threads", type=_positive_int, metavar="N",
                        help="at most N CPU threads for training (default: torch's choice, one per core)")
    parser.add_argument("--threads", type=_positive_int, dest="max_threads", metavar="N",
                        help="the former name of --max-threads")
    parser.add_argument("--gpu-only", action="store_true",
                        help="claim only work for the CUDA GPU (refuses to start without one)")
    parser.add_argument("--schedule", type=_schedule, metavar="HH:MM-HH:MM",
                        help="work only in these hours, local time (22:00-07:00 wraps midnight; several ranges "
                             "comma-separated); outside them finish the unit in hand, then sleep")
    parser.add_argument("--pause-when-busy", type=_percent, metavar="PERCENT",
                        help="claim no new work while other processes use more than PERCENT of the CPU")
    parser.add_argument("--pause-on-battery", action="store_true",
                        help="claim no new work while the machine runs on battery (Linux)")


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Train pieces of Muninn jobs on this machine and earn HU.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="{register,run,status,service,probe,verify-certificate,simulate}")

    register = commands.add_parser("register", help="register this device with your account token")
    register.add_argument("--server", help=f"site URL, e.g. https://muninn.example (env {ENV_SERVER})")
    register.add_argument("--token", help=f"your account API token (env {ENV_TOKEN})")
    register.add_argument("--name", help="device name shown on the site (default: host name)")
    register.add_argument("--config", help="config file (env MUNINN_WORKER_CONFIG)")
    register.set_defaults(handler=_cmd_register)

    run = commands.add_parser("run", help="claim and train work units until stopped")
    run.add_argument("--server", help=f"site URL (env {ENV_SERVER}; default: the registered one)")
    run.add_argument("--config", help="config file (env MUNINN_WORKER_CONFIG)")
    run.add_argument("--max-units", type=_positive_int, help="stop after this many units")
    run.add_argument("--exit-when-idle", type=_seconds, metavar="SECONDS",
                     help="exit 0 after this long without work (default: run forever)")
    run.add_argument("--poll-interval", type=_positive_seconds, default=1.0, metavar="S",
                     help="first wait after an empty claim; doubles up to 5 s (default 1)")
    run.add_argument("--claim-wait", type=_seconds, default=CLAIM_WAIT, metavar="SECONDS",
                     help=f"how long the site may hold an empty claim until work comes (a long poll; the site "
                          f"allows up to 30); 0 polls with --poll-interval instead (default {CLAIM_WAIT:g})")
    run.add_argument("--cache-dir", help=f"download cache (env {ENV_CACHE_DIR}; default ~/.cache/muninn-worker)")
    _owner_options(run)
    run.add_argument("--numerics", choices=("native", "f64"),
                     help="native (default), or f64: train in float64 rounded to float32 after every step, "
                          "another device's arithmetic for testing verification (env MUNINN_WORKER_NUMERICS)")
    run.set_defaults(handler=_cmd_run)

    status = commands.add_parser("status", help="show this device's reputation, today's units and earnings")
    status.add_argument("--server", help=f"site URL (env {ENV_SERVER}; default: the registered one)")
    status.add_argument("--config", help="config file (env MUNINN_WORKER_CONFIG)")
    status.add_argument("--json", action="store_true", help="print the site's answer as JSON")
    status.set_defaults(handler=_cmd_status)

    service = commands.add_parser("service", help="run the worker in the background at every log-in")
    actions = service.add_subparsers(dest="action", metavar="{install}", required=True)
    install = actions.add_parser("install", help="write a systemd user unit (Linux), or print a launchd agent "
                                                 "(macOS) or a Task Scheduler command (Windows)")
    install.add_argument("--print", action="store_true", help="only print the service, write nothing")
    install.add_argument("--server", help="site URL for the service's runs (default: the registered one)")
    install.add_argument("--config", help="config file the service uses (env MUNINN_WORKER_CONFIG)")
    install.add_argument("--cache-dir", help="download cache for the service's runs")
    _owner_options(install)
    install.set_defaults(handler=_cmd_service_install)

    probe = commands.add_parser("probe", help="print this device's capabilities as JSON")
    probe.set_defaults(handler=_cmd_probe)

    verify = commands.add_parser("verify-certificate", help="check a job's training certificate and model offline")
    verify.add_argument("certificate", metavar="CERT", help="the certificate (GET /api/jobs/<id>/certificate)")
    verify.add_argument("model", metavar="MODEL", help="the model file it certifies (GET /api/jobs/<id>/model)")
    verify.add_argument("--key", required=True, metavar="KEY",
                        help="the site's public key: base64, a file holding it, or the site's "
                             "/.well-known/muninn-signing-key JSON (saved to a file)")
    verify.set_defaults(handler=_cmd_verify_certificate)

    simulate_command.add_to(commands)
    return parser
