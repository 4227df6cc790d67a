"""The one error the planning modules raise for a configuration they refuse, and the check every JSON object they
read makes of its fields (a leaf: every module of ``dispatcher.plan`` may import it, it imports none of them)."""

from __future__ import annotations

import difflib
from typing import Any, Sequence


class ConfigError(ValueError):
    """A configuration the engine refuses; the message names the field, the value and the limit."""


def check_known_fields(data: dict[str, Any], known: Sequence[str], where: str) -> None:
    """ConfigError naming the first field of ``data`` not in ``known`` (with the closest known one, and them all)."""
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown field {key!r}{hint}; known fields: {', '.join(known)}")
