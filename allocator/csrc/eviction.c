/* LRU eviction of cached blocks (eviction.py): remembered candidates, the scan, unindexing.
 * Part of _native.c. */

/* -- eviction (eviction.py) -------------------------------------------------------------------- */

/* Set the store's remembered-candidate fields (eviction.py; NULL: leave that one). */
static void set_lru(Native *n, PyObject *ids, PyObject *ns, PyObject *pos, PyObject *cached) {
    PyObject *names[4] = {s_lru_ids, s_lru_ns, s_lru_pos, s_lru_cached};
    PyObject *values[4] = {ids, ns, pos, cached};
    for (int i = 0; i < 4; i++)
        if (values[i] && PyObject_SetAttr(n->store, names[i], values[i])) PyErr_Clear();
}

/* eviction._lru_take's `advance`, after commit: the consumed candidates are gone. */
static void lru_advance(Native *n) {
    PyObject *ids = field(n->store, s_lru_ids);
    PyObject *pos = field(n->store, s_lru_pos);
    PyObject *cached = field(n->store, s_lru_cached);
    if (ids && pos && cached && ids == n->pend_lru) {
        Py_ssize_t p = PyLong_AsSsize_t(pos);
        int64_t c = PyLong_AsLongLong(cached) - n->pend_taken;
        PyObject *np = PyLong_FromSsize_t(p > n->pend_pos ? p : n->pend_pos);
        PyObject *nc = PyLong_FromLongLong(c > 0 ? c : 0);
        if (np && nc) set_lru(n, NULL, NULL, np, nc);
        Py_XDECREF(np);
        Py_XDECREF(nc);
    }
    Py_XDECREF(ids);
    Py_XDECREF(pos);
    Py_XDECREF(cached);
    if (PyErr_Occurred()) PyErr_Clear();
}

/* eviction._lru_reset, after commit: a scan's later candidates become the remembered ones. */
static void lru_reset(Native *n) {
    int64_t m = n->pend_scan_n;
    PyObject *ids = PyList_New(m), *ns = PyList_New(m);
    PyObject *zero = PyLong_FromLong(0), *cached = PyLong_FromLongLong(n->pend_scan_cached);
    if (ids && ns && zero && cached) {
        for (int64_t i = 0; i < m; i++) {
            PyList_SET_ITEM(ids, i, PyLong_FromLong(n->pend_scan_ids[i]));
            PyList_SET_ITEM(ns, i, PyLong_FromUnsignedLongLong(n->pend_scan_ns[i]));
        }
        set_lru(n, ids, ns, zero, cached);
    }
    Py_XDECREF(ids);
    Py_XDECREF(ns);
    Py_XDECREF(zero);
    Py_XDECREF(cached);
    if (PyErr_Occurred()) PyErr_Clear();
}

static void drop_pending_scan(Native *n) {
    PyMem_Free(n->pend_scan_ids);
    PyMem_Free(n->pend_scan_ns);
    n->pend_scan_ids = NULL;
    n->pend_scan_ns = NULL;
    n->pend_scan_n = -1;
}

/* eviction._lru_take: the next k (+ extra) remembered candidates still CACHED and untouched
 * since the scan; FALLBACK when fewer than k are left (Python scans the pool). */
static int lru_take(Native *n, int64_t k, int64_t extra, int32_t *cand, int64_t *ncand,
                    int dry) {
    PyObject *ids = field(n->store, s_lru_ids), *stamps = field(n->store, s_lru_ns);
    PyObject *pos_o = field(n->store, s_lru_pos), *cached_o = field(n->store, s_lru_cached);
    int rc = FALLBACK;
    if (!ids || !stamps || !pos_o || !cached_o || !PyList_CheckExact(ids) ||
        !PyList_CheckExact(stamps) || PyList_GET_SIZE(stamps) != PyList_GET_SIZE(ids))
        goto out;
    Py_ssize_t pos = PyLong_AsSsize_t(pos_o);
    int64_t cached = PyLong_AsLongLong(cached_o);
    if (PyErr_Occurred()) goto out;
    int64_t spare = cached - k > 0 ? (cached - k) / 4 : 0;
    int64_t want = k + (extra < spare ? extra : spare), got = 0;
    Py_ssize_t len = PyList_GET_SIZE(ids);
    while (pos < len && got < want) {
        long b = PyLong_AsLong(PyList_GET_ITEM(ids, pos));
        uint64_t st = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(stamps, pos));
        if (PyErr_Occurred()) goto out;
        if (b >= 0 && b < n->nb) {
            uint8_t *r = blk(n, b);
            if (r[BF_STATE] == B_CACHED && U8(r + BF_ACCESS_NS) == st) cand[got++] = (int32_t)b;
        }
        pos++;
    }
    if (got < k && dry) goto out;
    if (got < k) {
        /* eviction._lru_take: forget the exhausted candidates (at once, not at commit). */
        PyObject *e1 = PyList_New(0), *e2 = PyList_New(0), *z = PyLong_FromLong(0);
        if (e1 && e2 && z) set_lru(n, e1, e2, z, NULL);
        Py_XDECREF(e1);
        Py_XDECREF(e2);
        Py_XDECREF(z);
        goto out;
    }
    *ncand = got;
    rc = OK;
    if (dry) goto out;
    if (n->pend_lru == ids) {
        /* a second eviction of this transaction (after a preemption): both advance */
        n->pend_pos = pos > n->pend_pos ? pos : n->pend_pos;
        n->pend_taken += got;
    } else {
        Py_XSETREF(n->pend_lru, Py_NewRef(ids));
        n->pend_pos = pos;
        n->pend_taken = got;
    }
out:
    if (PyErr_Occurred()) PyErr_Clear();
    Py_XDECREF(ids);
    Py_XDECREF(stamps);
    Py_XDECREF(pos_o);
    Py_XDECREF(cached_o);
    return rc;
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

/* eviction._lru_scan: the k (+ extra) least recently used CACHED blocks into cand, oldest
 * first; a large cache also remembers the next LRU_KEEP oldest (set at commit).
 * A dry run (planning the locks, before they are taken) leaves its result for the real run of
 * the same operation, which keeps it when it still holds. */
static int lru_scan(Native *n, int64_t k, int64_t extra, int32_t *cand, int64_t *ncand,
                    int dry) {
    PyObject *keep_o = PyObject_GetAttrString(n->evict_mod, "LRU_KEEP");
    int64_t lru_keep = keep_o ? PyLong_AsLongLong(keep_o) : -1;
    Py_XDECREF(keep_o);
    if (lru_keep < 0 || PyErr_Occurred()) {
        PyErr_Clear();
        return FALLBACK;
    }
    if (n->scan_buf == NULL && (n->scan_buf = PyMem_Malloc(sizeof(Aged) * (size_t)n->nb)) == NULL)
        return FALLBACK;
    Aged *a = n->scan_buf;
    int64_t m, keep, k_in = k;
    if (!dry && n->dry_valid && n->dry_k == k && n->dry_extra == extra && n->dry_lru_keep == lru_keep &&
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
        keep = m > 2 * lru_keep + k ? k + lru_keep : k;
        if (keep > m) keep = m;
        if (m > keep) select_oldest(a, m, keep);
        qsort(a, (size_t)keep, sizeof(Aged), aged_cmp);
    }
    if (dry) {
        n->dry_valid = 1;
        n->dry_k = k_in, n->dry_extra = extra, n->dry_lru_keep = lru_keep;
        n->dry_m = m, n->dry_keep = keep, n->dry_added = k - k_in;
    } else {
        n->dry_valid = 0;
    }
    int64_t take_n = k < keep ? k : keep;
    for (int64_t j = 0; j < take_n; j++) cand[j] = a[j].id;
    *ncand = take_n;
    if (keep > k && !dry) {
        drop_pending_scan(n);
        int64_t later = keep - k;
        n->pend_scan_ids = PyMem_Malloc(sizeof(int32_t) * (size_t)later);
        n->pend_scan_ns = PyMem_Malloc(sizeof(uint64_t) * (size_t)later);
        if (!n->pend_scan_ids || !n->pend_scan_ns) {
            drop_pending_scan(n);
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
    int64_t mine = nc < k ? nc : k;
    memcpy(out, cand, 4 * (size_t)mine);
    if (ring_push(n, cand + mine, nc - mine)) return FALLBACK;
    n->pend_evicted += nc;
    *got = mine;
    return OK;
}
