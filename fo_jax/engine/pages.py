"""Host-side page bookkeeping of the serving engine: a page pool with reference counts, a prefix
cache of full pages, and each request's page list and page-table row.

The offloaded state is held in shared pools of pages of Z tokens (the host KV pool and the
device indexer-key pool), both addressed by one int32 page table [B, P] per seat: token t of
the request in seat b lives at page `table[b, t // Z]`, offset `t % Z`; -1 means no page. This
module is pure Python / numpy: it decides which page ids a request maps; it never touches the
arrays (that is `fo_jax.offload`).

A page is in exactly one of three states:

    free      on the free list, refcount 0, not in the prefix cache
    held      refcount > 0 (mapped by one or more requests; may also be in the prefix cache)
    cached    refcount 0 but kept by the prefix cache; reusable by a later request with the
              same prefix, evicted (least recently released first) when an allocation needs room

so `num_free + num_held + num_cached == num_pages` at all times.

Costs: every call is O(pages it touches) (plus, for an allocation that evicts, the cached pages
it evicts and their dropped descendants); no call scans the pool (never O(num_pages)), except
the constructor and `check()`, the debug consistency check.

Not thread-safe: one scheduler thread owns a pool, its cache and its requests' pages.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

NO_PAGE = -1  # the page-table entry of a position without a page

_INT32_MIN = np.iinfo(np.int32).min
_INT32_MAX = np.iinfo(np.int32).max


class PoolExhausted(RuntimeError):
    """An allocation asked for more pages than are free plus evictable; nothing was changed."""


def _check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class PagePool:
    """`num_pages` pages of `page_size` (Z) tokens with reference counts.

    Page ids are int32 in [0, num_pages). A page allocated by `allocate` has refcount 1; a
    request that maps a page another request holds (a shared prefix) calls `incref`; every
    holder calls `decref` (or `free`) once when done. At refcount 0 a page goes back to the free
    list, or, if the prefix cache registered it, stays cached (reusable) until an allocation
    evicts it.

    Every method is O(pages passed or returned) (+ evictions), never O(num_pages).
    """

    def __init__(self, num_pages: int, page_size: int):
        self.num_pages = _check_positive_int("num_pages", num_pages)
        self.page_size = _check_positive_int("page_size", page_size)
        if self.num_pages > _INT32_MAX:
            raise ValueError(f"num_pages={num_pages} does not fit int32 page ids")
        # Allocation pops from the end: page 0 is handed out first.
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._is_free = np.ones(self.num_pages, dtype=bool)
        self._refcount = np.zeros(self.num_pages, dtype=np.int64)
        self._cached: set[int] = set()  # pages registered by the prefix cache (held or not)
        # Refcount-0 cached pages, least recently released first: the eviction order.
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._num_held = 0
        self._on_evict = None  # set by PrefixCache: drops a page (and its descendants) from it

    # -- occupancy ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Pages on the free list (refcount 0, not cached). O(1)."""
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Pages with refcount > 0. O(1)."""
        return self._num_held

    @property
    def num_cached(self) -> int:
        """Refcount-0 pages kept by the prefix cache (evictable). O(1)."""
        return len(self._lru)

    @property
    def num_available(self) -> int:
        """Pages an allocation can get now: free + evictable cached. O(1)."""
        return len(self._free) + len(self._lru)

    def refcount(self, page: int) -> int:
        """The reference count of `page`. O(1)."""
        return int(self._refcount[self._check_page(page)])

    def is_cached(self, page: int) -> bool:
        """Whether the prefix cache registered `page` (held or not). O(1)."""
        return self._check_page(page) in self._cached

    # -- allocation and reference counts -------------------------------------------------------

    def allocate(self, n: int) -> np.ndarray:
        """Takes `n` pages (refcount 1 each) and returns their ids, int32 [n].

        Free pages first; when too few are free, evicts refcount-0 cached pages, least recently
        released first (a evicted page's descendants in the prefix cache are dropped too).
        O(n + pages evicted).

        Raises:
          PoolExhausted: n > free + evictable cached pages; nothing is changed.
        """
        n = _check_positive_int("n", n, minimum=0)
        if n > self.num_available:
            raise PoolExhausted(
                f"cannot allocate {n} pages: {self.num_free} free, {self.num_cached} held by the "
                f"prefix cache (evictable), {self.num_held} held by requests, of "
                f"{self.num_pages} pages of {self.page_size} tokens; wait for requests to "
                "finish, preempt one, or use a larger pool")
        while len(self._free) < n:
            victim = next(iter(self._lru))
            self._on_evict(victim)  # unregisters it (and descendants): they land on _free
        pages = [self._free.pop() for _ in range(n)]
        idx = np.asarray(pages, dtype=np.int64)
        self._is_free[idx] = False
        self._refcount[idx] = 1
        self._num_held += n
        return np.asarray(pages, dtype=np.int32)

    def incref(self, pages: Iterable[int]) -> None:
        """One more reference to each of `pages` (a page may repeat). A refcount-0 cached page
        becomes held again (leaves the eviction order). O(len(pages)).

        Raises:
          ValueError: a page id is out of range, or a page is free (nothing maps it: allocate
            it instead); nothing is changed.
        """
        pages = [self._check_page(p) for p in pages]
        for page in pages:
            if self._is_free[page]:
                raise ValueError(f"incref of page {page}, which is free (refcount 0, not cached):"
                                 " only held or cached pages can gain a reference; allocate it")
        for page in pages:
            if self._refcount[page] == 0:
                del self._lru[page]
                self._num_held += 1
            self._refcount[page] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """One reference fewer to each of `pages`, in the order given. A page reaching 0 goes to
        the free list, or, if the prefix cache registered it, to the most recent end of the
        eviction order (so release a request's pages last page first: its deepest pages are
        then evicted before their ancestors). O(len(pages)).

        Raises:
          ValueError: a page id is out of range, or a page would go below refcount 0 (a double
            free); nothing is changed.
        """
        pages = [self._check_page(p) for p in pages]
        for page, count in collections.Counter(pages).items():
            if count > self._refcount[page]:
                raise ValueError(
                    f"decref of page {page} {count} time(s) but its refcount is "
                    f"{int(self._refcount[page])}: a page released more often than it was "
                    "allocated / incref'd (a double free)")
        for page in pages:
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._num_held -= 1
                if page in self._cached:
                    self._lru[page] = None
                else:
                    self._push_free(page)

    def free(self, pages: Iterable[int]) -> None:
        """Releases pages the caller holds alone (refcount exactly 1): `decref` that also checks
        nobody else maps them. O(len(pages)).

        Raises:
          ValueError: a page's refcount is not 1 (shared: use decref; or already free);
            nothing is changed.
        """
        pages = [self._check_page(p) for p in pages]
        for page, count in collections.Counter(pages).items():
            if count != 1 or self._refcount[page] != 1:
                raise ValueError(
                    f"free of page {page} (passed {count} time(s)) with refcount "
                    f"{int(self._refcount[page])}: free releases pages held once by the caller "
                    "alone; use decref for shared pages")
        self.decref(pages)

    # -- used by PrefixCache ---------------------------------------------------------------------

    def mark_cached(self, page: int) -> None:
        """Registers a held page as kept by the prefix cache. O(1)."""
        page = self._check_page(page)
        if self._refcount[page] == 0:
            raise ValueError(f"mark_cached of page {page} with refcount 0: only a page a request "
                             "holds (just prefilled) can enter the prefix cache")
        self._cached.add(page)

    def unmark_cached(self, page: int) -> None:
        """Drops a page from the prefix cache; if nobody holds it, it goes to the free list.
        O(1)."""
        page = self._check_page(page)
        self._cached.discard(page)
        if page in self._lru:
            del self._lru[page]
            self._push_free(page)

    # -- debug -----------------------------------------------------------------------------------

    def check(self) -> None:
        """Raises AssertionError unless the pool is consistent. O(num_pages): tests and debug
        only."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice on the free list"
        assert (self._refcount >= 0).all(), "a negative refcount"
        held = set(np.flatnonzero(self._refcount > 0).tolist())
        lru = set(self._lru)
        assert not free & held, f"pages both free and held: {sorted(free & held)}"
        assert not free & lru, f"pages both free and cached: {sorted(free & lru)}"
        assert not held & lru, f"pages both held and in the eviction order: {sorted(held & lru)}"
        assert lru <= self._cached, "an evictable page the cache does not hold"
        assert not free & self._cached, "a free page registered in the cache"
        assert len(free) + len(held) + len(lru) == self.num_pages, "a page in no state"
        assert self._num_held == len(held), "held count out of date"
        assert set(np.flatnonzero(self._is_free).tolist()) == free, "free flags out of date"

    def _check_page(self, page) -> int:
        if isinstance(page, bool) or not isinstance(page, (int, np.integer)) or not (
            0 <= page < self.num_pages
        ):
            raise ValueError(f"page id {page!r} is not an int in [0, {self.num_pages})")
        return int(page)

    def _push_free(self, page: int) -> None:
        self._free.append(page)
        self._is_free[page] = True


def _as_tokens(tokens) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"tokens must be a 1-D sequence of ints, got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    if arr.size and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX):
        raise ValueError("tokens must fit int32")
    return arr.astype(np.int32)


def page_hash(parent: bytes, page_tokens) -> bytes:
    """The chain hash of one full page: blake2b (16 bytes) of the previous page's hash (b"" for
    the first page) and the page's Z token ids as little-endian int32. Stable across processes
    (not Python's salted `hash`)."""
    data = np.asarray(page_tokens, dtype="<i4").tobytes()
    return hashlib.blake2b(parent + data, digest_size=16).digest()


class PrefixCache:
    """Full pages of earlier prompts, found again by a chain hash of their tokens.

    Page i of a token sequence (tokens [i * Z, (i + 1) * Z)) is identified by
    `page_hash(hash of page i - 1, its Z tokens)`, so a page matches only when the whole prefix
    up to and including it matches. Only full pages are ever registered or matched: the partial
    last page of a request stays private to it.

    Copy-on-write, without copies: a match always ends on a page boundary, and the tokens after
    the matched prefix are prefilled into fresh pages (`RequestPages.grow`), so a request never
    writes into a shared page (a full page is never written again). When the whole prompt is
    cached, match `prompt[:-1]` so that at least the last token is prefilled (its logits start
    decoding): then the last, possibly full, page is recomputed into a private page.

    Eviction: a refcount-0 cached page stays until an allocation needs room; the pool then evicts
    the least recently released one. Releasing a request's pages last page first puts a chain's
    deepest pages ahead of their ancestors; in any case evicting a page also drops its cached
    descendants (unreachable without it): a refcount-0 descendant goes to the free list, a held
    one stays with its holders and is freed when they release it. `on_drop`, when set, is called
    with the chain hash of every page dropped (what is kept beside a page, as the MTP rows of
    `fo_jax.engine.mtp_prefix`, goes with it).

    Costs: `match` and `insert` are O(len(tokens)) (hashing) + O(pages); eviction is O(pages
    dropped).
    """

    def __init__(self, pool: PagePool):
        if pool._on_evict is not None:
            raise ValueError("this PagePool already has a PrefixCache: one cache per pool")
        self.pool = pool
        self.page_size = pool.page_size
        self._page_of: dict[bytes, int] = {}  # chain hash -> page
        self._hash_of: dict[int, bytes] = {}  # page -> chain hash
        self._children: dict[bytes, set[bytes]] = {}  # chain hash -> hashes of next pages
        self._parent: dict[bytes, bytes] = {}  # chain hash -> previous page's hash (b"" at 0)
        self.num_evicted = 0  # pages dropped from the cache by evictions (with descendants)
        self.num_lookup_tokens = 0  # tokens passed to match, in full pages (the hit-rate base)
        self.num_hit_tokens = 0  # tokens match found cached
        # Called with the chain hash of every page the cache drops (an eviction and its
        # descendants): what is kept beside a page goes with it (`fo_jax.engine.mtp_prefix`).
        self.on_drop = None
        pool._on_evict = self._evict

    @property
    def num_pages(self) -> int:
        """Pages registered (held or not). O(1)."""
        return len(self._page_of)

    def hashes(self, tokens) -> list[bytes]:
        """The chain hash of each full page of `tokens` (what the cache keys page i by).
        O(len(tokens)) hashing."""
        return self._hashes(_as_tokens(tokens))

    def holds(self, chain_hash: bytes) -> bool:
        """Whether a page with this chain hash is cached (held or not). O(1)."""
        return chain_hash in self._page_of

    def _hashes(self, tokens: np.ndarray) -> list[bytes]:
        z = self.page_size
        hashes, parent = [], b""
        for i in range(len(tokens) // z):
            parent = page_hash(parent, tokens[i * z:(i + 1) * z])
            hashes.append(parent)
        return hashes

    def match(self, tokens, *, count: bool = True) -> tuple[np.ndarray, int]:
        """The longest cached prefix of full pages of `tokens`.

        Returns `(pages, num_tokens)`: the pages (int32 [n]) holding tokens [0, n * Z), each
        incref'd for the caller (who releases them with the rest of its pages), and
        `num_tokens = n * Z`. `count`: add the lookup to the hit-rate figures
        (`num_lookup_tokens`, `num_hit_tokens`); False for a lookup that serves no request (a
        caller finding what is cached before it inserts the rest). O(len(tokens)) hashing +
        O(n).
        """
        tokens = _as_tokens(tokens)
        z = self.page_size
        pages, parent = [], b""
        for i in range(len(tokens) // z):
            parent = page_hash(parent, tokens[i * z:(i + 1) * z])
            page = self._page_of.get(parent)
            if page is None:
                break
            pages.append(page)
        self.pool.incref(pages)
        if count:
            self.num_lookup_tokens += len(tokens) // z * z
            self.num_hit_tokens += len(pages) * z
        return np.asarray(pages, dtype=np.int32), len(pages) * z

    def insert(self, tokens, pages: Sequence[int]) -> int:
        """Registers the full pages of `tokens` after they are written (after a prefill).

        `pages[i]` holds tokens [i * Z, (i + 1) * Z); pages the caller got from `match` may be
        among them. Only the `len(tokens) // Z` full pages are registered; the caller must hold
        each of them (refcount > 0). A prefix already cached under another page (two requests
        prefilled it at once) keeps the cached page; the caller's duplicate stays private and is
        freed as usual. Returns how many pages were newly registered. O(len(tokens)) + O(pages).

        Raises:
          ValueError: fewer pages than full pages of tokens, a page not held by the caller, or a
            page already registered for other tokens; nothing is changed.
        """
        tokens = _as_tokens(tokens)
        num_full = len(tokens) // self.page_size
        pages = [self.pool._check_page(p) for p in pages]
        if len(pages) < num_full:
            raise ValueError(f"insert of {len(tokens)} tokens ({num_full} full pages of "
                             f"{self.page_size}) with only {len(pages)} pages")
        if len(set(pages[:num_full])) != num_full:
            raise ValueError(f"insert with a page repeated among the {num_full} full pages: "
                             "each page holds one block of tokens")
        hashes = self._hashes(tokens)
        plan = {}
        for i, h in enumerate(hashes):
            page = pages[i]
            if self.pool.refcount(page) == 0:
                raise ValueError(f"insert of page {page} (page {i} of the request), which has "
                                 "refcount 0: the caller must hold the pages it registers")
            known = self._hash_of.get(page)
            if known is not None and known != h:
                raise ValueError(f"page {page} is already cached for other tokens: page {i} of "
                                 "these tokens hashes differently (pages out of order?)")
            if h not in self._page_of:
                plan[i] = page
        parent = b""
        for i, h in enumerate(hashes):
            page = plan.get(i)
            if page is not None:
                self._page_of[h] = page
                self._hash_of[page] = h
                self._parent[h] = parent
                self._children.setdefault(parent, set()).add(h)
                self.pool.mark_cached(page)
            parent = h
        return len(plan)

    def _evict(self, page: int) -> None:
        """Drops `page` and its cached descendants (called by the pool for its LRU page)."""
        root = self._hash_of[page]
        parent = self._parent[root]
        siblings = self._children.get(parent)
        siblings.discard(root)
        if not siblings:
            del self._children[parent]
        stack = [root]
        while stack:
            h = stack.pop()
            stack.extend(self._children.pop(h, ()))
            dropped = self._page_of.pop(h)
            del self._hash_of[dropped]
            del self._parent[h]
            self.pool.unmark_cached(dropped)
            self.num_evicted += 1
            if self.on_drop is not None:
                self.on_drop(h)

    def check(self) -> None:
        """Raises AssertionError unless the cache and its pool agree. O(cached pages): tests
        and debug only."""
        assert set(self._hash_of) == self.pool._cached, "cache and pool disagree on cached pages"
        for h, page in self._page_of.items():
            assert self._hash_of[page] == h
            parent = self._parent[h]
            assert parent == b"" or parent in self._page_of, "a cached page without its parent"
            assert h in self._children[parent]


class RequestPages:
    """The pages one request maps, in token order, as the request grows.

    Page i holds the request's tokens [i * Z, (i + 1) * Z). `grow(n)` allocates pages so that n
    tokens fit (one more page every Z tokens); `table_row()` is the request's row of the page
    table (int32 [P], -1 padded) to write into its seat's row. Preemption keeps the pages: the
    scheduler frees the seat and keeps this object; on resume it writes `table_row()` into the
    new seat's row. `release()` (finish or cancel) drops every reference, last page first.

    Costs: `grow` O(new pages), `table_row` O(P), `release` O(pages held).
    """

    def __init__(self, pool: PagePool, max_pages: int, *, prefix_pages: Sequence[int] = (),
                 prefix_tokens: int = 0):
        """A request holding no pages, or the `prefix_pages` a `PrefixCache.match` returned
        (already incref'd for it) with their `prefix_tokens` tokens.

        Args:
          pool: the pool the pages come from.
          max_pages: P, the width of a page-table row (the most pages one seat maps).
          prefix_pages: matched pages; the request takes over their references.
          prefix_tokens: tokens in the matched pages: len(prefix_pages) * Z.
        """
        self.pool = pool
        self.max_pages = _check_positive_int("max_pages", max_pages)
        prefix_pages = [pool._check_page(p) for p in prefix_pages]
        if prefix_tokens != len(prefix_pages) * pool.page_size:
            raise ValueError(f"prefix_tokens={prefix_tokens} must be len(prefix_pages) * "
                             f"page_size = {len(prefix_pages)} * {pool.page_size}: a matched "
                             "prefix is whole pages")
        if len(prefix_pages) > self.max_pages:
            raise ValueError(f"{len(prefix_pages)} prefix pages exceed max_pages={max_pages}")
        self._pages = prefix_pages
        self.num_tokens = prefix_tokens
        self.released = False

    @property
    def pages(self) -> np.ndarray:
        """The mapped pages, int32 [len]. O(pages)."""
        return np.asarray(self._pages, dtype=np.int32)

    @property
    def num_pages(self) -> int:
        return len(self._pages)

    def pages_needed(self, num_tokens: int) -> int:
        """New pages `grow(num_tokens)` would allocate. O(1)."""
        return max(0, -(-num_tokens // self.pool.page_size) - len(self._pages))

    def grow(self, num_tokens: int) -> np.ndarray:
        """Makes room for `num_tokens` tokens in all (allocating ceil(num_tokens / Z) - pages
        held) and returns the new pages, int32 [new]. Never shrinks. O(new pages).

        Raises:
          PoolExhausted: the pool cannot give the pages (nothing changed: preempt or wait).
          ValueError: the request is released, or would need more than max_pages pages.
        """
        if self.released:
            raise ValueError("grow of a released request")
        num_tokens = _check_positive_int("num_tokens", num_tokens, minimum=0)
        need = self.pages_needed(num_tokens)
        if len(self._pages) + need > self.max_pages:
            raise ValueError(
                f"{num_tokens} tokens need {len(self._pages) + need} pages of "
                f"{self.pool.page_size} tokens but a page-table row has max_pages="
                f"{self.max_pages}")
        new = self.pool.allocate(need)
        self._pages.extend(new.tolist())
        self.num_tokens = max(self.num_tokens, num_tokens)
        return new

    def table_row(self) -> np.ndarray:
        """The page-table row: int32 [P], the pages in token order then -1. O(P)."""
        row = np.full(self.max_pages, NO_PAGE, dtype=np.int32)
        row[:len(self._pages)] = self._pages
        return row

    def release(self) -> None:
        """Drops the request's references, last page first (finish or cancel). O(pages).

        Raises:
          ValueError: already released.
        """
        if self.released:
            raise ValueError("release of a request already released")
        self.pool.decref(reversed(self._pages))
        self._pages = []
        self.released = True
