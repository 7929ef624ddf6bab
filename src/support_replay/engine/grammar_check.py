"""A grammar is compiled first where it can be killed: one worker process (``grammar_worker.py``) builds its
llguidance matcher under a deadline, one grammar at a time. A 390 KB JSON schema sent with ``n: 16`` was
compiled 32 times on the event loop and the engine's thread (11 s of every client's time, docs/reliability.md);
now a grammar reaches this process once, and one past its deadline costs the process, not the server."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from copy import copy
from pathlib import Path

from ..errors import OverloadedError, RequestError

WORKER = Path(__file__).with_name("grammar_worker.py")
STARTUP_SECONDS = 120.0  # building llguidance's tokenizer of a 150k vocabulary takes about a second
MEMORY_BYTES = 8 * 2**30  # the worker's address space: a grammar that needs more fails there alone


def first_line(error: str, limit: int = 400) -> str:
    """An llguidance error cut to its first line (a failed assertion carries a Rust backtrace)."""
    line = (error.strip().splitlines() or ["the grammar does not compile"])[0]
    return line if len(line) <= limit else line[:limit] + "..."


def tokenizer_json(tokenizer) -> str:
    """The fast tokenizer's ``tokenizer.json`` with its added tokens, as llguidance's ``hf.from_tokenizer`` reads it."""
    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class GrammarChecker:
    """One compiler process, started on the first grammar and again after a kill. ``check`` blocks (call it
    from a worker thread); at most ``max_waiting`` callers wait for the process, past that a 503."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], seconds: float, max_waiting: int):
        self._init = {
            "tokenizer": tokenizer_json(tokenizer),
            "n_vocab": vocab_size,
            "eos": list(eos_ids),
            "memory": MEMORY_BYTES,
        }
        self.seconds, self.max_waiting = seconds, max_waiting
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one grammar in the process at a time
        self._count = threading.Lock()
        self._waiting = 0
        self.killed = 0  # compiles past their deadline (their process killed)

    def check(self, grammar: str) -> None:
        """Raise ``RequestError`` (first line of llguidance's error, or the deadline) unless ``grammar`` compiles."""
        with self._count:
            if self._waiting >= self.max_waiting:
                raise OverloadedError(f"grammar: {self._waiting} grammars are waiting to be compiled; retry later")
            self._waiting += 1
        try:
            with self._lock:
                error = self._compile(grammar)
        finally:
            with self._count:
                self._waiting -= 1
        if error:
            raise RequestError(f"grammar: {first_line(error)}")

    def _compile(self, grammar: str) -> str:
        process = self._started()
        process.stdin.write(json.dumps(grammar) + "\n")
        process.stdin.flush()
        reply = self._read(process, self.seconds)
        if reply is None:
            self.killed += 1
            self.close()
            return f"compiling it took more than {self.seconds:g} s (the engine's grammar_compile_ms); it was stopped"
        if reply == "":
            self.close()
            return "the grammar compiler ran out of memory or crashed on it"
        return json.loads(reply)

    def _started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        # -P: the script's folder is not put on sys.path (its modules' names must not shadow the library's)
        process = subprocess.Popen(
            [sys.executable, "-P", str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        process.stdin.write(json.dumps(self._init) + "\n")
        process.stdin.flush()
        if self._read(process, STARTUP_SECONDS) != '"ready"':
            process.kill()
            process.wait()
            raise OverloadedError("grammar: the grammar compiler did not start; retry later")
        self._process = process
        return process

    @staticmethod
    def _read(process: subprocess.Popen, seconds: float) -> str | None:
        """The process's next line ("" when it died), or None when none came within ``seconds``."""
        ready, _, _ = select.select([process.stdout], [], [], seconds)
        if not ready:
            return None
        return process.stdout.readline().strip()

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()
            for stream in (process.stdin, process.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
