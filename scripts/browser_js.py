"""Run the browser tier's JavaScript (static/muninn/browser/) in headless chromium from Python: a small static
server for static/ and a Playwright page on its origin (a secure context, so WebCrypto works), into which a test
or a bench imports the modules and calls them. Bytes cross as base64.

Used by tests/test_browser_core.py and bench/browser_training.py. Debian's /usr/bin/chromium, never
`playwright install`.
"""
from __future__ import annotations

import base64
import functools
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # the test's output is not the place for an access log
        pass

    def guess_type(self, path):
        return "text/javascript" if str(path).endswith(".js") else super().guess_type(path)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


@contextmanager
def js_page() -> Iterator:
    """A chromium page on a local origin serving the repository's static/ at /static/. Call
    `page.evaluate("async (arg) => { const m = await import('/static/muninn/browser/order.js'); ... }", arg)`."""
    from playwright.sync_api import sync_playwright

    handler = functools.partial(_Quiet, directory=str(ROOT))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
            try:
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{server.server_address[1]}/static/muninn/browser/order.js")
                yield page
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()


class MlpCase:
    """One `mlp` unit as the site would hand it out: global weights (normalisation fitted to the data, as the
    site does), a shard of raw rows, and the claim's unit object; `spec` is `training.train_segment`'s keywords."""

    def __init__(self, *, task: str = "classification", encoding: str = "fp32", samples: int = 150,
                 features: int = 16, classes: int = 4, hidden: tuple[int, ...] = (32,), segment_steps: int = 8,
                 epochs: int = 2, batch_size: int = 16, lr: float = 0.05, momentum: float = 0.9, seed: int = 1234,
                 inner_steps: int | None = None):
        import torch

        from muninn_worker import zoo
        from muninn_worker.tensors import sha256_hex, shard_to_bytes, state_dict_to_bytes

        generator = torch.Generator().manual_seed(seed)
        self.config = ({"in_features": features, "hidden": list(hidden), "task": "regression"} if task == "regression"
                       else {"in_features": features, "num_classes": classes, "hidden": list(hidden)})
        self.X = torch.randn(samples, features, generator=generator) * 2.0 + 3.0
        signal = self.X @ torch.randn(features, generator=generator)
        self.y = signal * 10 + 50 if task == "regression" else (signal > signal.median()).long() + (
            signal > signal.quantile(0.8)).long() * 2
        self.model = zoo.build_model("mlp", self.config)
        self.model.load_state_dict(zoo.get_template("mlp").fit_state(dict(self.model.state_dict()), self.X, self.y))
        self.weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.momentum = momentum
        self.spec = {"epochs": epochs, "batch_size": batch_size, "lr": lr, "momentum": momentum, "seed": seed,
                     "optimizer": "sgd", "inner_steps": inner_steps}
        self.weights_bytes = state_dict_to_bytes(self.weights)
        self.shard_bytes = shard_to_bytes(self.X, self.y)
        self.unit = {"id": 1, "template": "mlp", "model_config": self.config, "encoding": encoding,
                     "algorithm": "fedavg" if inner_steps is None else "diloco", "samples": samples,
                     "train": {**self.spec, "segment_steps": segment_steps},
                     "weights_sha256": sha256_hex(self.weights_bytes), "shard_sha256": sha256_hex(self.shard_bytes)}

    def fresh_model(self):
        from muninn_worker import zoo

        model = zoo.build_model("mlp", self.config)
        model.load_state_dict(self.weights)
        return model


def mlp_case(**kwargs) -> MlpCase:
    return MlpCase(**kwargs)


def train_in_browser(page, case: MlpCase) -> dict:
    """Train the case's unit with static/muninn/browser/trainer.js: its receipt, upload bytes and every
    boundary's checkpoint (muninn_worker.segments.Checkpoint)."""
    from muninn_worker.segments import bytes_to_checkpoint

    answer = page.evaluate("""async ([unit, weights, shard]) => {
        const st = await import('/static/muninn/browser/safetensors.js');
        const b = await import('/static/muninn/browser/bytes.js');
        const t = await import('/static/muninn/browser/trainer.js');
        const raw = (s) => Uint8Array.from(atob(s), (c) => c.charCodeAt(0));
        const out = await t.trainUnit(unit, st.parse(raw(weights)).tensors, st.parse(raw(shard)).tensors);
        return {receipt: out.receipt, upload: b.base64(out.upload),
                checkpoints: out.checkpoints.map((c) => b.base64(t.checkpointBytes(c)))}; }""",
                           [case.unit, b64(case.weights_bytes), b64(case.shard_bytes)])
    return {"receipt": answer["receipt"], "upload": unb64(answer["upload"]),
            "checkpoints": [bytes_to_checkpoint(unb64(c)) for c in answer["checkpoints"]]}
