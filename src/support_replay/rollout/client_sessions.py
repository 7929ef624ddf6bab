"""Sessions keyed by the client's own id (``X-Session-ID``), and task scopes that turn a harness's ids
into one GRPO group (docs/agents.md).

A harness such as verifiers sends ``X-Session-ID: <trace id>`` on every request of a rollout and
expects one conversation per id. The first request with an id opens a session (under the store's
session limit and TTL); later ones continue it. Under a task scope (``/tasks/<task>/v1``) every new
id is one sample of that task's group: the scope admits at most its group size of ids, seeds them
in order of first sight, and hands its sessions over when the trainer closes it.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field

from ..errors import RequestError, SessionNotFound

MAX_CLIENT_ID_CHARS = 256


@dataclass
class TaskScope:
    """One task's group: up to ``size`` client ids, each a session with ``seeds[k]`` in order of first sight."""

    id: str
    size: int
    seeds: list[int]
    settings: object = None  # SessionSettings of the group's sessions (None: the store's)
    metadata: dict = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)  # client id -> session id, in order of first sight


def check_client_id(client_id: str | None) -> str:
    if not client_id or len(client_id) > MAX_CLIENT_ID_CHARS or not client_id.isprintable():
        raise RequestError(
            f"X-Session-ID: {client_id!r:.80} is not a session id (1 to {MAX_CLIENT_ID_CHARS} printable characters); "
            "send one per conversation, or open a session with POST /sessions"
        )
    return client_id


class ClientSessions:
    """Client ids -> sessions of ``store``, outside any task scope or inside one; thread-safe."""

    def __init__(self, store):
        self.store = store
        self._lock = threading.Lock()
        self._plain: dict[str, str] = {}  # client id -> session id
        self._tasks: dict[str, TaskScope] = {}

    def session_for(self, client_id: str | None, task: str | None = None):
        """The session of ``client_id`` (under ``task`` when given), opened on first sight."""
        client_id = check_client_id(client_id)
        with self._lock:
            scope = self._scope(task) if task is not None else None
            known = (scope.sessions if scope else self._plain).get(client_id)
        if known is not None:
            try:
                return self.store.get(known)
            except SessionNotFound:
                if scope is not None:  # a group's sample may not silently restart
                    raise SessionNotFound(
                        f"task {task!r:.80}: the session of X-Session-ID {client_id!r:.80} expired or was deleted"
                    ) from None
        return self._open(client_id, scope)

    def find(self, client_id: str | None, task: str | None = None):
        """The session already open for ``client_id`` (under ``task``); never opens one."""
        client_id = check_client_id(client_id)
        with self._lock:
            sid = (self._scope(task).sessions if task is not None else self._plain).get(client_id)
        if sid is None:
            raise SessionNotFound(f"X-Session-ID {client_id!r:.80}: no conversation with that id")
        return self.store.get(sid)

    def _scope(self, task: str) -> TaskScope:
        scope = self._tasks.get(task)
        if scope is None:
            raise SessionNotFound(f"task {task!r:.80}: no such task (never opened, or closed)")
        return scope

    def _open(self, client_id: str, scope: TaskScope | None):
        with self._lock:  # the same id's first requests may race: one opens, the others find it
            taken = scope.sessions if scope else self._plain
            already = taken.get(client_id)
            if already is not None and already in self.store:
                return self.store.get(already)
            if scope is not None and len(taken) >= scope.size:
                raise RequestError(
                    f"task {scope.id}: X-Session-ID {client_id!r:.80} would be sample {len(taken) + 1} of a group of "
                    f"{scope.size}; the task takes {scope.size} conversations"
                )
            metadata = {**(scope.metadata if scope else {}), "client_session_id": client_id}
            session = self.store.create(
                seed=scope.seeds[len(taken)] if scope is not None else None,
                metadata=metadata,
                settings=scope.settings if scope is not None else None,
            )
            taken[client_id] = session.id
            if scope is None:
                self._prune()
            return session

    def _prune(self) -> None:
        """Forget ids whose session is gone (expired, deleted), once the map outgrows the session limit."""
        if len(self._plain) > self.store.max_sessions:
            self._plain = {c: s for c, s in self._plain.items() if s in self.store}

    def open_task(self, size: int, seeds: list[int], *, settings=None, metadata: dict | None = None) -> TaskScope:
        if size < 1 or len(seeds) != size:
            raise RequestError(f"a task scope needs a group size >= 1 and one seed per sample, got {size}, {seeds}")
        scope = TaskScope(uuid.uuid4().hex, size, list(seeds), settings, dict(metadata or {}))
        with self._lock:
            self._tasks[scope.id] = scope
        return scope

    def close_task(self, task: str) -> list:
        """The task's sessions still open, in order of first sight; the scope and its ids are forgotten."""
        with self._lock:
            scope = self._tasks.pop(task, None)
        if scope is None:
            raise SessionNotFound(f"task {task!r:.80}: no such task (never opened, or closed)")
        return [self.store.get(sid) for sid in scope.sessions.values() if sid in self.store]

    def task_ids(self, task: str) -> list[str]:
        with self._lock:
            return list(self._scope(task).sessions)
