"""The work loop end to end against the fake site."""

from __future__ import annotations

import base64
import logging
import math
import threading
from datetime import datetime

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from conftest import MODEL_CONFIG

from muninn_worker import segments
from muninn_worker.api import ApiClient
from muninn_worker.runner import QUICK_RETRIES, QUICK_RETRY_S, DeviceRejected, format_money, run
from muninn_worker.signing import new_private_key, public_key_of
from muninn_worker.codec import decode_update, roundtrip, unpack
from muninn_worker.tensors import bytes_to_shard, bytes_to_state_dict, sha256_hex, state_dict_to_bytes
from muninn_worker.training import train_local
from muninn_worker.zoo import build_model, init_state


SIGNING_KEY = new_private_key()


def _run(site, tmp_path, **kwargs):
    client = ApiClient(site.url, device_token=site.device_token, attempts=2, retry_sleep=lambda s: None,
                       signing_key=SIGNING_KEY)
    kwargs.setdefault("exit_when_idle", 0)
    return run(client, cache_dir=tmp_path / "cache", poll_interval=0.01, **kwargs)


def test_runner_trains_one_unit_and_submits_a_matching_receipt(fake_site, tmp_path, caplog):
    unit = fake_site.add_unit(unit_id=42, samples=479, seed=1234, epochs=2)
    caplog.set_level(logging.INFO, logger="muninn_worker")

    stats = _run(fake_site, tmp_path)

    assert (stats.units, stats.accepted, stats.failed) == (1, 1, 0)
    [posted] = fake_site.results
    receipt = posted["receipt"]
    assert receipt["unit"] == 42
    assert receipt["output_sha256"] == sha256_hex(posted["weights"])
    assert receipt["weights_sha256"] == sha256_hex(unit.weights)
    assert receipt["shard_sha256"] == sha256_hex(unit.shard)
    assert receipt["samples"] == 479 and receipt["steps"] == 2 * math.ceil(479 / 32)
    assert receipt["loss_after"] < receipt["loss_before"]
    assert receipt["train_seconds"] > 0
    assert datetime.fromisoformat(receipt["started_at"]) <= datetime.fromisoformat(receipt["finished_at"])
    assert receipt["finished_at"].endswith("Z")
    public = Ed25519PublicKey.from_public_bytes(base64.b64decode(public_key_of(SIGNING_KEY)))
    public.verify(base64.b64decode(posted["signature"]), posted["receipt_bytes"])  # raises if forged

    initial = bytes_to_state_dict(unit.weights)
    sent = decode_update(posted["weights"], initial, "fp32")  # a delta against the global weights
    assert {k: (v.shape, v.dtype) for k, v in sent.items()} == {k: (v.shape, v.dtype) for k, v in initial.items()}
    assert "claimed unit 42 job 3 round 2 (479 samples)" in caplog.text
    assert "epoch 2/2 loss" in caplog.text
    assert "unit 42: accepted, earned €0.000000086 (0.0000001234 HU of work)" in caplog.text
    assert stats.earned_nanos == 86 and "done: 1 unit(s), 1 accepted, earned €0.000000086" in caplog.text


def test_runner_says_hu_when_the_site_does_not_say_what_the_unit_earned(fake_site, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="muninn_worker")
    fake_site.result_money = {}  # an older site: HU only
    fake_site.add_unit(unit_id=42)

    stats = _run(fake_site, tmp_path)

    assert "unit 42: accepted, earned 0.0000001234 HU" in caplog.text and stats.earned_nanos == 0


@pytest.mark.parametrize("nanos, shown", [(0, "€0.00"), (86, "€0.000000086"), (1_500_000_000, "€1.50"),
                                          (12_345_678_901_234, "€12,345.678901234")])
def test_worker_shows_money_as_the_site_does(nanos, shown):
    assert format_money(nanos, "EUR") == shown


def test_runner_result_is_what_the_site_gets_by_re_executing_the_unit(fake_site, tmp_path):
    unit = fake_site.add_unit(seed=99)

    _run(fake_site, tmp_path)

    model = build_model("mlp", MODEL_CONFIG)
    model.load_state_dict(bytes_to_state_dict(unit.weights))
    X, y = bytes_to_shard(unit.shard)
    expected = train_local(model, X, y, seed=99, **{k: v for k, v in unit.train.items() if k != "seed"})
    glob = bytes_to_state_dict(unit.weights)
    sent = decode_update(fake_site.results[0]["weights"], glob, "fp32")
    assert all(torch.equal(sent[k], v) for k, v in roundtrip(expected.state_dict, glob, "fp32").items())


def test_diloco_unit_trains_its_inner_steps_and_uploads_an_int8_delta(fake_site, tmp_path):
    unit = fake_site.add_unit(samples=100, seed=7, epochs=5)
    unit.algorithm, unit.encoding = "diloco", "int8"
    unit.train = {**unit.train, "inner_steps": 7}

    stats = _run(fake_site, tmp_path)

    assert stats.accepted == 1
    [posted] = fake_site.results
    assert posted["receipt"]["steps"] == 7  # the inner steps, not 5 epochs' worth
    glob = bytes_to_state_dict(unit.weights)
    encoded = unpack(posted["weights"])
    assert {encoded[k].dtype for k, v in glob.items() if v.is_floating_point()} == {torch.int8}
    model = build_model("mlp", MODEL_CONFIG)
    model.load_state_dict(glob)
    X, y = bytes_to_shard(unit.shard)
    expected = train_local(model, X, y, **unit.train)
    sent = decode_update(posted["weights"], glob, "int8")
    assert all(torch.equal(sent[k], v) for k, v in roundtrip(expected.state_dict, glob, "int8").items())


def test_runner_stops_after_max_units(fake_site, tmp_path):
    for unit_id in (1, 2, 3):
        fake_site.add_unit(unit_id=unit_id, samples=64)

    stats = _run(fake_site, tmp_path, max_units=2, exit_when_idle=None)

    assert stats.units == 2 and [r["unit"] for r in fake_site.results] == [1, 2]


def test_runner_downloads_shared_weights_once(fake_site, tmp_path):
    fake_site.add_unit(unit_id=1, samples=64)
    fake_site.add_unit(unit_id=2, samples=64)  # same global weights, same shard

    stats = _run(fake_site, tmp_path)

    assert stats.accepted == 2
    assert fake_site.gets("/weights") == 1 and fake_site.gets("/shard") == 1


def test_conflict_on_submit_is_logged_and_the_loop_goes_on(fake_site, tmp_path, caplog):
    fake_site.add_unit(unit_id=1, samples=64)
    fake_site.add_unit(unit_id=2, samples=64)
    fake_site.result_status = 409

    stats = _run(fake_site, tmp_path)

    assert (stats.units, stats.accepted, stats.failed) == (2, 0, 2)
    assert "lease lost or unit already done" in caplog.text


def test_rejected_result_is_logged_with_the_server_message(fake_site, tmp_path, caplog):
    fake_site.add_unit(samples=64)
    fake_site.result_status = 400

    stats = _run(fake_site, tmp_path)

    assert stats.failed == 1 and "Weights have the wrong shapes." in caplog.text


def test_heartbeats_keep_the_lease_during_a_slow_download(fake_site, tmp_path):
    fake_site.add_unit(samples=64, lease_seconds=1.5)  # heartbeat every 0.5 s
    fake_site.download_delay = 0.7

    stats = _run(fake_site, tmp_path)

    assert stats.accepted == 1 and fake_site.heartbeats >= 1


def test_lost_lease_skips_the_upload(fake_site, tmp_path, caplog):
    fake_site.add_unit(samples=64, lease_seconds=1.5)
    fake_site.download_delay = 0.7
    fake_site.heartbeat_status = 409

    stats = _run(fake_site, tmp_path)

    assert stats.failed == 1 and fake_site.results == []
    assert "lease lost" in caplog.text


def test_corrupt_download_fails_the_unit_not_the_loop(fake_site, tmp_path, caplog):
    fake_site.add_unit(samples=64)
    fake_site.corrupt_downloads = True

    stats = _run(fake_site, tmp_path)

    assert stats.failed == 1 and "expected" in caplog.text


def test_idle_worker_backs_off_and_exits_when_idle(fake_site, tmp_path):
    sleeps: list[float] = []
    client = ApiClient(fake_site.url, device_token=fake_site.device_token, attempts=1)
    now = [0.0]

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    stats = run(client, cache_dir=tmp_path, exit_when_idle=20, poll_interval=1.0, sleep=sleep, clock=lambda: now[0])

    assert stats.units == 0
    assert fake_site.claim_waits[0] == 20  # it asked the site to hold the claim; this one (an older site) did not
    assert 0.8 <= sleeps[0] <= 1.2 and 1.6 <= sleeps[1] <= 2.4
    assert max(sleeps) <= 6.0  # capped at ~5 s plus jitter
    assert now[0] == pytest.approx(20)


def test_an_idle_worker_waits_in_a_held_claim_and_gets_the_unit_the_moment_it_is_queued(fake_site, tmp_path):
    fake_site.holds_claims = True
    client = ApiClient(fake_site.url, device_token=fake_site.device_token, attempts=1, signing_key=SIGNING_KEY)
    sleeps: list[float] = []
    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(stats=run(
        client, cache_dir=tmp_path, max_units=1, claim_wait=20, sleep=sleeps.append)))
    worker.start()
    with fake_site.changed:  # the worker's claim is being held: nothing is queued yet
        assert fake_site.changed.wait_for(lambda: fake_site.held == 1, timeout=30)

    fake_site.add_unit()
    worker.join(timeout=60)

    assert not worker.is_alive() and done["stats"].accepted == 1
    assert fake_site.claim_waits == [20]  # one claim, held until the unit came
    assert sleeps == []  # no idle backoff


def test_a_site_that_turns_a_claim_away_with_retry_after_is_asked_again_after_it(fake_site, tmp_path):
    """A process holding all the claims it may turns the next away with a Retry-After; another process of the site
    may have room: asked again twice at once on new connections, then after the Retry-After."""
    fake_site.retry_after = "3"
    client = ApiClient(fake_site.url, device_token=fake_site.device_token, attempts=1)
    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    run(client, cache_dir=tmp_path, exit_when_idle=10, poll_interval=1.0, sleep=sleep, clock=lambda: now[0])

    assert fake_site.claim_waits[0] == 10  # the wait asked for, cut to the time left before exiting when idle
    assert all(QUICK_RETRY_S[0] <= s <= QUICK_RETRY_S[1] for s in sleeps[:QUICK_RETRIES]), sleeps
    assert sleeps[QUICK_RETRIES] >= 3  # then the Retry-After, above the first idle backoff of ~1 s
    assert all(QUICK_RETRY_S[0] <= s <= QUICK_RETRY_S[1] for s in sleeps[QUICK_RETRIES + 1:2 * QUICK_RETRIES + 1])
    ports = fake_site.claim_ports
    assert len(set(ports)) == len(ports)  # each claim after a turn-away on a connection of its own


def test_claim_wait_0_polls_as_before(fake_site, tmp_path):
    client = ApiClient(fake_site.url, device_token=fake_site.device_token, attempts=1)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    run(client, cache_dir=tmp_path, exit_when_idle=5, claim_wait=0, sleep=sleep, clock=lambda: now[0])

    assert fake_site.claim_waits and set(fake_site.claim_waits) == {0}


def test_revoked_device_token_stops_the_worker(fake_site, tmp_path):
    client = ApiClient(fake_site.url, device_token=fake_site.device_token, attempts=1)
    fake_site.device_token = "a-new-token"  # the site no longer knows ours

    with pytest.raises(DeviceRejected, match="register"):
        run(client, cache_dir=tmp_path, exit_when_idle=0)


def test_weights_that_do_not_fit_the_model_fail_the_unit_not_the_loop(fake_site, tmp_path, caplog):
    unit = fake_site.add_unit(unit_id=1, samples=64)
    unit.weights = state_dict_to_bytes(init_state("mlp", {**MODEL_CONFIG, "hidden": [8]}, 0))
    fake_site.add_unit(unit_id=2, samples=64)

    stats = _run(fake_site, tmp_path)

    assert (stats.units, stats.accepted, stats.failed) == (2, 1, 1)
    assert "unit 1 failed" in caplog.text and "size mismatch" in caplog.text


def test_runner_trains_a_lora_unit_on_base_weights_it_downloads_once(fake_site, tmp_path):
    from conftest import FakeUnit

    from muninn_worker.tensors import shard_to_bytes
    lm = {"vocab_size": 11, "context": 8, "d_model": 16, "layers": 1, "heads": 2}
    config = {**lm, "rank": 2, "alpha": 4.0}
    base = state_dict_to_bytes(init_state("transformer", lm, 1))
    ids = torch.randint(0, 11, (40, 9), generator=torch.Generator().manual_seed(0))
    train = {"epochs": 1, "batch_size": 8, "lr": 0.01, "momentum": 0.0, "seed": 5, "optimizer": "adam"}
    for unit_id in (1, 2):
        unit = FakeUnit(id=unit_id, weights=state_dict_to_bytes(init_state("lora", config, 0)),
                        shard=shard_to_bytes(ids[:, :-1], ids[:, 1:]), samples=40, train=train, template="lora",
                        model_config=config, base=base)
        fake_site.queue.append(unit)
        fake_site.units[unit_id] = unit

    stats = _run(fake_site, tmp_path)

    assert stats.accepted == 2 and fake_site.gets("/base") == 1  # the second unit found it in the cache
    sent = decode_update(fake_site.results[0]["weights"], bytes_to_state_dict(unit.weights), "fp32")
    assert set(sent) == set(bytes_to_state_dict(unit.weights))  # adapters only travel back
    assert all(k.endswith((".lora_a", ".lora_b")) for k in sent)
    assert fake_site.results[0]["receipt"]["loss_after"] < fake_site.results[0]["receipt"]["loss_before"]


def test_a_unit_of_one_segment_sends_its_last_checkpoint_with_the_result(fake_site, tmp_path):
    one = fake_site.add_unit(unit_id=42, samples=64, epochs=1)  # no segment_steps: one segment, the whole unit
    many = fake_site.add_unit(unit_id=43, samples=64, epochs=1)
    many.train["segment_steps"] = 1  # a checkpoint every step: two segments

    _run(fake_site, tmp_path)

    sent = {r["unit"]: r for r in fake_site.results}
    [end_weights, end_optimizer] = sent[42]["receipt"]["checkpoints"][-1]
    checkpoint = segments.bytes_to_checkpoint(sent[42]["checkpoint"])
    decoded = roundtrip(checkpoint.weights, bytes_to_state_dict(one.weights), "fp32")
    assert segments.commitment(decoded, checkpoint.optimizer) == [end_weights, end_optimizer]  # the committed end
    assert len(sent[43]["receipt"]["checkpoints"]) == 3 and sent[43]["checkpoint"] is None  # the site asks first
