"""Defaults for the new-job form, from the dataset's profile: a template that fits the data and hyper-parameters
that fit its size. Pure functions over the profile and the template registry."""
from __future__ import annotations

from muninn_worker import zoo

DEFAULT_ROUNDS = 5
TEMPLATE_FOR_KIND = {"table": "mlp", "image": "cnn", "text": "transformer"}


def templates_for(profile: dict) -> list[str]:
    """The templates that can train on this kind of data, the suggested one first."""
    kind = profile.get("kind")
    names = [name for name, spec in zoo.TEMPLATES.items() if kind in spec.data]
    first = TEMPLATE_FOR_KIND.get(kind)
    return sorted(names, key=lambda n: (n != first, n))


def hparams_for(template: str, profile: dict) -> dict:
    """The template's defaults, fitted to the data: a batch no larger than a tenth of the training rows (so a
    small dataset still takes several steps an epoch) and, for a zip of images, an image size no larger than
    the images themselves."""
    hp = {h.name: (list(h.default) if isinstance(h.default, tuple) else h.default)
          for h in zoo.get_template(template).hparams}
    rows = int(profile.get("rows") or 0)
    if "batch_size" in hp and rows:
        hp["batch_size"] = max(1, min(hp["batch_size"], rows // 10))
    largest = (profile.get("original_size") or {}).get("max")
    if "image_size" in hp and largest:
        spec = next(h for h in zoo.get_template(template).hparams if h.name == "image_size")
        hp["image_size"] = max(spec.minimum, min(hp["image_size"], max(largest)))
    return hp
