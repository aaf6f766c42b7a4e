"""CSV tables: a header row, numeric and categorical feature columns, a chosen target column.

Numeric columns: every present cell a number; a missing cell ("", NA, ?, ...) is filled with the column's
median and reported in the profile with its rows. Categorical columns (most present cells are words): one-hot
encoded over a sorted vocabulary that the profile stores, so the same file always encodes the same way; a
missing cell is its own category. A column that is mostly numbers with a stray word is a mistake, reported
with its row.
"""
from __future__ import annotations

import csv
import io
import math

import numpy as np

from .common import (
    MISSING_TOKENS, PROFILE_FEATURE_NAMES, DatasetError, ParsedDataset, as_numbers, check_rows, decode_utf8,
)
from .targets import encode_target

MAX_CATEGORIES = 1000
MISSING_CATEGORY = "(missing)"
MISSING_ROWS_SHOWN = 10


def parse_csv(data: bytes, *, target: str | None, task: str | None, max_rows: int,
              max_features: int) -> ParsedDataset:
    text = decode_utf8(data, fix="Save the file as UTF-8 (in Excel: 'CSV UTF-8') and upload it again.")
    first_line = io.StringIO(text).readline()
    delimiter = max(",;\t", key=first_line.count)  # ties (and none) go to the comma
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = [cell.strip() for cell in next(reader, [])]
        names, t = _check_header(header, target)
        rows, lines = _read_rows(reader, names, max_rows)
    except csv.Error as exc:
        raise DatasetError("not_csv", f"row {reader.line_num}: this is not valid CSV ({exc}).",
                           row=reader.line_num) from None
    if not rows:
        check_rows(0)
    labels = []
    for row, line in zip(rows, lines):
        if not row[t]:
            raise DatasetError("missing_value", f"row {line}, column {names[t]!r}: the label is empty; every row "
                               "needs a label.", row=line, column=names[t])
        labels.append(row[t])
    blocks, feature_names, columns, missing = [], [], [], {}
    for j in (j for j in range(len(names)) if j != t):
        block, described, report = _column([row[j] for row in rows], lines, names[j], delimiter != ",")
        blocks.append(block)
        columns.append(described)
        feature_names += [names[j]] if described["type"] == "numeric" else [
            f"{names[j]}={c}" for c in described["categories"]]
        if report:
            missing[names[j]] = report
    if len(feature_names) > max_features:
        raise DatasetError("too_large", f"The file has {len(feature_names)} features after encoding; the limit is "
                           f"{max_features}.", features=len(feature_names), limit=max_features)
    check_rows(len(rows))
    X = np.concatenate(blocks, axis=1).astype(np.float32)
    y, classes, target_profile = encode_target(np.array(labels, dtype=str),
                                               lambda i: f"row {lines[i]}, column {names[t]!r}", names[t], task)
    profile = {"format": "csv", "kind": "table", "rows": len(rows), "features": len(feature_names),
               "feature_names": feature_names[:PROFILE_FEATURE_NAMES], "target": names[t], **target_profile,
               "columns": columns, "missing": missing}
    return ParsedDataset(X=X, y=y, feature_names=feature_names, classes=classes, profile=profile)


def _read_rows(reader, names: list[str], max_rows: int, start: int = 2) -> tuple[list[list[str]], list[int]]:
    rows, lines = [], []
    for line, row in enumerate(reader, start=start):  # row numbers as a spreadsheet shows them
        if not any(cell.strip() for cell in row):
            continue  # blank line
        if len(row) != len(names):
            raise DatasetError("ragged_row", f"row {line} has {len(row)} fields but the header has "
                               f"{len(names)}; every row needs one value per column.",
                               row=line, fields=len(row), expected=len(names))
        if len(rows) == max_rows:
            raise DatasetError("too_large", f"The file has more than {max_rows} data rows, the limit.",
                               limit=max_rows)
        rows.append([cell.strip() for cell in row])
        lines.append(line)
    return rows, lines


def _check_header(header: list[str], target: str | None) -> tuple[list[str], int]:
    if len(header) < 2:
        raise DatasetError("not_csv", "row 1 (the header) has fewer than 2 columns; Muninn needs at least one "
                           "feature column and a label column, separated by commas, semicolons or tabs.", row=1)
    seen: dict[str, int] = {}
    for number, name in enumerate(header, start=1):
        if not name:
            raise DatasetError("not_csv", f"row 1, column {number}: the header cell is empty; every column "
                               "needs a name.", row=1, column=number)
        if name in seen:
            raise DatasetError("not_csv", f"row 1: the column name {name!r} appears twice (columns "
                               f"{seen[name]} and {number}); column names must be unique.", row=1, column=name)
        seen[name] = number
    if as_numbers(np.array(header)) is not None:
        raise DatasetError("not_csv", "row 1 holds numbers, not column names; the first row must be a header "
                           "naming each column.", row=1)
    if target is None:
        return header, len(header) - 1
    if target not in seen:
        shown = ", ".join(repr(h) for h in header[:20]) + (", ..." if len(header) > 20 else "")
        raise DatasetError("bad_target", f"There is no column named {target!r}. The columns are: {shown}.",
                           target=target, columns=header[:100])
    return header, seen[target] - 1


def _number(cell: str, decimal_comma: bool) -> float | None:
    if decimal_comma and cell.count(",") == 1 and "." not in cell:  # "1,5" in a ;- or tab-separated file
        cell = cell.replace(",", ".")
    try:
        return float(cell)
    except ValueError:
        return None


def _column(cells: list[str], lines: list[int], name: str, decimal_comma: bool):
    """(encoded block [rows, k], column description, missing-value report or None)."""
    missing = [i for i, c in enumerate(cells) if c.lower() in MISSING_TOKENS]
    present = len(cells) - len(missing)
    if present * 2 < len(cells):
        raise DatasetError("missing_value", f"column {name!r} is empty in {len(missing)} of {len(cells)} rows "
                           f"(first: row {lines[missing[0]]}); fill it in or drop the column.",
                           row=lines[missing[0]], column=name, missing=len(missing))
    missing_set = set(missing)
    values = [None if i in missing_set else _number(c, decimal_comma) for i, c in enumerate(cells)]
    words = [i for i, v in enumerate(values) if v is None and cells[i].lower() not in MISSING_TOKENS]
    if words and len(words) * 2 > present:
        return _categorical(cells, lines, name, missing_set)
    if words:
        i = words[0]
        shown = repr(cells[i] if len(cells[i]) <= 40 else cells[i][:37] + "...")
        raise DatasetError("bad_number", f"row {lines[i]}, column {name!r}: {shown} is not a number, but most of "
                           "this column is numbers. Fix the cell (a column of mostly words is treated as "
                           "categorical); if this column holds the labels, choose it as the target.",
                           row=lines[i], column=name, value=cells[i][:100])
    bad = next((i for i, v in enumerate(values) if v is not None and not math.isfinite(v)), None)
    if bad is not None:
        raise DatasetError("bad_number", f"row {lines[bad]}, column {name!r}: {cells[bad]!r} is not a finite "
                           "number.", row=lines[bad], column=name, value=cells[bad][:100])
    column = np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    if np.abs(column[~np.isnan(column)]).max(initial=0) > np.finfo(np.float32).max:
        i = int(np.nanargmax(np.abs(column)))
        raise DatasetError("bad_number", f"row {lines[i]}, column {name!r}: the value is too large for a 32-bit "
                           "float.", row=lines[i], column=name)
    described = {"name": name, "type": "numeric"}
    report = None
    if missing:
        fill = float(np.nanmedian(column))
        column[np.isnan(column)] = fill
        described["filled_with"] = fill
        report = {"count": len(missing), "rows": [lines[i] for i in missing[:MISSING_ROWS_SHOWN]],
                  "filled_with": fill}
    return column.reshape(-1, 1), described, report


def _categorical(cells: list[str], lines: list[int], name: str, missing: set[int]):
    values = [MISSING_CATEGORY if i in missing else c for i, c in enumerate(cells)]
    categories = sorted(set(values))
    if len(categories) > MAX_CATEGORIES:
        raise DatasetError("too_large", f"column {name!r} has {len(categories)} distinct values; a categorical "
                           f"column may have at most {MAX_CATEGORIES}.", column=name, categories=len(categories))
    index = {c: k for k, c in enumerate(categories)}
    block = np.zeros((len(cells), len(categories)), dtype=np.float64)
    block[np.arange(len(cells)), [index[v] for v in values]] = 1.0
    described = {"name": name, "type": "categorical", "categories": categories}
    report = None
    if missing:
        rows = sorted(missing)
        report = {"count": len(rows), "rows": [lines[i] for i in rows[:MISSING_ROWS_SHOWN]],
                  "filled_with": MISSING_CATEGORY}
    return block, described, report


def encode_table(text: str, columns: list[dict], *, max_rows: int,
                 first_row: int = 2) -> tuple[np.ndarray, list[int]]:
    """New rows of a CSV (a header, then rows) encoded as the training file's were: (X float32 [rows,
    features], the rows' line numbers). `columns` are the training profile's column descriptions: a numeric
    column's missing cell gets the training median where training had missing cells (and is an error where it
    had none: the model has no fill for it), a categorical column is one-hot over the training vocabulary.
    Columns may come in any order; columns the model does not use (the target, an id) are ignored. Rows are
    numbered from `first_row` in messages (2: as a spreadsheet shows a file with a header; 1: a list of rows)."""
    first_line = io.StringIO(text).readline()
    delimiter = max(",;\t", key=first_line.count)
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    try:
        header = [cell.strip() for cell in next(reader, [])]
        if not any(header):
            raise DatasetError("no_rows", "The input is empty; give a header row naming the columns, then rows.")
        rows, lines = _read_rows(reader, header, max_rows, first_row)
    except csv.Error as exc:
        raise DatasetError("not_csv", f"row {reader.line_num}: this is not valid CSV ({exc}).",
                           row=reader.line_num) from None
    if not rows:
        raise DatasetError("no_rows", "The input has a header but no rows to predict.", rows=0)
    position = {name: j for j, name in enumerate(header)}
    absent = [c["name"] for c in columns if c["name"] not in position]
    if absent:
        raise DatasetError("missing_column", f"The input has no column {absent[0]!r}; the model was trained on "
                           f"the columns {', '.join(repr(c['name']) for c in columns)} (in any order).",
                           column=absent[0], missing=absent[:100])
    blocks = [_encode_column(column, [row[position[column["name"]]] for row in rows], lines, delimiter != ",")
              for column in columns]
    return np.concatenate(blocks, axis=1).astype(np.float32), lines


def _encode_column(column: dict, cells: list[str], lines: list[int], decimal_comma: bool) -> np.ndarray:
    name = column["name"]
    if column["type"] == "categorical":
        index = {c: k for k, c in enumerate(column["categories"])}
        block = np.zeros((len(cells), len(index)), dtype=np.float64)
        for i, cell in enumerate(cells):
            value = MISSING_CATEGORY if cell.lower() in MISSING_TOKENS else cell
            if value not in index:
                known = ", ".join(repr(c) for c in column["categories"][:20])
                what = "is empty, and it was never empty in training" if value == MISSING_CATEGORY else \
                    f"{value[:40]!r} was not seen in training"
                raise DatasetError("bad_category", f"row {lines[i]}, column {name!r}: {what}; the model knows "
                                   f"{known}{', ...' if len(column['categories']) > 20 else ''}.",
                                   row=lines[i], column=name, value=value[:100])
            block[i, index[value]] = 1.0
        return block
    values = np.empty((len(cells), 1), dtype=np.float64)
    for i, cell in enumerate(cells):
        if cell.lower() in MISSING_TOKENS:
            if "filled_with" not in column:
                raise DatasetError("missing_value", f"row {lines[i]}, column {name!r}: the value is missing, and "
                                   "this column had no missing values in training, so the model has no fill for "
                                   "it; give a number.", row=lines[i], column=name)
            values[i, 0] = column["filled_with"]
            continue
        number = _number(cell, decimal_comma)
        if number is None or not math.isfinite(number) or abs(number) > np.finfo(np.float32).max:
            shown = repr(cell if len(cell) <= 40 else cell[:37] + "...")
            raise DatasetError("bad_number", f"row {lines[i]}, column {name!r}: {shown} is not a number; this "
                               "column held numbers in training.", row=lines[i], column=name, value=cell[:100])
        values[i, 0] = number
    return values
