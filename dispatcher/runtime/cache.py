"""Measurements kept across runs under $TWOGRID_CACHE (default ~/.cache/twogrid): a measured step-cost curve is
read back by every later run of the same setup, so that those runs decide alike (the same verify lengths, tiers,
fitted grids) and skip the measurement."""

from __future__ import annotations

import hashlib
import json
import logging
import os

from models.default_model import cache_dir

log = logging.getLogger("twogrid.engine")


def cached_json(name: str, key: list, measure, what: str) -> dict | None:
    """The data kept in $TWOGRID_CACHE/``name`` under ``key`` (a JSON-able list: device, model, dtype and what
    else the measurement depends on), with ``"source"`` (its path); else ``measure()`` (a JSON-able dict, or None:
    nothing measured) saved there. ValueError naming the file when it is unreadable."""
    text = json.dumps(key)
    folder = os.path.join(cache_dir(), name)
    path = os.path.join(folder, hashlib.sha256(text.encode()).hexdigest()[:16] + ".json")
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as fh:
                return dict(json.load(fh), source=path)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"the cached {what} in {path} are unreadable ({exc}): remove the file") from None
    data = measure()
    if data is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({**data, "key": text}, fh)
        log.info("%s saved to %s (reused by later runs)", what, path)
    except OSError as exc:
        log.warning("cannot save the %s to %s (%s)", what, path, exc)
    return {**data, "source": f"measured (kept in {path})"}
