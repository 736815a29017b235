/* A one-token append (append.py) and mark_computed (publish.py): growing a sequence and
 * publishing its full blocks. Part of _native.c. */

/* -- append ----------------------------------------------------------------------------------- */


/* append._extend_chain: hash blocks that became full; record keys of unshared ones. */
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
            uint64_t key, parent;
            if (seq_keys(n, chain, j, &key, &parent)) return ERROR;
            /* Key and checksum in one 16-byte store (append.py _set_keys: a kill leaves the
             * record sealed either way); the parent key is outside the checksum. */
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
            U8(r + BF_PARENT_HASH) = parent;
        }
    }
    return OK;
}

/* One token appended to seq (in `slot`) -> [] (no copies), or None (the Python path:
 * copy-on-write, ...): into the last block when it has room, else into a new block (a
 * transaction). */
static PyObject *core_append1(Native *n, PyObject *pool, PyObject *seq, int64_t slot,
                              int32_t tok) {
    PyObject *tokens = sfield(n, seq, F_TOKENS);
    PyObject *table = sfield(n, seq, F_BLOCK_TABLE);
    PyObject *chain = sfield(n, seq, F_CHAIN);
    PyObject *result = NULL, *tok_o = NULL;
    int mutex = 0;
    if (!tokens || !table || !chain) goto out;
    if (!PyList_CheckExact(tokens) || !PyList_CheckExact(table) || !PyList_CheckExact(chain)) {
        result = fallback(n);
        goto out;
    }
    Py_ssize_t n_old = PyList_GET_SIZE(tokens), nb = PyList_GET_SIZE(table);
    int64_t bs = n->bs, off = n_old % bs;
    if (nb == 0 || nb != (n_old + bs - 1) / bs) {
        result = fallback(n);
        goto out;
    }
    /* magic: a block this append fills gets its prefix key (extend_chain), on a record that
     * must still match its checksum (append.py _set_keys; else the Python path reports). */
    if ((n->probes & P_MAGIC) && (n_old + 1) % bs == 0) {
        for (Py_ssize_t j = PyList_GET_SIZE(chain); j < (n_old + 1) / bs && j < nb; j++) {
            long b = PyLong_AsLong(PyList_GET_ITEM(table, j));
            if (b < 0 || b >= n->nb || U8(blk(n, b) + BF_CHECKSUM) != checksum(n, b)) {
                PyErr_Clear();
                result = fallback(n);
                goto out;
            }
        }
    }
    /* The token as the sequence keeps it: an int. */
    tok_o = PyLong_FromLong(tok);
    if (tok_o == NULL) goto out;
    if (off) {
        long last = PyLong_AsLong(PyList_GET_ITEM(table, nb - 1));
        if (last < 0 || last >= n->nb) {
            PyErr_Clear();
            result = fallback(n);
            goto out;
        }
        uint8_t *r = blk(n, last);
        if (I4(r + BF_REFCOUNT) > 1) { /* copy-on-write */
            result = fallback(n);
            goto out;
        }
        /* The decode step: unjournaled, as append.py's fast path (docs/FORMAT.md, crash rule 5). */
        I4(r + BF_TOKENS + 4 * off) = (int32_t)tok;
        U4(r + BF_NUM_TOKENS) = (uint32_t)(off + 1);
        if (PyList_Append(tokens, tok_o)) goto out;
        U8(seqrec(n, slot) + SF_NUM_TOKENS) = (uint64_t)(n_old + 1);
    } else {
        int32_t site = site_now(n, pool);
        if (site == -2) goto out;
        int rc = take_mutex(n);
        if (rc != OK) {
            result = rc == ERROR ? NULL : fallback(n);
            goto out;
        }
        mutex = 1;
        uint64_t locks = take_locks(n, 1);
        if (txn_begin(n, locks)) {
            result = fallback(n);
            goto out;
        }
        int32_t b;
        uint8_t *s = seqrec(n, slot);
        char request[REQUEST_BYTES];
        memcpy(request, s + SF_REQUEST, REQUEST_BYTES);
        if (take(n, 1, &b) || unmapped(n, &b, 1) || poison_intact(n, &b, 1) ||
            stamp(n, &b, 1, request, site, wall_ns()) ||
            write_blocks(n, slot, nb, &b, 1)) {
            txn_abort(n);
            result = PyErr_Occurred() ? NULL : fallback(n);
            goto out;
        }
        unpoison(n, &b, 1);
        I4(blk(n, b) + BF_TOKENS) = (int32_t)tok;
        U4(blk(n, b) + BF_NUM_TOKENS) = 1;
        U8(s + SF_NUM_TOKENS) = (uint64_t)(n_old + 1);
        txn_commit(n);
        count(n, C_ALLOCS, 1);
        ev_record(n, E_ALLOCATE, &b, 1, request, (int64_t)U8(s + SF_SEQ_ID));
        if (append_new(table, PyLong_FromLong(b))) goto out;
        if (PyList_Append(tokens, tok_o)) goto out;
    }
    if ((n_old + 1) / bs > PyList_GET_SIZE(chain) && extend_chain(n, tokens, table, chain))
        goto out;
    n->native_ops++;
    result = PyList_New(0);
out:
    if (mutex) drop_mutex(n);
    Py_XDECREF(tok_o);
    Py_XDECREF(tokens);
    Py_XDECREF(table);
    Py_XDECREF(chain);
    return result;
}

/* -- mark_computed ---------------------------------------------------------------------------- */

/* seq's full blocks of positions [0, num_tokens) published -> how many, or None (the Python
 * path). */
static PyObject *core_publish(Native *n, PyObject *seq, PyObject *upto_in) {
    Py_ssize_t upto_tokens = PyLong_AsSsize_t(upto_in);
    if (upto_tokens == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return fallback(n);
    }
    PyObject *tokens = sfield(n, seq, F_TOKENS);
    PyObject *table = sfield(n, seq, F_BLOCK_TABLE);
    PyObject *chain = sfield(n, seq, F_CHAIN);
    PyObject *pub_o = sfield(n, seq, F_PUBLISHED);
    PyObject *result = NULL;
    int mutex = 0;
    if (!tokens || !table || !chain || !pub_o) goto out;
    if (!PyList_CheckExact(tokens) || !PyList_CheckExact(table) || !PyList_CheckExact(chain)) {
        result = fallback(n);
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
        result = fallback(n);
        goto out;
    }
    uint64_t key0, unused;
    if (seq_keys(n, chain, pub, &key0, &unused)) goto out;
    int rc = take_mutex(n);
    if (rc != OK) {
        result = rc == ERROR ? NULL : fallback(n);
        goto out;
    }
    mutex = 1;
    /* Every key of a sequence lives in the shard of its first (prefix.family_keys). */
    if (txn_begin(n, shard_lock(n, key0))) {
        result = fallback(n);
        goto out;
    }
    long published = 0;
    int32_t done[CHUNK]; /* (digest) the blocks published */
    if ((n->probes & P_DIGEST) && upto - pub > CHUNK) goto abort;
    for (Py_ssize_t j = pub; j < upto; j++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(table, j));
        if (b < 0 || b >= n->nb) {
            PyErr_Clear();
            goto abort;
        }
        uint8_t *r = blk(n, b);
        if (r[BF_INDEXED] || I4(r + BF_REFCOUNT) != 1) continue;
        uint64_t key, parent;
        if (seq_keys(n, chain, j, &key, &parent)) {
            PyErr_Clear();
            goto abort;
        }
        int inserted;
        if (index_insert(n, key, (int32_t)b, &inserted)) goto abort;
        if (!inserted) continue;
        /* BlockStore.publish */
        if (jsave_block(n, b)) goto abort;
        r[BF_INDEXED] = 1;
        U8(r + BF_PREFIX_HASH) = key;
        U8(r + BF_PARENT_HASH) = parent;
        seal(n, b);
        if (published < CHUNK) done[published] = (int32_t)b; /* (all of them with the digest) */
        published++;
    }
    if (stamp_digests(n, done, published)) goto abort;
    txn_commit(n);
    PyObject *u = PyLong_FromSsize_t(upto);
    if (u == NULL) goto out;
    sset(n, seq, F_PUBLISHED, u);
    Py_DECREF(u);
    n->native_ops++;
    result = PyLong_FromLong(published);
    goto out;
abort:
    txn_abort(n);
    result = PyErr_Occurred() ? NULL : fallback(n);
out:
    if (mutex) drop_mutex(n);
    Py_XDECREF(tokens);
    Py_XDECREF(table);
    Py_XDECREF(chain);
    Py_XDECREF(pub_o);
    return result;
}
