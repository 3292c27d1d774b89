"""The context-manager and finaliser face shared by the offload objects that own files and locked memory."""

from __future__ import annotations

from typing import Any


class Closing:
    """`with obj:` closes it at the end, and so does its finaliser if the owner forgot (errors swallowed
    there, since nothing can be raised from a finaliser). Subclasses define an idempotent `close()`."""

    def close(self) -> None:  # pragma: no cover - always overridden
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
