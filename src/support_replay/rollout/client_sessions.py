"""Sessions keyed by the client's own id (``X-Session-ID``), and task scopes that turn a harness's ids
into one GRPO group (docs/agents.md).

A harness such as verifiers sends ``X-Session-ID: <trace id>`` on every request of a rollout and
expects one conversation per id. The first request with an id opens a session (under the store's
session limit, its caller's quota and the TTL); later ones continue it. Under a task scope
(``/tasks/<task>/v1``) every new id is one sample of that task's group: the scope admits at most its
group size of ids, seeds them in order of first sight, and hands its sessions over when the trainer
closes it.

Ids live in their caller's namespace (``security.caller_of``: the API key the request presented), so
one caller's id never reaches another's conversation; within a caller the id is the conversation's
only credential, a secret like a session URL. A first turn that is refused leaves no session behind.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field

from ..errors import RequestError, SessionNotFound, SessionQuota

MAX_CLIENT_ID_CHARS = 256


@dataclass
class TaskScope:
    """One task's group: up to ``size`` client ids, each a session with ``seeds[k]`` in order of first sight."""

    id: str
    size: int
    seeds: list[int]
    settings: object = None  # SessionSettings of the group's sessions (None: the store's)
    metadata: dict = field(default_factory=dict)
    sessions: dict[tuple, str] = field(default_factory=dict)  # (caller, client id) -> session id, by first sight


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
        self._plain: dict[tuple, str] = {}  # (caller, client id) -> session id
        self._tasks: dict[str, TaskScope] = {}

    def session_for(self, client_id: str | None, task: str | None = None, caller: str = ""):
        """The session of ``client_id`` (under ``task`` when given), opened on first sight."""
        return self.open_or_find(client_id, task, caller)[0]

    def open_or_find(self, client_id: str | None, task: str | None = None, caller: str = ""):
        """``(session, opened)``: the session of ``caller``'s ``client_id`` (under ``task``), and whether this call
        opened it (a refused first turn then ``forget``s it)."""
        key = self._key(client_id, task, caller)
        with self._lock:
            scope = self._scope(task) if task is not None else None
            known = (scope.sessions if scope else self._plain).get(key)
        if known is not None:
            try:
                return self.store.get(known), False
            except SessionNotFound:
                if scope is not None:  # a group's sample may not silently restart
                    raise SessionNotFound(
                        f"task {task!r:.80}: the session of X-Session-ID {client_id!r:.80} expired or was deleted"
                    ) from None
        return self._open(key, scope)

    def forget(self, client_id: str, task: str | None, caller: str, sid: str) -> None:
        """A session whose first turn was refused goes, with its id: a refused request holds no place."""
        with self._lock:
            scope = self._tasks.get(task) if task is not None else None
            taken = scope.sessions if scope is not None else self._plain
            key = self._key(client_id, task, caller)
            if taken.get(key) == sid:
                del taken[key]
        self.store.discard(sid)

    def find(self, client_id: str | None, task: str | None = None, caller: str = ""):
        """The session already open for ``caller``'s ``client_id`` (under ``task``); never opens one."""
        key = self._key(client_id, task, caller)
        with self._lock:
            sid = (self._scope(task).sessions if task is not None else self._plain).get(key)
        if sid is None:
            raise SessionNotFound(f"X-Session-ID {client_id!r:.80}: no conversation with that id")
        return self.store.get(sid)

    @staticmethod
    def _key(client_id: str | None, task: str | None, caller: str) -> tuple:
        """Plain ids live in their caller's namespace; a task's ids in the task's (its unguessable id, handed to
        the harness by the trainer, is the credential there, and a harness may call with any key or none)."""
        return (caller if task is None else "", check_client_id(client_id))

    def _scope(self, task: str) -> TaskScope:
        scope = self._tasks.get(task)
        if scope is None:
            raise SessionNotFound(f"task {task!r:.80}: no such task (never opened, or closed)")
        return scope

    def _open(self, key: tuple, scope: TaskScope | None):
        caller, client_id = key
        with self._lock:  # the same id's first requests may race: one opens, the others find it
            taken = scope.sessions if scope else self._plain
            already = taken.get(key)
            if already is not None and already in self.store:
                return self.store.get(already), False
            if scope is not None and len(taken) >= scope.size:
                raise RequestError(
                    f"task {scope.id}: X-Session-ID {client_id!r:.80} would be sample {len(taken) + 1} of a group of "
                    f"{scope.size}; the task takes {scope.size} conversations"
                )
            if scope is None:
                self._prune()
                self._check_quota(caller)
            metadata = {**(scope.metadata if scope else {}), "client_session_id": client_id}
            session = self.store.create(
                seed=scope.seeds[len(taken)] if scope is not None else None,
                metadata=metadata,
                settings=scope.settings if scope is not None else None,
            )
            session.client_id = client_id
            taken[key] = session.id
            return session, True

    def _check_quota(self, caller: str) -> None:
        quota = self.store.max_sessions_per_caller
        held = sum(1 for (c, _), sid in self._plain.items() if c == caller and sid in self.store)
        if held >= quota:
            raise SessionQuota(
                f"X-Session-ID: this API key holds {held} open conversations, its quota ({quota}); finish or delete "
                "some, or wait for idle ones to expire"
            )

    def _prune(self) -> None:
        """Forget ids whose session is gone (expired, deleted), once the map reaches the session limit."""
        if len(self._plain) >= self.store.max_sessions:
            self.store.expire()
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
            return [client_id for _, client_id in self._scope(task).sessions]
