"""What differs between two dataset fingerprints, in words: the one diff that both the
loader's checkpoint (``loader/checkpoint.py``) and ``ListShards`` (a listing's state) use
to refuse a state taken on another version of the dataset."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["fingerprint_changes"]


def fingerprint_changes(saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    """What differs between two dataset fingerprints, in words.

    A fingerprint is a reader's (``ReaderBase.fingerprint()``: ``shards``, ``sizes``,
    ``checksums``), a mixture's (``components``: its components' fingerprints by name) or a
    shard listing's (``ListShards``: the reader's and ``samples``, each shard's sample
    count). The first of these keys that differs is named with what it means and its values
    (``key before -> after``); other keys are listed as ``key before -> after``.
    """
    if "components" in saved or "components" in now:
        before, after = saved.get("components") or {}, now.get("components") or {}
        parts = []
        for name in sorted(set(before) | set(after)):
            if name not in before:
                parts.append(f"component {name!r} is new")
            elif name not in after:
                parts.append(f"component {name!r} is gone")
            elif before[name] != after[name]:
                change = fingerprint_changes(before[name], after[name])
                parts.append(f"component {name!r}: {change}")
        return "; ".join(parts) or "its components differ"
    if saved.get("shards") != now.get("shards"):
        return (
            f"it had {saved.get('shards')} shard(s), it has {now.get('shards')} now "
            f"({_change('shards', saved, now)})"
        )
    if saved.get("sizes") != now.get("sizes"):
        return (
            f"it has as many shards, but shard files changed size ({_change('sizes', saved, now)})"
        )
    if saved.get("checksums") != now.get("checksums"):
        return (
            "it has the same shards and sizes, but their contents changed (the commit "
            f"records' checksums differ: {_change('checksums', saved, now)})"
        )
    if saved.get("samples") != now.get("samples"):
        return _samples_changed(list(saved.get("samples") or ()), list(now.get("samples") or ()))
    changed = [
        _change(key, saved, now)
        for key in sorted(set(saved) | set(now))
        if saved.get(key) != now.get(key)
    ]
    return ", ".join(changed) or f"fingerprint {dict(saved)} is now {dict(now)}"


def _change(key: str, saved: Mapping[str, Any], now: Mapping[str, Any]) -> str:
    return f"{key} {saved.get(key)!r} -> {now.get(key)!r}"


def _samples_changed(before: list[Any], after: list[Any]) -> str:
    """A listing's sample counts differ (the shards' files do not, or are not known)."""
    for shard, (was, is_now) in enumerate(zip(before, after)):
        if was != is_now:
            return (
                f"its shards hold other numbers of samples: shard {shard} held {was!r}, it "
                f"holds {is_now!r} now (another sequence_length, or other data)"
            )
    return f"it had sample counts of {len(before)} shard(s), it has {len(after)} now"
