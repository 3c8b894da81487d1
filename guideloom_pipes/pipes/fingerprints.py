"""What differs between two dataset fingerprints, in words, for the errors that refuse a
state taken on another version of the dataset."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["fingerprint_changes"]


def fingerprint_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """What differs between two listing fingerprints, in words."""
    changed = [
        f"{key} {saved.get(key)!r} -> {now.get(key)!r}"
        for key in sorted(set(saved) | set(now))
        if saved.get(key) != now.get(key)
    ]
    return ", ".join(changed) or f"{dict(saved)} -> {dict(now)}"
