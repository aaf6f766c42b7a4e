"""The target of a table or an .npz: classes or a number to predict, detected and shown in the profile.

A target is regression when its values are numbers and either some are not whole, or there are more than
REGRESSION_MIN_DISTINCT distinct whole numbers (a price, an age, a disease score); classes otherwise. The
customer can say which with `task` at upload.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .common import DatasetError, as_numbers

REGRESSION_MIN_DISTINCT = 30
TASKS = ("classification", "regression")


def encode_target(labels: np.ndarray, where: Callable[[int], str], label_name: str,
                  task: str | None = None) -> tuple[np.ndarray, list[str], dict]:
    """(y, classes, profile entries). y is int64 class indices or float32 values for regression."""
    if task not in (None, *TASKS):
        raise DatasetError("bad_target", f"task must be 'classification' or 'regression' (got {task!r}).", task=task)
    uniq, inverse = np.unique(labels, return_inverse=True)
    inverse = inverse.reshape(-1).astype(np.int64)
    numbers = uniq.astype(np.float64) if labels.dtype.kind in "biuf" else as_numbers(uniq)
    fractional = np.flatnonzero(numbers != np.floor(numbers)) if numbers is not None else np.array([], int)
    if task is None:
        regression = numbers is not None and (len(fractional) > 0 or len(uniq) > REGRESSION_MIN_DISTINCT)
        task = "regression" if regression else "classification"
    if task == "regression":
        return _regression(numbers, inverse, where, label_name, uniq)
    if len(fractional):
        k = int(fractional[0])
        raise DatasetError("bad_target", f"{where(int(np.argmax(inverse == k)))}: the label {str(uniq[k])!r} is not "
                           "a whole number, so it cannot be a class. Upload with task=regression to predict the "
                           "number instead.", value=str(uniq[k]))
    y, classes = _classes(labels, uniq, inverse, numbers)
    if len(classes) < 2:
        raise DatasetError("too_few_classes", f"The labels in {label_name!r} have only one class "
                           f"({classes[0]!r}); a classifier needs at least 2.", target=label_name, classes=classes)
    counts = np.bincount(y, minlength=len(classes))
    return y, classes, {"task": "classification", "classes": classes, "num_classes": len(classes),
                        "class_counts": dict(zip(classes, counts.tolist()))}


def _regression(numbers, inverse, where, label_name, uniq):
    if numbers is None:
        bad = next(i for i, u in enumerate(uniq.tolist()) if as_numbers(np.array([u])) is None)
        raise DatasetError("bad_target", f"{where(int(np.argmax(inverse == bad)))}: the target {str(uniq[bad])!r} "
                           "is not a number; regression needs a numeric target.", value=str(uniq[bad]))
    y = numbers[inverse].astype(np.float32)
    if float(y.std()) == 0.0:
        raise DatasetError("too_few_classes", f"The target {label_name!r} has the same value in every row; there "
                           "is nothing to predict.", target=label_name)
    stats = {"min": float(y.min()), "max": float(y.max()), "mean": float(y.mean()), "std": float(y.std())}
    return y, [], {"task": "regression", "target_stats": stats}


def _classes(labels, uniq, inverse, numbers):
    if numbers is None:
        return inverse, [str(u) for u in uniq.tolist()]
    kind_f = labels.dtype.kind == "f"  # 1.0 -> "1"
    classes = [str(int(v)) if kind_f else str(v) for v in (numbers if kind_f else uniq).tolist()]
    order = np.lexsort((np.arange(len(numbers)), numbers))  # numeric order: 2 before 10
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse].astype(np.int64), [classes[k] for k in order]
