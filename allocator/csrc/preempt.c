/* Preemption and a full pool: a take short of blocks after the ring and eviction frees this
 * handle's oldest waiting sequence, and when nothing is left raises PoolExhausted; set_state,
 * resume. Part of _native.c. */

/* -- the victim -------------------------------------------------------------------------------- */

/* The handle's live sequence (the core's registry: slot -> Sequence, sequences.c)
 * whose record is WAITING, with blocks, not in `exclude` (the slot being grown), with the
 * smallest seq id: its slot (*seq borrowed), -1 for none, -2 with an exception set. */
static int64_t oldest_waiting(Native *n, int64_t exclude, PyObject **seq) {
    Py_ssize_t pos = 0;
    PyObject *key, *s;
    int64_t best = -1;
    uint64_t best_id = 0;
    while (PyDict_Next(n->seqs, &pos, &key, &s)) {
        int64_t slot = PyLong_AsLongLong(key);
        if (slot == -1 && PyErr_Occurred()) return -2;
        /* the record's state, not the Sequence's: it is rolled back with the transaction */
        if (slot < 0 || slot >= n->max_seqs || slot == exclude ||
            seqrec(n, slot)[SF_STATE] != S_WAITING || U4(seqrec(n, slot) + SF_NUM_BLOCKS) == 0)
            continue;
        PyObject *id_o = sfield(n, s, F_SEQ_ID);
        if (id_o == NULL) return -2;
        uint64_t id = PyLong_AsUnsignedLongLong(id_o);
        Py_DECREF(id_o);
        if (PyErr_Occurred()) return -2;
        if (best < 0 || id < best_id) {
            best = slot;
            best_id = id;
            *seq = s;
        }
    }
    return best;
}

/* -- preemption ------------------------------------------------------------------------------- */

/* preempt_one's release of the victim's table (ids, zero: room for its k blocks each), as a
 * release (guard: guard mode guards it: its freed blocks checked, quarantined and poisoned
 * before the commit). The locks it needs: its indexed blocks' shards and the free lock (one
 * not held: the operation runs again with it, need_locks). */
static int preempt_table(Native *n, PyObject *seq, int64_t slot, const int32_t *ids,
                         Py_ssize_t k, uint64_t shards, int32_t *zero, int guard) {
    if (need_locks(n, shards | lock_bit(n->lock_free))) return UNHANDLED;
    /* magic: a scribbled record is reported and left as it is (in place: ids is this call's
     * copy of the table) */
    int32_t *drop = (int32_t *)ids;
    int64_t nd;
    if (unsealed_left(n, ids, k, drop, &nd)) return ERROR;
    /* digest: the published blocks released are as published; a block already free is a
     * double free */
    PyObject *when = NULL, *rid = sfield(n, seq, F_REQUEST_ID);
    const char *w = rid ? release_words(n, seq, &when) : NULL;
    int rc = w ? digests_intact(n, drop, nd, w) : ERROR;
    if (rc == OK) rc = already_free(n, drop, nd, rid);
    Py_XDECREF(when);
    Py_XDECREF(rid);
    if (rc != OK) return rc;
    /* the references dropped, then what they freed given back */
    int64_t nz = 0;
    if (drop_refs(n, drop, nd, wall_ns(), zero, &nz)) return UNHANDLED;
    if ((rc = give_back_freed(n, zero, &nz, guard, 0)) != OK) return rc;
    if (guard && poison_later(n, zero, nz)) return ERROR;
    if (write_blocks(n, slot, 0, NULL, 0)) return UNHANDLED;
    seqrec(n, slot)[SF_STATE] = S_PREEMPTED;
    if (n->n_pre == n->cap_pre) {
        int64_t cap = n->cap_pre ? 2 * n->cap_pre : 8;
        int64_t *p = PyMem_Realloc(n->pre_slots, sizeof(int64_t) * (size_t)cap);
        if (p == NULL) {
            PyErr_NoMemory();
            return ERROR;
        }
        n->pre_slots = p;
        n->cap_pre = cap;
    }
    n->pre_slots[n->n_pre++] = slot;
    return OK;
}

/* Preempt the handle's oldest waiting sequence (not `exclude`) inside the open transaction:
 * its blocks released as a release releases a table (a reference less; an
 * indexed block left unreferenced stays cached; the others to the local cache, the overflow
 * to the ring, or, guarded, quarantined), its record PREEMPTED with no blocks; its Sequence,
 * events and counters at commit (`preempted`). *found = 0 when there is none. OK, UNHANDLED (a
 * lock not held, the journal full, or a release too large for it: preempted ahead, n->ahead;
 * the operation rolls back and runs again: rolled_back), ERROR. */
static int preempt_one(Native *n, int64_t exclude, int64_t short_by, int *found) {
    PyObject *seq = NULL;
    *found = 0;
    int64_t slot = oldest_waiting(n, exclude, &seq);
    if (slot == -2) return ERROR;
    if (slot < 0) return OK;
    *found = 1;
    int guard = guard_release(n, slot);
    if (guard < 0) return ERROR;
    PyObject *table = sfield(n, seq, F_BLOCK_TABLE);
    if (table == NULL) return ERROR;
    /* Its release and the take's blocks still to come (each block's record saved about twice:
     * its reference or stamp, then the cache or ring it leaves or joins) must fit the journal's
     * room, with margin; else it is preempted ahead (preempt_ahead). */
    int64_t saves = 2 * ((PyList_Check(table) ? PyList_GET_SIZE(table) : 0) + short_by);
    int64_t room = (int64_t)JOURNAL_ENTRIES - (int64_t)n->jcount - 32;
    int64_t bytes = (int64_t)JOURNAL_BYTES - (int64_t)n->jused - 4096;
    if (saves > room || saves * ((int64_t)n->rec + 8) > bytes) {
        Py_DECREF(table);
        n->ahead = slot + 1;
        return UNHANDLED;
    }
    /* its ids and the ones it frees: on the stack up to CHUNK blocks */
    int32_t ids_s[2 * CHUNK], *ids = ids_s;
    Py_ssize_t cap = CHUNK, len = PyList_Check(table) ? PyList_GET_SIZE(table) : 0;
    if (len > CHUNK && len <= n->max_bps) {
        if ((ids = PyMem_Malloc(2 * sizeof(int32_t) * (size_t)len)) == NULL) {
            Py_DECREF(table);
            PyErr_NoMemory();
            return ERROR;
        }
        cap = len;
    }
    Py_ssize_t k;
    uint64_t shards;
    int rc = table_of(n, table, ids, cap, &k, &shards);
    Py_DECREF(table);
    if (rc == OK) rc = preempt_table(n, seq, slot, ids, k, shards, ids + cap, guard);
    if (ids != ids_s) PyMem_Free(ids);
    return rc;
}

static int preempted(Native *n, int64_t from, int64_t to) {
    int rc = OK;
    for (int64_t i = from; i < to && rc == OK; i++) {
        int64_t slot = n->pre_slots[i];
        PyObject *key = PyLong_FromLongLong(slot);
        PyObject *seq = key ? PyDict_GetItemWithError(n->seqs, key) : NULL;
        Py_XDECREF(key);
        if (seq == NULL) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_SystemError, "preempted slot %lld has no Sequence",
                             (long long)slot);
            return ERROR;
        }
        PyObject *table = sfield(n, seq, F_BLOCK_TABLE);
        int32_t ids_s[CHUNK], *ids = ids_s; /* (on the heap for a table of more) */
        Py_ssize_t k = 0, len = table && PyList_Check(table) ? PyList_GET_SIZE(table) : 0;
        uint64_t shards;
        if (len > CHUNK && (ids = PyMem_Malloc(sizeof(int32_t) * (size_t)len)) == NULL) {
            Py_XDECREF(table);
            PyErr_NoMemory();
            return ERROR;
        }
        if (table == NULL || table_of(n, table, ids, ids == ids_s ? CHUNK : len, &k, &shards)) {
            if (ids != ids_s) PyMem_Free(ids);
            Py_XDECREF(table);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "a preempted table changed");
            return ERROR;
        }
        Py_DECREF(table);
        const char *request = (const char *)seqrec(n, slot) + SF_REQUEST;
        if (n->oplog) oplog_preempted(n, seq);
        ev_record(n, E_PREEMPT, ids, k, request, 0);
        ev_record(n, E_FREE, ids, k, request, 0);
        count(n, C_FREES, (uint64_t)k);
        count(n, C_PREEMPTIONS, 1);
        if (ids != ids_s) PyMem_Free(ids);
        PyObject *empty = PyList_New(0), *zero = PyLong_FromLong(0);
        if (empty && zero) {
            sset(n, seq, F_BLOCK_TABLE, empty);
            sset(n, seq, F_STATE, s_preempted);
            sset(n, seq, F_PUBLISHED, zero);
        } else {
            rc = ERROR;
        }
        Py_XDECREF(empty);
        Py_XDECREF(zero);
    }
    return rc;
}

/* The preemption preempt_one left for after the operation's rollback (n->ahead): the waiting
 * sequence's table released from its tail, release_step blocks a transaction (release_tail,
 * as a long free), then the rest with its record PREEMPTED, as preempt_one does inside an
 * operation, in a transaction of its own. The operation then runs again; if it still fails,
 * the sequence stays preempted. OK, UNHANDLED (a transaction could not begin), ERROR. */
static int preempt_ahead(Native *n) {
    int64_t slot = n->ahead - 1;
    n->ahead = 0;
    PyObject *key = PyLong_FromLongLong(slot);
    PyObject *seq = key ? PyDict_GetItemWithError(n->seqs, key) : NULL;
    Py_XDECREF(key);
    /* (preempt_one found it in the registry, which the rollback left as it was) */
    if (seq == NULL) return core_bug("a sequence to preempt ahead left the registry");
    Py_INCREF(seq);
    PyObject *table = sfield(n, seq, F_BLOCK_TABLE), *when = NULL,
             *rid = sfield(n, seq, F_REQUEST_ID);
    Py_ssize_t k, len = table && PyList_Check(table) ? PyList_GET_SIZE(table) : 0;
    int32_t *ids = NULL;
    uint64_t shards;
    int guard = guard_release(n, slot), rc = ERROR;
    if (guard < 0 || table == NULL || rid == NULL) goto out;
    if (len > n->max_bps) {
        seq_changed("block table");
        goto out;
    }
    if ((ids = PyMem_Malloc(2 * sizeof(int32_t) * (size_t)(len ? len : 1))) == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    const char *w = release_words(n, seq, &when);
    if (w == NULL || table_of(n, table, ids, len, &k, &shards)) goto out;
    char request[REQUEST_BYTES];
    memcpy(request, seqrec(n, slot) + SF_REQUEST, REQUEST_BYTES);
    for (;;) {
        rc = release_down_to(n, seq, table, ids, &k, release_step(n), slot, S_PREEMPTED, guard,
                             w, request, rid);
        if (rc != OK) goto out;
        shards = 0;
        for (Py_ssize_t i = 0; i < k; i++)
            if (blk(n, ids[i])[BF_INDEXED] == 1) shards |= block_shard_lock(n, ids[i]);
        if (txn_begin(n, shards | lock_bit(n->lock_free) | n->want_locks)) {
            rc = UNHANDLED;
            goto out;
        }
        rc = preempt_table(n, seq, slot, ids, k, shards, ids + len, guard);
        if (rc == OK) rc = commit_poison(n);
        if (rc == OK) break;
        txn_abort(n);
        rc = rolled_back(n);
        if (rc == AGAIN) continue;
        /* (at most release_step blocks: sized to fit) */
        if (rc == JOURNAL_SHORT) rc = core_bug("a preemption sized to the journal outgrew it");
        goto out;
    }
    txn_commit(n);
    rc = preempted(n, 0, n->n_pre);
out:
    PyMem_Free(ids);
    Py_XDECREF(when);
    Py_XDECREF(rid);
    Py_XDECREF(table);
    Py_DECREF(seq);
    return rc;
}

/* -- a full pool ------------------------------------------------------------------------------ */

/* A take of `needed` blocks found nothing left: counted (num_exhausted, this client's) and
 * recorded as the pool's last exhaustion in the header (records.py EXHAUSTION_FIELDS), from the
 * pool as the rollback left it. Called by txn_abort after the rollback, the free lock still held
 * (the take that set exhausted_need held it: blocks.c take), so the ring's count is exact and
 * one raise's record is never mixed with another's. Not journaled: it follows the rollback,
 * nothing undoes it. Its time is cleared first and stored last, so a death in between leaves
 * no record (time 0) rather than figures of two raises. Other processes' local caches are
 * their owners' (no lock): their counts are as this read found them. */
static void exhausted_note(Native *n, int64_t needed) {
    count(n, C_EXHAUSTED, 1);
    /* (an operation that fails leaves no other event: a pool wedged on PoolExhausted says so
     * in the flight recorder too) */
    ev_record(n, E_EXHAUSTED, NULL, 0, n->exhausted_request, needed);
    if (!holds(n, n->lock_free)) return; /* (not reached: see above) */
    uint32_t local = 0;
    for (int64_t c = 0; c < n->max_clients; c++) {
        uint8_t *cr = n->seg + n->off_clients + (size_t)c * (size_t)CLIENT_SIZE;
        if (c == n->client || cr[CF_STATE] != CL_ATTACHED) continue;
        local += __atomic_load_n((uint32_t *)(cr + CF_LOCAL_COUNT), __ATOMIC_RELAXED);
    }
    uint8_t *h = n->seg;
    __atomic_store_n((uint64_t *)(h + HDR_EXHAUSTED_NS), 0, __ATOMIC_RELEASE);
    I4(h + HDR_EXHAUSTED_PID) = n->pid;
    U4(h + HDR_EXHAUSTED_NEED) = (uint32_t)needed;
    U4(h + HDR_EXHAUSTED_FREE) = U4(ringh(n) + RING_COUNT);
    U4(h + HDR_EXHAUSTED_OWN) = local_count(n);
    U4(h + HDR_EXHAUSTED_LOCAL) = local;
    __atomic_store_n((uint64_t *)(h + HDR_EXHAUSTED_NS), wall_ns(), __ATOMIC_RELEASE);
}

/* The blocks that requests of processes no longer alive hold, by pid, into `dead` (each block
 * once, however many of their requests map it): what a survivor's reclaim_dead() hands back.
 * 0, or -1 with an exception set. (A raise's cold path: each process's liveness read once.) */
static int dead_holders(Native *n, PyObject *dead) {
    enum { KNOWN = 64 };
    int32_t pids[KNOWN];
    uint64_t starts[KNOWN];
    int alive[KNOWN], known = 0;
    uint8_t *seen = NULL;
    int rc = 0;
    for (int64_t s = 0; s < n->max_seqs && rc == 0; s++) {
        uint8_t *r = seqrec(n, s);
        uint32_t nb = U4(r + SF_NUM_BLOCKS);
        if (r[SF_STATE] == S_EMPTY || nb == 0) continue;
        int32_t pid = I4(r + SF_OWNER_PID);
        uint64_t start = U8(r + SF_OWNER_START);
        int k = 0, live;
        while (k < known && !(pids[k] == pid && starts[k] == start)) k++;
        if (k < known)
            live = alive[k];
        else {
            live = proc_alive(pid, start);
            if (known < KNOWN) pids[known] = pid, starts[known] = start, alive[known++] = live;
        }
        if (live) continue;
        if (seen == NULL && (seen = PyMem_Calloc((size_t)n->nb, 1)) == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        long long count = 0;
        const int32_t *table = (const int32_t *)(r + SF_TABLE);
        for (uint32_t i = 0; i < nb && (int64_t)i < n->max_bps; i++) {
            int32_t b = table[i];
            if (b >= 0 && b < n->nb && !seen[b]) seen[b] = 1, count++;
        }
        if (count == 0) continue;
        PyObject *key = PyLong_FromLong(pid);
        PyObject *had = key ? PyDict_GetItemWithError(dead, key) : NULL;
        PyObject *v = key && !PyErr_Occurred()
                          ? PyLong_FromLongLong((had ? PyLong_AsLongLong(had) : 0) + count)
                          : NULL;
        if (v == NULL || PyDict_SetItem(dead, key, v) < 0) rc = -1;
        Py_XDECREF(key);
        Py_XDECREF(v);
    }
    PyMem_Free(seen);
    return rc;
}

/* qsort's order of sequence records (pointers to them) by their request field. */
static int by_request(const void *a, const void *b) {
    return memcmp(*(const uint8_t *const *)a + SF_REQUEST, *(const uint8_t *const *)b + SF_REQUEST,
                  REQUEST_BYTES);
}

/* holders[request] = the distinct blocks the request's live sequences map (a request's forks,
 * which share its id, share blocks: each counted once), for each request holding any (a
 * preempted one holds none). 0, or -1 with an exception set. */
static int request_blocks(Native *n, PyObject *holders) {
    uint8_t **order = PyMem_Calloc((size_t)n->max_seqs + 1, sizeof(uint8_t *));
    int64_t *stamp = PyMem_Malloc((size_t)n->nb * sizeof(int64_t));
    int rc = -1;
    if (order == NULL || stamp == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int64_t k = 0;
    for (int64_t s = 0; s < n->max_seqs; s++)
        if (seqrec(n, s)[SF_STATE] != S_EMPTY) order[k++] = seqrec(n, s);
    qsort(order, (size_t)k, sizeof(uint8_t *), by_request);
    for (int64_t b = 0; b < n->nb; b++) stamp[b] = -1;
    for (int64_t i = 0; i < k;) {
        uint8_t *r = order[i];
        long long count = 0;
        int64_t j = i;
        /* (each sequence of the request marks its blocks with the group's first index) */
        for (; j < k && memcmp(order[j] + SF_REQUEST, r + SF_REQUEST, REQUEST_BYTES) == 0; j++) {
            uint8_t *q = order[j];
            const int32_t *table = (const int32_t *)(q + SF_TABLE);
            uint32_t nb = U4(q + SF_NUM_BLOCKS);
            for (uint32_t t = 0; t < nb && (int64_t)t < n->max_bps; t++) {
                int32_t b = table[t];
                if (b >= 0 && b < n->nb && stamp[b] != i) stamp[b] = i, count++;
            }
        }
        i = j;
        if (count == 0) continue;
        /* the request as numpy reads the field: trailing NULs dropped, then UTF-8 (replace) */
        Py_ssize_t len = REQUEST_BYTES;
        while (len > 0 && r[SF_REQUEST + len - 1] == 0) len--;
        PyObject *rq = PyUnicode_DecodeUTF8((const char *)r + SF_REQUEST, len, "replace");
        PyObject *v = rq ? PyLong_FromLongLong(count) : NULL;
        int bad = v == NULL || PyDict_SetItem(holders, rq, v) < 0;
        Py_XDECREF(rq);
        Py_XDECREF(v);
        if (bad) goto done;
    }
    rc = 0;
done:
    PyMem_Free(order);
    PyMem_Free(stamp);
    return rc;
}

/* PoolExhausted for a take of `needed` blocks, read from the pool as the rollback left it:
 * blocks free (the ring, quarantined, any process's local cache), cached and held; the blocks
 * each live request holds; other attached processes' local caches by pid; the blocks requests
 * of dead processes hold, by pid (dead_holders). */
static void raise_exhausted(Native *n, int64_t needed) {
    if (PoolExhaustedType == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvscope: _native.register_errors() was not called");
        return;
    }
    int64_t st[B_QUARANTINED + 1] = {0};
    for (int64_t b = 0; b < n->nb; b++) {
        uint8_t s = blk(n, b)[BF_STATE];
        if (s <= B_QUARANTINED) st[s]++;
    }
    PyObject *holders = PyDict_New(), *elsewhere = PyDict_New(), *kw = NULL, *args = NULL;
    PyObject *err = NULL, *dead = PyDict_New();
    if (!holders || !elsewhere || !dead || dead_holders(n, dead) < 0 ||
        request_blocks(n, holders) < 0)
        goto out;
    for (int64_t c = 0; c < n->max_clients; c++) {
        uint8_t *cr = n->seg + n->off_clients + (size_t)c * (size_t)CLIENT_SIZE;
        uint32_t local = U4(cr + CF_LOCAL_COUNT);
        if (c == n->client || cr[CF_STATE] != CL_ATTACHED || local == 0) continue;
        PyObject *pid = PyLong_FromLong(I4(cr + CF_PID));
        if (pid == NULL) goto out;
        PyObject *had = PyDict_GetItemWithError(elsewhere, pid);
        long long sum = (had ? PyLong_AsLongLong(had) : 0) + (long long)local;
        PyObject *v = PyErr_Occurred() ? NULL : PyLong_FromLongLong(sum);
        int bad = v == NULL || PyDict_SetItem(elsewhere, pid, v) < 0;
        Py_DECREF(pid);
        Py_XDECREF(v);
        if (bad) goto out;
    }
    kw = Py_BuildValue("{sLsLsLsLsOsOsO}", "needed", (long long)needed, "free",
                       (long long)(st[B_FREE] + st[B_LOCAL] + st[B_QUARANTINED]), "cached",
                       (long long)st[B_CACHED], "held", (long long)st[B_ALLOCATED], "holders",
                       holders, "elsewhere", elsewhere, "dead", dead);
    args = PyTuple_New(0);
    if (kw && args) err = PyObject_Call(PoolExhaustedType, args, kw);
    if (err) PyErr_SetObject(PoolExhaustedType, err);
out:
    Py_XDECREF(holders);
    Py_XDECREF(elsewhere);
    Py_XDECREF(dead);
    Py_XDECREF(kw);
    Py_XDECREF(args);
    Py_XDECREF(err);
}

/* -- set_state -------------------------------------------------------------------------------- */

/* set_state(pool, seq, state) -> True: a live sequence of this handle marked running or
 * waiting (its record's state: one byte, no transaction); PoolError for another state, a
 * preempted sequence or one that is not a live sequence of this handle (own_slot). */
static PyObject *N_set_state(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "set_state(pool, seq, state)");
        return NULL;
    }
    GATE(n, args[0]);
    int64_t slot = own_used(n, args[1], "set_state");
    if (slot < 0) return NULL;
    seq_touch(n, slot);
    PyObject *state = args[2], *name = NULL;
    if (PyUnicode_Check(state)) {
        if (PyUnicode_CompareWithASCIIString(state, "running") == 0) name = s_running;
        else if (PyUnicode_CompareWithASCIIString(state, "waiting") == 0) name = s_waiting;
    }
    if (name == NULL) {
        pool_error("set_state takes 'running' or 'waiting', got %R", state);
        return NULL;
    }
    PyObject *cur = sfield(n, args[1], F_STATE);
    if (cur == NULL) return NULL;
    int pre = PyUnicode_Check(cur) && PyUnicode_CompareWithASCIIString(cur, "preempted") == 0;
    Py_DECREF(cur);
    if (pre) {
        pool_error("a preempted sequence must be resumed with pool.resume(seq) first");
        return NULL;
    }
    seqrec(n, slot)[SF_STATE] = name == s_running ? S_RUNNING : S_WAITING;
    sset(n, args[1], F_STATE, name);
    n->ops_done++;
    Py_RETURN_TRUE;
}

/* -- resume ----------------------------------------------------------------------------------- */

/* A resume whose first transaction (core_allocate: `got`) did not hold every token, and so left
 * the old slot as it was: the rest of them (toks[0..k)) appended to a new sequence in the new
 * slot, a transaction per CHUNK blocks' worth, then the old slot released in a transaction of
 * its own; `got`'s table and chain become the new sequence's, which seq takes over (N_resume).
 * On an error (ERROR, or UNHANDLED where the move's transaction could not begin) the new
 * sequence is aborted and seq stays preempted in its old slot. OK, UNHANDLED, ERROR. */
static int resume_rest(Native *n, PyObject *pool, PyObject *seq, int64_t old, PyObject *got,
                       const int32_t *toks, int64_t k) {
    PyObject *slot = PyTuple_GET_ITEM(got, 0), *table = PyTuple_GET_ITEM(got, 2);
    int64_t s = PyLong_AsLongLong(slot);
    PyObject *rid = sfield(n, seq, F_REQUEST_ID), *tokens = sfield(n, seq, F_TOKENS);
    PyObject *head = tokens ? PyList_GetSlice(tokens, 0, PyList_GET_SIZE(table) * n->bs) : NULL;
    PyObject *uid = PyLong_FromLongLong(n->uid);
    PyObject *cached =
        PyLong_FromLongLong(PyLong_AsLongLong(PyTuple_GET_ITEM(got, 4)) * n->bs);
    PyObject *fresh = NULL;
    int rc = ERROR;
    if (rid && head && uid && cached) {
        PyObject *a[10] = {rid,    head, table, slot, PyTuple_GET_ITEM(got, 1), uid, cached,
                           s_running, PyTuple_GET_ITEM(got, 3), PyTuple_GET_ITEM(got, 4)};
        fresh = new_sequence(n, a, slot);
    }
    Py_XDECREF(rid);
    Py_XDECREF(tokens);
    Py_XDECREF(head);
    Py_XDECREF(uid);
    Py_XDECREF(cached);
    if (fresh == NULL) return ERROR;
    PyObject *copies = core_append(n, pool, fresh, s, toks, k);
    rc = copies == NULL ? ERROR : OK;
    Py_XDECREF(copies);
    /* the move: the old slot released (got's table and chain are the new
     * sequence's lists, which the appends grew) */
    int to_table = rc == OK && !reserve_keeps(n, old, 0);
    if (rc == OK && txn_begin(n, to_table ? lock_bit(n->lock_seqs) : 0)) rc = UNHANDLED;
    if (rc == OK && jsave_head(n, old)) {
        /* (the only save of a transaction of its own) */
        txn_abort(n);
        rc = core_bug("a slot's release outgrew the journal");
    }
    if (rc == OK) {
        uint8_t *o = seqrec(n, old);
        if (to_table) o[SF_RESERVED] = 0;
        o[SF_STATE] = S_EMPTY;
        U4(o + SF_NUM_BLOCKS) = 0;
        crash_point(n, CP_AFTER_RELEASE);
        txn_commit(n);
        if (!to_table) n->res[n->res_n++] = (int32_t)old;
    }
    if (rc != OK && abandon(n, fresh, s) != OK) rc = ERROR;
    Py_DECREF(fresh);
    return rc;
}

/* resume(pool, seq) -> cached tokens: a preempted sequence of this handle allocated again for
 * its tokens (prefix hits included) in a new slot, its old slot released in the same
 * transaction; the Sequence takes the new slot, id, table and chain, its hits as cached and
 * published, state "running". PoolError for a sequence that is not preempted or not a live one
 * of this handle (own_slot). */
static PyObject *N_resume(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "resume(pool, seq)");
        return NULL;
    }
    GATE(n, args[0]);
    PyObject *seq = args[1];
    int64_t old = own_used(n, seq, "resume");
    if (old < 0) return NULL;
    seq_touch(n, old);
    PyObject *state = sfield(n, seq, F_STATE), *tokens = sfield(n, seq, F_TOKENS);
    PyObject *rid = sfield(n, seq, F_REQUEST_ID), *got = NULL, *result = NULL;
    int32_t *toks = NULL;
    if (!state || !tokens || !rid) goto out;
    if (!PyUnicode_Check(state) || PyUnicode_CompareWithASCIIString(state, "preempted") != 0) {
        pool_error("resume needs a preempted sequence, this one is %S", state);
        goto out;
    }
    Py_ssize_t ntok = PyList_CheckExact(tokens) ? PyList_GET_SIZE(tokens) : 0;
    if (!PyUnicode_Check(rid) || ntok == 0) {
        result = unhandled(n);
        goto out;
    }
    toks = PyMem_Malloc(sizeof(int32_t) * (size_t)ntok);
    if (toks == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    if (tokens_of(tokens, 0, toks, ntok) != OK) {
        seq_changed("tokens");
        goto out;
    }
    char request[REQUEST_BYTES];
    if (request_of(rid, request)) goto out;
    int32_t site = site_now(n);
    if (site == SITE_ERROR) goto out;
    got = core_allocate(n, toks, ntok, request, site, old);
    if (got == NULL) goto out;
    /* (slot, seq_id, table, chain, hits): the Sequence moves into the new slot */
    Py_ssize_t held = PyList_GET_SIZE(PyTuple_GET_ITEM(got, 2)) * n->bs;
    if (held < ntok) {
        /* the first transaction left the old slot: the rest, then the move */
        int rc = resume_rest(n, args[0], seq, old, got, toks + held, ntok - held);
        if (rc != OK) {
            result = rc == UNHANDLED ? unhandled(n) : NULL;
            goto out;
        }
    }
    PyObject *slot = PyTuple_GET_ITEM(got, 0), *hits = PyTuple_GET_ITEM(got, 4);
    PyObject *cached = PyLong_FromLongLong(PyLong_AsLongLong(hits) * n->bs);
    PyObject *old_key = PyLong_FromLongLong(old);
    if (cached == NULL || old_key == NULL) {
        Py_XDECREF(cached);
        Py_XDECREF(old_key);
        goto out;
    }
    sset(n, seq, F_SLOT, slot);
    sset(n, seq, F_SEQ_ID, PyTuple_GET_ITEM(got, 1));
    sset(n, seq, F_BLOCK_TABLE, PyTuple_GET_ITEM(got, 2));
    sset(n, seq, F_CHAIN, PyTuple_GET_ITEM(got, 3));
    sset(n, seq, F_PUBLISHED, hits);
    sset(n, seq, F_CACHED, cached);
    sset(n, seq, F_STATE, s_running);
    /* the handle's live (and sampled-guard) sequences: the old slot is anyone's now */
    if (PyDict_DelItem(n->seqs, old_key) < 0) PyErr_Clear();
    if (PySet_Discard(n->guarded, old_key) < 0) PyErr_Clear();
    Py_DECREF(old_key);
    if (PyDict_SetItem(n->seqs, slot, seq) < 0) {
        Py_DECREF(cached);
        goto out;
    }
    result = cached;
out:
    PyMem_Free(toks);
    Py_XDECREF(state);
    Py_XDECREF(tokens);
    Py_XDECREF(rid);
    Py_XDECREF(got);
    return result;
}
