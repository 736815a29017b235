/* allocate and free/abort: the core of a sequence's start and end. Part of _native.c. */

/* -- allocate --------------------------------------------------------------------------------- */

/* A prompt being allocated: its tokens, request (32 bytes) and site; `old` >= 0: a resume, whose
 * preempted sequence's slot is released in the same transaction; its blocks, full blocks and
 * most hits; the chain values and keys of its full blocks; room for its table. */
typedef struct {
    const int32_t *toks;
    Py_ssize_t ntok;
    const char *request;
    int32_t site;
    int64_t old, nblocks, nfull, max_hits;
    uint64_t *chain, *keys;
    int32_t *table;
} Prompt;

/* One transaction of an allocation: the claim, the longest verified prefix hit (of at most
 * `hit_cap` blocks), and at most `cap` new blocks (at least one where nothing hits); a resume's
 * old slot released (to this
 * process's reserve, or to the table under the seqs lock) when the
 * transaction holds every block. OK with *out = (slot, seq_id, table: list[int], chain:
 * list[int], hits) (NULL with an exception set where building it failed); else what the
 * rollback leaves (rolled_back: AGAIN, JOURNAL_SHORT, UNHANDLED, ERROR), *hits and *k the hits
 * and new blocks it held. */
static int allocate_txn(Native *n, const Prompt *p, int64_t hit_cap, int64_t cap,
                        int64_t *hits_out, int64_t *k_out, PyObject **out) {
    int64_t bs = n->bs, old = p->old;
    int32_t *table = p->table;
    *out = NULL;
    *hits_out = *k_out = 0;
    Claim claim;
    uint64_t locks = n->want_locks;
    claim_plan(n, &claim, &locks);
    /* where the old slot goes (reserve_keeps), once the claim has taken its slot from the
     * reserve */
    int old_to_table = 0;
    if (old >= 0) {
        old_to_table = !reserve_keeps(n, old, claim.direct ? 0 : 1);
        if (old_to_table) locks |= lock_bit(n->lock_seqs);
    }
    /* A prompt can only hit if its first block is indexed: a first look without the lock
     * spares the shard lock to prompts that cannot hit. (A key inserted meanwhile is a hit
     * missed, as if this allocation came first; a lookup never trusts a block without the
     * lock and the stored tokens.) */
    int may_hit = p->max_hits > 0 && index_lookup(n, p->keys[0]) >= 0;
    if (may_hit) locks |= shard_lock(n, p->keys[0]);
    locks |= take_locks(n, p->nblocks < cap ? p->nblocks : cap);
    if (txn_begin(n, locks)) return UNHANDLED;
    findings_hold(n);
    uint64_t now = wall_ns();
    if (claim_take(n, &claim)) goto abort;
    int64_t slot = claim.slot;
    uint64_t seq_id = claim.seq_id;
    /* (a resumed sequence keeps the site of the call that created it, its allocate or fork:
     * its blocks taken here are this call's) */
    int32_t made_at = old >= 0 ? (int32_t)U2(seqrec(n, old) + SF_SITE) - 1 : p->site;
    if (write_claim(n, slot, seq_id, p->request, now, made_at)) goto abort;
    /* The longest verified prefix hit. */
    int64_t hits = 0;
    uint64_t parent = 0;
    for (int64_t j = 0; may_hit && j < p->max_hits && j < hit_cap; j++) {
        int32_t b = index_lookup(n, p->keys[j]);
        if (b < 0 || b >= n->nb) break;
        uint8_t *r = blk(n, b);
        if (r[BF_INDEXED] != 1 || U8(r + BF_PREFIX_HASH) != p->keys[j] ||
            U8(r + BF_PARENT_HASH) != parent ||
            memcmp(r + BF_TOKENS, p->toks + j * bs, 4 * (size_t)bs) != 0)
            break;
        table[hits++] = b;
        parent = p->keys[j];
    }
    /* this transaction's blocks: the hits and at most `cap` new ones */
    int64_t room = cap > 0 ? cap : hits == 0;
    int64_t first = p->nblocks - hits > room ? hits + room : p->nblocks;
    int64_t k = first - hits;
    *hits_out = hits;
    *k_out = k;
    int move = old >= 0 && first == p->nblocks;
    if (move) {
        /* the resumed sequence's old slot released (after the claim: a direct claim takes the
         * lowest empty slot, which this must not be) */
        uint8_t *o = seqrec(n, old);
        if (old_to_table && need_locks(n, lock_bit(n->lock_seqs))) goto abort;
        if (jsave_head(n, old)) goto abort;
        if (old_to_table) o[SF_RESERVED] = 0;
        o[SF_STATE] = S_EMPTY;
        U4(o + SF_NUM_BLOCKS) = 0;
        crash_point(n, CP_AFTER_RELEASE);
    }
    for (int64_t j = 0; j < hits; j++)
        if (jsave_block(n, table[j])) goto abort;
    for (int64_t j = 0; j < hits; j++) {
        uint8_t *r = blk(n, table[j]);
        I4(r + BF_REFCOUNT) += 1;
        r[BF_STATE] = B_ALLOCATED;
        U8(r + BF_ACCESS_NS) = now;
        seal(n, table[j]);
    }
    if (hits) crash_point(n, CP_AFTER_HIT);
    /* digest: the hits are as published ("a prefix hit by request '...'": the request whose
     * hit saw the change; worded only where the digest probe looks) */
    if (hits && (n->probes & P_DIGEST)) {
        /* (put together, not snprintf'd: about 1,100 instructions a hit, callgrind) */
        static const char pre[] = "a prefix hit by request '";
        char seen[sizeof pre + REQUEST_BYTES + 1];
        size_t rl = strnlen(p->request, REQUEST_BYTES);
        memcpy(seen, pre, sizeof pre - 1);
        memcpy(seen + sizeof pre - 1, p->request, rl);
        seen[sizeof pre - 1 + rl] = '\'';
        seen[sizeof pre + rl] = 0;
        /* (a CUDA pool's with slot provenance: both of the hit's checks in one launch) */
        int hit_later = n->prov_every && prov_on_device(n);
        if (hit_later ? dev_hit_check(n, table, hits, seen, p->request)
                      : digests_intact_keep(n, table, hits, seen, 1))
            goto abort;
    }
    Py_ssize_t ntok_first = first * bs < p->ntok ? first * bs : p->ntok;
    int64_t nfull_first = p->nfull < first ? p->nfull : first;
    if (take(n, k, table + hits, -1, p->request) || poison_intact(n, table + hits, k) ||
        unmapped(n, table + hits, k, p->request))
        goto abort;
    if (stamp(n, table + hits, k, p->request, p->site, now)) goto abort;
    int skewed = faults_armed(n) && refcount_skew(n, table + hits, k);
    unpoison(n, table + hits, k);
    if (write_blocks(n, slot, 0, table, first)) goto abort;
    fill(n, table, hits * bs, p->toks + hits * bs, ntok_first - hits * bs);
    /* keys of the new full blocks (unindexed), then seal. */
    for (int64_t j = hits; j < first; j++) {
        uint8_t *r = blk(n, table[j]);
        if (j < nfull_first) {
            U8(r + BF_PREFIX_HASH) = p->keys[j];
            U8(r + BF_PARENT_HASH) = j ? p->keys[j - 1] : 0;
        }
        seal(n, table[j]);
    }
    U8(seqrec(n, slot) + SF_NUM_TOKENS) = (uint64_t)ntok_first;
    if (commit_poison(n)) goto abort;
    /* slot provenance on a CUDA pool: the hit's hashed slots checked on the GPU (provenance.c;
     * with the digest probe, in the digest check's launch above: dev_hit_check) */
    if (n->prov_every && hits && prov_on_device(n) && !(n->probes & P_DIGEST) &&
        prov_hits_later(n, table, hits, p->request))
        goto abort;
    txn_commit(n);
    /* (what was found before a preemption comes before its events, the rest after them) */
    findings_before(n, n->n_pend, 0);
    if (skewed) fault_fired(n, FT_REFCOUNT_SKEW);
    if (preempted(n, 0, n->n_pre)) return ERROR;
    findings_first(n, n->n_pend);
    if (n->prov_every) {
        /* slot provenance: the new slots recorded, the hit's checked (provenance.c) */
        if (prov_sampled(n, seq_id))
            prov_write(n, seq_id, p->request, table, hits * bs, hits * bs, p->toks + hits * bs,
                       ntok_first - hits * bs);
        if (hits && prov_check_hits(n, table, hits, p->toks, p->request)) return ERROR;
    }
    count(n, C_ALLOCS, (uint64_t)k);
    count(n, C_QUERIES, (uint64_t)(p->max_hits > 0 ? p->max_hits : 0));
    count(n, C_HITS, (uint64_t)hits);
    /* (arg 1: a resume's, so that a reader whose recorder lost the request's older events
     * knows it had a life before this allocation) */
    ev_record(n, E_PREFIX_HIT, table, hits, p->request, p->old >= 0);
    ev_record(n, E_ALLOCATE, table + hits, k, p->request, (int64_t)seq_id);
    if (hits < p->max_hits) ev_record(n, E_PREFIX_MISS, NULL, 0, p->request, p->max_hits - hits);
    if (claim_done(n, &claim)) return ERROR;
    if (move && !old_to_table) n->res[n->res_n++] = (int32_t)old;
    PyObject *tab = PyList_New(first), *ch = PyList_New(nfull_first);
    if (!tab || !ch) {
        Py_XDECREF(tab);
        Py_XDECREF(ch);
        return ERROR;
    }
    for (int64_t j = 0; j < first; j++) PyList_SET_ITEM(tab, j, PyLong_FromLong(table[j]));
    for (int64_t j = 0; j < nfull_first; j++)
        PyList_SET_ITEM(ch, j, PyLong_FromUnsignedLongLong(p->chain[j]));
    n->ops_done++;
    *out = Py_BuildValue("(LKNNL)", (long long)slot, (unsigned long long)seq_id, tab, ch,
                         (long long)hits);
    return *out ? OK : ERROR;
abort:
    txn_abort(n);
    return rolled_back(n);
}

/* A prompt's allocation (toks: its ntok tokens; request: 32 bytes) -> (slot, seq_id, table:
 * list[int], chain: list[int], hits); NULL with an exception set. `old` >= 0: a resume
 * (allocate_txn). Its first transaction holds its hits and at most CHUNK new blocks (the table
 * and chain say how far: the caller appends the rest, a transaction per CHUNK blocks' worth);
 * fewer where the journal cannot hold them: half as many new blocks, down to the hits alone,
 * then half as many hits (the prompt's later blocks are new ones then). Where the pool changed
 * since the plan, a preemption or an eviction outgrew the journal, or a K/V check waits for the
 * op mutex, the transaction runs again (rolled_back). */
static PyObject *core_allocate(Native *n, const int32_t *toks, Py_ssize_t ntok,
                               const char *request, int32_t site, int64_t old) {
    int64_t bs = n->bs;
    int64_t nblocks = (ntok + bs - 1) / bs;
    if (ntok == 0) {
        pool_error("allocate needs at least one token");
        return NULL;
    }
    if (nblocks > n->max_bps) {
        pool_error("a prompt of %zd tokens needs %lld blocks; PoolConfig.max_blocks_per_seq is %lld",
                   ntok, (long long)nblocks, (long long)n->max_bps);
        return NULL;
    }
    int64_t nfull = ntok / bs;
    /* the table, chain values and keys: on the stack up to CHUNK blocks */
    int32_t table_s[CHUNK];
    uint64_t chain_s[CHUNK + 1], keys_s[CHUNK + 1];
    Prompt p = {toks, ntok, request, site, old, nblocks, nfull, (ntok - 1) / bs,
                chain_s, keys_s, table_s};
    if (nblocks > CHUNK) {
        p.table = PyMem_Malloc(sizeof(int32_t) * (size_t)nblocks);
        p.chain = PyMem_Malloc(sizeof(uint64_t) * (size_t)(nfull + 1));
        p.keys = PyMem_Malloc(sizeof(uint64_t) * (size_t)(nfull + 1));
        if (!p.table || !p.chain || !p.keys) {
            PyMem_Free(p.table);
            PyMem_Free(p.chain);
            PyMem_Free(p.keys);
            return PyErr_NoMemory();
        }
    }
    /* Chain values and keys of the full blocks (prefix.c). */
    uint64_t mask = (uint64_t)(n->num_shards - 1);
    for (int64_t j = 0; j < nfull; j++) {
        p.chain[j] = chain_next(n, j ? p.chain[j - 1] : 0, toks + j * bs);
        p.keys[j] = fmix64(p.chain[j]);
    }
    if (mask)
        for (int64_t j = 0; j < nfull; j++) p.keys[j] = family_key(p.keys[j], p.keys[0], mask);
    PyObject *result = NULL;
    int64_t cap = CHUNK, hit_cap = p.max_hits;
    n->want_locks = 0;
    for (;;) {
        int64_t hits, k;
        int rc = allocate_txn(n, &p, hit_cap, cap, &hits, &k, &result);
        if (rc == OK || rc == ERROR) break;
        if (rc == AGAIN) continue;
        if (rc == UNHANDLED) {
            result = unhandled(n);
            break;
        }
        /* JOURNAL_SHORT: half as many new blocks (the rest are appended), down to the hits
         * alone (none where nothing hits: one block), then half as many hits */
        if (k > 1 || (k == 1 && hits > 0)) {
            cap = k / 2;
            continue;
        }
        if (hits > 1) {
            hit_cap = hits / 2;
            continue;
        }
        journal_full(n);
        break;
    }
    drop_mutex(n); /* (if waiting for a lock made the core take it) */
    if (p.table != table_s) {
        PyMem_Free(p.table);
        PyMem_Free(p.chain);
        PyMem_Free(p.keys);
    }
    return result;
}

/* -- free ------------------------------------------------------------------------------------- */

/* A release under the magic probe, inside its transaction: of ids[0, k),
 * a record failing its checksum (something outside the allocator wrote it) is left as it is,
 * and a block_header_corrupt finding (the record as it reads when reported); the others go to
 * kept (in order, *nk of them). Reported at the commit. OK, or ERROR with an exception set. */
static int unsealed_left(Native *n, const int32_t *ids, int64_t k, int32_t *kept, int64_t *nk) {
    int64_t got = 0;
    for (int64_t i = 0; i < k; i++) {
        if (!(n->probes & P_MAGIC) || U8(blk(n, ids[i]) + BF_CHECKSUM) == checksum(n, ids[i])) {
            kept[got++] = ids[i];
            continue;
        }
        Seen s;
        seen_of(n, ids[i], &s);
        PyObject *msg = PyUnicode_FromString(
            "block record checksum mismatch when its request released it: its header was "
            "overwritten outside the allocator");
        int64_t before = n->n_pend;
        if (finding_later(n, FK_BLOCK_HEADER_CORRUPT, &s, msg)) return ERROR;
        if (n->n_pend > before) n->pend[n->n_pend - 1].seen_later = 1;
    }
    *nk = got;
    return OK;
}

/* A release under a probe, inside its transaction, before the drop: a block of
 * ids[0, k) already free (not ALLOCATED with a reference: the drop leaves it as it is) is a
 * double_free finding about request `rid`, its record as it is now. Reported at the commit.
 * OK, or ERROR with an exception set. */
static int already_free(Native *n, const int32_t *ids, int64_t k, PyObject *rid) {
    if (!n->probes) return OK;
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        if (r[BF_STATE] == B_ALLOCATED && I4(r + BF_REFCOUNT) > 0) continue;
        Seen s;
        seen_of(n, ids[i], &s);
        if (finding_later(n, FK_DOUBLE_FREE, &s,
                          PyUnicode_FromFormat(
                              "block released by request %R but it was already free", rid)))
            return ERROR;
    }
    return OK;
}

/* The free-ring half of a release: the blocks it freed (zero, nz) to the local cache, the
 * overflow to the ring; in guard mode checked and quarantined (the
 * ring's tail; poisoned by the caller just before its commit). `fill_checks`: the caller
 * poisons them with release_poison, which on a pool whose K/V the core does not map checks
 * their canaries in the fill's launch (devchecks.c dev_release_later): not checked here then.
 * OK, UNHANDLED (the journal, or the free lock not held: need_locks), ERROR. */
static int give_back_freed(Native *n, int32_t *zero, int64_t *nzp, int guard, int fill_checks) {
    /* leased blocks quarantined, taken out of zero (leases.c) */
    if (leases_divert(n, zero, nzp)) return UNHANDLED;
    int64_t nz = *nzp;
    if (guard) {
        if (need_locks(n, lock_bit(n->lock_free))) return UNHANDLED;
        int rc = fill_checks && dev_release_later(n) ? OK : canaries_intact(n, zero, nz);
        return rc != OK ? rc : ring_push_quarantined(n, zero, nz);
    }
    int64_t fit;
    if (local_push(n, zero, nz, &fit)) return UNHANDLED;
    if (fit < nz &&
        (need_locks(n, lock_bit(n->lock_free)) || ring_push(n, zero + fit, nz - fit)))
        return UNHANDLED;
    /* (who freed them, kept through another process's refill: freed_by; the pushes saved the
     * records) */
    for (int64_t i = 0; i < nz; i++) U8(blk(n, zero[i]) + BF_FREED_AT) = (uint64_t)(uint32_t)n->pid;
    return OK;
}

/* A guarded release's freed blocks (zero, nz: give_back_freed's, with fill_checks) poisoned
 * just before its commit; on a pool whose K/V the core does not map, their canaries checked
 * in the same launch. OK, UNHANDLED, ERROR. */
static int release_poison(Native *n, const int32_t *zero, int64_t nz) {
    return dev_release_later(n) ? dev_release_check(n, zero, nz) : poison_blocks(n, zero, nz);
}

/* The most blocks one transaction of a release or a preemption drops (blocks_fit: each
 * block's record is saved for its reference, then for the cache or ring it joins). */
static inline int64_t release_step(Native *n) { return blocks_fit(n, 2, 8, 2); }

/* One transaction of a long release or preemption (final: the state it
 * ends in): the references of ids[keep, k) (at most release_step) dropped (a scribbled record
 * left, a block already free reported: unsealed_left, already_free), what they freed given
 * back, the sequence's table cut at keep. OK; else UNHANDLED (a transaction that could not
 * begin) or what the rollback leaves (rolled_back). */
static int release_tail(Native *n, const int32_t *ids, Py_ssize_t keep, Py_ssize_t k,
                        int64_t slot, long final, int guard, const char *when,
                        const char *request, PyObject *rid) {
    int32_t part[CHUNK];
    int64_t m = k - keep, nz = 0;
    int32_t zero[CHUNK];
    uint64_t locks = lock_bit(n->lock_free) | n->want_locks;
    for (int64_t i = 0; i < m; i++)
        if (blk(n, ids[keep + i])[BF_INDEXED] == 1) locks |= block_shard_lock(n, ids[keep + i]);
    if (txn_begin(n, locks)) return UNHANDLED;
    if (unsealed_left(n, ids + keep, k - keep, part, &m) || digests_intact(n, part, m, when) ||
        already_free(n, part, m, rid) || drop_refs(n, part, m, wall_ns(), zero, &nz) ||
        give_back_freed(n, zero, &nz, guard, 1) || write_blocks(n, slot, keep, NULL, 0) ||
        (guard && release_poison(n, zero, nz))) {
        txn_abort(n);
        return rolled_back(n);
    }
    txn_commit(n);
    count(n, C_FREES, (uint64_t)m);
    if (final == S_PREEMPTED) ev_record(n, E_PREEMPT, ids + keep, k - keep, request, 0);
    ev_record(n, final == 4 ? E_ABORT : E_FREE, part, m, request, final == 4 && n->abandoning);
    return OK;
}

/* A release's or preemption's table (seq's `list`, its ids) released from its tail until
 * `down_to` blocks are left, release_step blocks a transaction (release_tail), the Sequence's
 * table cut after each. OK, UNHANDLED (a transaction could not begin), ERROR. */
static int release_down_to(Native *n, PyObject *seq, PyObject *list, const int32_t *ids,
                           Py_ssize_t *k, Py_ssize_t down_to, int64_t slot, long final, int guard,
                           const char *when, const char *request, PyObject *rid) {
    int64_t step = release_step(n);
    while (*k > down_to) {
        Py_ssize_t keep = *k - down_to > step ? *k - step : down_to;
        int rc = release_tail(n, ids, keep, *k, slot, final, guard, when, request, rid);
        if (rc == AGAIN) continue;
        /* (sized by release_step to fit) */
        if (rc == JOURNAL_SHORT) return core_bug("a release sized to the journal outgrew it");
        if (rc != OK) return rc;
        PyObject *cut = PyList_GetSlice(list, 0, keep);
        if (cut == NULL) return ERROR;
        sset(n, seq, F_BLOCK_TABLE, cut);
        Py_DECREF(cut);
        *k = keep;
    }
    return OK;
}

/* A sequence's release (seq, table: its block ids; final: FINISHED or ABORTED; when: the
 * moment, in a published_block_modified finding's words; rid: its request id, in a
 * refcount_mismatch finding's) -> True, with the blocks it leaked in n->leak (leaked_blocks:
 * none without the leaks probe); NULL with an exception set. A
 * table of more than release_step blocks (CHUNK, or fewer where records are large: the
 * journal's bound) is released from its tail first (release_down_to), the Sequence's table cut
 * after each transaction. */
static PyObject *core_release(Native *n, PyObject *seq, PyObject *list, int64_t slot,
                              long final, int guard, const char *when, PyObject *rid) {
    int32_t ids_s[CHUNK], zero[CHUNK];
    int32_t *ids = ids_s;
    Py_ssize_t k, total = PyList_CheckExact(list) ? PyList_GET_SIZE(list) : 0;
    if (total > n->max_bps) {
        seq_changed("block table");
        return NULL;
    }
    if (total > CHUNK && (ids = PyMem_Malloc(sizeof(int32_t) * (size_t)total)) == NULL)
        return PyErr_NoMemory();
    PyObject *result = NULL, *twice_rec = NULL;
    /* Locks: the shards of indexed blocks; free when the private ones overflow the cache. */
    uint64_t locks;
    if (table_of(n, list, ids, total > CHUNK ? total : CHUNK, &k, &locks)) goto done;
    /* leaks: refcounts the handle's tables do not explain, reported before the release */
    if (n->probes && refcounts_match(n, ids, k, rid)) goto done;
    char request[REQUEST_BYTES];
    memcpy(request, seqrec(n, slot) + SF_REQUEST, REQUEST_BYTES);
    n->want_locks = 0;
    int rc = release_down_to(n, seq, list, ids, &k, release_step(n), slot, final, guard, when,
                             request, rid);
    if (rc != OK) {
        result = rc == UNHANDLED ? unhandled(n) : NULL;
        goto out;
    }
    if (k < total) { /* the shards of what is left */
        locks = 0;
        for (Py_ssize_t i = 0; i < k; i++)
            if (blk(n, ids[i])[BF_INDEXED] == 1) locks |= block_shard_lock(n, ids[i]);
    }
    /* The faults that strike when a request ends, on what a long table's tail left, decided
     * once: the blocks it drops are ids without the one `leak` keeps
     * (drop[0..nd)); `use-after-free` keeps the table live (stale); `double-free`'s
     * opportunity is the first transaction that frees a block (a rerun does not count it
     * again). */
    int64_t skip = -1;
    int stale = 0, twice_chance = -1;
    if (faults_armed(n)) end_faults(n, ids, k, &skip, &stale);
    int32_t drop[CHUNK], kept[CHUNK];
    /* The slot goes back to this process's reserve where it keeps it (reserve_keeps); else to
     * the table, under the seqs lock. */
    uint8_t *s = seqrec(n, slot);
    int to_table = !reserve_keeps(n, slot, 0);
    if (to_table && !stale) locks |= lock_bit(n->lock_seqs);
    int64_t private_ = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        private_ += r[BF_INDEXED] != 1 && I4(r + BF_REFCOUNT) <= 1;
    }
    /* Guard mode: freed blocks go to the ring (quarantine) */
    if (guard || (int64_t)local_count(n) + private_ > n->local_max)
        locks |= lock_bit(n->lock_free);
    if (faults_armed(n)) kill_fault(n, locks);
again:
    if (txn_begin(n, locks | n->want_locks)) {
        result = unhandled(n);
        goto out;
    }
    /* magic: a scribbled record is reported and left as it is */
    int64_t nd = 0, nkept = 0;
    if (unsealed_left(n, ids, k, kept, &nkept)) goto abort;
    for (int64_t i = 0; i < nkept; i++)
        if (skip < 0 || kept[i] != ids[skip]) drop[nd++] = kept[i];
    /* digest: the published blocks released are as published */
    if (digests_intact(n, drop, nd, when)) goto abort;
    if (already_free(n, drop, nd, rid)) goto abort;
    int64_t nz = 0;
    uint64_t now = wall_ns();
    if (drop_refs(n, drop, nd, now, zero, &nz)) goto abort;
    if (give_back_freed(n, zero, &nz, guard, 1)) goto abort;
    /* the leaks probe's blocks still held: read inside the transaction (once it commits, what
     * it freed is anyone's) */
    if (leaked_blocks(n, ids, k, slot) < 0) goto abort;
    if (!stale) {
        if (write_blocks(n, slot, 0, NULL, 0)) goto abort;
        s[SF_STATE] = (uint8_t)final;
        /* the slot released */
        if (to_table && need_locks(n, lock_bit(n->lock_seqs))) goto abort;
        if (jsave_head(n, slot)) goto abort;
        if (to_table) s[SF_RESERVED] = 0;
        s[SF_STATE] = S_EMPTY;
        U4(s + SF_NUM_BLOCKS) = 0;
        crash_point(n, CP_AFTER_RELEASE);
    }
    /* `double-free`: the last block this release freed, released
     * again in the same transaction (a block already free: the drop leaves it as it is) */
    int32_t twice = -1;
    if (nz && twice_chance < 0) twice_chance = fault_opportunity(n, FT_DOUBLE_FREE);
    if (nz && twice_chance == 1) {
        int32_t none;
        int64_t again;
        twice = zero[nz - 1];
        if (drop_refs(n, &twice, 1, now, &none, &again)) goto abort;
        Py_XSETREF(twice_rec, PyBytes_FromStringAndSize((const char *)blk(n, twice), n->rec));
        if (twice_rec == NULL) goto abort;
    }
    /* Poisoned only if the release commits, before its locks are let go. */
    if (guard && release_poison(n, zero, nz)) goto abort;
    txn_commit(n);
    count(n, C_FREES, (uint64_t)nkept);
    ev_record(n, final == 4 ? E_ABORT : E_FREE, drop, nd, request, final == 4 && n->abandoning);
    if (skip >= 0) fault_fired(n, FT_LEAK);
    if (stale) fault_fired(n, FT_USE_AFTER_FREE);
    if (twice >= 0) double_free_fired(n, twice, twice_rec, request);
    if (!to_table && !stale) n->res[n->res_n++] = (int32_t)slot;
    n->ops_done++;
    result = Py_NewRef(Py_True);
    goto out;
abort:
    txn_abort(n);
    rc = rolled_back(n);
    if (rc == AGAIN) goto again;
    /* (at most release_step blocks: sized to fit) */
    if (rc == JOURNAL_SHORT) core_bug("a release sized to the journal outgrew it");
    result = rc == UNHANDLED ? unhandled(n) : NULL;
out:
    Py_XDECREF(twice_rec);
    drop_mutex(n);
done:
    if (ids != ids_s) PyMem_Free(ids);
    return result;
}
