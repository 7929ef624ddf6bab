"""A prefix cache: the KV blocks of finished sequences, read by later prompts that begin with them.

When a request finishes, its row's blocks of the KV pool (prompt and every fed output token) pass to
the cache without a copy (engine/block_pool.py counts their holders), keyed by those token ids. A
later prompt whose first tokens equal an entry's (a session's next turn: the previous context plus
the inserted tokens; another sample of a GRPO task; requests that share a system prompt) prefills
only the rest, attending to the cached positions (SGLang's radix cache and vLLM's block hashing
reuse KV across requests the same way; here an entry is one whole sequence, found through the
chained hashes of its whole chunks of 8 ids, the match then extended id by id). Prompts admitted
together prefill in one batch, which computes the columns past every row's cached prefix
(``model_runner.cached_columns``: the longest rest); each row's first positions are read from its
entry, and the row is written into its own reservation like any other, so it decodes in place (vLLM
and SGLang read shared blocks from their attention kernels; ours would gather a shared prefix at
every step and layer, more than the one copy at admission).

A sequence that captured its routing (a mixture of experts) leaves it with its entry; a request
that captures routing matches only such entries, and its cached positions report that routing.

The cache lives inside the engine's KV budget (engine/kv_budget.py): its blocks count as held, least
recently used entries go first, and admission evicts entries before it makes a request wait (a block
also held by a running row stays until that row leaves). They also give way, oldest first, to a
group of rows that finds no run of free blocks at one pitch while it would without them
(``BlockPool.allocate_rows``): rollouts without a weight update between them leave their entries
among the freed rows, and once the pool's untouched tail runs out their rows would no longer be
attended in place. A weight update (or version change) and ``/flush_cache`` empty it: keys and
values from other weights are not these weights'; an update also counts the cache's ``epoch`` on, and a row
admitted before it is not stored when it ends. The deterministic engine (true-on-policy) keeps
none, so a prefill there is always the whole prompt's, bit for bit.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from .block_pool import BlockPool

MIN_MATCH = 8  # a shorter common prefix is not worth its own prefill
CHUNK = MIN_MATCH  # ids per hashed chunk of the lookup's index
CANDIDATES = 8  # entries sharing the deepest chunk compared id by id


@dataclass
class CacheStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0  # prompt positions taken from the cache
    prefilled_tokens: int = 0  # prompt positions computed (with or without a hit)
    stored: int = 0
    evicted: int = 0


@dataclass
class Entry:
    ids: np.ndarray  # int64 [n]: the token of every cached position
    blocks: list[int]  # the pool's blocks holding its positions (the last one partly)
    routing: np.ndarray | None = None  # [n, layers, top_k]: every cached position's experts, where captured
    chunks: list[int] = field(default_factory=list)  # chained hashes of its whole chunks (PrefixCache.index)


def chunk_hashes(ids: np.ndarray, chunks: int):
    """The chained hashes of ``ids``' first ``chunks`` whole chunks, lazily: the k-th names the first k chunks
    (vLLM's block hashes: equal hashes are equal prefixes, unless two collide, which a match checks)."""
    h = 0
    for k in range(chunks):
        h = hash((h, ids[k * CHUNK : (k + 1) * CHUNK].tobytes()))
        yield h


@dataclass
class PrefixCache:
    """Entries by token ids, least recently used first; ``tokens`` positions held in all.

    The lookup is indexed: ``index`` maps the chained hash of an entry's first k whole chunks of
    ``CHUNK`` ids to the entries that begin with them (``routed`` the same for entries that kept their
    routing), so a prompt's lookup costs its length, not the number of entries: 33 ms per prompt at
    16,000 entries when every entry was compared (docs/reliability.md, bench/prefix_cache_lookup.py)."""

    pool: BlockPool | None = None
    enabled: bool = True
    entries: OrderedDict = field(default_factory=OrderedDict)
    tokens: int = 0
    stats: CacheStats = field(default_factory=CacheStats)
    index: dict = field(default_factory=dict)  # chained chunk hash -> {entry key: None} (an ordered set)
    routed: dict = field(default_factory=dict)
    # the weights the entries' keys and values were computed with: ``new_weights`` counts on, and a row admitted
    # under other weights is never stored, whatever the order of an update and the row's end
    epoch: int = 0

    def match(self, prompt: list[int], routing: bool = False) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``prompt`` and that length, at most ``len(prompt) - 1``
        (the last prompt token is always computed: its logits sample the first new token); ``(None, 0)``
        below ``MIN_MATCH``. With ``routing`` (a request capturing its experts), only entries that kept
        their positions' routing.

        The deepest whole chunk the prompt shares with any entry is found by hash; the match is then
        extended id by id against the ``CANDIDATES`` entries stored last among those sharing it, so it
        may fall short of the longest by less than a chunk where more entries share that chunk."""
        if not self.enabled or not self.entries:
            return None, 0
        self.stats.lookups += 1
        query = np.asarray(prompt, np.int64)
        limit = len(query) - 1
        index = self.routed if routing else self.index
        sharing = None
        for h in chunk_hashes(query, limit // CHUNK):
            deeper = index.get(h)
            if deeper is None:
                break
            sharing = deeper
        if sharing is None:
            return None, 0
        best, best_n = None, 0
        for key in itertools.islice(reversed(sharing), CANDIDATES):
            entry = self.entries[key]
            m = min(len(entry.ids), limit)
            differ = np.flatnonzero(entry.ids[:m] != query[:m])  # a hash collision shows here as a short match
            n = int(differ[0]) if differ.size else m
            if n > best_n:
                best, best_n = key, n
        if best is None or best_n < MIN_MATCH:
            return None, 0
        self.entries.move_to_end(best)
        return self.entries[best], best_n

    def count(self, prompts: list[list[int]], reused: list[int]) -> None:
        """A prefill's figures: ``reused[i]`` first positions of request i read from the cache, the rest of
        each distinct prompt computed (identical prompts admitted together are prefilled once)."""
        self.stats.hits += sum(n > 0 for n in reused)
        self.stats.reused_tokens += sum(reused)
        self.stats.prefilled_tokens += sum(len(p) - n for p, n in dict(zip(map(tuple, prompts), reused)).items())

    def store(self, ids: list[int], blocks: list[int], routing: np.ndarray | None = None, epoch: int = 0) -> None:
        """Keep a finished sequence's blocks (one more holder each: the row lets its own hold go after),
        and its positions' routing where it captured them (kept with them: a later hit's cached
        positions report the experts that computed their keys and values). ``epoch``: the weights the
        row was admitted under; keys and values of other weights than the current ones are not kept."""
        if not self.enabled or len(ids) < MIN_MATCH or epoch != self.epoch:
            return
        key = tuple(ids)
        if key in self.entries:
            self.entries.move_to_end(key)
            entry = self.entries[key]
            if routing is not None and entry.routing is None:
                entry.routing = routing
                self._index(self.routed, key, entry.chunks)
            return
        self.pool.share(blocks)
        entry = Entry(np.asarray(ids, np.int64), list(blocks), routing)
        entry.chunks = list(chunk_hashes(entry.ids, len(ids) // CHUNK))
        self.entries[key] = entry
        self._index(self.index, key, entry.chunks)
        if routing is not None:
            self._index(self.routed, key, entry.chunks)
        self.tokens += len(ids)
        self.stats.stored += 1

    @staticmethod
    def _index(index: dict, key: tuple, chunks: list[int]) -> None:
        for h in chunks:
            index.setdefault(h, {})[key] = None

    @staticmethod
    def _unindex(index: dict, key: tuple, chunks: list[int]) -> None:
        for h in chunks:
            sharing = index.get(h)
            if sharing is not None:
                sharing.pop(key, None)
                if not sharing:
                    del index[h]

    def evict_oldest(self) -> None:
        """The least recently used entry out (its blocks go back to the pool unless a running row holds them)."""
        key, entry = self.entries.popitem(last=False)
        self._unindex(self.index, key, entry.chunks)
        if entry.routing is not None:
            self._unindex(self.routed, key, entry.chunks)
        self.pool.release(entry.blocks)
        self.tokens -= len(entry.ids)
        self.stats.evicted += 1

    def held(self, blocks: int) -> np.ndarray:
        """How many entries hold each of the pool's ``blocks`` blocks (``BlockPool.allocate_rows`` asks)."""
        ids = [b for entry in self.entries.values() for b in entry.blocks]
        return np.bincount(np.asarray(ids, np.int64), minlength=blocks)[:blocks]

    def give_way(self) -> bool:
        """The oldest entry out, where there is one (``BlockPool.allocate_rows``: for rows in place)."""
        if not self.entries:
            return False
        self.evict_oldest()
        return True

    def clear(self) -> None:
        while self.entries:
            self.evict_oldest()

    def new_weights(self) -> None:
        """Other weights from now on (an update, an adapter, a version's new name): every entry out, and rows
        admitted before are not stored when they finish."""
        self.clear()
        self.epoch += 1

    def to_json(self) -> dict:
        return {"enabled": self.enabled, "entries": len(self.entries), "tokens": self.tokens, **vars(self.stats)}
