/* Taking and returning blocks: the local cache, the free ring, stamps, the take. Part of
 * _native.c. */

/* -- blocks ----------------------------------------------------------------------------------- */

static inline uint32_t local_count(Native *n) { return U4(n->seg + n->c_local_count); }
static inline int32_t *local_arr(Native *n) { return (int32_t *)(n->seg + n->c_local); }

/* Up to k ids from the end of the local cache, in array order. */
static int local_pop(Native *n, int64_t k, int32_t *out, int64_t *got) {
    uint32_t c = local_count(n);
    if (k > c) k = c;
    *got = k;
    if (k == 0) return OK;
    if (jsave(n, n->c_local_count, 4)) return UNHANDLED;
    memcpy(out, local_arr(n) + (c - k), 4 * (size_t)k);
    U4(n->seg + n->c_local_count) = (uint32_t)(c - k);
    crash_point(n, CP_AFTER_LOCAL_POP);
    return OK;
}

/* ids at the ring's tail (journaled; records unchanged). Free lock held. */
static int ring_append(Native *n, const int32_t *ids, int64_t k) {
    if (k == 0) return OK;
    uint8_t *h = ringh(n);
    uint64_t tail = U8(h + RING_TAIL);
    if (jsave(n, n->off_ring, RING_IDS)) return UNHANDLED;
    uint64_t first = tail % (uint64_t)n->nb;
    uint64_t n1 = (uint64_t)k < (uint64_t)n->nb - first ? (uint64_t)k : (uint64_t)n->nb - first;
    if (jsave(n, n->off_ring + RING_IDS + 4 * first, (uint32_t)(4 * n1))) return UNHANDLED;
    if (n1 < (uint64_t)k && jsave(n, n->off_ring + RING_IDS, (uint32_t)(4 * ((uint64_t)k - n1))))
        return UNHANDLED;
    int32_t *ring = (int32_t *)(h + RING_IDS);
    for (int64_t i = 0; i < k; i++) ring[(tail + (uint64_t)i) % (uint64_t)n->nb] = ids[i];
    U8(h + RING_TAIL) = tail + (uint64_t)k;
    U4(h + RING_COUNT) += (uint32_t)k;
    return OK;
}

/* The pid that freed block record r (a free one): its owner while it is quarantined in the
 * ring (guard mode: `freed_at` is then the ring's count); else `freed_at`, which a release
 * outside guard mode, a refill out of the ring (before it makes the refilling process the
 * owner) and an eviction set, and an allocation clears (0: none of them since, the owner).
 * integrity.freed_by reads the same. */
static inline int32_t freed_by(const uint8_t *r) {
    if (r[BF_STATE] != B_QUARANTINED && U8(r + BF_FREED_AT) != 0)
        return (int32_t)(uint32_t)U8(r + BF_FREED_AT);
    return I4(r + BF_OWNER_PID);
}

/* A block freed in guard mode fewer than `quarantine` allocations ago. */
static inline int young(Native *n, int32_t b, uint64_t allocs) {
    uint8_t *r = blk(n, b);
    return r[BF_STATE] == B_QUARANTINED &&
           (int64_t)allocs - (int64_t)U8(r + BF_FREED_AT) < n->quarantine;
}

/* The quarantine: of the ids[0..k) just popped, send the young ones back to the
 * tail and take older free blocks from behind the head instead (at most one lap of the ring);
 * when only young ones are left, they are used anyway. The ring header is journaled. */
static int release_quarantine(Native *n, int32_t *ids, int64_t k) {
    uint8_t *h = ringh(n);
    uint64_t allocs = U8(h + RING_ALLOCS);
    int any = 0;
    for (int64_t i = 0; i < k && !any; i++) any = young(n, ids[i], allocs);
    if (!any) return OK;
    uint32_t rest = U4(h + RING_COUNT);
    /* keep and extra hold at most k each, back the young of both: k + rest */
    int32_t *keep = malloc(sizeof(int32_t) * (size_t)(3 * k + rest));
    if (keep == NULL) {
        PyErr_NoMemory();
        return ERROR;
    }
    int32_t *extra = keep + k, *back = extra + k;
    int64_t nk = 0, ne = 0, nb = 0;
    for (int64_t i = 0; i < k; i++) {
        if (young(n, ids[i], allocs)) back[nb++] = ids[i];
        else keep[nk++] = ids[i];
    }
    int32_t *ring = (int32_t *)(h + RING_IDS);
    for (uint32_t it = 0; it < rest && nk + ne < k; it++) {
        /* one popped from the head */
        uint64_t head = U8(h + RING_HEAD);
        int32_t b = ring[head % (uint64_t)n->nb];
        U8(h + RING_HEAD) = head + 1;
        U4(h + RING_COUNT) -= 1;
        if (young(n, b, allocs)) back[nb++] = b;
        else extra[ne++] = b;
    }
    int64_t g = 0;
    for (int64_t i = 0; i < nk; i++) ids[g++] = keep[i];
    for (int64_t i = 0; i < ne; i++) ids[g++] = extra[i];
    int64_t used = 0;
    while (g < k) ids[g++] = back[used++];
    int rc = ring_append(n, back + used, nb - used);
    free(keep);
    return rc;
}

/* Up to k ids from the head, with the quarantine rule of a pool that has a
 * quarantine count. Free lock held. */
static int ring_pop(Native *n, int64_t k, int32_t *out, int64_t *got) {
    uint8_t *h = ringh(n);
    uint32_t cnt = U4(h + RING_COUNT);
    if (k > cnt) k = cnt;
    uint64_t head = U8(h + RING_HEAD);
    int32_t *ring = (int32_t *)(h + RING_IDS);
    for (int64_t i = 0; i < k; i++) out[i] = ring[(head + (uint64_t)i) % (uint64_t)n->nb];
    if (jsave(n, n->off_ring, RING_IDS)) return UNHANDLED;
    U8(h + RING_HEAD) = head + (uint64_t)k;
    U4(h + RING_COUNT) = cnt - (uint32_t)k;
    int rc = n->quarantine > 0 && k > 0 ? release_quarantine(n, out, k) : OK;
    if (rc == OK && k > 0 && leases_any(n)) rc = leases_pass_over(n, out, &k); /* (leases.c) */
    if (rc != OK) return rc;
    U8(h + RING_ALLOCS) += (uint64_t)k;
    *got = k;
    crash_point(n, CP_AFTER_RING_POP);
    return OK;
}

/* The records reset (state FREE, or QUARANTINED in guard mode: then with the ring's
 * allocation count), then the ids at the ring's tail (ring_append). Free lock held. */
static int ring_push_state(Native *n, const int32_t *ids, int64_t k, uint8_t state) {
    if (k == 0) return OK;
    for (int64_t i = 0; i < k; i++)
        if (jsave_block(n, ids[i])) return UNHANDLED;
    uint8_t *h = ringh(n);
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        r[BF_STATE] = state;
        I4(r + BF_REFCOUNT) = 0;
        r[BF_INDEXED] = 0;
        I4(r + BF_OWNER_CLIENT) = -1;
        seal(n, ids[i]);
        if (state == B_QUARANTINED) U8(r + BF_FREED_AT) = U8(h + RING_ALLOCS);
    }
    crash_point(n, CP_AFTER_RELEASE_RECORDS);
    if (ring_append(n, ids, k)) return UNHANDLED;
    crash_point(n, CP_AFTER_RING_PUSH);
    return OK;
}

static inline int ring_push(Native *n, const int32_t *ids, int64_t k) {
    return ring_push_state(n, ids, k, B_FREE);
}

static int local_push(Native *n, const int32_t *ids, int64_t k, int64_t *fit_out) {
    uint32_t c = local_count(n);
    int64_t room = n->local_max - (int64_t)c;
    if (room < 0) room = 0;
    int64_t fit = k < room ? k : room;
    *fit_out = fit;
    if (fit == 0) return OK;
    for (int64_t i = 0; i < fit; i++)
        if (jsave_block(n, ids[i])) return UNHANDLED;
    for (int64_t i = 0; i < fit; i++) {
        uint8_t *r = blk(n, ids[i]);
        r[BF_STATE] = B_LOCAL;
        I4(r + BF_REFCOUNT) = 0;
        r[BF_INDEXED] = 0;
        seal(n, ids[i]);
    }
    if (jsave(n, n->c_local_count, 4)) return UNHANDLED;
    if (jsave(n, n->c_local + 4 * (size_t)c, (uint32_t)(4 * fit))) return UNHANDLED;
    memcpy(local_arr(n) + c, ids, 4 * (size_t)fit);
    U4(n->seg + n->c_local_count) = c + (uint32_t)fit;
    return OK;
}

/* A batch of FREE blocks from the ring into the local cache, as many as the journal holds
 * beside the stamps of the `later` blocks the take gives out (each refilled
 * block's record is saved twice: its owner, then the local cache; a batch is only a batch). */
static int refill(Native *n, int64_t later) {
    int64_t want = n->local_cap - (int64_t)local_count(n);
    int64_t by_bytes = ((int64_t)JOURNAL_BYTES - (int64_t)n->jused - TXN_SLACK_BYTES -
                        later * n->rec) / (2 * n->rec + 4);
    int64_t by_entries =
        ((int64_t)JOURNAL_ENTRIES - (int64_t)n->jcount - TXN_SLACK_ENTRIES - later) / 2;
    if (want > by_bytes) want = by_bytes;
    if (want > by_entries) want = by_entries;
    if (want < 0) want = 0;
    int32_t ids[LOCAL_CACHE_MAX];
    int64_t got;
    if (ring_pop(n, want, ids, &got)) return UNHANDLED;
    for (int64_t i = 0; i < got; i++)
        if (jsave_block(n, ids[i])) return UNHANDLED;
    for (int64_t i = 0; i < got; i++) {
        uint8_t *r = blk(n, ids[i]);
        /* (a block out of quarantine, or one no release marked, keeps who freed it: freed_by) */
        if (r[BF_STATE] == B_QUARANTINED || U8(r + BF_FREED_AT) == 0)
            U8(r + BF_FREED_AT) = (uint64_t)(uint32_t)I4(r + BF_OWNER_PID);
        I4(r + BF_OWNER_PID) = n->pid;
        I4(r + BF_OWNER_CLIENT) = n->client;
        U8(r + BF_OWNER_START) = n->start;
    }
    int64_t fit;
    return local_push(n, ids, got, &fit);
}

static int take(Native *n, int64_t k, int32_t *out, int64_t exclude, const char *request) {
    int64_t got, more;
    n->evicting = 0; /* (what an earlier operation left, if anything, is not this one's) */
    n->jfull = 0;
    if (local_pop(n, k, out, &got)) return UNHANDLED;
    if (got == k) return OK;
    if (need_locks(n, lock_bit(n->lock_free))) return UNHANDLED;
    if (ring_pop(n, k - got, out + got, &more)) return UNHANDLED;
    got += more;
    if (got == k) return refill(n, k);
    int rc = evict_into(n, k - got, EVICT_BATCH, k - got, out + got, &more, k);
    if (rc != OK) return rc;
    got += more;
    while (got < k) {
        int found;
        if ((rc = preempt_one(n, exclude, k - got, &found)) != OK) return rc;
        if (!found) break;
        /* what it freed: into the local cache, the ring, or still cached (indexed) */
        if (local_pop(n, k - got, out + got, &more)) return UNHANDLED;
        got += more;
        if (got < k) {
            if (ring_pop(n, k - got, out + got, &more)) return UNHANDLED;
            got += more;
        }
        if (got < k) {
            if ((rc = evict_into(n, k - got, 0, k - got, out + got, &more, k)) != OK) return rc;
            got += more;
        }
    }
    if (got < k) {
        n->exhausted_need = k;
        memcpy(n->exhausted_request, request, REQUEST_BYTES);
        return UNHANDLED;
    }
    return OK;
}

static uint64_t take_locks(Native *n, int64_t k) {
    n->dry_valid = 0; /* a plan is for one operation only */
    int64_t local = local_count(n);
    if (local >= k) return 0;
    uint64_t locks = lock_bit(n->lock_free);
    int64_t short_ = k - local - (int64_t)U4(ringh(n) + RING_COUNT);
    if (short_ <= 0) return locks;
    /* Eviction: the shards of the blocks it will take, found now without the locks (the same
     * choice it makes under them when no other process changed the pool meanwhile); every
     * shard when the cache is short too (preemption releases indexed blocks of any shard). */
    int32_t cand[CHUNK + EVICT_BATCH];
    int64_t nc = 0;
    if (short_ <= CHUNK &&
        (!lru_take(n, short_, EVICT_BATCH, cand, &nc, 1) ||
         !lru_scan(n, short_, EVICT_BATCH, cand, &nc, 1)) &&
        nc >= short_) {
        for (int64_t i = 0; i < nc; i++) locks |= block_shard_lock(n, cand[i]);
        return locks;
    }
    for (int64_t s = 0; s < n->num_shards; s++) locks |= lock_bit(n->lock_shard0 + (int)s);
    return locks;
}

static int stamp(Native *n, const int32_t *ids, int64_t k, const char *request, int32_t site,
                 uint64_t now) {
    for (int64_t i = 0; i < k; i++)
        if (jsave_block(n, ids[i])) return UNHANDLED;
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        U4(r) = BLOCK_MAGIC;
        r[BF_STATE] = B_ALLOCATED;
        r[BF_INDEXED] = 0;
        I4(r + BF_REFCOUNT) = 1;
        U4(r + BF_GENERATION) += 1;
        I4(r + BF_OWNER_PID) = n->pid;
        I4(r + BF_OWNER_CLIENT) = n->client;
        U8(r + BF_PREFIX_HASH) = 0;
        U8(r + BF_OWNER_START) = n->start;
        memcpy(r + BF_REQUEST, request, REQUEST_BYTES);
        U8(r + BF_ALLOC_NS) = now;
        U8(r + BF_ACCESS_NS) = now;
        I4(r + BF_SITE) = site;
        U4(r + BF_NUM_TOKENS) = 0;
        U8(r + BF_PARENT_HASH) = 0;
        U8(r + BF_FREED_AT) = 0;
        seal(n, ids[i]);
    }
    if (k) crash_point(n, CP_AFTER_RECORDS);
    return OK;
}

static int drop_refs(Native *n, const int32_t *ids, int64_t k, uint64_t now, int32_t *zero,
                     int64_t *nz) {
    *nz = 0;
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        int32_t rcnt = I4(r + BF_REFCOUNT);
        if (r[BF_STATE] != B_ALLOCATED || rcnt <= 0) continue;
        if (jsave_block(n, ids[i])) return UNHANDLED;
        I4(r + BF_REFCOUNT) = rcnt - 1;
        U8(r + BF_ACCESS_NS) = now;
        if (rcnt == 1) {
            if (r[BF_INDEXED] == 1)
                r[BF_STATE] = B_CACHED;
            else
                zero[(*nz)++] = ids[i];
        }
        seal(n, ids[i]);
    }
    return OK;
}
