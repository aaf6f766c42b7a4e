"""A minimal worker client written from docs/worker-protocol.md alone: the conformance client.

    python tests/conformance/client.py --server URL --account-token TOKEN --units 3 --dir DIR

It registers a device with an Ed25519 key of its own, claims units of `mlp` jobs, trains them as the document
says, commits to its checkpoints, uploads each encoded update with a signed receipt, answers the site's
challenge, and waits until every unit is accepted and its earnings are posted. It prints one JSON line per unit
(`UNIT {...}`) and exits 0 when all were credited, 1 with a sentence when the site and the document disagree.

It may use torch, safetensors, numpy, cryptography, requests and the standard library. It never imports the
reference client (muninn_worker) nor the site: the import guard below refuses them, so anything it needs that the
document does not say is a gap in the document, to be fixed there."""
from __future__ import annotations

import sys

FORBIDDEN = ("muninn_worker", "muninn", "contributors", "jobs", "accounts", "billing", "worker_client")


class _RefuseRepositoryCode:
    """A meta path finder that refuses the reference client and the site's own packages."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"the conformance client may not import {name}: it is written from the document")
        return None


sys.meta_path.insert(0, _RefuseRepositoryCode())

import argparse  # noqa: E402
import base64  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import requests  # noqa: E402
import torch  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlp  # noqa: E402
import wire  # noqa: E402


class Disagreement(Exception):
    """The site did not answer as the document says it would."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise Disagreement(message)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


class Device:
    def __init__(self, server: str, directory: Path):
        self.server, self.dir = server.rstrip("/"), directory
        self.key = Ed25519PrivateKey.generate()
        self.http = requests.Session()

    def call(self, method: str, path: str, *, expected: tuple[int, ...], timeout: float = 30, **kwargs):
        response = self.http.request(method, f"{self.server}{path}", timeout=timeout, **kwargs)
        expect(response.status_code in expected, f"{method} {path} answered {response.status_code}, expected "
                                                 f"{expected}: {response.text[:500]}")
        return response

    # --- the endpoints --------------------------------------------------------------------------------------

    def register(self, account_token: str, name: str) -> None:
        public = self.key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        body = {"name": name, "public_key": base64.b64encode(public).decode(),
                "capabilities": {"cpu_cores": os.cpu_count() or 1, "ram_bytes": 2 * 2**30, "backends": ["cpu"],
                                 "gpus": [], "torch_version": torch.__version__, "samples_per_s": 1000.0,
                                 "flops_per_s": 1e9}}
        answer = self.call("POST", "/api/worker/devices", expected=(201,), json=body,
                           headers={"Authorization": f"Token {account_token}"}).json()
        expect(isinstance(answer.get("device_id"), int) and len(answer.get("device_token", "")) >= 40
               and answer.get("name") == name and answer.get("quarantined") is False, f"registration: {answer}")
        self.http.headers["Authorization"] = f"Device {answer['device_token']}"
        self.device_id = answer["device_id"]

    def claim(self, wait: float) -> dict | None:
        asked = time.monotonic()
        response = self.call("POST", "/api/worker/claim", expected=(200, 204), json={"wait": wait},
                             timeout=wait + 30)
        if response.status_code == 204:
            if "Retry-After" in response.headers:  # the site holds all the claims it can: wait that long
                time.sleep(min(float(response.headers["Retry-After"]), 5.0))
            elif time.monotonic() - asked < wait / 2:  # an older site that does not hold claims: poll
                time.sleep(0.5)
            return None
        answer = response.json()
        expect("check" not in answer, "a peer check was handed out, though the site validates CPU units itself")
        return answer["unit"]

    def download(self, unit: dict, kind: str) -> bytes:
        data = self.call("GET", f"/api/worker/units/{unit['id']}/{kind}", expected=(200,)).content
        expect(wire.sha256_hex(data) == unit[f"{kind}_sha256"], f"unit {unit['id']}: the {kind} hash differently "
                                                                   f"from {kind}_sha256")
        return data

    def post_result(self, unit_id: int, upload: bytes, receipt_text: str) -> dict:
        signature = base64.b64encode(self.key.sign(receipt_text.encode())).decode()
        return self.call("POST", f"/api/worker/units/{unit_id}/result", expected=(201,),
                         files={"weights": ("update.safetensors.zz", upload, "application/octet-stream")},
                         data={"receipt": receipt_text, "signature": signature}).json()

    # --- one unit -------------------------------------------------------------------------------------------

    def work(self, unit: dict, poll_timeout: float) -> dict:
        expect(unit["template"] == "mlp", f"this client trains mlp units only (got {unit['template']})")
        expect(unit["encoding"] in ("fp32", "fp16", "int8"), f"unknown encoding {unit['encoding']}")
        weights_bytes, shard_bytes = self.download(unit, "weights"), self.download(unit, "shard")
        beat = self.call("POST", f"/api/worker/units/{unit['id']}/heartbeat", expected=(200,)).json()
        expect(beat.get("lease_seconds", 0) > 0 and "lease_expires_at" in beat, f"heartbeat: {beat}")
        global_state, shard = wire.parse(weights_bytes), wire.parse(shard_bytes)
        expect(set(shard) == {"X", "y"} and shard["X"].shape[0] == unit["samples"], "the shard is not X and y "
                                                                                      "with one row per sample")
        # The site serves the round's weights in their canonical form: boundary 0's weights hash is weights_sha256.
        expect(wire.sha256_hex(wire.canonical_bytes(global_state)) == unit["weights_sha256"],
               "the served weights are not in canonical safetensors form")

        started_at = now_iso()
        trained = mlp.train(mlp.MLP(unit["model_config"], global_state), shard["X"], shard["y"], unit["train"])
        finished_at = now_iso()
        k = unit["train"]["segment_steps"]
        expect(len(trained.boundaries) == max(1, math.ceil(trained.steps / k)) + 1, "boundary count")
        files = self.dir / str(unit["id"])
        files.mkdir(parents=True, exist_ok=True)
        chain = []
        for i, (weights, optimizer) in enumerate(trained.boundaries):
            # The last boundary's file keeps the trained weights before encoding (the site encodes them itself).
            (files / f"{i}.safetensors").write_bytes(wire.checkpoint_file(weights, optimizer))
            chain.append(wire.commitment(weights, optimizer))
        upload = wire.encode_update(trained.state, global_state, unit["encoding"])
        decoded = wire.decode_update(upload, global_state, unit["encoding"])
        chain[-1][0] = wire.commitment(decoded, {})[0]

        receipt = {"unit": unit["id"], "weights_sha256": unit["weights_sha256"],
                   "shard_sha256": unit["shard_sha256"], "output_sha256": wire.sha256_hex(upload),
                   "samples": int(shard["X"].shape[0]), "steps": trained.steps,
                   "loss_before": trained.loss_before if math.isfinite(trained.loss_before) else None,
                   "loss_after": trained.loss_after if math.isfinite(trained.loss_after) else None,
                   "started_at": started_at, "finished_at": finished_at,
                   "train_seconds": round(trained.train_seconds, 6), "segment_steps": k, "checkpoints": chain}
        text = json.dumps(receipt)
        answer = self.post_result(unit["id"], upload, text)
        expect(answer.get("unit") == unit["id"] and answer.get("status") == "pending", f"result: {answer}")
        expect(answer["earned_nanos"] == 0 and "credit" not in answer, f"a pending result earned: {answer}")
        challenge = answer.get("challenge")
        expect(isinstance(challenge, dict), f"every result is challenged, but this one was not: {answer}")
        report = {"unit": unit["id"], "job": unit["job"], "encoding": unit["encoding"],
                  "task": unit["model_config"].get("task", "classification"),
                  "algorithm": unit["algorithm"], "steps": trained.steps, "segment_steps": k,
                  "momentum": unit["train"].get("momentum"), "segments": challenge["segments"]}
        self.answer(unit, challenge, files, len(chain) - 1)
        report.update(self.wait_credited(unit["id"], upload, text, poll_timeout))
        return report

    def answer(self, unit: dict, challenge: dict, files: Path, last: int) -> None:
        """Upload both ends of each drawn segment but boundary 0: one segment, or every one (up to the last 64)
        when a cheap check found the result odd."""
        drawn = challenge["segments"]
        expect(challenge["unit"] == unit["id"] and (len(drawn) == 1 and 0 <= drawn[0] < last
                                                    or drawn == list(range(max(0, last - 64), last))),
               f"the challenge draws neither one segment nor every one: {challenge}")
        needed = sorted({b for j in drawn for b in (j, j + 1)} - {0})
        expect(challenge["checkpoints"] == needed and challenge["missing"] == needed and challenge["seconds"] > 0,
               f"the challenge of segments {drawn} asks for other checkpoints: {challenge}")
        listed = self.call("GET", "/api/worker/challenges", expected=(200,)).json()["challenges"]
        expect([c["unit"] for c in listed] == [unit["id"]] and listed[0]["missing"] == needed,
               f"open challenges: {listed}")
        for boundary in challenge["missing"]:
            data = (files / f"{boundary}.safetensors").read_bytes()
            answer = self.call("POST", f"/api/worker/units/{unit['id']}/checkpoints/{boundary}", expected=(200,),
                               files={"checkpoint": (f"{boundary}.safetensors", data,
                                                     "application/octet-stream")}).json()
            expect(answer["status"] in ("pending", "accepted"), f"checkpoint {boundary}: {answer}")

    def wait_credited(self, unit_id: int, upload: bytes, text: str, timeout: float) -> dict:
        """The same upload sent again answers with the result's standing, and its earnings once posted."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = self.post_result(unit_id, upload, text)
            except Disagreement as e:  # a refused result is no longer live: the upload is taken as a new one
                raise Disagreement(f"unit {unit_id} was refused after its segment check ({e})") from None
            if answer["status"] == "accepted" and answer.get("credit") == "posted":
                expect(answer["earned_nanos"] > 0 and answer["challenge"] is None, f"credited: {answer}")
                return {"status": "accepted", "earned_nanos": answer["earned_nanos"], "earned": answer["earned"],
                        "credited_hu": answer["credited_hu"]}
            expect(answer["status"] in ("pending", "accepted"), f"unit {unit_id} was refused: {answer}")
            expect(time.monotonic() < deadline, f"unit {unit_id} not credited in {timeout:.0f} s: {answer}")
            time.sleep(0.3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--account-token", default=os.environ.get("MUNINN_ACCOUNT_TOKEN"))
    parser.add_argument("--name", default="conformance")
    parser.add_argument("--units", type=int, default=1, help="units to have credited before exiting")
    parser.add_argument("--dir", required=True, help="where the checkpoints are kept")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    device = Device(args.server, Path(args.dir))
    deadline = time.monotonic() + args.timeout
    try:
        device.register(args.account_token, args.name)
        expect(device.call("GET", "/api/worker/challenges", expected=(200,)).json() == {"challenges": []},
               "a new device has open challenges")
        print(f"REGISTERED {device.device_id}", flush=True)
        done = 0
        while done < args.units:
            expect(time.monotonic() < deadline, f"only {done} of {args.units} units credited in {args.timeout:.0f} s")
            unit = device.claim(wait=min(10.0, max(0.0, deadline - time.monotonic())))
            if unit is None:
                continue
            print("UNIT " + json.dumps(device.work(unit, deadline - time.monotonic())), flush=True)
            done += 1
    except Disagreement as e:
        print(f"DISAGREEMENT {e}", flush=True)
        return 1
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)
    if loaded:
        print(f"DISAGREEMENT the client imported {loaded}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
