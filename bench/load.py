"""Load: the worker API under granian on PostgreSQL with N simulated devices, and the time to plan a round.

The benchmark brings its own world. It drops and recreates a PostgreSQL database (`muninn_load`), migrates
it, starts the site's web server on a free port against it (scripts/stack.py: granian, as deployed, or gunicorn
with `--server gunicorn`; DEBUG off, as in production), creates a
customer with credit and enough running jobs (a small MLP on digits) that every claim finds a queued unit,
and registers N devices through the real API, each with its own Ed25519 key. Then N asyncio devices loop:

    claim → heartbeat(s) → post a small valid result (signed receipt, an encoded update) → claim ...

twice, for `--seconds` each: first as fast as they can (the most the site serves: ops/s), then paced to
`--rate` ops/s in all (the latency a device sees at that load; each device's ops a Poisson process, so claims,
heartbeats and results arrive mixed, as from a market's independent devices). With N devices that never
wait, latency is N / throughput by Little's law (200 devices at 500 ops/s: 400 ms), whatever the server does,
so the p99 that counts is the paced one. Every op's answer is counted: 2xx ok, 409 conflict, anything else an error.

Results are cheap but real: the global weights (downloaded once per job, cached by hash as the worker client
does) plus a small random change, so every check of the site runs on them (signature, hashes, safetensors,
shapes, update norm, timing, the loss on 64 samples of the shard). The updates are made before each phase, one per
queued unit, each used once (`Updates`): a real device's update costs its own machine, not the site's cores.
The devices are made veterans (a long streak of verified results, written straight to their rows), as most
devices of a running market are: their results are re-executed at the 5 % floor and the rest accepted at once,
their charges owed to the credit task. New devices (`--new-devices`) are always re-executed instead: their results
only queue a validation task.
Re-executions, aggregations and credits are queued on a filesystem broker in the run's temporary folder
(`--broker` to use another) and not run: they are Celery's work, not the web's. The charges owed are posted
afterwards, here, as the credit task does, and its CPU per result is reported.

Double leases are counted twice: on the client (a unit whose claim was answered to a second device before
the first one sent the result the site then accepted) and in the database afterwards (a unit's Lease rows
whose validity overlaps: from creation to the lease's receipt, or to the lease's expiry). The JSON's
`double_leases` is the larger.

Last, round planning: `jobs.services.round_open` (plan shards ∝ throughput, one unit per device, the round's
shards in one blob) and the pure `federated.sharding.plan_shards` alone, for 10, 100, 1,000 and 10,000 online devices
(bench/load_planning.py runs this part alone).

    .venv/bin/python bench/load.py [--devices 200] [--seconds 20] [--rate 500] [--workers 3] [--threads 8]
        [--server granian|gunicorn] [--worker-class CLASS] [--loop uvloop|asyncio] [--keep-alive 2]

Needs PostgreSQL (`--database-url`, default postgres://postgres@127.0.0.1:5432/muninn_load; the database is
dropped and recreated), aiohttp and uvloop (`make bench-deps`: the world registers its devices with aiohttp; the
devices themselves speak HTTP/1.1 by hand, see `Connection`, on uvloop's event loop, which costs the cores they share
with the site ~15 % less than asyncio's own). The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "platform"), str(ROOT / "worker_client")]

from load_planning import PLAN_SIZES, plan_timings  # noqa: E402  (bench/ is this script's folder)
from machine import disk_note, settled_disk_ms, wake_us, yardstick_s  # noqa: E402
from load_world import World, build_world, environment, recreate_database, top_up  # noqa: E402
from scripts.stack import WEB_SERVER, WEB_SERVERS, WEB_WORKER, Stack, base_env, free_port  # noqa: E402
from muninn_worker import heap  # noqa: E402

DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/muninn_load"


def main() -> int:
    options = _parse_args()
    try:
        import aiohttp  # noqa: F401
        if options.loop == "uvloop":
            import uvloop  # noqa: F401
    except ImportError as error:
        print(f"{error.name} is not installed ({error}). Install it with `make bench-deps`.", file=sys.stderr)
        return 2
    yardstick = yardstick_s()  # the machine's speed now, before anything of the bench runs (bench/machine.py)
    wakes = wake_us()  # and what a thread's wake costs it: a paced op is many of them
    tmp = Path(tempfile.mkdtemp(prefix="muninn-load-"))
    env = environment(options, tmp)
    os.environ.update(env)
    recreate_database(options.database_url)  # the last run's database deleted: the disk may slow down for a while

    import django

    django.setup()
    logging.disable(logging.INFO)  # this process's Celery and round logs; the server logs to its own file
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    disk_ms = settled_disk_ms(tmp / "disk-probe")  # beside the site's blobs (MEDIA_ROOT), before any are written

    with Stack(env=base_env(**env), log_dir=tmp / "log") as stack:
        access_log = tmp / "access.log"  # --server-times: gunicorn's request time per request
        gunicorn_args = f"--keep-alive {options.keep_alive:g}"
        if options.server_times:
            gunicorn_args += (f" --access-logfile {access_log} "
                              "--access-logformat %(U)s|%(D)s|%({x-bench-id}i)s|%(p)s")
        url = stack.web(free_port(), workers=options.workers, threads=options.threads, server=options.server,
                        worker_class=options.worker_class, env={**stack.env, "GUNICORN_CMD_ARGS": gunicorn_args})
        world = build_world(url, options)
        web_pid = next(proc.pid for name, proc in stack.procs if name == "web")
        phases = {}
        for phase, rate in (("saturated", 0.0), ("paced", options.rate)):
            top_up(world)  # each phase starts with the world's queue (the first: as built)
            updates = Updates()
            made, made_s = updates.prepare(random.Random(phase))
            # The devices' process holds Django, torch and the world: the collector's full passes over all of it
            # stopped every device for 100-220 ms every few seconds (their event loop's lag), and the requests
            # they had in flight looked that much slower. Exempted, as the site's processes are (muninn/wsgi.py).
            heap.freeze()
            before = _cpu_seconds(web_pid, options.database_url)
            logged = access_log.stat().st_size if options.server_times else 0
            phases[phase] = _run_loop(options.loop, _drive(url, world, options, updates, rate=rate))
            phases[phase].updates = {"made_before": made, "made_before_s": round(made_s, 1),
                                     "made_live": updates.made_live}
            after = _cpu_seconds(web_pid, options.database_url)
            if options.server_times:
                phases[phase].server, by_id = _server_times(access_log, logged)
                phases[phase].matched = [(took, *by_id[ident]) for _, _, took, ident in phases[phase].sent
                                         if ident in by_id]
            phases[phase].cpu = defaultdict(float)
            for (who, pid), seconds in after.items():  # per process: one that ended in between counts nothing
                phases[phase].cpu[who] += seconds - before.get((who, pid), 0.0)
        stack.stop("web")
        web_log = stack.log("web")
    db_doubles = _database_double_leases()
    credit = _credit_owed()
    plans = {} if options.skip_planning else plan_timings(options)
    _report(options, world, phases, db_doubles, plans, web_log, credit, yardstick, disk_ms, wakes)
    shutil.rmtree(tmp, ignore_errors=True)  # blobs, broker messages, logs (a web log with tracebacks was kept)
    return 0


# --- The devices ----------------------------------------------------------------------------------

@dataclass
class Stats:
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    statuses: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    errors: list[str] = field(default_factory=list)
    leases: dict[int, list[tuple[int, float, float]]] = field(default_factory=lambda: defaultdict(list))
    empty_claims: int = 0
    elapsed: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds used in the phase: web, database, devices
    server: dict[str, list[float]] = field(default_factory=dict)  # --server-times: gunicorn's own, per op
    # (device's time, gunicorn's own, gunicorn's worker process) per request
    matched: list[tuple[float, float, str]] = field(default_factory=list)
    loop_lag: list[float] = field(default_factory=list)  # how late the devices' event loop woke, every 5 ms
    lag_at: list[float] = field(default_factory=list)  # when each loop_lag was measured (time.monotonic())
    # (time.monotonic(), the machine's CPU time stolen by the hypervisor so far, in ticks), every 100 ms
    steal: list[tuple[float, int]] = field(default_factory=list)
    # (when it was sent, op, its time as the device saw it, its X-Bench-Id or 0) of every op that ended in the window
    sent: list[tuple[float, str, float, int]] = field(default_factory=list)
    updates: dict = field(default_factory=dict)  # the devices' updates: made before the phase, made during it

    def ok(self, op: str | None = None) -> int:
        ops = [op] if op else list(self.statuses)
        return sum(n for o in ops for code, n in self.statuses[o].items() if 200 <= code < 300)

    def count(self, op: str | None, low: int, high: int) -> int:
        ops = [op] if op else list(self.statuses)
        return sum(n for o in ops for code, n in self.statuses[o].items() if low <= code < high)

    def conflicts(self, op: str | None = None) -> int:
        return self.count(op, 409, 410)

    def failed(self, op: str | None = None) -> int:
        return self.count(op, 0, 1000) - self.ok(op) - self.conflicts(op)


class WeightsCache:
    """The global weights by hash, fetched once (the worker client caches them by hash too)."""

    def __init__(self) -> None:
        self._states: dict[str, asyncio.Future] = {}

    async def state(self, sha: str, fetch) -> dict:
        if sha not in self._states:
            self._states[sha] = asyncio.ensure_future(fetch())
        return await self._states[sha]


def _run_loop(kind: str, coroutine):
    """Run the devices: on one torch thread (their results' tensors are tiny; torch's default pool of a thread
    per core spun on the cores the site needs), on `kind`'s event loop."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if kind == "uvloop":
            import uvloop

            return uvloop.run(coroutine)
        return asyncio.run(coroutine)
    finally:
        torch.set_num_threads(threads)


async def _drive(url: str, world: World, options: argparse.Namespace, updates: Updates, *, rate: float) -> Stats:
    stats, cache = Stats(), WeightsCache()
    address = urlsplit(url)
    start = time.monotonic()
    stop_at = start + options.seconds
    interval = len(world.devices) / rate if rate else 0.0
    idle_s = max(options.keep_alive - 1.0, options.keep_alive / 2)  # closed by the device before the server would
    connections = [Connection(address.hostname, address.port, device["token"], idle_s) for device in world.devices]
    lag = asyncio.ensure_future(_loop_lag(stats, stop_at))
    stolen = asyncio.ensure_future(_steal_samples(stats, stop_at))
    try:
        await asyncio.gather(lag, stolen, *(
            _device(connection, device, stats, cache, updates, options, start=start, stop_at=stop_at,
                    interval=interval, rng=random.Random(i))
            for i, (connection, device) in enumerate(zip(connections, world.devices))))
    finally:
        for connection in connections:
            connection.close()
    stats.elapsed = time.monotonic() - start
    return stats


async def _loop_lag(stats: Stats, stop_at: float, every: float = 0.005) -> None:
    """How late the devices' event loop runs a callback due now: the part of a device's time that is its own
    process (building and signing other devices' results, or waiting for a core), not the site's."""
    while time.monotonic() < stop_at:
        due = time.monotonic() + every
        await asyncio.sleep(every)
        stats.loop_lag.append(max(0.0, time.monotonic() - due))
        stats.lag_at.append(due)


async def _steal_samples(stats: Stats, stop_at: float, every: float = 0.1) -> None:
    """The machine's stolen CPU time (/proc/stat: time its virtual CPUs were ready but the hypervisor ran something
    else) every `every` s: a second in which the VM was not run stalls the site and the devices alike, and is no
    fault of either. Nothing where /proc/stat has no steal column."""
    while time.monotonic() < stop_at + every:
        ticks = _steal_ticks()
        if ticks is None:
            return
        stats.steal.append((time.monotonic(), ticks))
        await asyncio.sleep(every)


def _steal_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return int(fields[8]) if len(fields) > 8 and fields[0] == "cpu" else None


_IDS = itertools.count(1)  # --server-times: each request's id, sent as X-Bench-Id and logged by gunicorn


class Connection:
    """One device's keep-alive HTTP/1.1 connection to the site, written and read by hand. The simulated devices
    share the site's two cores, so what they spend is taken from the site: aiohttp cost ~0.36 ms of CPU more per
    request than this (the devices' share went from 0.77 to 0.41 ms per op). Answers with a Content-Length or
    chunked (the server streams a file), and a connection idle for `idle_s` (a second at gunicorn's default keep-alive
    of 2 s) is closed before the server closes it, so no request is sent on a connection the server is closing."""

    def __init__(self, host: str, port: int, token: str, idle_s: float = 1.0) -> None:
        self.host, self.port, self.idle_s = host, port, idle_s
        self.head = f"Host: {host}:{port}\r\nAuthorization: Device {token}\r\nUser-Agent: bench-load\r\n"
        self.reader = self.writer = None
        self.used = 0.0

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(self, method: str, path: str, body: bytes = b"", content_type: str | None = None,
                      ident: int = 0) -> tuple[int, bytes]:
        if self.writer is not None and time.monotonic() - self.used > self.idle_s:
            self.close()
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        typed = f"Content-Type: {content_type}\r\n" if content_type else ""
        typed += f"X-Bench-Id: {ident}\r\n" if ident else ""
        self.writer.write(f"{method} {path} HTTP/1.1\r\n{self.head}{typed}Content-Length: {len(body)}\r\n\r\n"
                          .encode() + body)
        try:
            status, data, keep = await self._answer()
        except BaseException:
            self.close()
            raise
        self.used = time.monotonic()
        if not keep:
            self.close()
        return status, data

    async def _answer(self) -> tuple[int, bytes, bool]:
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        keep = headers.get("connection", "").lower() != "close"
        if headers.get("transfer-encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                chunks.append(await self.reader.readexactly(size + 2))
                if size == 0:
                    return status, b"".join(chunk[:-2] for chunk in chunks), keep
        length = int(headers.get("content-length", "0"))
        return status, (await self.reader.readexactly(length) if length else b""), keep


async def _device(connection: Connection, device: dict, stats: Stats, cache: WeightsCache, updates: Updates,
                  options: argparse.Namespace, *, start: float, stop_at: float, interval: float,
                  rng: random.Random) -> None:
    """One device: claim, heartbeat, post a result, again, until the time is up; paced, when `interval` is set,
    to one op per `interval` seconds on average, each op a random time after the one before (exponential: each
    device's ops are a Poisson process, and so are all of them together). An op the device is late for goes at
    once, and the device catches up with its schedule: the site is offered the rate whatever its answers' times.

    Pacing at exactly `interval` instead made the devices march together by op: each device's first op came
    within one interval of the start, and its ops go claim, heartbeat, result, so for one interval in three every
    device was posting a result (README, the load benchmark's twelfth session)."""
    from muninn_worker import signing, tensors

    key = signing._load(device["key"])  # loaded once, as the worker client keeps its key
    next_at = start + rng.expovariate(1 / interval) if interval else start

    async def op(name: str, method: str, path: str, body: bytes = b"",
                 content_type: str | None = None) -> tuple[int, dict | bytes | None]:
        nonlocal next_at
        if interval:
            now = time.monotonic()
            if next_at > now:
                await asyncio.sleep(next_at - now)
            next_at += rng.expovariate(1 / interval)
        ident = next(_IDS) if options.server_times else 0
        t0 = time.monotonic()
        try:
            status, answer = await connection.request(method, path, body, content_type, ident)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            status, answer = 599, repr(e).encode()
        t1 = time.monotonic()
        if t1 <= stop_at:  # only what finished inside the window counts
            stats.latencies[name].append(t1 - t0)
            stats.statuses[name][status] += 1
            stats.sent.append((t0, name, t1 - t0, ident))
        if status >= 300 and status != 409 and len(stats.errors) < 20:
            stats.errors.append(f"{name} {status}: {answer[:200]!r}")
        if status == 200 and answer[:1] == b"{":
            return status, json.loads(answer)
        return status, answer

    async def fetch_weights(unit_id: int) -> dict:
        status, body = await op("weights", "GET", f"/api/worker/units/{unit_id}/weights")
        if status != 200:
            raise RuntimeError(f"weights download failed: {status} {body[:200]!r}")
        return tensors.bytes_to_state_dict(body)

    while time.monotonic() < stop_at:
        status, answer = await op("claim", "POST", "/api/worker/claim", b"{}", "application/json")
        if status == 204:
            stats.empty_claims += 1
            await asyncio.sleep(0.5)
            continue
        if status != 200:
            await asyncio.sleep(0.5)
            continue
        claimed = time.monotonic()
        unit = answer["unit"]
        for _ in range(options.heartbeats):
            await op("heartbeat", "POST", f"/api/worker/units/{unit['id']}/heartbeat")
        state = await cache.state(unit["weights_sha256"], lambda: fetch_weights(unit["id"]))
        weights, receipt = _result(unit, state, claimed, rng, updates)
        body = json.dumps(receipt)
        form, form_type = _form(weights, body, base64.b64encode(key.sign(body.encode())).decode())
        sent = time.monotonic()
        status, _ = await op("result", "POST", f"/api/worker/units/{unit['id']}/result", form, form_type)
        stats.leases[unit["id"]].append((device["id"], claimed, sent if status == 201 else claimed))


_FIRST: dict[tuple, list[str]] = {}  # (weights, optimizer, momentum) → boundary 0's commitment


class Updates:
    """The devices' updates, made before each phase: a real device's update costs its own machine, not the cores
    the site runs on, and making one here (nudging, encoding and hashing the weights) was ~1 ms of the devices'
    CPU a result, about half of all they spent. Each is used once, so every upload the site sees is still unique;
    a round with none left (a unit leased again) gets one made on the spot, counted in `made_live`."""

    def __init__(self) -> None:
        self._ready: dict[tuple[str, str], list[tuple[bytes, str, str]]] = {}
        self.made_live = 0

    def prepare(self, rng: random.Random) -> tuple[int, float]:
        """One update per queued unit, for each round with queued units; (how many, seconds it took)."""
        import torch
        from django.db.models import Count

        from jobs import storage
        from jobs.models import WorkUnit
        from muninn_worker import tensors

        started, threads = time.perf_counter(), torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            queued = (WorkUnit.objects.filter(status=WorkUnit.Status.QUEUED)
                      .values_list("round__weights_sha256", "round__job__update_encoding").annotate(n=Count("id")))
            for sha, encoding, n in queued:
                state = tensors.bytes_to_state_dict(storage.blob_get(sha))
                self._ready[sha, encoding] = [_update(state, encoding, rng) for _ in range(n)]
        finally:
            torch.set_num_threads(threads)
        return sum(map(len, self._ready.values())), time.perf_counter() - started

    def take(self, sha: str, state: dict, encoding: str, rng: random.Random) -> tuple[bytes, str, str]:
        ready = self._ready.get((sha, encoding))
        if ready:
            return ready.pop()
        self.made_live += 1
        return _update(state, encoding, rng)


def _update(state: dict, encoding: str, rng: random.Random) -> tuple[bytes, str, str]:
    """The global weights nudged a little, encoded as the worker client uploads them: (the upload, its sha256, and
    the commitment to what the site decodes from it, which ends the receipt's chain)."""
    import torch
    from muninn_worker import codec, segments, tensors

    generator = torch.Generator().manual_seed(rng.getrandbits(62))
    nudged = {name: (value + 1e-3 * torch.randn(value.shape, generator=generator) if value.is_floating_point()
                     else value) for name, value in state.items()}
    encoded = codec.encode_tensors(nudged, state, encoding)
    out = codec.pack(encoded, encoding)  # as the worker client uploads it (codec.encode_update)
    # What the site decodes from `out`, without inflating and parsing it again (codec.roundtrip: the same values)
    last = segments.commitment(codec.decode_tensors(tensors.plain_tensors(encoded), state, encoding), {})[0]
    return out, tensors.sha256_hex(out), last


def _result(unit: dict, state: dict, claimed: float, rng: random.Random,
            updates: Updates | None = None) -> tuple[bytes, dict]:
    """A valid, unique result that passes every check of the site: an update (made before the phase, when
    `updates` has one) and its receipt."""
    from muninn_worker import order, segments, training, zoo

    encoding = unit.get("encoding", "fp32")
    out, out_sha, last = (updates.take(unit["weights_sha256"], state, encoding, rng) if updates
                          else _update(state, encoding, rng))
    now = datetime.now(UTC)
    seconds = time.monotonic() - claimed
    train = unit["train"]
    steps = order.total_steps(unit["samples"], epochs=train["epochs"], batch_size=train["batch_size"],
                              inner_steps=train.get("inner_steps"))
    # A chain that starts at the global weights with a fresh optimizer and ends at the upload, as the site checks;
    # the boundaries between are made up: the bench runs no validator and leaves its challenges unanswered.
    key = (unit["weights_sha256"], train.get("optimizer", "sgd"), train.get("momentum", 0.0))
    if key not in _FIRST:  # the same for every unit of a round (the site computes it once per round too)
        model = zoo.build_model(unit["template"], unit["model_config"])
        _FIRST[key] = segments.commitment(state, training.initial_optimizer_state(model, *key[1:]))
    first = _FIRST[key]
    middle = [[f"{rng.getrandbits(256):064x}"] * 2
              for _ in range(segments.segment_count(steps, train["segment_steps"]) - 1)]
    receipt = {
        "unit": unit["id"], "weights_sha256": unit["weights_sha256"], "shard_sha256": unit["shard_sha256"],
        "output_sha256": out_sha, "samples": unit["samples"],
        "steps": steps, "loss_before": 2.30, "loss_after": 2.29,
        "started_at": now.isoformat(), "finished_at": now.isoformat(), "train_seconds": seconds,
        "segment_steps": train["segment_steps"], "checkpoints": [first, *middle, [last, "0" * 64]],
    }
    return out, receipt


BOUNDARY = "muninn-bench-load-boundary"


def _form(weights: bytes, receipt: str, signature: str) -> tuple[bytes, str]:
    """The result's multipart form, as the worker client sends it: the weights file, the receipt, the signature."""
    def field(name: str, value: bytes, filename: str | None = None) -> bytes:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename else "")
        typed = "Content-Type: application/octet-stream\r\n" if filename else ""
        return f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n{typed}\r\n".encode() + value + b"\r\n"

    body = (field("weights", weights, "weights.safetensors") + field("receipt", receipt.encode())
            + field("signature", signature.encode()) + f"--{BOUNDARY}--\r\n".encode())
    return body, f"multipart/form-data; boundary={BOUNDARY}"


# --- CPU used, by whom -----------------------------------------------------------------------------

def _cpu_seconds(web_pid: int, database_url: str) -> dict[tuple[str, int], float]:
    """CPU seconds so far, by (who, pid): the web server's main process and workers ("web"), the PostgreSQL backends
    serving this database ("database"), and this process, the simulated devices ("devices"). On a shared
    machine wall-clock rates swing with everyone else's load; CPU per op moves much less."""
    tick = os.sysconf("SC_CLK_TCK")
    database = urlsplit(database_url).path.lstrip("/")
    used = {("devices", os.getpid()): time.process_time()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        if int(entry.name) == web_pid or int(fields[1]) == web_pid:
            used["web", int(entry.name)] = seconds
        elif cmdline.startswith("postgres:") and f" {database} " in cmdline:
            used["database", int(entry.name)] = seconds
    return used


# --- The charges owed, posted as the credit task does -----------------------------------------------

def _credit_owed() -> dict:
    """Accepted results are charged off the request, by the credit task (contributors.credit), which this bench's
    site does not run: post what the phases left owed here, in its batches, and count its CPU per result (the
    Celery worker's share of a result, on top of the web's)."""
    from contributors import credit
    from contributors.models import Receipt

    owed = Receipt.objects.filter(credit_pending=True).count()
    start = time.process_time()
    credit.credit_all_pending()
    spent = time.process_time() - start
    return {"results": owed, "cpu_ms_per_result": round(spent / owed * 1e3, 2) if owed else None}


# --- Double leases seen by the database -----------------------------------------------------------

def _database_double_leases() -> dict:
    """Units whose Lease rows overlap in time (contributors.selectors.units_leased_twice)."""
    from django.db import connection
    from django.db.models import Count

    from contributors.models import Lease, Receipt
    from contributors.selectors import units_leased_twice

    connection.close()  # the server wrote meanwhile; start a fresh connection
    multi = Lease.objects.values("unit_id").annotate(n=Count("id")).filter(n__gt=1).count()
    return {"leases": Lease.objects.count(), "units_leased_again": multi, "double_leases": len(units_leased_twice()),
            "receipts": dict(Receipt.objects.values_list("status").annotate(n=Count("id")).order_by())}


def _client_double_leases(stats: Stats) -> tuple[int, int]:
    """(units leased to more than one device, of which overlapping): a lease is known valid from its claim's
    answer until its accepted result was sent, and at least at its claim's answer otherwise."""
    again = doubles = 0
    for leases in stats.leases.values():
        if len(leases) < 2:
            continue
        again += 1
        leases = sorted(leases, key=lambda lease: lease[1])
        if any(b[1] < a[2] for a, b in zip(leases, leases[1:])):
            doubles += 1
    return again, doubles


def _server_times(access_log: Path, offset: int) -> tuple[dict[str, list[float]], dict[int, tuple[float, str]]]:
    """Seconds gunicorn took for each request it logged after `offset` (its access log's `%(D)s`, from the request
    read to the answer sent): the site's own latency, without the devices' event loop (one process for 200
    devices, which builds and signs results between requests) in the way; and the same by each request's id
    (X-Bench-Id), with the worker process that served it, to set beside the device's time for it."""
    times: dict[str, list[float]] = defaultdict(list)
    by_id: dict[int, tuple[float, str]] = {}
    with access_log.open() as log:
        log.seek(offset)
        for line in log:
            path, micros, ident, pid = (line.strip().split("|") + ["", "", ""])[:4]
            name = path.rsplit("/", 1)[-1]
            if name in ("claim", "heartbeat", "weights", "result") and micros.isdigit():
                times[name].append(int(micros) / 1e6)
                if ident.isdigit():
                    by_id[int(ident)] = int(micros) / 1e6, pid.strip("<>")
    return times, by_id


# --- The report -----------------------------------------------------------------------------------

def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _windows(stats: Stats, window: float) -> tuple[dict[int, list[tuple]], list[int]]:
    """The phase's ops ((name, took) each) by the `window` they were sent in (0: the first), and the full windows
    among them (not the first and the last, which the phase's start and end cut short)."""
    first = min(t for t, *_ in stats.sent)
    ops: dict[int, list[tuple]] = defaultdict(list)
    for t, name, took, _ in stats.sent:
        ops[int((t - first) / window)].append((name, took))
    last = max(ops)
    return ops, [k for k in ops if 0 < k < last]


def _result_share(stats: Stats, window: float = 0.5) -> tuple[float, float]:
    """The least and the most of the ops sent in a window that were results, over the phase's full windows: a
    third each when the devices' ops are mixed as a market's are, not all devices posting results at once."""
    if not stats.sent:
        return 0.0, 0.0
    ops, full = _windows(stats, window)
    shares = [sum(name == "result" for name, _ in ops[k]) / len(ops[k]) for k in full]
    return (min(shares), max(shares)) if shares else (0.0, 0.0)


def _tail_in_time(stats: Stats, window: float = 1.0) -> dict:
    """When the slowest 1 % were sent: the share of them in the worst `window` and when it began (s into the
    phase), and the median over the phase's full windows of each window's own p99. An episode (a stall, or a queue
    that built up for a second at a rate near the cores' limit) shows as most of the slowest in one window, with a
    median p99 far below the phase's; a tail spread over the phase does not."""
    if len(stats.sent) < 100:
        return {}
    cut = sorted(took for _, _, took, _ in stats.sent)[int(len(stats.sent) * 0.99)]
    ops, full = _windows(stats, window)
    slowest = {k: sum(took >= cut for _, took in v) for k, v in ops.items()}
    worst = max(slowest, key=slowest.get)
    p99s = [_quantile([took for _, took in ops[k]], 0.99) for k in full]
    begin = min(t for t, *_ in stats.sent) + worst * window
    lags = [lag for lag, at in zip(stats.loop_lag, stats.lag_at) if begin <= at < begin + window]
    return {"worst_share": round(slowest[worst] / max(1, sum(slowest.values())), 2),
            "worst_at_s": round(worst * window, 1),
            "p99_ms_per_window_median": round(_quantile(p99s, 0.5) * 1e3, 1) if p99s else None,
            # what the worst window says of the machine: CPU time the hypervisor took from it (ms, all cores; the
            # phase's own in `steal_ms`), and how late the devices' own event loop ran then, at worst
            "worst_steal_ms": _stolen_ms(stats, begin, begin + window),
            "worst_loop_lag_ms": round(max(lags) * 1e3, 1) if lags else None,
            "steal_ms": _stolen_ms(stats, float("-inf"), float("inf"))}


def _stolen_ms(stats: Stats, begin: float, end: float) -> float | None:
    """The machine's stolen CPU time between two of the phase's samples nearest `begin` and `end`, in ms."""
    inside = [ticks for at, ticks in stats.steal if begin - 0.05 <= at <= end + 0.05]
    if len(inside) < 2:
        return None
    return round((inside[-1] - inside[0]) * 1e3 / os.sysconf("SC_CLK_TCK"), 1)


def _ms(value: float | None) -> str:
    return "(not measured)" if value is None else f"{value:.0f} ms"


def _tail(stats: Stats) -> dict:
    """The slowest 1 % of the requests matched to gunicorn's log, as their devices saw them: how much of their time
    gunicorn counted, and how much it did not (a request waiting for the worker's main thread and a free thread,
    the devices' own process); and how late the devices' event loop ran, over the whole phase."""
    slowest = sorted(stats.matched, reverse=True)[:max(1, len(stats.matched) // 100)]
    device = sum(d for d, _, _ in slowest) / len(slowest)
    server = sum(s for _, s, _ in slowest) / len(slowest)
    by_process: dict[str, list[float]] = defaultdict(list)
    for d, _, pid in stats.matched:
        by_process[pid].append(d)
    processes = sorted(by_process.values(), key=len, reverse=True)
    return {"n": len(slowest), "device_ms": round(device * 1e3, 1), "server_ms": round(server * 1e3, 1),
            "outside_ms": round((device - server) * 1e3, 1),
            "process_shares": [round(len(times) / len(stats.matched), 2) for times in processes],
            "process_p99_ms": [round(_quantile(times, 0.99) * 1e3, 1) for times in processes],
            "loop_lag_p50_ms": round(_quantile(stats.loop_lag, 0.5) * 1e3, 1),
            "loop_lag_p99_ms": round(_quantile(stats.loop_lag, 0.99) * 1e3, 1)}


def _server_note(options) -> str:
    if options.server == "gunicorn":
        return f"gunicorn {options.workers} workers x {options.threads} threads ({options.worker_class})"
    return f"{options.server} {options.workers} workers x {options.threads} threads"


def _report(options, world: World, phases: dict[str, Stats], db: dict, plans: dict, web_log: str,
            credit: dict, yardstick: float, disk_ms: float, wakes: dict) -> None:
    load = os.getloadavg()
    print(f"world: {len(world.devices)} devices ({'new' if options.new_devices else 'veteran'}), {world.jobs} jobs, "
          f"{world.units:,} queued units at the start of each phase ({world.topped_up} jobs added before the "
          f"paced one), set up in {world.setup_s:.1f} s; {_server_note(options)}; "
          f"{options.heartbeats} heartbeat(s) per unit; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs; the machine's yardstick "
          f"{yardstick:.3f} s (bench/machine.py); {disk_note(disk_ms)}; a round trip between two threads costs "
          f"{wakes['busy']:.0f} µs of CPU busy, {wakes['idle']:.0f} µs after 10 ms idle (bench/machine.py)")
    figures: dict = {}
    for phase, stats in phases.items():
        title = "as fast as they can" if phase == "saturated" else f"paced to {options.rate:g} ops/s"
        print(f"\n{phase} ({title}, {options.seconds:g} s)")
        print(f"{'op':11}{'ok':>8}{'ops/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'409':>7}{'errors':>8}")
        for name in ["claim", "heartbeat", "weights", "result", None]:
            if name is not None and name not in stats.statuses:
                continue
            lat = stats.latencies[name] if name else [x for v in stats.latencies.values() for x in v]
            print(f"{name or 'all':11}{stats.ok(name):>8}{stats.ok(name) / options.seconds:>9.1f}"
                  f"{_quantile(lat, 0.5) * 1e3:>9.1f}{_quantile(lat, 0.99) * 1e3:>9.1f}"
                  f"{stats.conflicts(name):>7}{stats.failed(name):>8}")
        ok = max(stats.ok(), 1)
        per_op = {k: v / ok * 1e3 for k, v in stats.cpu.items()}
        server = per_op.get("web", 0.0) + per_op.get("database", 0.0)
        print(f"CPU per ok op: web {per_op.get('web', 0):.1f} ms, database {per_op.get('database', 0):.1f} ms, "
              f"devices {per_op.get('devices', 0):.1f} ms; the site alone on {os.cpu_count()} idle cores: "
              f"~{os.cpu_count() * 1e3 / server if server else float('nan'):.0f} ops/s")
        if stats.server:
            print("gunicorn's own time (its access log), p50 / p99 ms: " + ", ".join(
                f"{name} {_quantile(v, 0.5) * 1e3:.1f} / {_quantile(v, 0.99) * 1e3:.1f}"
                for name, v in stats.server.items()) + ", all {:.1f} / {:.1f}".format(
                *(_quantile([x for v in stats.server.values() for x in v], q) * 1e3 for q in (0.5, 0.99))))
        tail = _tail(stats) if stats.matched else {}
        mix = _result_share(stats)
        if tail:
            print(f"the slowest 1 % as the devices saw them ({tail['n']} requests, {tail['device_ms']:.1f} ms on "
                  f"average): gunicorn's own time {tail['server_ms']:.1f} ms, the rest {tail['outside_ms']:.1f} ms "
                  f"(before gunicorn's clock starts, and the devices' process); the devices' event loop late by "
                  f"{tail['loop_lag_p50_ms']:.1f} / {tail['loop_lag_p99_ms']:.1f} ms (p50 / p99)")
            print("gunicorn's worker processes, their share of the requests (p99 as the devices saw it): " + ", ".join(
                f"{share:.0%} ({p99:.0f} ms)" for share, p99 in zip(tail["process_shares"], tail["process_p99_ms"])))
        print(f"the ops' mix: results were {mix[0]:.0%}-{mix[1]:.0%} of the ops sent in each half second")
        when = _tail_in_time(stats)
        if when:
            print(f"the slowest 1 % in time: {when['worst_share']:.0%} of them sent in the worst second (from "
                  f"{when['worst_at_s']:.0f} s); each second's own p99, median over the phase: "
                  f"{when['p99_ms_per_window_median']:.1f} ms; in that second the hypervisor took "
                  f"{_ms(when['worst_steal_ms'])} of the machine's CPU ({_ms(when['steal_ms'])} in the phase) and "
                  f"the devices' event loop ran up to {_ms(when['worst_loop_lag_ms'])} late")
        again, doubles = _client_double_leases(stats)
        print(f"empty claims (204) {stats.empty_claims}; units leased again {again}, overlapping (client) {doubles}")
        print(f"the devices' updates: {stats.updates['made_before']:,} made before the phase (in "
              f"{stats.updates['made_before_s']:.1f} s), {stats.updates['made_live']} during it")
        all_lat = [x for v in stats.latencies.values() for x in v]
        figures[phase] = {"ops_per_s": round(stats.ok() / options.seconds, 1),
                          "p50_ms": round(_quantile(all_lat, 0.5) * 1e3, 1),
                          "p99_ms": round(_quantile(all_lat, 0.99) * 1e3, 1),
                          "results_per_s": round(stats.ok("result") / options.seconds, 1),
                          "errors": stats.failed(), "conflicts": stats.conflicts(), "client_double_leases": doubles,
                          "empty_claims": stats.empty_claims, "updates": stats.updates,
                          "result_share": [round(x, 2) for x in mix], "tail_in_time": when,
                          "cpu_ms_per_op": {k: round(v, 2) for k, v in per_op.items()},
                          "cpu_bound_ops_per_s": round(os.cpu_count() * 1e3 / server, 1) if server else None}
        if stats.server:
            every = [x for v in stats.server.values() for x in v]
            figures[phase]["server_p50_ms"] = round(_quantile(every, 0.5) * 1e3, 1)
            figures[phase]["server_p99_ms"] = round(_quantile(every, 0.99) * 1e3, 1)
            figures[phase]["tail"] = tail
        for message in stats.errors[:5]:
            print(f"  error: {message}")
    print(f"\ndatabase: {db['leases']:,} leases, {db['units_leased_again']} units leased more than once, "
          f"{db['double_leases']} with overlapping leases; receipts {db['receipts']}")
    print(f"credit task (run here afterwards): {credit['results']:,} results charged, {credit['cpu_ms_per_result']} ms "
          "of CPU each")
    if "Traceback" in web_log:  # the whole log is kept (the run's folder is not): an error is rare, and costly to miss
        kept = Path(tempfile.gettempdir()) / f"muninn-load-web-{datetime.now(UTC):%Y%m%dT%H%M%S}.log"
        kept.write_text(web_log)
        print(f"the web log has tracebacks (the whole log: {kept}): " + web_log[web_log.index("Traceback"):][:3000])
    if plans:
        print(f"\nround planning (best of {options.plan_repeats}; {plans[PLAN_SIZES[0]]['n_train']:,} training rows)")
        print(f"{'devices':>8}{'units':>7}{'round_open ms':>15}{'(worst)':>9}{'CPU ms':>8}{'plan_shards ms':>16}")
    for size, t in plans.items():
        print(f"{size:>8}{t['units']:>7}{t['round_open_ms']:>15.1f}{t['round_open_max_ms']:>9.1f}"
              f"{t['round_open_cpu_ms']:>8.1f}{t['plan_shards_ms']:>16.3f}")
    client_doubles = max(f["client_double_leases"] for f in figures.values())
    print(json.dumps({
        "ops_per_s": figures["saturated"]["ops_per_s"], "p50_ms": figures["paced"]["p50_ms"],
        "p99_ms": figures["paced"]["p99_ms"], "double_leases": max(client_doubles, db["double_leases"]),
        "errors": sum(f["errors"] for f in figures.values()),
        "paced_ops_per_s": figures["paced"]["ops_per_s"], "paced_result_share": figures["paced"]["result_share"],
        "paced_tail_in_time": figures["paced"]["tail_in_time"],
        "saturated_p99_ms": figures["saturated"]["p99_ms"],
        "saturated_results_per_s": figures["saturated"]["results_per_s"],
        "cpu_ms_per_op": figures["saturated"]["cpu_ms_per_op"],
        "cpu_bound_ops_per_s": figures["saturated"]["cpu_bound_ops_per_s"],
        # what decides the paced p99: an op paced costs more than one saturated (threads wake for each request)
        "paced_cpu_ms_per_op": figures["paced"]["cpu_ms_per_op"],
        "credit_cpu_ms_per_result": credit["cpu_ms_per_result"],
        "updates_made_live": sum(f["updates"]["made_live"] for f in figures.values()),
        **({"server_p50_ms": figures["paced"]["server_p50_ms"], "server_p99_ms": figures["paced"]["server_p99_ms"],
            "paced_tail": figures["paced"]["tail"]} if options.server_times else {}),
        "conflicts": sum(f["conflicts"] for f in figures.values()),
        "client_double_leases": client_doubles, "db_double_leases": db["double_leases"],
        **{f"plan_ms_{size}": round(t["round_open_ms"], 1) for size, t in plans.items()},
        **{f"plan_cpu_ms_{size}": round(t["round_open_cpu_ms"], 1) for size, t in plans.items()},
        **{f"plan_shards_ms_{size}": round(t["plan_shards_ms"], 3) for size, t in plans.items()},
        "devices": len(world.devices), "seconds": options.seconds, "rate": options.rate,
        "server": options.server, "workers": options.workers, "threads": options.threads,
        "worker_class": options.worker_class if options.server == "gunicorn" else None,
        "loop": options.loop, "keep_alive": options.keep_alive,
        "load_average": round(load[0], 2),
        "yardstick_s": yardstick, "new_file_ms": disk_ms, "wake_us": wakes,
    }))


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=200, help="simulated devices (default 200)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each phase (default 20)")
    parser.add_argument("--rate", type=float, default=500.0, help="ops/s of the paced phase, all devices (default 500)")
    parser.add_argument("--heartbeats", type=int, default=1, help="heartbeats per unit (default 1)")
    parser.add_argument("--units", type=int, default=0,
                        help="queued units to start with (default 40 per device: enough for both phases)")
    parser.add_argument("--server", choices=WEB_SERVERS, default=WEB_SERVER,
                        help=f"the site's HTTP server (default {WEB_SERVER}, as the site is deployed)")
    parser.add_argument("--workers", type=int, default=3, help="the server's worker processes (default 3)")
    parser.add_argument("--threads", type=int, default=8, help="threads per worker (default 8)")
    parser.add_argument("--worker-class", default=WEB_WORKER,
                        help=f"with --server gunicorn: its worker class (default {WEB_WORKER})")
    parser.add_argument("--keep-alive", type=float, default=2.0,
                        help="the devices close a connection idle for a second less than this (for half of it, "
                             "below 2 s); with --server gunicorn also its keep-alive (default 2, gunicorn's own; "
                             "granian's idle limit is its 30 s header read timeout)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                        help="the simulated devices' event loop (default uvloop: it costs the shared cores less)")
    parser.add_argument("--new-devices", action="store_true", help="devices start new (every result re-executed)")
    parser.add_argument("--server-times", action="store_true",
                        help="with --server gunicorn: also its own time per request, from its access log (costs the "
                             "web a little CPU)")
    parser.add_argument("--skip-planning", action="store_true", help="only the load phases")
    parser.add_argument("--plan-repeats", type=int, default=3, help="timed round_open runs per size (default 3)")
    parser.add_argument("--database-url", default=DEFAULT_DATABASE_URL,
                        help=f"PostgreSQL database to DROP and recreate (default {DEFAULT_DATABASE_URL})")
    parser.add_argument("--broker", default="muninnfs://",
                        help="Celery broker the site queues its tasks on (default: a filesystem one in the run's "
                             "temporary folder; nothing consumes them)")
    options = parser.parse_args()
    for name in ("devices", "seconds", "rate", "workers", "threads", "plan_repeats"):
        if getattr(options, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if options.server_times and options.server != "gunicorn":
        parser.error("--server-times reads gunicorn's access log: add --server gunicorn")
    if not options.database_url.startswith(("postgres://", "postgresql://")):
        parser.error("--database-url must be a PostgreSQL URL: the claims need SKIP LOCKED")
    options.units = options.units or 40 * options.devices
    return options


if __name__ == "__main__":
    sys.exit(main())
