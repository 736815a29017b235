/* Appends, with copy-on-write, and mark_computed: growing a sequence and publishing its full
 * blocks. Part of _native.c. */

/* -- append ----------------------------------------------------------------------------------- */


/* Hash blocks that became full; record keys of unshared ones. */
static int extend_chain(Native *n, PyObject *tokens, PyObject *table, PyObject *chain) {
    Py_ssize_t full = PyList_GET_SIZE(tokens) / n->bs;
    int32_t tk[4096]; /* a block's tokens (block_size <= 4096: N_init) */
    while (PyList_GET_SIZE(chain) < full) {
        Py_ssize_t j = PyList_GET_SIZE(chain);
        uint64_t prev = j ? PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(chain, j - 1)) : 0;
        if (PyErr_Occurred()) return ERROR;
        /* A sequence's tokens are int32 ints (both paths store them in the records). */
        if (tokens_of(tokens, j * n->bs, tk, n->bs)) {
            PyErr_SetString(PyExc_SystemError, "a sequence holds a token that is not an int32");
            return ERROR;
        }
        if (append_new(chain, PyLong_FromUnsignedLongLong(chain_next(n, prev, tk))))
            return ERROR;
        long b = PyLong_AsLong(PyList_GET_ITEM(table, j));
        if (b == -1 && PyErr_Occurred()) return ERROR;
        uint8_t *r = blk(n, b);
        if (r[BF_INDEXED] == 0 && I4(r + BF_REFCOUNT) == 1) {
            /* magic: a record something outside the allocator wrote is reported before it is
             * resealed over (at once, the record as
             * it was) */
            if ((n->probes & P_MAGIC) && U8(r + BF_CHECKSUM) != checksum(n, b)) {
                Seen s;
                seen_of(n, (int32_t)b, &s);
                PyObject *msg = PyUnicode_FromString(
                    "block record checksum mismatch when the allocator was about to change it: "
                    "its header was overwritten outside the allocator");
                int bad = msg == NULL || finding_report(n, FK_BLOCK_HEADER_CORRUPT, &s, msg);
                Py_XDECREF(msg);
                if (bad) return ERROR;
            }
            uint64_t key, parent;
            if (seq_keys(n, chain, j, &key, &parent)) return ERROR;
            /* Key and checksum in one 16-byte store (a kill leaves the record sealed either
             * way); the parent key is outside the checksum. */
            uint64_t w[2];
            uint64_t old = U8(r + BF_PREFIX_HASH);
            U8(r + BF_PREFIX_HASH) = key;
            w[0] = key;
            w[1] = checksum(n, b);
            U8(r + BF_PREFIX_HASH) = old;
#if defined(__SSE2__)
            _mm_storeu_si128((__m128i *)(r + BF_PREFIX_HASH), _mm_loadu_si128((__m128i *)w));
#else
            U8(r + BF_PREFIX_HASH) = w[0];
            U8(r + BF_CHECKSUM) = w[1];
#endif
            crash_point(n, CP_AFTER_PREFIX_KEY);
            U8(r + BF_PARENT_HASH) = parent;
        }
    }
    return OK;
}

/* The take of an append to the sequence in `slot`: k fresh blocks stamped for it (the local
 * cache, the ring, eviction, preemption of another), with the probes' checks of the blocks
 * taken (what they find is reported at the commit). OK, or UNHANDLED (the transaction
 * rolls back: nothing left is PoolExhausted, other reasons rolled_back's; an exception set
 * is raised). */
static int take_fresh(Native *n, int64_t k, int32_t *out, const char *request, int32_t site,
                      uint64_t now, int64_t slot) {
    if (take(n, k, out, slot, request) || poison_intact(n, out, k) || unmapped(n, out, k, request) ||
        stamp(n, out, k, request, site, now))
        return UNHANDLED;
    unpoison(n, out, k);
    return OK;
}

/* Table entry `pos` of `slot` replaced (copy-on-write). */
static int set_block(Native *n, int64_t slot, int64_t pos, int32_t b) {
    size_t off = n->off_seqs + (size_t)slot * n->seq_rec + SF_TABLE + 4 * (size_t)pos;
    if (jsave(n, off, 4)) return UNHANDLED;
    if (n->own_valid && own_follows(n, slot)) {
        own_note(n, I4(n->seg + off), -1);
        own_note(n, b, 1);
    }
    I4(n->seg + off) = b;
    return OK;
}

/* k tokens (at most CHUNK blocks' worth) appended to seq (in `slot`; its
 * lists tokens, table, chain): into the last block when it has room and is the sequence's
 * own (unjournaled: the decode step), else in a transaction that copies a shared last block
 * first (copy-on-write: its (src, dst) appended to `copies`) and takes new blocks. OK;
 * UNHANDLED, nothing changed (a transaction that could not begin); what the transaction's
 * rollback leaves (rolled_back: AGAIN, JOURNAL_SHORT); ERROR. */
static int append_chunk(Native *n, PyObject *pool, PyObject *seq, int64_t slot,
                        PyObject *lists[3], const int32_t *toks, int64_t k, PyObject *copies) {
    PyObject *tokens = lists[0], *table = lists[1], *chain = lists[2];
    int64_t bs = n->bs;
    Py_ssize_t n_old = PyList_GET_SIZE(tokens), nb = PyList_GET_SIZE(table);
    if (nb != (n_old + bs - 1) / bs) return seq_changed("block table");
    int64_t n_new = n_old + k, off = n_old % bs;
    int64_t need = (n_new + bs - 1) / bs - nb;
    int32_t last = -1;
    if (nb) {
        long b = PyLong_AsLong(PyList_GET_ITEM(table, nb - 1));
        if (b < 0 || b >= n->nb) return seq_changed("block table");
        last = (int32_t)b;
    }
    int cow = off != 0 && last >= 0 && I4(blk(n, last) + BF_REFCOUNT) > 1;
    /* (core_append's chunks are CHUNK blocks' worth at most) */
    if (need > CHUNK) return core_bug("an append chunk of more than CHUNK blocks");
    /* The blocks written, from the one holding position n_old: the last block (or its copy)
     * when it has room, then the new ones. */
    int32_t ids[CHUNK + 1];
    int32_t *fresh = ids + (off != 0);
    ids[0] = last;
    uint8_t *s = seqrec(n, slot);
    int txn = !(need <= 0 && !cow);
    if (!txn) {
        if (k == 1) { /* the decode step: one token, one count */
            uint8_t *r = blk(n, last);
            I4(r + BF_TOKENS + 4 * off) = toks[0];
            U4(r + BF_NUM_TOKENS) = (uint32_t)(off + 1);
        } else {
            fill(n, ids, off, toks, k);
        }
        U8(s + SF_NUM_TOKENS) = (uint64_t)n_new;
    } else {
        int32_t site = site_now(n);
        if (site == SITE_ERROR) return ERROR;
        uint64_t locks = take_locks(n, (need > 0 ? need : 0) + cow) | n->want_locks;
        /* an indexed block is changed under its shard's lock */
        if (cow && blk(n, last)[BF_INDEXED] == 1) locks |= block_shard_lock(n, last);
        if (txn_begin(n, locks)) return UNHANDLED;
        char request[REQUEST_BYTES];
        memcpy(request, s + SF_REQUEST, REQUEST_BYTES);
        uint64_t now = wall_ns();
        int64_t pre_cow = 0; /* sequences the copy's take preempted (events in take order) */
        int64_t found_cow = 0; /* findings of the copy's take (reported before its events) */
        findings_hold(n);
        if (cow) {
            int32_t dst;
            if (take_fresh(n, 1, &dst, request, site, now, slot)) goto abort;
            uint8_t *src_r = blk(n, last), *dst_r = blk(n, dst);
            memcpy(dst_r + BF_TOKENS, src_r + BF_TOKENS, 4 * (size_t)bs);
            U4(dst_r + BF_NUM_TOKENS) = U4(src_r + BF_NUM_TOKENS);
            /* The source's reference dropped: it stays shared (refcount > 1), unless taking dst
             * preempted its other holders: then it has no reference left, and is cached
             * (published) or freed */
            if (jsave_block(n, last)) goto abort;
            int freed = (I4(src_r + BF_REFCOUNT) -= 1) == 0;
            U8(src_r + BF_ACCESS_NS) = now;
            if (freed && src_r[BF_INDEXED] == 1) src_r[BF_STATE] = B_CACHED;
            seal(n, last);
            if (freed && src_r[BF_INDEXED] != 1) {
                /* given back as a release gives its blocks back (give_back_freed: a leased
                 * block quarantined; in guard mode checked, quarantined and poisoned at the
                 * commit, as this sequence's free would; its freer kept) */
                int32_t z = last;
                int64_t nz = 1;
                int guard = guard_release(n, slot);
                if (guard < 0 || give_back_freed(n, &z, &nz, guard, 0) != OK ||
                    (guard && poison_later(n, &z, nz)))
                    goto abort;
            }
            if (set_block(n, slot, nb - 1, dst)) goto abort;
            seal(n, dst);
            ids[0] = dst;
            pre_cow = n->n_pre;
            found_cow = n->n_pend;
        }
        if (need > 0) {
            if (take_fresh(n, need, fresh, request, site, now, slot) ||
                write_blocks(n, slot, nb, fresh, need))
                goto abort;
        } else if (jsave_head(n, slot)) {
            goto abort;
        }
        fill(n, ids, off, toks, k);
        U8(s + SF_NUM_TOKENS) = (uint64_t)n_new;
        if (commit_poison(n)) goto abort;
        txn_commit(n);
        int64_t seq_id = (int64_t)U8(s + SF_SEQ_ID);
        count(n, C_ALLOCS, (uint64_t)((need > 0 ? need : 0) + cow));
        int64_t pre = n->n_pre;
        /* (what a take found before a preemption comes before its events, the rest after
         * them; the copy's before its events) */
        int64_t waiting = n->n_pend;
        findings_before(n, found_cow, 0);
        found_cow -= waiting - n->n_pend;
        if (preempted(n, 0, pre_cow)) return ERROR;
        findings_first(n, found_cow);
        if (cow) {
            count(n, C_COW, 1);
            ev_record(n, E_ALLOCATE, ids, 1, request, seq_id);
            ev_record(n, E_COW, &last, 1, request, ids[0]);
        }
        findings_before(n, n->n_pend, pre_cow);
        if (preempted(n, pre_cow, pre)) return ERROR;
        findings_first(n, n->n_pend);
        if (need > 0) ev_record(n, E_ALLOCATE, fresh, need, request, seq_id);
        /* The Sequence: the table as the segment's, the copy to make. */
        if (cow) {
            PyObject *pair = Py_BuildValue("(ii)", (int)last, (int)ids[0]);
            if (PyList_SetItem(table, nb - 1, PyLong_FromLong(ids[0])) ||
                append_new(copies, pair))
                return ERROR;
        }
        for (int64_t i = 0; i < need; i++)
            if (append_new(table, PyLong_FromLong(fresh[i]))) return ERROR;
    }
    /* slot provenance: the written slots recorded (a copy's records copied): provenance.c */
    if (n->prov_every) prov_after_append(n, slot, ids, off, n_old, toks, k, cow ? last : -1);
    if (ints_extend(tokens, toks, k)) return ERROR;
    if (n_new / bs > PyList_GET_SIZE(chain) && extend_chain(n, tokens, table, chain))
        return ERROR;
    /* a chunk that ran a transaction is an opportunity for the append faults (faults.c) */
    if (txn && append_faults(n, pool, table)) return ERROR;
    return OK;
abort:
    txn_abort(n);
    return rolled_back(n);
}

static PyObject *core_append(Native *n, PyObject *pool, PyObject *seq, int64_t slot,
                             const int32_t *toks, int64_t k) {
    PyObject *lists[3] = {sfield(n, seq, F_TOKENS), sfield(n, seq, F_BLOCK_TABLE),
                          sfield(n, seq, F_CHAIN)};
    PyObject *copies = PyList_New(0), *result = NULL;
    if (!lists[0] || !lists[1] || !lists[2] || !copies) goto out;
    if (!PyList_CheckExact(lists[0]) || !PyList_CheckExact(lists[1]) ||
        !PyList_CheckExact(lists[2])) {
        seq_changed(!PyList_CheckExact(lists[0])   ? "tokens"
                    : !PyList_CheckExact(lists[1]) ? "block table"
                                                   : "chain");
        goto out;
    }
    int64_t step = k <= n->bs ? k : CHUNK * n->bs, done = 0;
    n->want_locks = 0;
    while (done < k) {
        int64_t part = k - done < step ? k - done : step;
        int rc = append_chunk(n, pool, seq, slot, lists, toks + done, part, copies);
        if (rc == AGAIN) continue;
        if (rc == JOURNAL_SHORT) {
            if (part > 1) {
                step = part / 2;
                continue;
            }
            rc = journal_full(n);
        }
        drop_mutex(n);
        if (rc == ERROR) goto out;
        if (rc == UNHANDLED) {
            result = unhandled(n);
            goto out;
        }
        done += part;
    }
    n->ops_done++;
    result = Py_NewRef(copies);
out:
    for (int i = 0; i < 3; i++) Py_XDECREF(lists[i]);
    Py_XDECREF(copies);
    return result;
}

/* -- mark_computed ---------------------------------------------------------------------------- */

/* One transaction of mark_computed: seq's full blocks [pub, upto) (at most
 * CHUNK) published, each under its key (`chain`'s: every key of a sequence lives in the shard
 * of its first: family_key) unless it is indexed already or shared (refcount > 1), or
 * its key is; seq's num_published set to upto. OK with *got published; else UNHANDLED (a
 * transaction that could not begin), what the rollback leaves (rolled_back), ERROR. */
static int publish_chunk(Native *n, PyObject *seq, PyObject *table, PyObject *chain,
                         Py_ssize_t pub, Py_ssize_t upto, int64_t slot, long *got) {
    uint64_t key0, unused;
    if (seq_keys(n, chain, pub, &key0, &unused)) return seq_changed("chain");
    if (txn_begin(n, shard_lock(n, key0) | n->want_locks)) return UNHANDLED;
    long published = 0;
    int32_t done[CHUNK]; /* (digest, events) the blocks published */
    int64_t kept = dev_batch_mark(n); /* (a batch's kept checks: this one's undone with it) */
    for (Py_ssize_t j = pub; j < upto; j++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(table, j));
        if (b < 0 || b >= n->nb) {
            seq_changed("block table");
            goto abort;
        }
        uint8_t *r = blk(n, b);
        if (r[BF_INDEXED] || I4(r + BF_REFCOUNT) != 1) continue;
        uint64_t key, parent;
        if (seq_keys(n, chain, j, &key, &parent)) {
            seq_changed("chain");
            goto abort;
        }
        int inserted;
        if (index_insert(n, key, (int32_t)b, &inserted)) goto abort;
        if (!inserted) continue;
        /* published */
        if (jsave_block(n, b)) goto abort;
        r[BF_INDEXED] = 1;
        U8(r + BF_PREFIX_HASH) = key;
        U8(r + BF_PARENT_HASH) = parent;
        seal(n, b);
        done[published++] = (int32_t)b;
    }
    if (stamp_digests(n, done, published)) goto abort;
    /* slot provenance on a CUDA pool: the recorded slots' K/V hashed on the GPU (provenance.c) */
    if (n->prov_every && published && prov_on_device(n) && prov_stamp_later(n, done, published))
        goto abort;
    txn_commit(n);
    if (n->prov_every && published) prov_published(n, done, published); /* provenance.c */
    /* (after what the commit reports: a record the magic probe found scribbled over) */
    if (published)
        ev_record(n, E_PUBLISH, done, published, (const char *)(seqrec(n, slot) + SF_REQUEST), 0);
    PyObject *u = PyLong_FromSsize_t(upto);
    if (u == NULL) return ERROR;
    sset(n, seq, F_PUBLISHED, u);
    Py_DECREF(u);
    *got = published;
    return OK;
abort:
    txn_abort(n);
    dev_batch_undo(n, kept);
    return rolled_back(n);
}

/* seq's full blocks of positions [0, num_tokens) published -> how many; NULL with an
 * exception set (what the transactions before it published stays published). A transaction
 * per CHUNK blocks (the journal's bound: half as many where it cannot hold them). */
static PyObject *core_publish(Native *n, PyObject *seq, Py_ssize_t upto_tokens, int64_t slot) {
    PyObject *tokens = sfield(n, seq, F_TOKENS);
    PyObject *table = sfield(n, seq, F_BLOCK_TABLE);
    PyObject *chain = sfield(n, seq, F_CHAIN);
    PyObject *pub_o = sfield(n, seq, F_PUBLISHED);
    PyObject *result = NULL;
    if (!tokens || !table || !chain || !pub_o) goto out;
    if (!PyList_CheckExact(tokens) || !PyList_CheckExact(table) || !PyList_CheckExact(chain)) {
        seq_changed(!PyList_CheckExact(tokens) ? "tokens"
                    : !PyList_CheckExact(table) ? "block table"
                                                : "chain");
        goto out;
    }
    Py_ssize_t pub = PyLong_AsSsize_t(pub_o);
    if (pub == -1 && PyErr_Occurred()) goto out;
    Py_ssize_t ntok = PyList_GET_SIZE(tokens);
    Py_ssize_t upto = (upto_tokens < ntok ? upto_tokens : ntok) / n->bs;
    if (upto <= pub) {
        result = PyLong_FromLong(0);
        goto out;
    }
    if (upto > PyList_GET_SIZE(chain) || upto > PyList_GET_SIZE(table) || pub < 0) {
        seq_changed(upto > PyList_GET_SIZE(table) ? "block table" : "chain");
        goto out;
    }
    long total = 0;
    Py_ssize_t step = CHUNK;
    int rc;
    n->want_locks = 0;
    while (pub < upto) {
        Py_ssize_t end = upto - pub > step ? pub + step : upto;
        long got = 0;
        rc = publish_chunk(n, seq, table, chain, pub, end, slot, &got);
        if (rc == AGAIN) continue;
        if (rc == JOURNAL_SHORT) {
            if (end - pub > 1) {
                step = (end - pub) / 2;
                continue;
            }
            rc = journal_full(n);
        }
        if (rc == UNHANDLED) result = unhandled(n);
        if (rc != OK) goto out;
        total += got;
        pub = end;
    }
    n->ops_done++;
    result = PyLong_FromLong(total);
out:
    drop_mutex(n);
    Py_XDECREF(tokens);
    Py_XDECREF(table);
    Py_XDECREF(chain);
    Py_XDECREF(pub_o);
    return result;
}
