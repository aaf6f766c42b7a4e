"""The work loop: claim → download → train → upload → repeat.

Nothing a single unit does can stop the loop: a lost lease, a refused result or a broken download is logged
and the worker asks for the next unit. Only a rejected device token (the device was removed or the token
revoked) ends it, because every further request would be refused too.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal, InvalidOperation
from typing import Any

import torch

from muninn_worker import codec, heap
from muninn_worker.api import ApiClient, ApiError, NetworkError
from muninn_worker.cache import ContentCache
from muninn_worker.challenge import (CheckpointStore, answer_open_challenges, run_peer_check,
                                    upload_challenged_checkpoints)
from muninn_worker.config import CLAIM_WAIT
from muninn_worker.failpoints import failpoint
from muninn_worker.pause import Gate
from muninn_worker.receipt import build_receipt, utc_now_iso
from muninn_worker.tensors import bytes_to_shard, bytes_to_state_dict, sha256_hex
from muninn_worker.segments import Checkpoint
from muninn_worker.training import TrainResult, deterministic_cuda, train_local, warm_up
from muninn_worker.zoo import build_model, get_template, load_base

__all__ = ["run", "RunStats", "DeviceRejected"]

log = logging.getLogger("muninn_worker")

MAX_IDLE_DELAY = 5.0
# A claim turned away at once with a Retry-After came from one web process holding all the claims it may; another
# process of the site may have room. Asked again this many times, each after a short random pause and on a new
# connection (ApiClient.reconnect), before the Retry-After is honoured: under bench/round_latency.py a device
# turned away for 2 s missed its round's opening (10 devices on 2 processes: one round in six runs).
QUICK_RETRIES = 2
QUICK_RETRY_S = (0.05, 0.25)
_FAILED = object()  # _claim's answer when the claim itself failed (as opposed to "nothing to do")
DEFAULT_CACHE_MAX_BYTES = 2 * 1024**3
_BIG_BODY = 8 * 1024**2  # downloads at least this big get progress lines


class DeviceRejected(Exception):
    """The site refuses this device's token (401/403): register again."""


class _LeaseLost(Exception):
    """The heartbeat learned that the unit is no longer ours; stop working on it."""


@dataclass
class RunStats:
    units: int = 0
    accepted: int = 0
    failed: int = 0
    credited_hu: Decimal = Decimal(0)
    earned_nanos: int = 0  # the contributor's share of the accepted units' charges, in 10^-9 of the site's currency
    currency: str = "EUR"


def run(
    client: ApiClient,
    *,
    cache_dir: str | os.PathLike[str],
    max_units: int | None = None,
    exit_when_idle: float | None = None,
    poll_interval: float = 1.0,
    threads: int | None = None,
    cache_max_bytes: int = DEFAULT_CACHE_MAX_BYTES,
    sleep: Callable[[float], Any] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    numerics: str = "native",
    claim_wait: float = CLAIM_WAIT,
    gate: Gate | None = None,
    backends: Sequence[str] | None = None,
    freeze_heap: bool = False,
) -> RunStats:
    """Work until `max_units` units were handled or no work came for `exit_when_idle` seconds (None: forever).

    An empty claim is held by the site up to `claim_wait` seconds (0: never) and answered the moment a unit is
    queued, so an idle worker learns of new work at once instead of at its next poll. A site that answers an
    empty claim early (an older site, or one holding all the claims it can: its Retry-After) gets the old
    idle backoff: `poll_interval` doubling up to MAX_IDLE_DELAY, or the Retry-After when longer; a Retry-After
    claim is first asked again QUICK_RETRIES times at once, on new connections (another process may have room).

    `numerics` "f64" trains in float64 rounded to float32 after every step: another device's arithmetic, for
    testing verification on CPU-only machines (muninn_worker.training).

    `threads` caps torch's CPU threads (it never raises them above torch's own choice). `gate` holds every claim
    while the owner's rules say pause (muninn_worker.pause; a unit in hand is always finished first), and paused
    time counts as time without work for `exit_when_idle`. `backends` ("cuda" for --gpu-only) asks the site for
    units of those backends only. `freeze_heap` (the CLI's process, not a caller's) exempts the objects alive
    after torch's warm-up from the garbage collector's full passes (muninn_worker.heap)."""
    if threads is not None:
        torch.set_num_threads(max(1, min(threads, torch.get_num_threads())))
    warmed = warm_up()  # before the first claim: a round never waits on it
    if freeze_heap:  # the process is the worker's own (the CLI): its start-up objects out of the collector's full
        heap.freeze()  # passes, which stopped a client ~0.3 s mid-job (muninn_worker.heap)
    log.info("torch warmed up in %.2f s", warmed)
    cache = ContentCache(cache_dir)
    answer_open_challenges(client, cache.root)
    stats = RunStats()
    idle = _IdleBackoff(poll_interval, max(poll_interval, MAX_IDLE_DELAY))
    idle_since = clock()
    turned_away = 0  # claims turned away in a row, asked again at once (QUICK_RETRIES)
    while max_units is None or stats.units < max_units:
        if gate is not None and not gate.wait_until_allowed(
                None if exit_when_idle is None else exit_when_idle - (clock() - idle_since)):
            log.info("paused, no work for %.0f s; exiting", clock() - idle_since)
            break
        wait = claim_wait if exit_when_idle is None else min(claim_wait, exit_when_idle - (clock() - idle_since))
        open_for = None if gate is None else gate.open_for()
        if open_for is not None:
            wait = min(wait, open_for)  # a claim held past the working hours would bring work outside them
        asked = clock()
        unit = _claim(client, max(0.0, wait), backends)
        if unit is None or unit is _FAILED:
            waited = clock() - idle_since
            if exit_when_idle is not None and waited >= exit_when_idle:
                log.info("no work for %.0f s; exiting", waited)
                break
            if unit is None and wait > 0 and clock() - asked >= wait / 2:
                turned_away = 0
                continue  # the site held the claim for its wait: ask again at once
            retry_after = (client.retry_after or 0.0) if unit is None else 0.0
            if retry_after and wait > 0 and turned_away < QUICK_RETRIES:
                turned_away += 1
                sleep(random.uniform(*QUICK_RETRY_S))
                continue
            turned_away = 0
            delay = max(idle.next_delay(), retry_after)
            sleep(delay if exit_when_idle is None else min(delay, exit_when_idle - waited))
            continue
        idle.reset()
        turned_away = 0
        if unit.get("kind") == "check":
            _work_on_check(client, unit, cache, numerics)
            idle_since = clock()
            continue
        ok = _work_on_unit(client, unit, cache, stats, numerics)
        stats.units += 1
        cache.prune(cache_max_bytes)
        idle_since = clock()
        if not ok:
            sleep(poll_interval)  # a unit that failed here may fail again; do not hammer the site
    log.info("done: %d unit(s), %d accepted, earned %s (%s HU)", stats.units, stats.accepted,
             format_money(stats.earned_nanos, stats.currency), format(stats.credited_hu, "f"))
    return stats


# ------------------------------------------------------------------------------------------- steps


def _claim(client: ApiClient, wait: float, backends: Sequence[str] | None = None) -> dict | object | None:
    """The claimed unit or check, None when the site has nothing for us, _FAILED when the claim failed."""
    try:
        return client.claim(wait, backends=backends)
    except NetworkError as exc:
        log.warning("%s; will try again", exc)
    except ApiError as exc:
        if exc.status in (401, 403):
            raise DeviceRejected(
                f"the server refuses this device ({exc.message}); run `muninn-worker register` again"
            ) from None
        if exc.code == "bad_backends":  # e.g. --gpu-only on a device registered without CUDA: no claim will do
            raise DeviceRejected(f"the server refuses these claims: {exc.message}") from None
        log.warning("claim failed: %s", exc)
    return _FAILED


def _work_on_unit(client: ApiClient, unit: dict, cache: ContentCache, stats: RunStats,
                  numerics: str = "native") -> bool:
    """Do one unit end to end; True when the site accepted the result. Never raises for a unit's failure."""
    unit_id = unit.get("id", "?")
    store, uploaded = None, False
    try:
        spec = _UnitSpec.from_claim(unit)
        log.info("claimed unit %s job %s round %s (%d samples)", spec.id, spec.job, spec.round, spec.samples)
        store = CheckpointStore(cache.root, spec.id)
        with _Heartbeat(client, spec.id, _lease_seconds(unit)) as heartbeat:
            weights, shard = _download_inputs(client, spec, cache)
            base = _download_base(client, spec, cache)
            result = _train(spec, weights, shard, heartbeat, base, store, numerics)
            heartbeat.check()
            answer = _upload(client, spec, unit, result, bytes_to_state_dict(weights), store)
        uploaded = True
        if isinstance(answer.get("challenge"), dict):
            challenge = answer["challenge"]
            if challenge.get("missing"):
                log.info("unit %s: the site checks segment(s) %s; uploading checkpoints %s", spec.id,
                         challenge.get("segments"), challenge.get("missing"))
            else:
                log.info("unit %s: the site checks segment(s) %s with the checkpoint sent along", spec.id,
                         challenge.get("segments"))
            checked = upload_challenged_checkpoints(client, store, challenge)
            answer = {**answer, **{k: v for k, v in checked.items() if k in _CHECKED_FIELDS}}
        _record(answer, spec.id, stats)
        return True
    except KeyboardInterrupt:
        if not uploaded and isinstance(unit_id, int) and client.give_back(unit_id):
            log.warning("interrupted during unit %s; gave it back to the site for another device", unit_id)
        else:
            log.warning("interrupted during unit %s; its lease will expire on the server", unit_id)
        raise
    except _LeaseLost as exc:
        log.warning("unit %s: lease lost (%s); moving on", unit_id, exc)
    except NetworkError as exc:
        log.warning("unit %s: %s; giving it up", unit_id, exc)
        _give_back(client, unit_id, uploaded)
    except ApiError as exc:
        if exc.status == 409:
            log.warning("unit %s: lease lost or unit already done (%s); moving on", unit_id, exc.message)
        else:
            log.error("unit %s: the server refused it: %s", unit_id, exc)
            _give_back(client, unit_id, uploaded)
    except (ValueError, RuntimeError) as exc:  # bad bytes, wrong shapes, unknown template, torch errors
        log.error("unit %s failed: %s", unit_id, exc)
        _give_back(client, unit_id, uploaded)
    finally:
        if store is not None:
            store.discard()  # answered, not challenged, or given up: the site needs none of them any more
    stats.failed += 1
    return False


def _work_on_check(client: ApiClient, check: dict, cache: ContentCache, numerics: str) -> None:
    """A peer check: another device's segment re-trained and reported. Its failures never stop the loop."""
    try:
        run_peer_check(client, check, cache.root, numerics)
    except (ApiError, ValueError, RuntimeError, KeyError, TypeError) as exc:
        log.warning("peer check %s failed: %s", check.get("id"), exc)


def _download_inputs(client: ApiClient, spec: _UnitSpec, cache: ContentCache) -> tuple[bytes, bytes]:
    wanted = {"weights": spec.weights_sha256, "shard": spec.shard_sha256}
    missing = [kind for kind, sha in wanted.items() if not cache.path_for(sha).exists()]
    if missing:
        log.info("unit %s: downloading %s…", spec.id, " and ".join(missing))
    else:
        log.info("unit %s: weights and shard already cached", spec.id)
    weights = client.download(spec.id, "weights", spec.weights_sha256, cache.root,
                              progress=_progress(spec.id, "weights"))
    shard = client.download(spec.id, "shard", spec.shard_sha256, cache.root, progress=_progress(spec.id, "shard"))
    log.info("unit %s: weights %s, shard %s", spec.id, _mb(len(weights)), _mb(len(shard)))
    return weights, shard


def _download_base(client: ApiClient, spec: _UnitSpec, cache: ContentCache) -> bytes | None:
    """LoRA units: the job's frozen base weights, downloaded once and then served from the cache by hash."""
    if spec.base_sha256 is None:
        return None
    if not cache.path_for(spec.base_sha256).exists():
        log.info("unit %s: downloading the base weights…", spec.id)
    return client.download(spec.id, "base", spec.base_sha256, cache.root, progress=_progress(spec.id, "base"))


def _train(spec: _UnitSpec, weights: bytes, shard: bytes, heartbeat: _Heartbeat,
           base: bytes | None, store: CheckpointStore, numerics: str = "native") -> TrainResult:
    model = build_model(spec.template, spec.model_config)
    incoming = bytes_to_state_dict(weights)
    _check_dtypes(model.state_dict(), incoming)
    model.load_state_dict(incoming, strict=True)  # strict: missing/extra keys and wrong shapes raise
    if base is not None:
        load_base(model, bytes_to_state_dict(base))
    model.to(_train_device(spec.template))
    X, y = bytes_to_shard(shard)
    if X.shape[0] != spec.samples:
        raise ValueError(f"the shard has {X.shape[0]} samples but the unit says {spec.samples}")

    def progress(epoch: int, epochs: int, loss: float) -> None:
        log.info("unit %s: epoch %d/%d loss %.4f", spec.id, epoch, epochs, loss)
        failpoint("train.after_epoch")
        heartbeat.check()  # abort early rather than finish work nobody will accept

    spec.started_at = utc_now_iso()
    result = train_local(model, X, y, epochs=spec.epochs, batch_size=spec.batch_size, lr=spec.lr,
                         momentum=spec.momentum, seed=spec.seed, optimizer=spec.optimizer,
                         inner_steps=spec.inner_steps, progress=progress, segment_steps=spec.segment_steps,
                         on_boundary=store.keep, numerics=numerics)
    spec.finished_at = utc_now_iso()
    log.info("unit %s: trained %d steps in %.2f s, loss %.4f → %.4f",
             spec.id, result.steps, result.train_seconds, result.loss_before, result.loss_after)
    return result


def _upload(client: ApiClient, spec: _UnitSpec, unit: dict, result: TrainResult,
            global_state: dict[str, torch.Tensor], store: CheckpointStore) -> dict:
    """The update travels as its delta against the round's global weights in the job's encoding; the
    receipt's output hash is over exactly these bytes, and its chain ends at them decoded."""
    payload = codec.encode_update(result.state_dict, global_state, spec.encoding)
    chain = store.seal(Checkpoint(result.state_dict, result.optimizer_state), global_state, spec.encoding)
    receipt = build_receipt(unit, result, output_sha256=sha256_hex(payload), started_at=spec.started_at,
                            finished_at=spec.finished_at, segment_steps=spec.segment_steps or result.steps,
                            checkpoints=chain)
    # A unit of one segment: every check of it re-trains that segment and needs its end, the last checkpoint, so
    # it goes with the result (the receipt commits to it already) and a check costs no second request.
    last = store.path(len(chain) - 1).read_bytes() if len(chain) == 2 else None
    log.info("unit %s: uploading %s (%s update)…", spec.id, _mb(len(payload) + len(last or b"")), spec.encoding)
    return client.submit_result(spec.id, payload, receipt, checkpoint=last)


def _train_device(template: str) -> torch.device:
    """GPU-tier templates train on the GPU when there is one, with deterministic kernels and full fp32 (two
    GPUs of a kind then agree bit for bit, and a segment stays within the measured envelope of a CPU's);
    everything else on the CPU, where training is bitwise reproducible."""
    if get_template(template).tier == "gpu" and torch.cuda.is_available():
        deterministic_cuda()
        return torch.device("cuda")
    return torch.device("cpu")


def _check_dtypes(expected: dict[str, torch.Tensor], incoming: dict[str, torch.Tensor]) -> None:
    """load_state_dict would silently cast; the result must have the global weights' dtypes, so refuse."""
    for key, tensor in incoming.items():
        if key in expected and tensor.dtype != expected[key].dtype:
            raise ValueError(f"global weights {key!r} are {tensor.dtype}, the model expects {expected[key].dtype}")


def _give_back(client: ApiClient, unit_id, uploaded: bool) -> None:
    """A unit given up before its result: hand it back so that another device takes it now (a refused upload
    already put it back: the site released it)."""
    if not uploaded and isinstance(unit_id, int) and client.give_back(unit_id):
        log.info("unit %s given back to the site for another device", unit_id)


def _record(answer: dict, unit_id: int, stats: RunStats) -> None:
    status = str(answer.get("status", "accepted"))
    credited = _decimal(answer.get("credited_hu"))
    stats.accepted += 1
    stats.credited_hu += credited
    if status == "rejected":
        log.warning("unit %s: the site's check refused it; it earns nothing", unit_id)
        return
    if status == "pending":
        log.info("unit %s: uploaded; the site is checking it, and credits its earnings when the check passes",
                 unit_id)
        return
    if answer.get("credit") == "pending":  # accepted; the site posts its charge moments later, off the request
        log.info("unit %s: accepted, %s HU of work; its earnings are credited moments later (your contributor "
                 "page shows them)", unit_id, answer.get("credited_hu", "0"))
        return
    earned = answer.get("earned_nanos")
    if isinstance(earned, int) and not isinstance(earned, bool):
        stats.earned_nanos += earned
        stats.currency = str(answer.get("currency") or stats.currency)
        shown = str(answer.get("earned") or format_money(earned, stats.currency))
    else:  # a site that does not say it in money
        shown = f"{format(credited, 'f')} HU"
    log.info("unit %s: accepted, earned %s (%s HU of work)", unit_id, shown, answer.get("credited_hu", "0"))


# What a checkpoint's answer adds to the result's once the check is decided (contributors.api.CheckpointView).
_CHECKED_FIELDS = ("status", "credited_hu", "earned", "earned_nanos", "currency")
_SYMBOLS = {"EUR": "€", "USD": "$", "GBP": "£"}


def format_money(nanos: int, currency: str = "EUR") -> str:
    """Nanos (10^-9 of the currency) as the site shows money: up to 9 decimals, trailing zeros trimmed to 2."""
    sign = "-" if nanos < 0 else ""
    whole, frac = divmod(abs(nanos), 10**9)
    return f"{sign}{_SYMBOLS.get(currency, currency + ' ')}{whole:,}.{f'{frac:09d}'.rstrip('0').ljust(2, '0')}"


# ----------------------------------------------------------------------------------------- helpers


@dataclass
class _UnitSpec:
    """A claimed unit, checked field by field so a malformed answer fails with a sentence, not KeyError."""

    id: int
    job: int
    round: int
    template: str
    model_config: dict
    epochs: int
    batch_size: int
    lr: float
    momentum: float
    seed: int
    weights_sha256: str
    shard_sha256: str
    samples: int
    optimizer: str = "sgd"
    algorithm: str = "fedavg"
    inner_steps: int | None = None  # DiLoCo: exactly this many local steps instead of epochs
    encoding: str = "fp32"  # how the update is uploaded (muninn_worker.codec)
    segment_steps: int | None = None  # a checkpoint every this many steps (None: one segment, the whole unit)
    base_sha256: str | None = None
    started_at: str = ""
    finished_at: str = ""

    @classmethod
    def from_claim(cls, unit: dict) -> _UnitSpec:
        train = unit.get("train")
        if not isinstance(train, dict) or not isinstance(unit.get("model_config"), dict):
            raise ValueError("malformed unit from the server: 'train' and 'model_config' must be objects")
        try:
            return cls(
                id=_int(unit["id"]), job=_int(unit["job"]), round=_int(unit["round"]),
                template=str(unit["template"]), model_config=unit["model_config"],
                epochs=_int(train["epochs"]), batch_size=_int(train["batch_size"]),
                lr=float(train["lr"]), momentum=float(train["momentum"]), seed=_int(train["seed"]),
                weights_sha256=str(unit["weights_sha256"]), shard_sha256=str(unit["shard_sha256"]),
                samples=_int(unit["samples"]), optimizer=str(train.get("optimizer") or "sgd"),
                base_sha256=str(unit["base_sha256"]) if unit.get("base_sha256") else None,
                algorithm=str(unit.get("algorithm") or "fedavg"),
                inner_steps=None if train.get("inner_steps") is None else _int(train["inner_steps"]),
                encoding=_encoding(unit.get("encoding") or "fp32"),
                segment_steps=None if train.get("segment_steps") is None else _int(train["segment_steps"]),
            )
        except KeyError as exc:
            raise ValueError(f"malformed unit from the server: missing {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed unit from the server: {exc}") from None


def _encoding(value: Any) -> str:
    if value not in codec.ENCODINGS:
        raise ValueError(f"unknown update encoding {value!r} (known: {', '.join(codec.ENCODINGS)})")
    return str(value)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


class _Heartbeat:
    """Extends the lease every lease/3 seconds from a daemon thread while the unit is being worked on."""

    def __init__(self, client: ApiClient, unit_id: int, lease_seconds: float) -> None:
        self._client = client
        self._unit_id = unit_id
        self._interval = _interval_for(lease_seconds)
        self._stop = threading.Event()
        self._lost: str | None = None
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{unit_id}", daemon=True)

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)  # a heartbeat stuck in retries must not hold up the next unit

    def check(self) -> None:
        if self._lost is not None:
            raise _LeaseLost(self._lost)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                answer = self._client.heartbeat(self._unit_id)
            except ApiError as exc:
                if exc.status in (404, 409):
                    self._lost = exc.message
                    return
                log.warning("unit %s: heartbeat failed: %s", self._unit_id, exc)
                continue
            self._interval = _interval_for(_lease_seconds(answer))


def _lease_seconds(lease: dict, default: float = 30.0) -> float:
    """Seconds left on a lease: the site's `lease_seconds` (immune to clock skew), else computed from the
    ISO 8601 expiry against our own clock."""
    if isinstance(lease.get("lease_seconds"), (int, float)) and lease["lease_seconds"] > 0:
        return float(lease["lease_seconds"])
    try:
        expiry = datetime.fromisoformat(str(lease.get("lease_expires_at")).replace("Z", "+00:00"))
    except ValueError:
        return default
    if expiry.tzinfo is None:
        expiry = expiry.replace(tzinfo=timezone.utc)
    left = (expiry - datetime.now(timezone.utc)).total_seconds()
    return left if left > 0 else default  # already past: our clock is ahead of the site's, so guess


def _interval_for(lease_seconds: float) -> float:
    # A third of the lease leaves two more chances if one heartbeat is lost; clamped against clock skew.
    return min(60.0, max(0.5, lease_seconds / 3))


class _IdleBackoff:
    """Sleep poll_interval after the first empty claim, doubling up to `cap`, with ±20 % jitter."""

    def __init__(self, first: float, cap: float) -> None:
        self._first = first
        self._cap = cap
        self._delay = first

    def next_delay(self) -> float:
        delay = self._delay
        self._delay = min(self._cap, self._delay * 2)
        return delay * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self._delay = self._first


def _progress(unit_id: int, kind: str) -> Callable[[int, int | None], None]:
    """Log big downloads at each quarter; small ones stay quiet."""
    last = [0]

    def report(done: int, total: int | None) -> None:
        if total is None or total < _BIG_BODY:
            return
        quarter = done * 4 // total
        if quarter > last[0]:
            last[0] = quarter
            log.info("unit %s: %s %d%% of %s", unit_id, kind, quarter * 25, _mb(total))

    return report


def _mb(size: int) -> str:
    return f"{size / 1e6:.2f} MB"


def _decimal(value: Any) -> Decimal:
    try:
        return Decimal(str(value)) if value is not None else Decimal(0)
    except InvalidOperation:
        return Decimal(0)
