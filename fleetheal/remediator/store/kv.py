"""Named values the remediator keeps between runs (the gate's circuit breaker: open since when)."""

from __future__ import annotations

from fleetheal.remediator.store.db import Database


class KeyValue(Database):
    def kv_get(self, key: str) -> str | None:
        row = self._one("SELECT value FROM kv WHERE key = ?", (key,))
        return None if row is None else str(row["value"])

    def kv_set(self, key: str, value: str | None) -> None:
        """Set `key`, or delete it with None."""
        with self.tx() as db:
            if value is None:
                db.execute("DELETE FROM kv WHERE key = ?", (key,))
            else:
                db.execute(
                    "INSERT INTO kv (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (key, value),
                )
