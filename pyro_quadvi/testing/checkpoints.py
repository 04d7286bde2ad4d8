"""An older checkpoint whose optimizer entry sits under another key, and the user's load
pre-hook that migrates it: the scenario the plain-torch optimizers' checkpoint hooks serve."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["rename_back", "renamed_entry"]


def renamed_entry(saved: dict, key: str) -> dict:
    """``saved`` with its ``key`` entry kept under ``key + "_v0"`` instead, as an older
    checkpoint might hold it."""
    old = {k: v for k, v in saved.items() if k != key}
    old[f"{key}_v0"] = saved[key]
    return old


def rename_back(key: str) -> Callable[[object, dict], dict]:
    """A ``register_load_state_dict_pre_hook`` hook that moves the ``key + "_v0"`` entry of
    `renamed_entry` back under ``key``."""

    def migrate(optimizer: object, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        state_dict[key] = state_dict.pop(f"{key}_v0")
        return state_dict

    return migrate
