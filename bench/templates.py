"""Every template, trained briefly on its bundled or generated data by two simulated devices (FedAvg).

For each template (and dataset) it prints the held-out metric, the stated baseline, whether the metric beats
it, and the HU quoted against the HU used:

  hu_quoted   what the site quotes (jobs/estimate.py's arithmetic): torch's FLOP count of one forward +
              backward batch per sample x training samples x local epochs, plus two forward passes per
              sample for the receipt's loss before/after, x rounds
  hu_used     the FLOPs torch's counter records while the two devices actually run train_local, all rounds:
              every batch (the last, smaller one too) and the receipt's loss before/after passes (the
              "receipt" column: their share of it)

    .venv/bin/python bench/templates.py [--quick]

The devices run in this process, one after the other, each from the round's global weights on its half of
the training split; the round's result is `federated.aggregation.fedavg` of the two. The last line is JSON.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from muninn_worker import flops, tensors, training, zoo  # noqa: E402
from muninn_worker.samples import generated_text, image_folder_zip, synthetic_images  # noqa: E402
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits, load_wine  # noqa: E402

from muninn_worker import datasets, preparation  # noqa: E402
from muninn_worker.federated.aggregation import fedavg  # noqa: E402
from jobs.hu import FLOPS_PER_HU  # noqa: E402

DEVICES = 2
SEED = 7


@dataclass
class Case:
    name: str
    template: str
    data: bytes
    fmt: str
    hparams: dict
    rounds: int
    baseline: str  # how the baseline is computed, see _baseline
    options: dict
    splits: tuple[int, ...] = (SEED,)  # held-out split seeds; several: metric and baseline are their means


def _npz(X, y) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, X=X, y=y)
    return buffer.getvalue()


def _csv(data, target_name: str) -> bytes:
    rows = [",".join([*map(repr, x), repr(t)]) for x, t in zip(data.data.tolist(), data.target.tolist())]
    names = [str(n).replace(",", " ") for n in data.feature_names]
    return ("\n".join([",".join([*names, target_name]), *rows]) + "\n").encode()


def _image_zip() -> bytes:
    return image_folder_zip(*synthetic_images(seed=1, per_class=60, size=16), ["bars", "columns", "boxes"])


def cases(quick: bool) -> list[Case]:
    digits = load_digits()
    lm = {"d_model": 64, "layers": 2, "heads": 4, "context": 32, "epochs": 2}
    return [
        Case("mlp/breast_cancer", "mlp", _csv(load_breast_cancer(), "diagnosis"), "csv",
             {"hidden": [32], "epochs": 5, "batch_size": 16, "lr": 0.01}, 3, "accuracy>=0.93", {}),
        Case("mlp/wine", "mlp", _csv(load_wine(), "cultivar"), "csv",
             {"hidden": [32], "epochs": 5, "batch_size": 16, "lr": 0.01}, 3, "accuracy>=0.93", {}),
        Case("mlp/diabetes", "mlp", _csv(load_diabetes(), "progression"), "csv",
             {"hidden": [32], "epochs": 10, "batch_size": 32, "lr": 0.005}, 3, "rmse<=0.7*mean", {},
             # Even least squares removes only 23-33% of the mean's RMSE on single 80/20 splits of diabetes (the
             # 30% bar is at the data's ceiling), so this case is judged on five splits, as its test is.
             splits=(0, 1, 2, 3, 4)),
        Case("cnn/digits", "cnn", _npz(digits.images.astype(np.float32), digits.target), "npz",
             {"epochs": 3}, 3, "accuracy>=0.95", {}),
        Case("resnet18/shapes", "resnet18", _image_zip(), "images",
             {"base_width": 8 if quick else 16, "image_size": 16, "epochs": 3, "batch_size": 16, "lr": 0.05}, 3,
             "accuracy>majority", {}),
        Case("transformer/generated_text", "transformer", generated_text(seed=0, sentences=1200).encode(), "text",
             lm, 2, "perplexity<vocab/2", {"tokenizer": "byte"}),
        Case("lora/generated_text_b", "lora", generated_text(seed=1, sentences=800, style="b").encode(), "text",
             {"rank": 4, "epochs": 2}, 2, "perplexity<base", {"tokenizer": "byte"}),
    ]


def run_case(case: Case, base_state: dict | None) -> tuple[dict, dict | None]:
    runs = [_run_split(case, base_state, seed) for seed in case.splits]
    value = sum(r["value"] for r in runs) / len(runs)
    baseline = sum(r["baseline"] for r in runs) / len(runs)
    beats = value > baseline if case.baseline == "accuracy>majority" else (
        value >= baseline if case.baseline.startswith("accuracy") else value <= baseline if "rmse" in case.baseline
        else value < baseline)
    quoted, used, receipt = (sum(r[k] for r in runs) for k in ("quoted", "used", "receipt"))
    row = {"metric": round(value, 4), "baseline": round(baseline, 4), "beats_baseline": bool(beats),
           "hu_quoted": quoted / FLOPS_PER_HU, "hu_used": used / FLOPS_PER_HU}
    extra = {"metric_name": runs[0]["name"], "receipt_share": receipt / used,
             "seconds": round(sum(r["seconds"] for r in runs), 1), "upload_bytes": runs[0]["upload_bytes"],
             "full_model_bytes": len(tensors.state_dict_to_bytes(base_state)) if base_state else 0}
    return {**row, "_extra": extra}, runs[-1]["final"]


def _run_split(case: Case, base_state: dict | None, split_seed: int) -> dict:
    parsed = datasets.parse_dataset(case.data, case.fmt, **case.options)
    hp = zoo.validate_hparams(case.template, case.hparams)
    profile = dict(parsed.profile)
    if case.template == "lora":
        profile["base_model_config"] = zoo.lm_config_from_base(base_state, heads=4)
    config = zoo.model_config_for(case.template, profile, hp)
    if case.fmt == "images":
        parsed = datasets.parse_dataset(case.data, case.fmt, image_size=config["height"])
    X, y = preparation.samples(parsed, config)
    train_idx, test_idx = datasets.split_holdout(len(y), seed=split_seed)
    X_train, y_train, X_test, y_test = X[train_idx], y[train_idx], X[test_idx], y[test_idx]
    spec = zoo.get_template(case.template)
    state = spec.fit_state(zoo.init_state(case.template, config, SEED), X_train, y_train)

    def model_with(weights):
        model = zoo.build_model(case.template, config)
        model.load_state_dict(weights)
        if base_state is not None:
            zoo.load_base(model, base_state)
        return model

    before = training.evaluate(model_with(state), X_test, y_test)
    per_sample = flops.flops_per_sample(case.template, config, hp["batch_size"])
    forward = flops.forward_flops_per_sample(case.template, config, hp["batch_size"])
    quoted = flops.unit_flops(per_sample, len(train_idx), hp["epochs"], forward) * case.rounds
    half = len(train_idx) // 2
    shards = [(0, half), (half, len(train_idx))]
    used, receipt_flops, upload_bytes, started = 0, 0, 0, time.perf_counter()
    for number in range(1, case.rounds + 1):
        results = []
        for device, (start, stop) in enumerate(shards):
            model = model_with(state)
            counter = FlopCounterMode(display=False)
            with counter:
                result = training.train_local(model, X_train[start:stop], y_train[start:stop], epochs=hp["epochs"],
                                              batch_size=hp["batch_size"], lr=hp["lr"],
                                              momentum=hp.get("momentum", 0.0), seed=SEED * 1000 + number * 10 + device,
                                              optimizer=spec.optimizer)
            used += counter.get_total_flops()
            evaluation = FlopCounterMode(display=False)
            with evaluation:  # what the receipt's loss_before / loss_after passes cost, to split "used" up
                training.evaluate(model, X_train[start:stop], y_train[start:stop])
            receipt_flops += 2 * evaluation.get_total_flops()
            upload_bytes = len(tensors.state_dict_to_bytes(result.state_dict))
            results.append(result)
        state = fedavg([r.state_dict for r in results], [r.samples for r in results])
    metrics = training.evaluate(model_with(state), X_test, y_test)
    name, value = _metric(spec, config, metrics)
    baseline, _ = _baseline(case, parsed, y_train, y_test, before, value)
    return {"name": name, "value": value, "baseline": baseline, "quoted": quoted, "used": used,
            "receipt": receipt_flops, "upload_bytes": upload_bytes, "seconds": time.perf_counter() - started,
            "final": model_with(state).state_dict() if case.template == "transformer" else None}


def _metric(spec, config, metrics) -> tuple[str, float]:
    name = zoo.TASK_METRICS[spec.task_of(config)][0]
    return name, metrics[name]


def _baseline(case: Case, parsed, y_train, y_test, before: dict, value: float) -> tuple[float, bool]:
    if case.baseline.startswith("accuracy>="):
        threshold = float(case.baseline.split(">=")[1])
        return threshold, value >= threshold
    if case.baseline == "accuracy>majority":
        majority = np.bincount(y_train.numpy()).argmax()
        share = float((y_test.numpy() == majority).mean())
        return share, value > share
    if case.baseline == "rmse<=0.7*mean":
        mean_rmse = math.sqrt(float(((y_test - y_train.mean()) ** 2).mean()))
        return 0.7 * mean_rmse, value <= 0.7 * mean_rmse
    if case.baseline == "perplexity<vocab/2":
        return parsed.profile["vocab_size"] / 2, value < parsed.profile["vocab_size"] / 2
    if case.baseline == "perplexity<base":
        return before["perplexity"], value < before["perplexity"]
    raise AssertionError(case.baseline)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a narrower ResNet, for a fast look")
    args = parser.parse_args()
    torch.manual_seed(0)
    results, base_state = {}, None
    print(f"{'template/data':30} {'metric':>20} {'baseline':>10} {'beats':>6} {'HU quoted':>12} {'HU used':>12} "
          f"{'used/quoted':>11} {'receipt':>7} {'s':>6}")
    for case in cases(args.quick):
        row, final = run_case(case, base_state)
        if final is not None:
            base_state = final  # the LoRA case fine-tunes the transformer this bench just trained
        extra = row.pop("_extra")
        results[case.name] = row
        ratio = row["hu_used"] / row["hu_quoted"] if row["hu_quoted"] else float("nan")
        print(f"{case.name:30} {extra['metric_name'] + ' ' + format(row['metric'], '.4f'):>20} "
              f"{row['baseline']:>10.4f} {str(row['beats_baseline']):>6} {row['hu_quoted']:>12.3e} "
              f"{row['hu_used']:>12.3e} {ratio:>11.3f} {extra['receipt_share']:>7.1%} {extra['seconds']:>6}",
              flush=True)
        if case.template == "lora":
            print(f"{'':30} lora upload per device per round: {extra['upload_bytes']:,} bytes "
                  f"({extra['upload_bytes'] / extra['full_model_bytes']:.1%} of the full model's "
                  f"{extra['full_model_bytes']:,})")
    print(json.dumps({"templates": results, "all_beat_baseline": all(r["beats_baseline"] for r in results.values())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
