"""Whether a state's dataset fingerprint holds for the dataset now (:func:`same_dataset`),
and what differs between the two in words (:func:`fingerprint_changes`): what both the
loader's checkpoint (``loader/checkpoint.py``) and ``ListShards`` (a listing's state) use
to refuse a state taken on another version of the dataset."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["fingerprint_changes", "same_dataset"]


def same_dataset(saved: Any, now: Mapping[str, Any]) -> bool:
    """Whether the fingerprint ``saved`` with a state is the dataset's ``now``, in the keys
    ``saved`` has: a key a later version of this package added to fingerprints (a packed
    dataset's ``packing``) is not held against a state saved before it; a mixture's
    components are compared so, each."""
    if not isinstance(saved, Mapping):
        return False
    for key, value in saved.items():
        if key not in now:
            return False
        if key == "components" and isinstance(value, Mapping):
            components = now[key]
            if not isinstance(components, Mapping) or set(components) != set(value):
                return False
            if not all(
                same_dataset(value[name], components[name])
                if isinstance(components[name], Mapping)
                else value[name] == components[name]
                for name in value
            ):
                return False
        elif value != now[key]:
            return False
    return True


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
    if "packing" in saved and saved.get("packing") != now.get("packing"):
        return (
            f"it is the same data packed with other settings ({_change('packing', saved, now)}): "
            f"its windows hold other tokens"
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
