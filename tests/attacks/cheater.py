"""A worker client that cheats, for the attack suite: one process per class of cheating.

    python -m tests.attacks.cheater --config worker.json --cache-dir DIR --strategy sign_flip

It speaks the real protocol with the real client library (muninn_worker.api), trains with the real
training loop where the strategy needs an honest starting point, and then lies in one specific way, keeping
its receipt's chain of checkpoints consistent with the lie and answering the site's challenges.
It stops when the site quarantines it (403), after --max-units, or after --idle seconds without work.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from muninn_worker import codec, segments, signing, tensors, training, zoo
from muninn_worker.api import ApiClient, ApiError
from muninn_worker.challenge import CheckpointStore, answer_challenge
from muninn_worker.config import load_config
from muninn_worker.receipt import build_receipt
from muninn_worker.segments import Checkpoint

log = logging.getLogger("cheater")
STRATEGIES = ("no_training", "partial_shard", "random_noise", "scaled", "sign_flip", "replay", "forged_signature",
              "other_lease", "nan", "wrong_shape", "oversized", "pickle")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class Cheater:
    def __init__(self, client: ApiClient, strategy: str, cache_dir: str):
        self.client, self.strategy, self.cache_dir = client, strategy, cache_dir
        self.previous_output: bytes | None = None

    def work(self, unit: dict) -> None:
        glob_bytes = self.client.download(unit["id"], "weights", unit["weights_sha256"], self.cache_dir)
        shard = self.client.download(unit["id"], "shard", unit["shard_sha256"], self.cache_dir)
        glob = tensors.bytes_to_state_dict(glob_bytes)
        X, y = tensors.bytes_to_shard(shard)
        if self.strategy == "partial_shard":  # a third of the shard, repeated to the right number of steps
            third = max(1, len(y) // 3)
            tile = lambda t: t[:third].repeat(4, *[1] * (t.ndim - 1))[: len(y)]  # noqa: E731 - 4 thirds ≥ all
            X, y = tile(X), tile(y)
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--max-units", type=int, default=6)
    parser.add_argument("--idle", type=float, default=120.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    config = load_config(Path(args.config))
    key = signing.new_private_key() if args.strategy == "forged_signature" else config.signing_key
    client = ApiClient(config.server, device_token=config.device_token, signing_key=key, attempts=3)
    cheater, done, idle_since = Cheater(client, args.strategy, args.cache_dir), 0, time.monotonic()
    while done < args.max_units and time.monotonic() - idle_since < args.idle:
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


if __name__ == "__main__":
    raise SystemExit(main())
