"""The browser tier's JavaScript core (static/muninn/browser/) against the Python client, in headless chromium:
the same data order, the same canonical bytes and boundary-0 commitment, a trained unit whose every segment the
site's validator (torch, `training.train_segment`) re-trains within the template's tolerance, an encoded update
the site decodes to exactly the state the receipt commits to, and a receipt signature the site verifies."""
from __future__ import annotations

import pytest
import torch

from contributors import checks, tolerances
from muninn_worker import codec, order, segments, signing, training
from muninn_worker.tensors import sha256_hex, state_dict_to_bytes
from scripts.browser_js import b64, js_page, mlp_case, train_in_browser, unb64

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def page():
    with js_page() as page:
        yield page


def test_data_order_matches_the_python_client(page):
    cases = [(1234, 0, 10), (0, 0, 1), (2**31 - 1, 7, 257), (99, 2, 1000)]
    got = page.evaluate("""async (cases) => { const m = await import('/static/muninn/browser/order.js');
        return cases.map(([s, e, n]) => Array.from(m.permutation(s, e, n))); }""", cases)
    assert got == [list(order.permutation(*case)) for case in cases]

    diloco = page.evaluate("""async () => { const m = await import('/static/muninn/browser/order.js');
        return [0, 1, 5, 13].map((s) => m.batchIndices(s, {seed: 5, samples: 11, batchSize: 4, innerSteps: 20})); }""")
    assert diloco == [order.batch_indices(s, seed=5, samples=11, batch_size=4, inner_steps=20) for s in (0, 1, 5, 13)]


def test_canonical_bytes_match_the_reference_serializer(page):
    tensors = {"b.weight": torch.randn(3, 2), "a": torch.arange(4, dtype=torch.int64), "scalar": torch.tensor(2.5),
               "half": torch.randn(5).half(), "q": torch.tensor([1, -2], dtype=torch.int8)}
    for given in (tensors, {}):
        rewritten = page.evaluate("""async (data) => { const st = await import('/static/muninn/browser/safetensors.js');
            const b = await import('/static/muninn/browser/bytes.js');
            const raw = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
            return b.base64(st.serialize(st.parse(raw).tensors)); }""", b64(state_dict_to_bytes(given)))
        assert unb64(rewritten) == state_dict_to_bytes(given)


@pytest.mark.parametrize("task,encoding,momentum,inner_steps", [
    ("classification", "fp32", 0.9, None), ("regression", "fp16", 0.9, None), ("classification", "int8", 0.9, None),
    ("classification", "fp32", 0.0, 19),  # DiLoCo's inner steps, plain SGD (an empty optimizer state)
])
def test_browser_unit_passes_the_sites_segment_checks(page, task, encoding, momentum, inner_steps):
    case = mlp_case(task=task, encoding=encoding, samples=150, segment_steps=8, momentum=momentum,
                    inner_steps=inner_steps)
    trained = train_in_browser(page, case)

    assert trained["receipt"]["steps"] == order.total_steps(150, epochs=2, batch_size=16, inner_steps=inner_steps)
    chain = trained["receipt"]["checkpoints"]
    first = segments.Checkpoint(case.weights, training.initial_optimizer_state(case.model, "sgd", momentum))
    assert chain[0] == first.commitment()
    assert len(chain) == segments.segment_count(trained["receipt"]["steps"], 8) + 1

    bounds = segments.boundaries(trained["receipt"]["steps"], 8)
    tolerance = tolerances.tolerance("mlp", 8)
    distances = []
    for j in range(len(bounds) - 1):
        start, end = trained["checkpoints"][j], trained["checkpoints"][j + 1]
        model = case.fresh_model()
        validator_end, _ = training.train_segment(model, case.X, case.y, start, first_step=bounds[j],
                                                  steps=bounds[j + 1] - bounds[j], **case.spec)
        distances.append(checks.segment_distance(
            device_weights=end.weights, device_optimizer=end.optimizer, validator_weights=validator_end.weights,
            validator_optimizer=validator_end.optimizer, start_weights=start.weights))
        if j < len(bounds) - 2:
            assert chain[j + 1] == end.commitment()
    assert max(distances) <= tolerance, (distances, tolerance)

    last = trained["checkpoints"][-1]
    decoded = codec.decode_update(trained["upload"], case.weights, encoding)
    assert segments.commitment(decoded, last.optimizer) == chain[-1]
    assert segments.commitment(codec.roundtrip(last.weights, case.weights, encoding), last.optimizer) == chain[-1]
    assert trained["receipt"]["output_sha256"] == sha256_hex(trained["upload"])


def test_a_scaled_update_lands_far_outside_the_tolerance(page):
    case = mlp_case(task="classification", encoding="fp32", samples=64, segment_steps=8)
    trained = train_in_browser(page, case)
    start, end = trained["checkpoints"][0], trained["checkpoints"][1]
    cheat = {k: start.weights[k] + 1.5 * (v - start.weights[k]) for k, v in end.weights.items()}
    validator_end, _ = training.train_segment(case.fresh_model(), case.X, case.y, start, first_step=0, steps=8,
                                              **case.spec)
    distance = checks.segment_distance(device_weights=cheat, device_optimizer=end.optimizer,
                                       validator_weights=validator_end.weights,
                                       validator_optimizer=validator_end.optimizer, start_weights=start.weights)
    assert distance > 100 * tolerances.tolerance("mlp", 8)


def test_receipt_signed_in_the_browser_verifies_on_the_site(page):
    receipt = '{"unit": 42, "loss_after": 0.41, "name": "caf\\u00e9 \u2713"}'
    public_key, signature = page.evaluate("""async (text) => { const k = await import('/static/muninn/browser/keys.js');
        const pair = await k.newKeyPair();
        return [await k.publicKeyBase64(pair), await k.sign(pair, new TextEncoder().encode(text))]; }""", receipt)
    assert signing.verify(public_key, receipt.encode(), signature)
    assert not signing.verify(public_key, receipt.replace("42", "43").encode(), signature)
