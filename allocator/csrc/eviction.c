/* LRU eviction of cached blocks (eviction.py): the segment's LRU list, the scan, unindexing.
 * Part of _native.c. */

/* -- eviction (eviction.py) -------------------------------------------------------------------- */

/* The LRU list (docs/FORMAT.md, "LRU list"): one per pool, in the segment, shared by every
 * process. Written only under the free lock (which every eviction holds); read without it by
 * a plan (take_locks), which only guesses: every entry is checked against its block record
 * when taken, so a stale or torn one is passed over. */
static inline uint8_t *lru_head(Native *n) { return n->seg + n->off_lru; }
static inline uint8_t *lru_entry(Native *n, int64_t i) {
    return n->seg + n->off_lru + LRU_ENTRIES + i * LRU_ENTRY;
}

static void lru_drop_pending(Native *n) {
    PyMem_Free(n->pend_scan_ids);
    PyMem_Free(n->pend_scan_ns);
    n->pend_scan_ids = NULL;
    n->pend_scan_ns = NULL;
    n->pend_scan_n = -1;
    n->pend_take_pos = n->pend_taken = n->pend_takes = n->pend_scans = 0;
}

/* At commit, the free lock still held: a scan's later candidates become the list (entries
 * first, its count last: a crash in between leaves an empty list); otherwise the takes
 * advance it. Then the counters. */
static void lru_commit(Native *n) {
    if (n->pend_scan_n < 0 && !n->pend_takes && !n->pend_scans) return; /* (no eviction) */
    uint8_t *h = lru_head(n);
    if (n->pend_scan_n >= 0) {
        __atomic_store_n((uint32_t *)(h + LRU_COUNT), 0, __ATOMIC_RELEASE);
        for (int64_t j = 0; j < n->pend_scan_n; j++) {
            uint8_t *e = lru_entry(n, j);
            I4(e + LE_BLOCK) = n->pend_scan_ids[j];
            U8(e + LE_ACCESS_NS) = n->pend_scan_ns[j];
        }
        U4(h + LRU_POS) = 0;
        U8(h + LRU_CACHED) = (uint64_t)n->pend_scan_cached;
        __atomic_store_n((uint32_t *)(h + LRU_COUNT), (uint32_t)n->pend_scan_n, __ATOMIC_RELEASE);
    } else if (n->pend_takes) {
        if ((int64_t)U4(h + LRU_POS) < n->pend_take_pos)
            U4(h + LRU_POS) = (uint32_t)n->pend_take_pos;
        uint64_t c = U8(h + LRU_CACHED);
        U8(h + LRU_CACHED) = c > (uint64_t)n->pend_taken ? c - (uint64_t)n->pend_taken : 0;
    }
    U8(h + LRU_SCANS) += (uint64_t)n->pend_scans;
    U8(h + LRU_TAKES) += (uint64_t)n->pend_takes;
    lru_drop_pending(n);
}

/* The next k (+ extra) listed candidates still CACHED and untouched since the scan;
 * FALLBACK when fewer than k are left (the caller scans). */
static int lru_take(Native *n, int64_t k, int64_t extra, int32_t *cand, int64_t *ncand,
                    int dry) {
    uint8_t *h = lru_head(n);
    int64_t len = __atomic_load_n((uint32_t *)(h + LRU_COUNT), __ATOMIC_ACQUIRE);
    int64_t pos = __atomic_load_n((uint32_t *)(h + LRU_POS), __ATOMIC_RELAXED);
    int64_t cached = (int64_t)__atomic_load_n((uint64_t *)(h + LRU_CACHED), __ATOMIC_RELAXED);
    if (len > LRU_KEEP) len = LRU_KEEP; /* (a damaged count: the list's own entries only) */
    if (!dry && n->pend_takes) {
        /* a second eviction of this transaction (after a preemption): on from the first */
        pos = pos > n->pend_take_pos ? pos : n->pend_take_pos;
        cached -= n->pend_taken;
    }
    int64_t spare = cached - k > 0 ? (cached - k) / 4 : 0;
    int64_t want = k + (extra < spare ? extra : spare), got = 0;
    while (pos < len && got < want) {
        uint8_t *e = lru_entry(n, pos);
        int64_t b = I4(e + LE_BLOCK);
        if (b >= 0 && b < n->nb) {
            uint8_t *r = blk(n, b);
            if (r[BF_STATE] == B_CACHED && U8(r + BF_ACCESS_NS) == U8(e + LE_ACCESS_NS))
                cand[got++] = (int32_t)b;
        }
        pos++;
    }
    if (got < k) {
        /* forget the exhausted candidates (at once: the free lock is held) */
        if (!dry && len) __atomic_store_n((uint32_t *)(h + LRU_COUNT), 0, __ATOMIC_RELEASE);
        return FALLBACK;
    }
    *ncand = got;
    if (!dry) {
        n->pend_take_pos = pos;
        n->pend_taken += got;
        n->pend_takes++;
    }
    return OK;
}

static inline int aged_lt(const Aged *a, const Aged *b) {
    return a->ns < b->ns || (a->ns == b->ns && a->id < b->id);
}

static int aged_cmp(const void *a, const void *b) {
    return aged_lt(a, b) ? -1 : aged_lt(b, a) ? 1 : 0;
}

/* Put the `keep` smallest of a[0..m) (by access time, then id) first (quickselect). */
static void select_oldest(Aged *a, int64_t m, int64_t keep) {
    int64_t lo = 0, hi = m - 1;
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    while (lo < hi) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        Aged pivot = a[lo + (int64_t)((seed >> 33) % (uint64_t)(hi - lo + 1))];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (aged_lt(&a[i], &pivot)) i++;
            while (aged_lt(&pivot, &a[j])) j--;
            if (i <= j) {
                Aged t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (keep - 1 <= j)
            hi = j;
        else if (keep - 1 >= i)
            lo = i;
        else
            return;
    }
}

/* True when the blocks a dry scan chose (scan_buf[0..dry_keep)) are still CACHED with the access
 * times it saw: nothing older can have appeared since (a block cached later is newer), so the
 * scan's choice stands. */
static int dry_still_oldest(Native *n) {
    for (int64_t j = 0; j < n->dry_keep; j++) {
        uint8_t *r = blk(n, n->scan_buf[j].id);
        if (r[BF_STATE] != B_CACHED || U8(r + BF_ACCESS_NS) != n->scan_buf[j].ns) return 0;
    }
    return 1;
}

/* The k (+ extra) least recently used CACHED blocks into cand, oldest first, from a scan of
 * the block records; a large cache also gives the LRU list the next LRU_KEEP oldest (at
 * commit): blocks cached after the scan are newer than all of them, so while they last they
 * are still the oldest, and eviction needs no scan.
 * A dry run (planning the locks, before they are taken) leaves its result for the real run of
 * the same operation, which keeps it when it still holds. */
static int lru_scan(Native *n, int64_t k, int64_t extra, int32_t *cand, int64_t *ncand,
                    int dry) {
    if (n->scan_buf == NULL && (n->scan_buf = PyMem_Malloc(sizeof(Aged) * (size_t)n->nb)) == NULL)
        return FALLBACK;
    Aged *a = n->scan_buf;
    int64_t m, keep, k_in = k;
    if (!dry && n->dry_valid && n->dry_k == k && n->dry_extra == extra &&
        dry_still_oldest(n)) {
        /* The scan that planned this operation's locks, still true under them. */
        m = n->dry_m;
        keep = n->dry_keep;
        k += n->dry_added;
    } else {
        /* One pass over the records (without the locks when dry: only a plan). */
        m = 0;
        for (int64_t b = 0; b < n->nb; b++) {
            uint8_t *r = blk(n, b);
            if (r[BF_STATE] == B_CACHED) a[m].ns = U8(r + BF_ACCESS_NS), a[m++].id = (int32_t)b;
        }
        if (m == 0) {
            /* nothing cached: a plan takes every shard; a take goes on to preemption */
            n->dry_valid = 0;
            *ncand = 0;
            return dry ? FALLBACK : OK;
        }
        int64_t spare = m - k > 0 ? (m - k) / 4 : 0;
        k += extra < spare ? extra : spare;
        keep = m > 2 * LRU_KEEP + k ? k + LRU_KEEP : k;
        if (keep > m) keep = m;
        if (m > keep) select_oldest(a, m, keep);
        qsort(a, (size_t)keep, sizeof(Aged), aged_cmp);
    }
    if (dry) {
        n->dry_valid = 1;
        n->dry_k = k_in, n->dry_extra = extra;
        n->dry_m = m, n->dry_keep = keep, n->dry_added = k - k_in;
    } else {
        n->dry_valid = 0;
    }
    int64_t take_n = k < keep ? k : keep;
    for (int64_t j = 0; j < take_n; j++) cand[j] = a[j].id;
    *ncand = take_n;
    if (!dry) n->pend_scans++;
    if (keep > k && !dry) {
        PyMem_Free(n->pend_scan_ids);
        PyMem_Free(n->pend_scan_ns);
        int64_t later = keep - k;
        n->pend_scan_ids = PyMem_Malloc(sizeof(int32_t) * (size_t)later);
        n->pend_scan_ns = PyMem_Malloc(sizeof(uint64_t) * (size_t)later);
        if (!n->pend_scan_ids || !n->pend_scan_ns) {
            lru_drop_pending(n);
            return FALLBACK;
        }
        for (int64_t j = 0; j < later; j++) {
            n->pend_scan_ids[j] = a[k + j].id;
            n->pend_scan_ns[j] = a[k + j].ns;
        }
        n->pend_scan_n = later;
        n->pend_scan_cached = m - k;
    }
    return OK;
}

/* reserve.take's eviction step: up to `k` blocks into out (*got of them: fewer when fewer are
 * cached) from the LRU cached ones; up to `extra` more go to the free ring (the free lock and
 * the candidates' shard locks held). */
static int evict_into(Native *n, int64_t k, int64_t extra, int32_t *out, int64_t *got) {
    *got = 0;
    if (!holds(n, n->lock_free)) return FALLBACK;
    int32_t cand[CHUNK + EVICT_BATCH];
    int64_t nc = 0;
    if (k > CHUNK) return FALLBACK;
    if (lru_take(n, k, extra, cand, &nc, 0) && lru_scan(n, k, extra, cand, &nc, 0))
        return FALLBACK;
    if (nc == 0) return OK;
    /* Only the candidates' shards are locked (`take_locks` found them before the locks:
     * another process may have changed the pool since; then the Python path, every shard). */
    for (int64_t i = 0; i < nc; i++)
        if (!(n->held & block_shard_lock(n, cand[i]))) return FALLBACK;
    /* BlockStore.evict */
    for (int64_t i = 0; i < nc; i++)
        if (jsave_block(n, cand[i])) return FALLBACK;
    /* digest: what is evicted is as published (writes.evicting) */
    int rc = digests_intact(n, cand, nc, "its eviction");
    if (rc != OK) return rc;
    for (int64_t i = 0; i < nc; i++) {
        uint8_t *r = blk(n, cand[i]);
        int removed;
        if (index_remove(n, U8(r + BF_PREFIX_HASH), cand[i], &removed) || !removed)
            return FALLBACK;
    }
    for (int64_t i = 0; i < nc; i++) {
        uint8_t *r = blk(n, cand[i]);
        r[BF_INDEXED] = 0;
        I4(r + BF_REFCOUNT) = 0;
        r[BF_STATE] = B_LOCAL; /* in flight to the caller: stamped or pushed to the ring */
        I4(r + BF_OWNER_CLIENT) = n->client;
    }
    crash_point(n, CP_AFTER_EVICT);
    int64_t mine = nc < k ? nc : k;
    memcpy(out, cand, 4 * (size_t)mine);
    if (ring_push(n, cand + mine, nc - mine)) return FALLBACK;
    n->pend_evicted += nc;
    *got = mine;
    return OK;
}
