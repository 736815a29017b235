/* LRU eviction of cached blocks: the segment's LRU list, the scan, unindexing.
 * Part of _native.c. */

/* -- eviction --------------------------------------------------------------------------------- */

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
    n->pend_forget = 0;
}

/* At commit, the free lock still held: a scan's later candidates become the list (entries
 * first, its count last: a crash in between leaves an empty list); otherwise the takes
 * advance it; an eviction that stopped short of its candidates empties it. Then the
 * counters. */
static void lru_commit(Native *n) {
    if (n->pend_scan_n < 0 && !n->pend_takes && !n->pend_scans) return; /* (no eviction) */
    uint8_t *h = lru_head(n);
    if (n->pend_forget) {
        __atomic_store_n((uint32_t *)(h + LRU_COUNT), 0, __ATOMIC_RELEASE);
    } else if (n->pend_scan_n >= 0) {
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
 * UNHANDLED when fewer than k are left (the caller scans). */
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
            if (r[BF_STATE] == B_CACHED && U8(r + BF_ACCESS_NS) == U8(e + LE_ACCESS_NS) &&
                !leased(n, (int32_t)b)) /* (a leased block is passed over: leases.c) */
                cand[got++] = (int32_t)b;
        }
        pos++;
    }
    if (got < k) {
        /* forget the exhausted candidates (at once: the free lock is held) */
        if (!dry && len) __atomic_store_n((uint32_t *)(h + LRU_COUNT), 0, __ATOMIC_RELEASE);
        return UNHANDLED;
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
    if (n->scan_buf == NULL && (n->scan_buf = PyMem_Malloc(sizeof(Aged) * (size_t)n->nb)) == NULL) {
        if (dry) return UNHANDLED; /* (a plan does without: every shard) */
        PyErr_NoMemory();
        return ERROR;
    }
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
            if (r[BF_STATE] == B_CACHED && !leased(n, (int32_t)b))
                a[m].ns = U8(r + BF_ACCESS_NS), a[m++].id = (int32_t)b;
        }
        if (m == 0) {
            /* nothing cached: a plan takes every shard; a take goes on to preemption */
            n->dry_valid = 0;
            *ncand = 0;
            return dry ? UNHANDLED : OK;
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
            PyErr_NoMemory();
            return ERROR;
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

/* Room in the open transaction's journal for `entries` more saves of `bytes` in all. */
static inline int jroom(Native *n, int64_t entries, int64_t bytes) {
    return (int64_t)n->jcount + entries <= (int64_t)JOURNAL_ENTRIES &&
           (int64_t)n->jused + bytes <= (int64_t)JOURNAL_BYTES;
}

/* The journal saves index_remove(key, block) will make (one per entry it shifts back, and
 * the hole it leaves), 0 when the block is not indexed under key: a dry run of it. */
static int64_t index_remove_saves(Native *n, uint64_t key, int32_t block) {
    int64_t base, w = n->index_w, i = probe_start(n, key, &base), s;
    for (s = 0; s < w; s++) {
        uint8_t *e = idx_entry(n, base + i);
        if (U8(e) == 0) return 0;
        if (U8(e) == key && I4(e + 8) == block) break;
        i = (i + 1) % w;
    }
    if (s == w) return 0;
    int64_t hole = i, j = (i + 1) % w, saves = 1;
    for (s = 0; s < w - 1; s++) {
        uint64_t kj = U8(idx_entry(n, base + j));
        if (kj == 0) break;
        int64_t home = (int64_t)((kj >> 16) % (uint64_t)w);
        if (((j - home) % w + w) % w >= ((j - hole) % w + w) % w) saves++, hole = j;
        j = (j + 1) % w;
    }
    return saves;
}

/* Journal room an eviction inside a take leaves for the rest of the operation besides the
 * stamp of the blocks taken: the sequence's head and table, the ring's header. */
#define TAKE_SLACK_ENTRIES 16
#define TAKE_SLACK_BYTES 8192

/* Every index shard's lock. */
static inline uint64_t every_shard(Native *n) {
    return ((1ull << n->num_shards) - 1) << n->lock_shard0;
}

/* A CACHED block the prefix index has no entry for, met by an eviction (something outside the
 * allocator wrote the segment: the allocator never leaves one): nothing can hit it, so it is
 * evicted all the same, and reported (as check() counts it: refcount_mismatch) when the
 * operation commits. OK, or ERROR. */
static int unindexed_cached(Native *n, int32_t b) {
    Seen s;
    seen_of(n, b, &s);
    return finding_later(n, FK_REFCOUNT_MISMATCH, &s,
                         PyUnicode_FromString("CACHED block is marked indexed but the prefix "
                                              "index has no entry for it: evicted without one"));
}

/* Eviction: up to k (+ extra) least recently used CACHED blocks unindexed,
 * the first `mine` of them (at most k) into out (*got of them: fewer when fewer are cached),
 * the others to the free ring. The free lock and the candidates' shard locks held (when the
 * pool changed since the plan chose them, UNHANDLED: the operation runs again under every
 * shard, need_locks). Journal-bounded: a block is evicted only while the journal has room for
 * it, for the return to the ring of the blocks before it that go there, and for the `later`
 * block records (and TAKE_SLACK) the operation writes after it. The blocks for the ring stop
 * where the room ends; one of the first `mine` that does not fit leaves UNHANDLED with `jfull`
 * set: the operation rolls back and evicts them ahead (rolled_back). */
static int evict_into(Native *n, int64_t k, int64_t extra, int64_t mine, int32_t *out,
                      int64_t *got, int64_t later) {
    *got = 0;
    if (need_locks(n, lock_bit(n->lock_free))) return UNHANDLED;
    if (k > CHUNK) {
        /* more than one transaction's candidates: all of them ahead */
        n->evicting += mine;
        n->jfull = 1;
        n->jfull_entries = n->jcount;
        n->jfull_bytes = n->jused;
        return UNHANDLED;
    }
    int32_t cand[CHUNK + EVICT_BATCH];
    int64_t nc = 0;
    if (lru_take(n, k, extra, cand, &nc, 0)) {
        int rc = lru_scan(n, k, extra, cand, &nc, 0);
        if (rc != OK) return rc;
    }
    if (nc == 0) return OK;
    if (mine > nc) mine = nc;
    n->evicting += mine;
    /* Only the candidates' shards are locked (`take_locks` found them before the locks: another
     * process may have changed the pool since; then the operation runs again under every
     * shard: escalate). */
    for (int64_t i = 0; i < nc; i++)
        if (!(n->held & block_shard_lock(n, cand[i])))
            return need_locks(n, every_shard(n) | lock_bit(n->lock_free));
    int64_t done = 0;
    for (; done < nc; done++) {
        int32_t b = cand[done];
        uint64_t key = U8(blk(n, b) + BF_PREFIX_HASH);
        int64_t saves = index_remove_saves(n, key, b);
        int64_t ring = done + 1 > mine ? done + 1 - mine : 0;
        int64_t entries = 1 + saves + (ring ? ring + 3 : 0) + later + TAKE_SLACK_ENTRIES;
        int64_t bytes = n->rec + saves * INDEX_ENTRY +
                        (ring ? ring * (n->rec + 4) + RING_IDS : 0) + later * n->rec +
                        TAKE_SLACK_BYTES;
        if (!jroom(n, entries, bytes)) {
            if (done < mine) {
                n->jfull = 1;
                n->jfull_entries = n->jcount + (uint32_t)entries;
                n->jfull_bytes = n->jused + (uint32_t)bytes;
                return UNHANDLED;
            }
            n->pend_forget = 1; /* the rest stay cached, older than the list's next entries */
            break;
        }
        if (saves == 0 && unindexed_cached(n, b)) return ERROR;
        if (jsave_block(n, b)) return UNHANDLED;
        int removed = 1;
        if (saves && index_remove(n, key, b, &removed)) return UNHANDLED;
        /* (index_remove_saves found it there, under the same locks) */
        if (!removed) return core_bug("an indexed block left the index under its shard lock");
    }
    if (done == 0) return OK;
    /* digest: what is evicted is as published (its record still says so) */
    int rc = digests_intact(n, cand, done, "its eviction");
    if (rc != OK) return rc;
    /* guard mode: what is evicted holds the poison from the commit on (evicted_poison_later),
     * as a freed block does, so that a slot its next holder never writes (a copy-on-write copy
     * not made, a store that went elsewhere) is not another request's K/V but the poison its
     * finish check finds (kv_never_written); those for the ring are marked poisoned, as a
     * freed block is, their evicting process kept as the one that freed them (freed_by) */
    int guard = guard_poisons(n);
    if (guard && evicted_poison_later(n, cand, done)) return ERROR;
    for (int64_t i = 0; i < done; i++) {
        uint8_t *r = blk(n, cand[i]);
        r[BF_INDEXED] = 0;
        I4(r + BF_REFCOUNT) = 0;
        r[BF_STATE] = B_LOCAL; /* in flight to the caller: stamped or pushed to the ring */
        I4(r + BF_OWNER_CLIENT) = n->client;
        if (i >= mine) U8(r + BF_FREED_AT) = (uint64_t)(uint32_t)n->pid;
        if (guard && i >= mine) r[BF_POISONED] = 1;
    }
    crash_point(n, CP_AFTER_EVICT);
    if (mine) memcpy(out, cand, 4 * (size_t)mine);
    if (ring_push(n, cand + mine, done - mine)) return UNHANDLED;
    n->pend_evicted += done;
    *got = mine;
    return OK;
}

/* KVPool.evict's work: up to `num` least recently used CACHED blocks to the free ring, in
 * transactions of at most CHUNK blocks, each evicting as many as its journal holds and
 * committing (*done: how many in all). Each takes the free lock and the shards of the blocks
 * a look without the locks chose, or every shard when that look is out of date under them
 * (and waits for the op mutex, holding no pool lock, where a K/V check needs it and another
 * thread has it). OK (fewer when fewer are cached), UNHANDLED when a transaction could not run
 * (a record that fails its checks) with *done evicted before it, ERROR with an exception set. */
static int evict_to_ring(Native *n, int64_t num, int64_t *done) {
    *done = 0;
    int every = 0;
    uint64_t want = n->want_locks; /* (the operation's, which these transactions leave as is) */
    while (*done < num) {
        int64_t want_n = num - *done < CHUNK ? num - *done : CHUNK;
        uint64_t locks = lock_bit(n->lock_free);
        int32_t cand[CHUNK + EVICT_BATCH];
        int64_t nc = 0;
        n->dry_valid = 0;
        if (!every &&
            (!lru_take(n, want_n, 0, cand, &nc, 1) || !lru_scan(n, want_n, 0, cand, &nc, 1))) {
            if (nc == 0) return OK; /* nothing cached */
            for (int64_t i = 0; i < nc; i++) locks |= block_shard_lock(n, cand[i]);
        } else {
            locks |= every_shard(n);
        }
        int began = txn_begin(n, locks);
        if (began != OK) return began;
        n->evicting = 0;
        n->jfull = n->escalate = n->need_mutex = 0;
        int64_t got;
        int rc = evict_into(n, want_n, 0, 0, NULL, &got, 0);
        if (rc == OK) rc = commit_poison(n);
        if (rc != OK) {
            txn_abort(n);
            int mutex = n->need_mutex;
            n->want_locks = want;
            n->evicting = 0;
            n->jfull = n->escalate = n->need_mutex = 0;
            if (rc == ERROR || PyErr_Occurred()) return ERROR;
            if (mutex) {
                if (mutex_wait(n)) return ERROR;
                continue;
            }
            /* Under the free lock and every shard's, only a K/V check's mutex stops it (its
             * journal room is checked before each block). */
            if (every) return core_bug("an eviction under every shard lock stopped");
            every = 1; /* the pool changed since the look: again under every shard */
            continue;
        }
        int64_t evicted = n->pend_evicted;
        txn_commit(n);
        if (evicted == 0) return OK;
        *done += evicted;
        every = 0;
    }
    return OK;
}

/* -- after a rollback ---------------------------------------------------------------------- */

static int rolled_back(Native *n) {
    int64_t ahead = n->ahead, evict = n->jfull ? n->evicting : 0;
    int jfull = n->jfull, escalate = n->escalate, mutex = n->need_mutex;
    n->ahead = n->evicting = 0;
    n->jfull = n->escalate = n->need_mutex = 0;
    if (PyErr_Occurred()) return ERROR;
    if (ahead) {
        n->ahead = ahead;
        int rc = preempt_ahead(n);
        return rc == OK ? AGAIN : rc;
    }
    if (mutex) return mutex_wait(n) == OK ? AGAIN : ERROR;
    if (escalate) return AGAIN;
    if (evict > 0) {
        int64_t done;
        int rc = evict_to_ring(n, evict, &done);
        if (rc != OK) return rc;
        return done > 0 ? AGAIN : JOURNAL_SHORT;
    }
    if (jfull) return JOURNAL_SHORT;
    /* Every step that stops a transaction without an exception records why (above). */
    return core_bug("an operation rolled back with no reason recorded");
}

/* What the gate (entry.c) sets up for a call, without its refusals, for the work only the
 * core does (evict, the slot reserve): this call's probes, lockdep's edges known, the magic
 * probe's periodic check. OK, or ERROR. */
static int ungated(Native *n, PyObject *pool) {
    n->probes = (int)*n->probe_bits;
    n->op_ns = mono_coarse_ns();
    if (!(n->probes & P_LOCKDEP)) n->lockdep_was_on = 0;
    else if (!n->lockdep_was_on) {
        memset(n->known_into, 0, sizeof n->known_into);
        n->lockdep_was_on = 1;
    }
    n->pool = pool;
    return (n->probes & P_MAGIC) && verify_often(n) ? ERROR : OK;
}

/* evict(pool, num_blocks) -> int: KVPool.evict, the only implementation (called with the
 * handle's op mutex held: another thread's operation on the handle is waited for first). How
 * many were evicted: its transactions wait for their locks and recover dead holders
 * (txn_begin); one that cannot run (a record that fails its checks, reported by the probes
 * that check it) ends it with those evicted before. */
static PyObject *N_evict(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "evict(pool, num_blocks)");
        return NULL;
    }
    int64_t num = PyLong_AsLongLong(args[1]);
    if (num == -1 && PyErr_Occurred()) return NULL;
    int mine;
    if (py_caller_unusable(n) || wait_others(n, &mine, NULL)) return NULL;
    if (mine) {
        PyErr_SetString(PoolErrorType ? PoolErrorType : PyExc_RuntimeError,
                        "evict was called from inside another operation of the same pool "
                        "handle (Python that operation called)");
        return NULL;
    }
    if (py_caller_unusable(n) || ungated(n, args[0])) return NULL; /* (closed meanwhile) */
    int64_t done = 0;
    int rc = num > 0 ? evict_to_ring(n, num, &done) : OK;
    drop_mutex(n);
    if (rc == ERROR) return NULL;
    n->ops_done++;
    return PyLong_FromLongLong(done);
}
