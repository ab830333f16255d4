"""Page bookkeeping of the engine (fo_jax.engine.pages): the pool's states and reference counts,
the prefix cache's chain hash, matching and eviction, a request's pages and table row; every
error message pinned; and a random schedule of arrivals, growth, shared prefixes, preemption,
cancel and eviction checked against a model of who maps which page."""

import hashlib
import re

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from fo_jax.engine.pages import (NO_PAGE, PagePool, PoolExhausted, PrefixCache, RequestPages,
                                 page_hash)


def _occupancy(pool):
    return pool.num_free, pool.num_held, pool.num_cached


# -- PagePool ----------------------------------------------------------------------------------


def test_allocate_hands_out_pages_in_order_with_refcount_one():
    pool = PagePool(4, 2)
    pages = pool.allocate(3)
    assert pages.dtype == np.int32
    np.testing.assert_array_equal(pages, [0, 1, 2])
    assert [pool.refcount(p) for p in range(4)] == [1, 1, 1, 0]
    assert _occupancy(pool) == (1, 3, 0)
    assert pool.allocate(0).shape == (0,)
    pool.check()


def test_refcounts_free_at_zero():
    pool = PagePool(3, 4)
    (page,) = pool.allocate(1)
    pool.incref([page, page])
    assert pool.refcount(page) == 3
    pool.decref([page])
    pool.decref([page])
    assert _occupancy(pool) == (2, 1, 0)
    pool.decref([page])
    assert _occupancy(pool) == (3, 0, 0)
    # A freed page is handed out again (last freed, first reused).
    np.testing.assert_array_equal(pool.allocate(1), [page])
    pool.check()


def test_pool_exhausted_names_the_figures_and_changes_nothing():
    pool = PagePool(4, 16)
    cache = PrefixCache(pool)
    request = RequestPages(pool, 4)
    request.grow(32)  # two pages
    cache.insert(np.arange(32), request.pages)
    request.release()  # both pages stay cached, unreferenced
    held = pool.allocate(1)
    assert _occupancy(pool) == (1, 1, 2)
    with pytest.raises(PoolExhausted, match=re.escape(
            "cannot allocate 4 pages: 1 free, 2 held by the prefix cache (evictable), 1 held by "
            "requests, of 4 pages of 16 tokens; wait for requests to finish, preempt one, or use "
            "a larger pool")):
        pool.allocate(4)
    assert _occupancy(pool) == (1, 1, 2)
    assert cache.num_pages == 2
    pool.check()
    cache.check()


def test_double_free_and_bad_ids_are_refused_before_any_change():
    pool = PagePool(3, 2)
    pages = pool.allocate(2)
    with pytest.raises(ValueError, match=re.escape(
            "decref of page 0 2 time(s) but its refcount is 1: a page released more often than "
            "it was allocated / incref'd (a double free)")):
        pool.decref([1, 0, 0])
    assert pool.refcount(1) == 1  # page 1 was not released either
    with pytest.raises(ValueError, match=re.escape("page id 3 is not an int in [0, 3)")):
        pool.decref([pages[0], 3])
    with pytest.raises(ValueError, match=re.escape("page id -1 is not an int in [0, 3)")):
        pool.refcount(-1)
    with pytest.raises(ValueError, match=re.escape(
            "incref of page 2, which is free (refcount 0, not cached): only held or cached "
            "pages can gain a reference; allocate it")):
        pool.incref([0, 2])
    assert pool.refcount(0) == 1
    pool.incref([0])
    with pytest.raises(ValueError, match=re.escape(
            "free of page 0 (passed 1 time(s)) with refcount 2: free releases pages held once "
            "by the caller alone; use decref for shared pages")):
        pool.free([1, 0])
    assert pool.refcount(1) == 1
    pool.free([1])
    assert _occupancy(pool) == (2, 1, 0)
    pool.check()


def test_pool_arguments_are_checked():
    with pytest.raises(ValueError, match=re.escape("num_pages must be an int >= 1, got 0")):
        PagePool(0, 4)
    with pytest.raises(ValueError, match=re.escape("page_size must be an int >= 1, got 2.0")):
        PagePool(4, 2.0)
    with pytest.raises(ValueError, match=re.escape("n must be an int >= 0, got -1")):
        PagePool(4, 2).allocate(-1)
    with pytest.raises(ValueError, match=re.escape(
            "mark_cached of page 0 with refcount 0: only a page a request holds (just "
            "prefilled) can enter the prefix cache")):
        PagePool(4, 2).mark_cached(0)


# -- PrefixCache -------------------------------------------------------------------------------


def test_page_hash_is_a_stable_chain():
    first = page_hash(b"", [1, 2])
    # blake2b-128 of int32 little-endian 1, 2: the same in every process (no salted hash).
    assert first.hex() == page_hash(b"", np.array([1, 2], np.int64)).hex()
    assert len(first) == 16
    assert page_hash(first, [3, 4]) != page_hash(b"", [3, 4])  # the chain: prefix matters
    assert first == hashlib.blake2b(np.array([1, 2], "<i4").tobytes(), digest_size=16).digest()


def test_match_returns_exactly_the_inserted_pages_of_a_prefix():
    pool = PagePool(8, 2)
    cache = PrefixCache(pool)
    prompt = [5, 6, 7, 8, 9]  # two full pages and a partial one
    request = RequestPages(pool, 4)
    request.grow(len(prompt))
    assert cache.insert(prompt, request.pages) == 2  # the partial page is never registered
    assert cache.num_pages == 2
    pages, num_tokens = cache.match([5, 6, 7, 8, 1, 2])
    np.testing.assert_array_equal(pages, request.pages[:2])
    assert num_tokens == 4
    assert [pool.refcount(p) for p in request.pages] == [2, 2, 1]
    # A different first page: nothing matches, even with the same second page.
    assert cache.match([0, 6, 7, 8])[1] == 0
    # Shorter than a page: nothing.
    assert cache.match([5])[1] == 0
    # Only the first page.
    pages1, n1 = cache.match([5, 6, 7])
    np.testing.assert_array_equal(pages1, request.pages[:1])
    assert n1 == 2
    pool.decref(pages)
    pool.decref(pages1)
    request.release()
    assert _occupancy(pool) == (6, 0, 2)  # the full pages stay cached, the partial one is free
    # Matched again after every holder left: cached pages become held again.
    pages, num_tokens = cache.match(prompt)
    assert num_tokens == 4 and _occupancy(pool) == (6, 2, 0)
    pool.check()
    cache.check()


def test_shared_prefix_then_private_pages():
    """A second request matches the first one's full pages and prefills the rest into fresh
    pages: it never writes into a shared page."""
    pool = PagePool(8, 4)
    cache = PrefixCache(pool)
    prompt_a = list(range(10))
    a = RequestPages(pool, 4)
    a.grow(len(prompt_a))
    cache.insert(prompt_a, a.pages)
    prompt_b = list(range(8)) + [42, 43, 44]
    # Match all but the last prompt token: the last one is prefilled (its logits start decoding).
    pages, num_tokens = cache.match(prompt_b[:-1])
    b = RequestPages(pool, 4, prefix_pages=pages, prefix_tokens=num_tokens)
    new = b.grow(len(prompt_b))
    assert num_tokens == 8 and len(new) == 1
    assert not set(new.tolist()) & set(a.pages.tolist())
    np.testing.assert_array_equal(b.table_row(), [a.pages[0], a.pages[1], new[0], NO_PAGE])
    assert cache.insert(prompt_b, b.pages) == 0  # its only full pages were already cached
    b.release()
    a.release()
    assert pool.num_held == 0 and pool.num_cached == 2
    pool.check()
    cache.check()


def test_whole_prompt_cached_leaves_the_last_page_to_prefill():
    pool = PagePool(8, 4)
    cache = PrefixCache(pool)
    prompt = list(range(8))
    a = RequestPages(pool, 4)
    a.grow(8)
    cache.insert(prompt, a.pages)
    pages, num_tokens = cache.match(prompt[:-1])
    assert num_tokens == 4  # page 1 ends at the last token: recomputed into a private page
    b = RequestPages(pool, 4, prefix_pages=pages, prefix_tokens=num_tokens)
    new = b.grow(8)
    assert new.tolist() != [a.pages[1]]
    # The same prefix prefilled twice: the cached page is kept, b's duplicate stays private.
    assert cache.insert(prompt, b.pages) == 0
    assert not pool.is_cached(int(new[0]))
    b.release()
    assert pool.num_free == 6  # b's duplicate page went straight back to the free list
    a.release()
    pool.check()
    cache.check()


def test_eviction_is_lru_leaves_first_and_drops_descendants():
    pool = PagePool(4, 1)
    cache = PrefixCache(pool)
    a = RequestPages(pool, 4)
    a.grow(3)  # pages 0, 1, 2 for tokens 7, 8, 9: a chain of three
    cache.insert([7, 8, 9], a.pages)
    a.release()  # last page first: 2 is the least recently released
    assert _occupancy(pool) == (1, 0, 3)
    pool.allocate(2)  # the free page 3, then evicts the leaf (page 2) only
    assert cache.num_pages == 2 and cache.num_evicted == 1
    np.testing.assert_array_equal(cache.match([7, 8, 9])[0], [0, 1])
    pool.decref([1, 0])
    pool.check()
    cache.check()


def test_least_recently_released_chain_is_evicted_first_and_hits_are_counted():
    pool = PagePool(4, 2)
    cache = PrefixCache(pool)
    a, b = RequestPages(pool, 2), RequestPages(pool, 2)
    a.grow(2)
    b.grow(2)
    cache.insert([1, 1], a.pages)
    cache.insert([2, 2], b.pages)
    b.release()
    a.release()  # b's page left first: it is evicted first
    pool.allocate(3)  # two free pages, then one eviction
    assert cache.match([2, 2])[1] == 0
    pages, num_tokens = cache.match([1, 1, 1])
    assert num_tokens == 2 and pages.tolist() == [0]  # a got page 0, b page 1
    # Lookups count whole pages of the tokens passed: 2 + 2 tokens, 2 found.
    assert (cache.num_lookup_tokens, cache.num_hit_tokens) == (4, 2)
    pool.check()
    cache.check()


def test_evicting_a_page_drops_its_held_descendants():
    """Two requests prefill the same prefix: b's copy of page 1 stays private, b's page 2 is
    cached under a's page 1. When a leaves, its page 1 is evictable while b still holds page 2:
    evicting it drops page 2 from the cache (unreachable), and page 2 is freed when b ends."""
    pool = PagePool(5, 2)
    cache = PrefixCache(pool)
    prompt = [1, 2, 3, 4]
    a = RequestPages(pool, 4)
    a.grow(4)  # pages 0, 1
    cache.insert(prompt, a.pages)
    pages, num_tokens = cache.match(prompt[:-1])  # page 0 only: the last token is prefilled
    b = RequestPages(pool, 4, prefix_pages=pages, prefix_tokens=num_tokens)
    b.grow(4)  # page 2: b's private copy of tokens 3, 4
    assert cache.insert(prompt, b.pages) == 0
    b.grow(6)  # page 3: tokens 5, 6
    assert cache.insert(prompt + [5, 6], b.pages) == 1  # page 3, under page 1's hash
    a.release()  # page 1 -> evictable; page 0 still held by b
    assert _occupancy(pool) == (1, 3, 1)
    cache.check()
    pool.allocate(2)  # the free page 4, then evicts page 1, which drops page 3 from the cache
    assert cache.num_pages == 1 and cache.num_evicted == 2
    assert not pool.is_cached(3) and pool.refcount(3) == 1
    pool.check()
    cache.check()
    b.release()  # page 3 is freed, not cached; page 2 (private) freed; page 0 cached
    assert _occupancy(pool) == (2, 2, 1)
    pool.check()
    cache.check()


def test_insert_errors_are_pinned():
    pool = PagePool(6, 2)
    cache = PrefixCache(pool)
    with pytest.raises(ValueError, match=re.escape(
            "this PagePool already has a PrefixCache: one cache per pool")):
        PrefixCache(pool)
    a = RequestPages(pool, 3)
    a.grow(4)
    with pytest.raises(ValueError, match=re.escape(
            "insert of 4 tokens (2 full pages of 2) with only 1 pages")):
        cache.insert([1, 2, 3, 4], a.pages[:1])
    with pytest.raises(ValueError, match=re.escape(
            "insert of page 5 (page 1 of the request), which has refcount 0: the caller must "
            "hold the pages it registers")):
        cache.insert([1, 2, 3, 4], [a.pages[0], 5])
    with pytest.raises(ValueError, match=re.escape(
            "insert with a page repeated among the 2 full pages: each page holds one block of "
            "tokens")):
        cache.insert([1, 2, 3, 4], [a.pages[0], a.pages[0]])
    cache.insert([1, 2, 3, 4], a.pages)
    with pytest.raises(ValueError, match=re.escape(
            f"page {a.pages[1]} is already cached for other tokens: page 0 of these tokens "
            "hashes differently (pages out of order?)")):
        cache.insert([1, 2, 3, 4], a.pages[::-1])
    with pytest.raises(ValueError, match=re.escape(
            "tokens must be a 1-D sequence of ints, got shape (1, 2) dtype int64")):
        cache.match(np.array([[1, 2]], np.int64))
    with pytest.raises(ValueError, match=re.escape("tokens must fit int32")):
        cache.match([2**31])
    assert cache.num_pages == 2
    pool.check()
    cache.check()


# -- RequestPages ------------------------------------------------------------------------------


def test_request_grows_a_page_every_z_tokens():
    pool = PagePool(8, 4)
    request = RequestPages(pool, 3)
    np.testing.assert_array_equal(request.table_row(), [-1, -1, -1])
    assert request.table_row().dtype == np.int32
    assert request.grow(1).tolist() == [0]
    assert request.grow(4).tolist() == []  # tokens 0..3: still one page
    assert request.pages_needed(5) == 1
    assert request.grow(5).tolist() == [1]
    assert request.grow(3).tolist() == []  # never shrinks
    assert request.num_tokens == 5
    np.testing.assert_array_equal(request.table_row(), [0, 1, -1])
    with pytest.raises(ValueError, match=re.escape(
            "13 tokens need 4 pages of 4 tokens but a page-table row has max_pages=3")):
        request.grow(13)
    assert request.num_pages == 2
    request.release()
    assert pool.num_free == 8
    np.testing.assert_array_equal(request.table_row(), [-1, -1, -1])
    with pytest.raises(ValueError, match=re.escape("release of a request already released")):
        request.release()
    with pytest.raises(ValueError, match=re.escape("grow of a released request")):
        request.grow(1)


def test_grow_failure_changes_nothing():
    pool = PagePool(2, 2)
    request = RequestPages(pool, 4)
    request.grow(2)
    with pytest.raises(PoolExhausted):
        request.grow(8)  # needs 3 more, 1 free
    assert request.num_pages == 1 and request.num_tokens == 2 and pool.num_free == 1


def test_request_prefix_arguments_are_checked():
    pool = PagePool(4, 2)
    with pytest.raises(ValueError, match=re.escape(
            "prefix_tokens=3 must be len(prefix_pages) * page_size = 1 * 2: a matched prefix "
            "is whole pages")):
        RequestPages(pool, 2, prefix_pages=[0], prefix_tokens=3)
    with pytest.raises(ValueError, match=re.escape(
            "3 prefix pages exceed max_pages=2")):
        RequestPages(pool, 2, prefix_pages=[0, 1, 2], prefix_tokens=6)
    with pytest.raises(ValueError, match=re.escape("max_pages must be an int >= 1, got 0")):
        RequestPages(pool, 0)


# -- A random schedule against a model -----------------------------------------------------------

PAGE = 2
NUM_PAGES = 10
MAX_PAGES = 5
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=PAGE * MAX_PAGES - 2)


class Schedule(RuleBasedStateMachine):
    """Requests arrive (matching cached prefixes), grow a token at a time, are preempted and
    resumed (pages kept), cancelled or finished (their full pages inserted), while allocations
    evict; after every step the pool's refcounts equal the number of live requests mapping each
    page, and a matched page holds exactly the matched tokens."""

    @initialize()
    def setup(self):
        self.pool = PagePool(NUM_PAGES, PAGE)
        self.cache = PrefixCache(self.pool)
        self.live = {}  # id -> [RequestPages, tokens, preempted]
        self.content = {}  # page -> the tokens from position 0 to the end of that page
        self.next_id = 0

    def _record(self, request, tokens):
        for i in range(len(tokens) // PAGE):
            self.content[int(request.pages[i])] = tuple(tokens[:(i + 1) * PAGE])

    @rule(prompt=TOKENS)
    def arrive(self, prompt):
        pages, num_tokens = self.cache.match(prompt[:-1])
        for i, page in enumerate(pages.tolist()):
            assert self.content[page] == tuple(prompt[:(i + 1) * PAGE])
        assert num_tokens == len(pages) * PAGE <= len(prompt) - 1
        request = RequestPages(self.pool, MAX_PAGES, prefix_pages=pages,
                               prefix_tokens=num_tokens)
        try:
            request.grow(len(prompt))
        except PoolExhausted:
            request.release()  # refused for now: the matched pages go back
            return
        self._record(request, prompt)
        self.cache.insert(prompt, request.pages)
        # What was just inserted matches at once (nothing evicts between).
        again, n = self.cache.match(prompt)
        assert n == len(prompt) // PAGE * PAGE
        for i, page in enumerate(again.tolist()):
            assert self.content[page] == tuple(prompt[:(i + 1) * PAGE])
        self.pool.decref(again)
        self.live[self.next_id] = [request, list(prompt), False]
        self.next_id += 1

    def _pick(self, data, running):
        ids = sorted(i for i, r in self.live.items() if r[2] != running)
        return data.draw(st.sampled_from(ids)) if ids else None

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 1))
    def decode(self, data, token):
        i = self._pick(data, running=True)
        if i is None:
            return
        request, tokens, _ = self.live[i]
        if len(tokens) + 1 > MAX_PAGES * PAGE:
            return
        try:
            request.grow(len(tokens) + 1)
        except PoolExhausted:
            self.live[i][2] = True  # preempted under pressure: seat freed, pages kept
            return
        tokens.append(token)
        self._record(request, tokens)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def preempt(self, data):
        i = self._pick(data, running=True)
        if i is not None:
            self.live[i][2] = True

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def resume(self, data):
        i = self._pick(data, running=False)
        if i is not None:
            request, tokens, _ = self.live[i]
            row = request.table_row()
            np.testing.assert_array_equal(row[:request.num_pages], request.pages)
            assert (row[request.num_pages:] == NO_PAGE).all()
            self.live[i][2] = False

    @precondition(lambda self: self.live)
    @rule(data=st.data(), finish=st.booleans())
    def end(self, data, finish):
        i = data.draw(st.sampled_from(sorted(self.live)))
        request, tokens, _ = self.live.pop(i)
        if finish:  # finished: its prompt + output is a reusable prefix; cancelled: not
            self.cache.insert(tokens, request.pages)
        request.release()

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check()
        self.cache.check()
        expected = np.zeros(NUM_PAGES, np.int64)
        for request, tokens, _ in self.live.values():
            assert request.num_pages == -(-len(tokens) // PAGE)
            np.add.at(expected, request.pages, 1)
        assert [self.pool.refcount(p) for p in range(NUM_PAGES)] == expected.tolist()

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for request, _, _ in self.live.values():
            request.release()
        self.pool.check()
        self.cache.check()
        assert self.pool.num_held == 0
        assert self.pool.num_free + self.pool.num_cached == NUM_PAGES
        assert self.pool.num_cached == self.cache.num_pages


Schedule.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestSchedule = Schedule.TestCase
