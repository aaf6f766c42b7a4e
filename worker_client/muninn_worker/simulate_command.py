"""`muninn-worker simulate DATASET`: a job run locally, free, with the platform's own code (muninn_worker.simulation).

Prints one line per round (the held-out metric, losses, bytes moved, devices) and a final line; `--json` makes
the last line machine-readable. A mistake the user can fix (no such file, a dataset the site would refuse, an
unknown template, a bad hyper-parameter) exits 2 with one sentence; a job whose training diverges exits 1.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROG = "muninn-worker"
ALGORITHMS = ("fedavg", "diloco")  # muninn_worker.federated.algorithms (imported late: it pulls in torch)
ENCODINGS = ("fp32", "fp16", "int8")
RULES = ("fedavg", "trimmed_mean", "median", "norm_clip")


def add_to(commands) -> None:
    sim = commands.add_parser(
        "simulate", help="run a job locally with the platform's training code, before paying for it",
        description="Run a whole job in this process: the platform's data preparation, sharding, local training, "
                    "update encoding, aggregation and held-out evaluation, for N devices of equal speed. With the "
                    "same settings and seed it reproduces the platform's result.")
    sim.add_argument("dataset", metavar="DATASET", help="the file you would upload (CSV, NPZ, zip of images, text)")
    sim.add_argument("--template", default="mlp", help="model template (default mlp)")
    sim.add_argument("--rounds", type=_positive_int, default=10, help="rounds (default 10)")
    sim.add_argument("--devices", type=_positive_int, default=8, help="devices online each round (default 8)")
    sim.add_argument("--non-iid", type=float, metavar="ALPHA",
                     help="give each device a fixed label-skewed share of the training split, Dirichlet(ALPHA) "
                          "over classes (0.1: one or two classes each; 100: nearly even). Models contributors "
                          "whose data differ; the platform itself cuts contiguous shards of the uploaded rows, so "
                          "leave this out (or 0) to reproduce it. Classification only")
    sim.add_argument("--algorithm", choices=ALGORITHMS, default="fedavg", help="fedavg (default) or diloco")
    sim.add_argument("--encoding", choices=ENCODINGS, default="fp32", help="how updates travel (default fp32)")
    sim.add_argument("--outer-lr", type=float, help="DiLoCo's outer learning rate (default 0.7)")
    sim.add_argument("--outer-momentum", type=float, help="DiLoCo's outer Nesterov momentum (default 0.9)")
    sim.add_argument("--inner-steps", type=int, help="DiLoCo's local steps per round (default 20)")
    sim.add_argument("--aggregation", choices=RULES, default="fedavg", help="the round's rule (default fedavg)")
    sim.add_argument("--hparam", action="append", default=[], metavar="NAME=VALUE", type=_hparam,
                     help="a template hyper-parameter, repeatable: --hparam epochs=2 --hparam lr=0.05 "
                          "--hparam hidden=[64,32] (values are JSON; anything else is a string)")
    sim.add_argument("--seed", type=int, default=0, help="the job's seed: holdout split, weights, data order "
                                                         "(default 0)")
    sim.add_argument("--target", help="the label column (CSV) or array (NPZ); default the last column / y")
    sim.add_argument("--task", choices=("classification", "regression"), help="force a table's task")
    sim.add_argument("--tokenizer", choices=("char", "byte"), help="text: char (default) or byte")
    sim.add_argument("--json", action="store_true", help="make the last line a JSON summary")
    sim.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        data = Path(args.dataset).read_bytes()
    except OSError as e:
        return _error(f"cannot read {args.dataset}: {e.strerror or e}")
    from muninn_worker import datasets, simulation

    training = {"algorithm": args.algorithm, "update_encoding": args.encoding, "outer_lr": args.outer_lr,
                "outer_momentum": args.outer_momentum, "inner_steps": args.inner_steps}
    try:
        job = simulation.job_prepare(data, Path(args.dataset).name, template=args.template,
                                     hparams=dict(args.hparam), seed=args.seed, training_scheme=training,
                                     aggregation=args.aggregation, target=args.target, task=args.task,
                                     tokenizer=args.tokenizer)
        reports = simulation.simulate(job, rounds=args.rounds, devices=args.devices, non_iid=args.non_iid)
        _print_header(args, job)
        history = []
        for report in reports:
            if not history:
                _print_partition(args, report)
                print(f"{'round':>5}  {job.metric:>10}  {'test loss':>10}  {'train loss':>10}  {'bytes down':>12}  "
                      f"{'bytes up':>12}  {'devices':>7}", flush=True)
            history.append(report)
            print(f"{report.round:>5}  {report.metrics[job.metric]:>10.4f}  {report.metrics['loss']:>10.4f}  "
                  f"{report.train_loss:>10.4f}  {report.bytes_down:>12,}  {report.bytes_up:>12,}  "
                  f"{report.devices:>7}", flush=True)
    except datasets.DatasetError as e:
        return _error(e.message)
    except simulation.SimulationError as e:
        return _error(str(e), code=1 if str(e).startswith("Training diverges") else 2)
    _print_final(args, job, history)
    return 0


def _print_header(args: argparse.Namespace, job) -> None:
    scheme = job.scheme
    algorithm = (f"diloco (outer lr {scheme.outer_lr:g}, momentum {scheme.outer_momentum:g}, {scheme.inner_steps} "
                 "inner steps)" if scheme.is_diloco else "fedavg")
    hparams = ", ".join(f"{k}={json.dumps(v)}" for k, v in job.hparams.items())
    print(f"simulating {job.template} on {Path(args.dataset).name}: {len(job.y_train)} training / "
          f"{len(job.y_test)} held-out samples; {args.devices} devices; {algorithm}, {scheme.update_encoding} "
          f"updates, {job.aggregation} aggregation; seed {job.seed}")
    print(f"hyper-parameters: {hparams}")


def _print_partition(args: argparse.Namespace, first) -> None:
    if args.non_iid:
        print(f"non-IID: Dirichlet({args.non_iid:g}) label skew; each device's samples per class:")
        for device, counts in enumerate(first.shard_labels):
            print(f"  device {device}: {counts}")
    else:
        print("partition: the platform's (contiguous shards of the training split, equal devices)")


def _print_final(args: argparse.Namespace, job, history) -> None:
    last = history[-1]
    down, up = sum(r.bytes_down for r in history), sum(r.bytes_up for r in history)
    if args.json:
        print(json.dumps({
            "template": job.template, "metric": job.metric, job.metric: last.metrics[job.metric],
            "test_loss": last.metrics["loss"], "rounds": len(history), "devices": args.devices,
            "non_iid": args.non_iid or None, "seed": job.seed, "bytes_down": down, "bytes_up": up,
            "history": [{"round": r.round, job.metric: r.metrics[job.metric], "test_loss": r.metrics["loss"],
                         "train_loss": r.train_loss, "bytes_down": r.bytes_down, "bytes_up": r.bytes_up,
                         "devices": r.devices} for r in history],
            **({"device_labels": history[0].shard_labels} if history[0].shard_labels else {}),
        }))
    else:
        print(f"final: {job.metric} {last.metrics[job.metric]:.4f}, test loss {last.metrics['loss']:.4f} after "
              f"{len(history)} rounds; {down:,} bytes down and {up:,} bytes up in all")


def _error(message: str, code: int = 2) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _hparam(text: str) -> tuple[str, object]:
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE (e.g. lr=0.05)")
    try:
        return name.strip(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip(), value
