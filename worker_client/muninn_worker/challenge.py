"""A unit's checkpoints on disk, their commitments, and answering the site's challenges.

While a unit trains, the state at every segment boundary is written to `<cache>/checkpoints/<unit>/<i>.safetensors`
and hashed for the receipt (muninn_worker.segments). After the upload the site may challenge some segments: the
device then uploads the checkpoints at both ends of each. The files stay until the unit's check no longer needs
them (answered, or not challenged); ones left by a run that stopped are answered or pruned at the next start.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from muninn_worker import codec, segments
from muninn_worker.segments import Checkpoint

__all__ = ["CheckpointStore", "answer_challenge", "answer_open_challenges", "run_peer_check"]

log = logging.getLogger("muninn_worker")


class CheckpointStore:
    """The checkpoints of one unit."""

    def __init__(self, root: str | Path, unit_id: int) -> None:
        self.dir = Path(root) / "checkpoints" / str(int(unit_id))
        self.commitments: list[list[str]] = []

    def keep(self, boundary: int, checkpoint: Checkpoint) -> None:
        """`train_local`'s on_boundary: write the checkpoint and remember its commitment."""
        if boundary != len(self.commitments):
            raise ValueError(f"checkpoint {boundary} out of order (expected {len(self.commitments)})")
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(boundary)
        tmp = path.with_suffix(".part")
        tmp.write_bytes(segments.checkpoint_to_bytes(checkpoint))
        tmp.replace(path)
        self.commitments.append(checkpoint.commitment())

    def seal(self, final: Checkpoint, global_state: dict, encoding: str) -> list[list[str]]:
        """The receipt's chain: the last boundary commits to the result as the site will decode it (the trained
        weights through the job's encoding) and to the optimizer state; its file keeps the weights before
        encoding, which the site checks encode to exactly the upload."""
        decoded = codec.roundtrip(final.weights, global_state, encoding)
        self.commitments[-1] = [segments.commitment(decoded, {})[0], self.commitments[-1][1]]
        return self.commitments

    def path(self, boundary: int) -> Path:
        return self.dir / f"{boundary}.safetensors"

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def answer_challenge(client, store: CheckpointStore, challenge: dict) -> str:
    """Upload the checkpoints the site asks for; returns the unit's status after the last one."""
    return str(upload_challenged_checkpoints(client, store, challenge).get("status", "pending"))


def upload_challenged_checkpoints(client, store: CheckpointStore, challenge: dict) -> dict:
    """Upload the checkpoints the site asks for; returns the site's last answer (its `status`, and what the unit
    earned once accepted)."""
    last: dict = {"status": "pending"}
    for boundary in challenge.get("missing", challenge.get("checkpoints", [])):
        path = store.path(int(boundary))
        if not path.exists():
            log.error("unit %s: checkpoint %s asked for is not on disk; the check will count as failed",
                      challenge.get("unit"), boundary)
            continue
        answer = client.upload_checkpoint(int(challenge["unit"]), int(boundary), path.read_bytes())
        last = {**answer, "status": str(answer.get("status", last["status"]))}
        log.info("unit %s: checkpoint %s uploaded (%s)", challenge["unit"], boundary, last["status"])
        if last["status"] != "pending":
            break
    return last


def answer_open_challenges(client, root: str | Path) -> int:
    """At start-up: answer the challenges a previous run left open (from its checkpoints on disk), then delete
    every checkpoint no open challenge needs. Returns how many challenges were answered."""
    try:
        open_challenges = client.challenges()
    except Exception as exc:  # noqa: BLE001 - a site without the endpoint, or offline: nothing to answer now
        log.warning("could not ask for open challenges: %s", exc)
        return 0
    answered = 0
    for challenge in open_challenges:
        store = CheckpointStore(root, int(challenge["unit"]))
        if store.dir.exists():
            answer_challenge(client, store, challenge)
            answered += 1
    base = Path(root) / "checkpoints"
    if base.exists():
        for unit_dir in base.iterdir():
            shutil.rmtree(unit_dir, ignore_errors=True)
    return answered


def run_peer_check(client, check: dict, cache_root: str | Path, numerics: str = "native") -> str:
    """A peer check (the claim answered {"check": ...}): re-train another device's segment from its start
    checkpoint, exactly as `train_local` would have, and upload the end with a signed receipt. Returns the
    site's verdict on the segment ("agreed" or "disagreed")."""
    from muninn_worker import tensors, training, zoo

    check_id = int(check["id"])
    start = segments.bytes_to_checkpoint(
        client.download(check_id, "start", str(check["start_sha256"]), cache_root, scope="checks"))
    X, y = tensors.bytes_to_shard(client.download(check_id, "shard", str(check["shard_sha256"]), cache_root,
                                                  scope="checks"))
    model = zoo.build_model(str(check["template"]), check["model_config"])
    model.load_state_dict(start.weights, strict=True)
    if check.get("base_sha256"):
        zoo.load_base(model, tensors.bytes_to_state_dict(
            client.download(check_id, "base", str(check["base_sha256"]), cache_root, scope="checks")))
    train = {k: v for k, v in check["train"].items() if k != "segment_steps"}
    end, _ = training.train_segment(model, X, y, start, first_step=int(check["first_step"]),
                                    steps=int(check["steps"]), numerics=numerics, **train)
    answer = client.submit_check(check_id, segments.checkpoint_to_bytes(end),
                                 {"check": check_id, "end": end.commitment()})
    log.info("peer check %s (unit %s, steps %s+%s): %s", check_id, check.get("unit"), check["first_step"],
             check["steps"], answer.get("status"))
    return str(answer.get("status"))
