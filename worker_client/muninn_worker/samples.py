"""Generated sample data for tests, benchmarks and demos: nothing is downloaded.

`generated_text` writes a corpus from a small seeded grammar: its words are spelled the same way every
time, so a character-level language model can learn far more than the uniform-vocabulary guess;
`style="b"` gives a different vocabulary for the same letters (a "new text" to fine-tune on).
`synthetic_images` draws class-dependent shapes (bars, crosses, boxes) with noise; `image_folder_zip` packs
images as the zip of class folders a customer uploads.
"""

from __future__ import annotations

import io
import random
import zipfile
from collections.abc import Sequence

import numpy as np

__all__ = ["generated_text", "image_folder_zip", "synthetic_images"]

_WORDS = {
    "a": {"det": ["the", "a", "every", "one"], "adj": ["quick", "lazy", "red", "old", "small", "brave"],
          "noun": ["fox", "dog", "raven", "river", "stone", "king"],
          "verb": ["sees", "chases", "finds", "guards", "hears", "follows"]},
    "b": {"det": ["some", "this", "that", "no"], "adj": ["silent", "golden", "frozen", "wild", "dark"],
          "noun": ["wolf", "mountain", "forest", "moon", "sword"],
          "verb": ["watches", "crosses", "breaks", "remembers", "sings"]},
}


def generated_text(*, seed: int = 0, sentences: int = 2000, style: str = "a") -> str:
    words = _WORDS[style]
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        out.append(f"{rng.choice(words['det'])} {rng.choice(words['adj'])} {rng.choice(words['noun'])} "
                   f"{rng.choice(words['verb'])} {rng.choice(words['det'])} {rng.choice(words['noun'])}.")
    return " ".join(out) + "\n"


def synthetic_images(*, seed: int = 0, per_class: int = 20, size: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """uint8 RGB images [n, size, size, 3] in 3 classes (0 horizontal bar, 1 vertical bar, 2 box) and labels."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for label in range(3):
        for _ in range(per_class):
            img = rng.integers(0, 60, (size, size, 3), dtype=np.int64)
            lo, hi = sorted(rng.integers(1, size - 1, 2))
            hi = max(hi, lo + 2)
            if label == 0:
                img[lo:hi, 1:-1] += 180
            elif label == 1:
                img[1:-1, lo:hi] += 180
            else:
                img[lo, lo:hi] += 180
                img[hi - 1, lo:hi] += 180
                img[lo:hi, lo] += 180
                img[lo:hi, hi - 1] += 180
            images.append(np.clip(img, 0, 255).astype(np.uint8))
            labels.append(label)
    return np.stack(images), np.array(labels, dtype=np.int64)


def image_folder_zip(images: np.ndarray, labels: np.ndarray, class_names: Sequence[str], *,
                     root: str = "shapes") -> bytes:
    """A zip of class folders, as a customer uploads images: `<root>/<class name>/<i>.png` for each image."""
    from PIL import Image  # (pillow is imported only where images are made or read)

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for i, (image, label) in enumerate(zip(images, labels)):
            raw = io.BytesIO()
            Image.fromarray(image).save(raw, format="PNG")
            archive.writestr(f"{root}/{class_names[label]}/{i}.png", raw.getvalue())
    return buffer.getvalue()
