"""Worker clients that cheat, for the attack suite: one device per class of cheating, all in one process.

    python -m tests.attacks.cheater --cache-dir DIR --device sign_flip=worker.json [--device nan=other.json ...]

Each device runs in its own thread (one adversary, one machine: one torch import and one probe, where twelve
processes had paid them side by side on a 2-core machine). It speaks the real protocol with the real client library
(muninn_worker.api), trains with the real training loop where the strategy needs an honest starting point, and
then lies in one specific way, keeping its receipt's chain of checkpoints consistent with the lie and answering
the site's challenges.
A device warms torch up before its first claim and heartbeats its lease while it works, as the real client does,
so each of its results reaches the site's checks instead of coming too late. A device stops when the site
quarantines it (403), after --max-units, or after --idle seconds without work.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from muninn_worker import codec, segments, signing, tensors, training, zoo
from muninn_worker.api import ApiClient, ApiError
from muninn_worker.challenge import CheckpointStore, answer_challenge
from muninn_worker.config import Config, load_config, save_config
from muninn_worker.probe import probe_device
from muninn_worker.receipt import build_receipt
from muninn_worker.segments import Checkpoint

log = logging.getLogger("cheater")
STRATEGIES = ("no_training", "partial_shard", "random_noise", "scaled", "sign_flip", "replay", "forged_signature",
              "other_lease", "nan", "wrong_shape", "oversized", "pickle")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Cheater:
    def __init__(self, client: ApiClient, strategy: str, cache_dir: str, beat: ApiClient):
        self.client, self.strategy, self.cache_dir, self.beat = client, strategy, cache_dir, beat
        self.previous_output: bytes | None = None

    def work(self, unit: dict) -> None:
        """Cheat on one unit, heartbeating its lease meanwhile as an honest client does."""
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(2.0):
                try:
                    self.beat.heartbeat(unit["id"])
                except ApiError:
                    return  # the lease is gone: the result will be refused as lease_lost
        beating = threading.Thread(target=heartbeat, name=f"{threading.current_thread().name}-heartbeat")
        beating.start()
        try:
            self.cheat(unit)
        finally:
            stop.set()
            beating.join()

    def cheat(self, unit: dict) -> None:
        t0 = time.monotonic()
        log.info("claimed unit %s", unit["id"])
        glob_bytes = self.client.download(unit["id"], "weights", unit["weights_sha256"], self.cache_dir)
        shard = self.client.download(unit["id"], "shard", unit["shard_sha256"], self.cache_dir)
        glob = tensors.bytes_to_state_dict(glob_bytes)
        X, y = tensors.bytes_to_shard(shard)
        if self.strategy == "partial_shard":  # a third of the shard, repeated to the right number of steps
            third = max(1, len(y) // 3)
            tile = lambda t: t[:third].repeat(4, *[1] * (t.ndim - 1))[: len(y)]  # noqa: E731 - 4 thirds ≥ all
            X, y = tile(X), tile(y)
        log.info("unit %s: downloaded in %.2f s", unit["id"], time.monotonic() - t0)
        model = zoo.build_model(unit["template"], unit["model_config"])
        model.load_state_dict(glob)
        started = _now()
        train = {k: v for k, v in unit["train"].items() if k != "segment_steps"}
        store = CheckpointStore(self.cache_dir, unit["id"])
        result = training.train_local(model, X, y, **train, segment_steps=unit["train"]["segment_steps"],
                                      on_boundary=store.keep)
        result = dataclasses.replace(result, samples=unit["samples"])  # partial_shard claims the whole shard
        payload, claimed = self.tamper(unit, glob, dict(result.state_dict), glob_bytes)
        # A careful cheater: the chain ends at what it uploads, and its last checkpoint file says the same, so
        # only re-training a segment (or a cheap check) can tell.
        last = len(store.commitments) - 1
        if claimed is not None:
            store.path(last).write_bytes(segments.checkpoint_to_bytes(Checkpoint(claimed, result.optimizer_state)))
        chain = store.seal(Checkpoint(claimed if claimed is not None else result.state_dict, result.optimizer_state),
                           glob, unit["encoding"])
        receipt = build_receipt(unit, result, output_sha256=tensors.sha256_hex(payload), started_at=started,
                                finished_at=_now(), segment_steps=unit["train"]["segment_steps"], checkpoints=chain)
        log.info("unit %s: trained and sealed at %.2f s", unit["id"], time.monotonic() - t0)
        target = unit["id"]
        if self.strategy == "other_lease":  # a unit that is someone else's (or nobody's)
            target = unit["id"] + 1
        try:
            answer = self.client.submit_result(target, payload, receipt)
            log.info("unit %s: %s", target, answer)
            if isinstance(answer.get("challenge"), dict):
                log.info("unit %s: challenged, answered: %s", target,
                         answer_challenge(self.client, store, answer["challenge"]))
        except ApiError as exc:
            log.info("unit %s refused: %s %s", target, exc.code, exc.message)
        finally:
            store.discard()
        if self.previous_output is None:
            self.previous_output = codec.encode_update(result.state_dict, glob, unit["encoding"])

    def tamper(self, unit: dict, glob: dict, state: dict, glob_bytes: bytes) -> tuple[bytes, dict | None]:
        """The bytes to upload, and the full state they claim to be (None for bytes that are not an update)."""
        floating = [k for k, v in glob.items() if v.is_floating_point()]
        s, encoding = self.strategy, unit["encoding"]
        if s == "no_training":
            return codec.encode_update(glob, glob, encoding), glob
        if s == "random_noise":
            state = {k: torch.randn_like(v) if k in floating else v for k, v in state.items()}
        elif s == "scaled":
            state = {k: glob[k] + 100 * (v - glob[k]) if k in floating else v for k, v in state.items()}
        elif s == "sign_flip":
            state = {k: glob[k] - (v - glob[k]) if k in floating else v for k, v in state.items()}
        elif s == "replay" and self.previous_output is not None:
            return self.previous_output, None
        elif s == "nan":
            first = floating[-1]
            state[first] = state[first].clone()
            state[first].view(-1)[0] = float("nan")
        elif s == "wrong_shape":  # a delta of another shape than the weights it claims to update
            encoded = codec.unpack(codec.encode_update(state, glob, encoding))
            encoded[floating[-1]] = torch.zeros(3, 3, dtype=encoded[floating[-1]].dtype)
            return codec.pack(encoded, encoding), None
        elif s == "oversized":
            return codec.encode_update(state, glob, encoding) + bytes(8 << 20), None
        elif s == "pickle":
            return pickle.dumps({k: v.numpy() for k, v in state.items()}), None
        return codec.encode_update(state, glob, encoding), state


def register(server: str, account_token: str, names: dict[str, str], config_dir: Path) -> dict[str, Path]:
    """Register one device per strategy ({strategy: device name}) under one account, as `muninn-worker register`
    does but with one probe for all (one machine): its config files, {strategy: path}."""
    capabilities = probe_device(quick=True)
    client, configs = ApiClient(server, account_token=account_token), {}
    for strategy, name in names.items():
        key = signing.new_private_key()
        answer = client.register_device(name, capabilities, signing.public_key_of(key))
        configs[strategy] = config_dir / f"{name}.json"
        save_config(Config(server=client.server_url, device_token=answer["device_token"],
                           device_id=answer["device_id"], name=name, signing_key=key), configs[strategy])
    return configs


def run(client: ApiClient, beat: ApiClient, strategy: str, cache_dir: str, max_units: int, idle: float) -> int:
    """One cheating device: claim, cheat, repeat, until quarantined (403), max_units, or idle seconds without work."""
    cheater, done, idle_since = Cheater(client, strategy, cache_dir, beat), 0, time.monotonic()
    while done < max_units and time.monotonic() - idle_since < idle:
        try:
            unit = client.claim()
        except ApiError as exc:
            log.info("claim refused: %s %s", exc.code, exc.message)
            return 0 if exc.status == 403 else 1
        if unit is None:
            time.sleep(0.3)
            continue
        cheater.work(unit)
        done, idle_since = done + 1, time.monotonic()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", action="append", required=True, metavar="STRATEGY=CONFIG",
                        help="a cheating device: its strategy and its worker config file (repeat for more)")
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--max-units", type=int, default=6)
    parser.add_argument("--idle", type=float, default=120.0)
    args = parser.parse_args()
    devices = dict(d.split("=", 1) for d in args.device)
    if unknown := set(devices) - set(STRATEGIES):
        parser.error(f"unknown strategies {sorted(unknown)}; known: {', '.join(STRATEGIES)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")
    torch.set_num_threads(1)
    training.warm_up()  # torch's first use, paid before the first claim (a cold first unit outlives its lease)
    codes: dict[str, int] = {}

    def device(strategy: str, path: str) -> None:
        config = load_config(Path(path))
        key = signing.new_private_key() if strategy == "forged_signature" else config.signing_key
        client, beat = (ApiClient(config.server, device_token=config.device_token, signing_key=key, attempts=3)
                        for _ in range(2))
        codes[strategy] = run(client, beat, strategy, str(Path(args.cache_dir) / strategy), args.max_units, args.idle)

    threads = [threading.Thread(target=device, args=item, name=f"cheat-{item[0]}") for item in devices.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return max(codes.values(), default=1) if len(codes) == len(threads) else 1


if __name__ == "__main__":
    raise SystemExit(main())
