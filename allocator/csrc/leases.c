/* Leases: a transfer in flight over blocks (docs/POOL.md "Leases", FORMAT.md section 13). A
 * lease counts on each of its blocks (the section's per-block counts); a leased block that a
 * release or a preemption frees goes to the free ring QUARANTINED and is passed over there
 * (never handed out) until its last lease ends; eviction passes over a leased cached block. A
 * write lease that completes into a block its request no longer holds is a
 * transfer_after_free finding; a lease past its deadline, or still held when its holder
 * closes the pool, a lease_leak. The table is written under the free lock, journaled; a dead
 * holder's leases are reclaimed with its blocks (recovery.c reclaim_one). Part of _native.c. */

/* -- the operation log ------------------------------------------------------------------------ */

/* A lease operation as the operation log records it (oplog.c oplog_lease, docs/REPLAY.md): what
 * it was asked and what it gave. */
typedef struct {
    int op, status, fault, mode;
    int64_t seq_id, arg, result; /* the sequence (-1: none); EXPIRE_LEASES' now_ns; its answer */
    int32_t record;              /* the lease's record in the table (-1: none) */
    uint64_t lease_id, timeout_ns, deadline_ns;
    char holder[REQUEST_BYTES], request[REQUEST_BYTES];
    const int32_t *blocks; /* NULL: none */
    const uint32_t *gens;
    int64_t n_blocks, n_gens;
    Py_ssize_t found0; /* KVPool._found's length when the call began */
} LeaseRec;
static void oplog_lease(Native *n, const LeaseRec *o); /* oplog.c */

/* A LeaseRec of op `op` with nothing in it yet (after the call's gate: its findings since). */
static void lease_rec_init(Native *n, LeaseRec *o, int op) {
    memset(o, 0, sizeof *o);
    o->op = op;
    o->seq_id = -1;
    o->record = -1;
    o->deadline_ns = UINT64_MAX;
    o->found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
}

/* -- the section ------------------------------------------------------------------------------ */

static inline uint8_t *lease_head(Native *n) { return n->seg + n->off_leases; }
static inline uint32_t *lease_counts(Native *n) {
    return (uint32_t *)(n->seg + n->off_leases + LEASE_COUNTS);
}
static inline uint8_t *lease_at(Native *n, int64_t i) {
    return n->seg + n->off_leases + n->lease_records + (size_t)i * (size_t)n->lease_rec;
}
static inline int32_t *lease_ids(uint8_t *l) { return (int32_t *)(l + LS_BLOCKS); }
static inline uint32_t *lease_gens(Native *n, uint8_t *l) {
    return (uint32_t *)(l + LS_BLOCKS + 4 * (size_t)n->max_bps);
}

/* Journal a lease record: its fixed fields and its first k blocks and generations. */
static int jsave_lease(Native *n, uint8_t *l, int64_t k) {
    size_t at = (size_t)(l - n->seg);
    if (jsave(n, at, LS_BLOCKS)) return UNHANDLED;
    if (k == 0) return OK;
    if (jsave(n, at + LS_BLOCKS, (uint32_t)(4 * k))) return UNHANDLED;
    return jsave(n, (size_t)((uint8_t *)lease_gens(n, l) - n->seg), (uint32_t)(4 * k));
}

/* Journal the lease counts of ids[0..k): one range from the lowest to the highest when that is
 * no more bytes than a word each would save in entries, else each word. */
static int jsave_counts(Native *n, const int32_t *ids, int64_t k) {
    if (k == 0) return OK;
    int32_t lo = ids[0], hi = ids[0];
    for (int64_t i = 1; i < k; i++) {
        if (ids[i] < lo) lo = ids[i];
        if (ids[i] > hi) hi = ids[i];
    }
    size_t base = n->off_leases + LEASE_COUNTS;
    int64_t span = (int64_t)hi - lo + 1;
    if (k > 16 && 4 * span <= 64 * k)
        return jsave(n, base + 4 * (size_t)lo, (uint32_t)(4 * span));
    for (int64_t i = 0; i < k; i++)
        if (jsave(n, base + 4 * (size_t)ids[i], 4)) return UNHANDLED;
    return OK;
}

/* -- the hooks -------------------------------------------------------------------------------- */

static int leases_divert(Native *n, int32_t *zero, int64_t *nz) {
    if (!leases_any(n)) return OK;
    int64_t m = 0;
    for (int64_t i = 0; i < *nz; i++) m += leased(n, zero[i]);
    if (m == 0) return OK;
    if (need_locks(n, lock_bit(n->lock_free))) return UNHANDLED;
    /* (a preemption's table may hold more than CHUNK) */
    int32_t held_s[CHUNK], *held = held_s;
    if (m > CHUNK && (held = PyMem_Malloc(sizeof(int32_t) * (size_t)m)) == NULL) {
        PyErr_NoMemory();
        return ERROR;
    }
    int64_t kept = 0, h = 0;
    for (int64_t i = 0; i < *nz; i++) {
        if (leased(n, zero[i])) held[h++] = zero[i];
        else zero[kept++] = zero[i];
    }
    int rc = ring_push_state(n, held, m, B_QUARANTINED) || jsave(n, n->off_leases, LEASE_COUNTS)
                 ? UNHANDLED
                 : OK;
    if (held != held_s) PyMem_Free(held);
    if (rc != OK) {
        /* (rolled back: zero's order no longer matters, its blocks are as they were) */
        return rc;
    }
    U4(lease_head(n) + LH_QUARANTINED) += (uint32_t)m;
    *nz = kept;
    return OK;
}

/* ring_pop's last step (free lock held; the ring header journaled): the leased blocks among
 * out[0..*k) go back to the ring's tail and free blocks from its head take their places, as
 * many as one lap of the ring finds; *k is what is left. OK or UNHANDLED. */
static int leases_pass_over(Native *n, int32_t *out, int64_t *k) {
    int64_t m = 0, kept = 0;
    for (int64_t i = 0; i < *k; i++) m += leased(n, out[i]);
    if (m == 0) return OK;
    uint8_t *h = ringh(n);
    int32_t *ring = (int32_t *)(h + RING_IDS);
    uint32_t rest = U4(h + RING_COUNT);
    int32_t *back = PyMem_Malloc(sizeof(int32_t) * (size_t)(m + rest + 1));
    if (back == NULL) {
        PyErr_NoMemory();
        return ERROR;
    }
    int64_t nb = 0;
    for (int64_t i = 0; i < *k; i++) {
        if (leased(n, out[i])) back[nb++] = out[i];
        else out[kept++] = out[i];
    }
    for (uint32_t it = 0; it < rest && kept < *k; it++) {
        uint64_t head = U8(h + RING_HEAD);
        int32_t b = ring[head % (uint64_t)n->nb];
        U8(h + RING_HEAD) = head + 1;
        U4(h + RING_COUNT) -= 1;
        if (leased(n, b)) back[nb++] = b;
        else out[kept++] = b;
    }
    int rc = ring_append(n, back, nb);
    PyMem_Free(back);
    *k = kept;
    return rc;
}

/* -- taking one -------------------------------------------------------------------------------- */

/* The blocks of a lease's target into ids (at most max_bps): a live Sequence's table (*slot
 * its slot, else -1), or a sequence of block ids. Each must be held (ALLOCATED) or cached,
 * and a block no other process can reach but its owner must be this handle's own (another
 * process frees it without the free lock). OK, or ERROR with PoolError set. */
static int lease_target(Native *n, PyObject *target, int32_t *ids, int64_t *k, int64_t *slot) {
    *slot = -1;
    *k = 0;
    PyObject *list;
    if (PyObject_TypeCheck(target, (PyTypeObject *)n->seq_type)) {
        *slot = own_used(n, target, "lease");
        if (*slot < 0) return ERROR;
        seq_touch(n, *slot);
        list = sfield(n, target, F_BLOCK_TABLE);
        if (list == NULL) return ERROR;
    } else {
        list = PySequence_List(target);
        if (list == NULL) {
            PyErr_Clear();
            return pool_error("lease takes a Sequence or a list of block ids, got %s",
                              Py_TYPE(target)->tp_name);
        }
    }
    Py_ssize_t len = PyList_GET_SIZE(list);
    int rc = OK;
    if (len == 0)
        rc = pool_error("nothing to lease: %s", *slot >= 0 ? "the sequence holds no blocks"
                                                            : "no block ids");
    else if (len > n->max_bps)
        rc = pool_error("a lease holds at most %lld blocks (PoolConfig.max_blocks_per_seq), "
                        "got %lld",
                        (long long)n->max_bps, (long long)len);
    for (Py_ssize_t i = 0; rc == OK && i < len; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        /* (an int, or any integer with __index__: a numpy or torch scalar) */
        PyObject *v = PyLong_Check(o) ? Py_NewRef(o) : PyNumber_Index(o);
        long long b = v ? PyLong_AsLongLong(v) : -1;
        Py_XDECREF(v);
        if (PyErr_Occurred()) PyErr_Clear();
        if (v == NULL || b < 0 || b >= n->nb) {
            rc = pool_error("lease: %R is not a block id of this pool (0..%lld)", o,
                            (long long)n->nb - 1);
            break;
        }
        uint8_t *r = blk(n, b);
        if (r[BF_STATE] != B_ALLOCATED && r[BF_STATE] != B_CACHED)
            rc = pool_error("lease: block %lld is not held or cached (state %d)", b,
                            (int)r[BF_STATE]);
        else if (r[BF_STATE] == B_ALLOCATED && r[BF_INDEXED] == 0 &&
                 I4(r + BF_OWNER_CLIENT) != n->client)
            rc = pool_error("lease: block %lld is another process's unpublished block; lease "
                            "it in the process that holds it",
                            b);
        ids[i] = (int32_t)b;
    }
    *k = len;
    Py_DECREF(list);
    return rc;
}

/* A free lease record: from the handle's hint on, one lap of the table; -1 when full. */
static int64_t lease_free_record(Native *n) {
    for (int64_t j = 0; j < n->lease_cap; j++) {
        int64_t i = (n->lease_hint + j) % n->lease_cap;
        if (lease_at(n, i)[LS_STATE] == L_EMPTY) return i;
    }
    return -1;
}

/* The transaction of a lease: its record, the counts of its blocks, the header. OK,
 * UNHANDLED, or ERROR (the table full: PoolError). */
static int lease_write(Native *n, int64_t rec, const int32_t *ids, int64_t k, int mode,
                       int64_t slot, const char *holder, const char *request, int32_t site,
                       uint64_t timeout_ns, int64_t deadline, uint64_t *id) {
    uint8_t *l = lease_at(n, rec), *h = lease_head(n);
    if (jsave(n, n->off_leases, LEASE_COUNTS) || jsave_lease(n, l, k) || jsave_counts(n, ids, k))
        return UNHANDLED;
    *id = U8(h + LH_NEXT_ID) + 1;
    U8(h + LH_NEXT_ID) = *id;
    U8(h + LH_TAKEN) += 1;
    U4(h + LH_ACTIVE) += 1;
    uint32_t *cnt = lease_counts(n), *gens = lease_gens(n, l);
    for (int64_t i = 0; i < k; i++) {
        cnt[ids[i]] += 1;
        lease_ids(l)[i] = ids[i];
        gens[i] = U4(blk(n, ids[i]) + BF_GENERATION);
    }
    l[LS_MODE] = (uint8_t)mode;
    l[LS_ON_SEQ] = slot >= 0;
    I4(l + LS_HOLDER_CLIENT) = n->client;
    I4(l + LS_HOLDER_PID) = n->pid;
    U4(l + LS_NUM_BLOCKS) = (uint32_t)k;
    U8(l + LS_HOLDER_START) = n->start;
    U8(l + LS_LEASE_ID) = *id;
    U8(l + LS_SEQ_ID) = slot >= 0 ? U8(seqrec(n, slot) + SF_SEQ_ID) : 0;
    I4(l + LS_SEQ_SLOT) = (int32_t)slot;
    I4(l + LS_SITE) = site;
    U8(l + LS_TAKEN_NS) = wall_ns();
    U8(l + LS_DEADLINE_NS) = deadline >= 0 ? (uint64_t)deadline
                             : timeout_ns    ? mono_ns() + timeout_ns
                                             : UINT64_MAX;
    memcpy(l + LS_HOLDER, holder, REQUEST_BYTES);
    memcpy(l + LS_REQUEST, request, REQUEST_BYTES);
    l[LS_STATE] = L_HELD;
    return OK;
}

/* A str argument's 32 bytes (its str()). */
static int text32(PyObject *o, char *out) {
    PyObject *s = PyObject_Str(o);
    if (s == NULL) return ERROR;
    int rc = request_of(s, out);
    Py_DECREF(s);
    return rc;
}

/* lease(pool, target, mode, holder, timeout_ns[, deadline_ns]) -> (record, lease id):
 * KVPool.lease. target: a live Sequence of this handle or block ids; mode "read" or "write";
 * timeout_ns 0: none; deadline_ns (>= 0) the deadline itself on CLOCK_MONOTONIC in its place (a
 * replay's: the recorded one). In one transaction under the free lock. The transfer-after-free
 * fault strikes here: a write lease on a waiting sequence, which is then preempted at once (the
 * scheduler's preemption in the same step as the transfer it queued). */
static PyObject *N_lease_body(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "lease(pool, target, mode, holder, timeout_ns[, deadline_ns])");
        return NULL;
    }
    int mode = 0;
    if (PyUnicode_Check(args[2])) {
        if (PyUnicode_CompareWithASCIIString(args[2], "read") == 0) mode = LM_READ;
        else if (PyUnicode_CompareWithASCIIString(args[2], "write") == 0) mode = LM_WRITE;
    }
    if (mode == 0) {
        pool_error("lease mode must be 'read' or 'write', got %R", args[2]);
        return NULL;
    }
    long long timeout = PyLong_AsLongLong(args[4]);
    if (timeout == -1 && PyErr_Occurred()) return NULL;
    if (timeout < 0) {
        pool_error("lease timeout must be positive (or None), got %lld ns", timeout);
        return NULL;
    }
    long long deadline = nargs == 6 ? PyLong_AsLongLong(args[5]) : -1;
    if (deadline == -1 && PyErr_Occurred()) return NULL;
    char holder[REQUEST_BYTES], request[REQUEST_BYTES];
    if (text32(args[3], holder)) return NULL;
    /* (before any pool lock: site_intern waits for the sites lock) */
    int32_t site = site_now(n);
    if (site == SITE_ERROR) return NULL;
    int32_t ids_s[CHUNK], *ids = ids_s;
    if (n->max_bps > CHUNK && (ids = PyMem_Malloc(sizeof(int32_t) * (size_t)n->max_bps)) == NULL)
        return PyErr_NoMemory();
    int64_t k, slot;
    PyObject *result = NULL;
    if (lease_target(n, args[1], ids, &k, &slot)) goto out;
    if (slot >= 0)
        memcpy(request, seqrec(n, slot) + SF_REQUEST, REQUEST_BYTES);
    else
        memcpy(request, blk(n, ids[0]) + BF_REQUEST, REQUEST_BYTES);
    uint64_t id = 0;
    int64_t rec;
    int rc;
    for (;;) {
        if (txn_begin(n, lock_bit(n->lock_free) | n->want_locks)) goto out;
        rec = lease_free_record(n);
        if (rec < 0) {
            txn_abort(n);
            pool_error("the lease table is full: %lld leases held (a quarter of "
                       "PoolConfig.max_seqs, at least 64)",
                       (long long)n->lease_cap);
            goto out;
        }
        /* (the blocks checked again under the lock: a cached one may have been evicted, and
         * handed to another process since) */
        for (int64_t i = 0; i < k; i++) {
            uint8_t *r = blk(n, ids[i]);
            if ((r[BF_STATE] != B_ALLOCATED && r[BF_STATE] != B_CACHED) ||
                (r[BF_STATE] == B_ALLOCATED && r[BF_INDEXED] == 0 &&
                 I4(r + BF_OWNER_CLIENT) != n->client)) {
                txn_abort(n);
                pool_error("lease: block %d is no longer held or cached", (int)ids[i]);
                goto out;
            }
        }
        rc = lease_write(n, rec, ids, k, mode, slot, holder, request, site, (uint64_t)timeout,
                         deadline, &id);
        if (rc == OK) break;
        txn_abort(n);
        rc = rolled_back(n);
        if (rc == AGAIN) continue;
        if (rc == JOURNAL_SHORT)
            pool_error("a lease of %lld blocks outgrows one transaction's journal", (long long)k);
        else if (rc == UNHANDLED)
            unhandled(n);
        goto out;
    }
    txn_commit(n);
    n->lease_hint = (rec + 1) % n->lease_cap;
    n->want_locks = 0;
    ev_record(n, E_LEASE, ids, k, request, mode);
    n->ops_done++;
    if (mode == LM_WRITE && slot >= 0 && seqrec(n, slot)[SF_STATE] == S_WAITING &&
        fault_opportunity(n, FT_TRANSFER_AFTER_FREE)) {
        n->n_pre = 0;
        n->ahead = slot + 1;
        if (preempt_ahead(n) != OK) {
            if (!PyErr_Occurred()) unhandled(n);
            goto out;
        }
        fault_fired(n, FT_TRANSFER_AFTER_FREE);
    }
    result = Py_BuildValue("(LK)", (long long)rec, (unsigned long long)id);
out:
    if (ids != ids_s) PyMem_Free(ids);
    return result;
}

/* The entry points: the gate (entry.c: another thread's operation in flight waited for, a call
 * from inside one of this thread's refused), the body, then the op mutex given back where
 * waiting for a lock made the core take it (drop_mutex), as every operation's end does. */
static void oplog_lease_take(Native *n, PyObject *const *args, Py_ssize_t nargs, PyObject *r,
                             LeaseRec *o, Py_ssize_t armed0);
static PyObject *N_lease(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 && nargs != 6) return N_lease_body(n, args, nargs); /* (its TypeError) */
    GATE(n, args[0]);
    LeaseRec o;
    Py_ssize_t armed0 = n->faults_armed ? PyDict_GET_SIZE(n->faults_armed) : 0;
    int recording = n->oplog != NULL; /* (as the call began: another thread may start it) */
    if (recording) lease_rec_init(n, &o, OP_LEASE);
    PyObject *r = N_lease_body(n, args, nargs);
    if (recording) oplog_lease_take(n, args, nargs, r, &o, armed0);
    drop_mutex(n);
    return r;
}

/* A lease's take recorded (recording on): what it got, from its record in the table, or (where
 * it was refused) what it was asked. */
static void oplog_lease_take(Native *n, PyObject *const *args, Py_ssize_t nargs, PyObject *r,
                             LeaseRec *o, Py_ssize_t armed0) {
    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    if (r == NULL) {
        PyErr_Fetch(&et, &ev, &etb);
        o->status = op_status(et);
    }
    if (n->faults_armed && PyDict_GET_SIZE(n->faults_armed) < armed0) o->fault = 1;
    long long t = PyLong_Check(args[4]) ? PyLong_AsLongLong(args[4]) : 0;
    o->timeout_ns = t > 0 ? (uint64_t)t : 0;
    int32_t ids_s[CHUNK], *ids = NULL;
    uint8_t *l = NULL;
    if (r != NULL && PyTuple_Check(r) && PyTuple_GET_SIZE(r) == 2) {
        long long rec = PyLong_AsLongLong(PyTuple_GET_ITEM(r, 0));
        if (rec >= 0 && rec < n->lease_cap) l = lease_at(n, rec);
        if (l) o->record = (int32_t)rec;
    }
    if (l != NULL) {
        /* (held: the transfer-after-free fault's preemption leaves it so) */
        o->mode = l[LS_MODE];
        memcpy(o->holder, l + LS_HOLDER, REQUEST_BYTES);
        memcpy(o->request, l + LS_REQUEST, REQUEST_BYTES);
        o->lease_id = U8(l + LS_LEASE_ID);
        o->result = (int64_t)o->lease_id;
        o->deadline_ns = U8(l + LS_DEADLINE_NS);
        o->seq_id = l[LS_ON_SEQ] ? (int64_t)U8(l + LS_SEQ_ID) : -1;
        o->n_blocks = o->n_gens = U4(l + LS_NUM_BLOCKS) <= (uint64_t)n->max_bps
                                      ? U4(l + LS_NUM_BLOCKS)
                                      : 0;
        o->blocks = lease_ids(l);
        o->gens = lease_gens(n, l);
    } else {
        /* refused: its arguments */
        PyObject *mode = args[2], *target = args[1];
        if (PyUnicode_Check(mode))
            o->mode = PyUnicode_CompareWithASCIIString(mode, "read") == 0    ? LM_READ
                      : PyUnicode_CompareWithASCIIString(mode, "write") == 0 ? LM_WRITE
                                                                             : 0;
        if (text32(args[3], o->holder)) memset(o->holder, 0, REQUEST_BYTES);
        if (nargs == 6 && PyLong_Check(args[5])) {
            long long d = PyLong_AsLongLong(args[5]);
            if (d >= 0) o->deadline_ns = (uint64_t)d;
        }
        if (PyObject_TypeCheck(target, (PyTypeObject *)n->seq_type)) {
            PyObject *id = sfield(n, target, F_SEQ_ID);
            o->seq_id = id && PyLong_Check(id) ? PyLong_AsLongLong(id) : -1;
            Py_XDECREF(id);
            PyObject *rid = sfield(n, target, F_REQUEST_ID);
            PyObject *rs = rid ? request_str(rid) : NULL;
            if (rs == NULL || request_of(rs, o->request)) memset(o->request, 0, REQUEST_BYTES);
            Py_XDECREF(rs);
            Py_XDECREF(rid);
        } else if (PyList_Check(target) || PyTuple_Check(target)) {
            Py_ssize_t k = PySequence_Fast_GET_SIZE(target);
            if (k > n->max_bps) k = n->max_bps;
            ids = k <= CHUNK ? ids_s : PyMem_Malloc(sizeof(int32_t) * (size_t)k);
            if (ids != NULL) {
                for (Py_ssize_t i = 0; i < k; i++) {
                    PyObject *v = PyNumber_Index(PySequence_Fast_GET_ITEM(target, i));
                    long long b = v ? PyLong_AsLongLong(v) : -1;
                    Py_XDECREF(v);
                    if (PyErr_Occurred()) PyErr_Clear();
                    ids[i] = b >= INT32_MIN && b <= INT32_MAX ? (int32_t)b : -1;
                }
                o->blocks = ids;
                o->n_blocks = k;
            }
        }
        if (o->seq_id == -1 && PyErr_Occurred()) PyErr_Clear();
    }
    if (PyErr_Occurred()) PyErr_Clear();
    oplog_lease(n, o);
    if (ids != NULL && ids != ids_s) PyMem_Free(ids);
    if (r == NULL) PyErr_Restore(et, ev, etb);
}

/* -- its end ----------------------------------------------------------------------------------- */

/* Whether block record r is neither held nor cached: freed (or quarantined) since. */
static inline int rec_released(const uint8_t *r) {
    return r[BF_STATE] != B_ALLOCATED && r[BF_STATE] != B_CACHED;
}

/* Why block i of write lease l no longer belongs to what the lease was taken on, as the words
 * after "after" (NULL: it does): freed, another generation, or its sequence ended or
 * preempted. */
static const char *lease_changed(Native *n, uint8_t *l, int64_t i) {
    int32_t b = lease_ids(l)[i];
    if (b < 0 || b >= n->nb) return "it was outside the pool";
    uint8_t *r = blk(n, b);
    if (U4(r + BF_GENERATION) != lease_gens(n, l)[i]) return "it was handed out again";
    if (l[LS_ON_SEQ]) {
        int32_t slot = I4(l + LS_SEQ_SLOT);
        if (slot < 0 || slot >= n->max_seqs) return "it was outside the sequence table";
        uint8_t *s = seqrec(n, slot);
        /* (the record keeps no trace of how a sequence ended: a free's and an abort's both
         * empty it; the flight recorder's events tell them apart) */
        if (U8(s + SF_SEQ_ID) != U8(l + LS_SEQ_ID) ||
            (s[SF_STATE] != S_RUNNING && s[SF_STATE] != S_WAITING && s[SF_STATE] != S_PREEMPTED))
            return rec_released(r)
                       ? "the request ended (freed or aborted) and the block was freed"
                       : "the request ended (freed or aborted)";
        if (s[SF_STATE] == S_PREEMPTED) return "the request was preempted";
        /* (its table at the take was the lease's blocks: a copy-on-write replaces one) */
        if (i >= (int64_t)U4(s + SF_NUM_BLOCKS) || ((const int32_t *)(s + SF_TABLE))[i] != b)
            return "it was replaced in its sequence's table (copy-on-write)";
    }
    return rec_released(r) ? "it was freed" : NULL;
}

/* Whether block i of write lease l itself changed since the take (handed out again, or no
 * longer allocated or cached): where a transfer's write lands in what is no longer the
 * request's, the block a finding names before one its sequence's end left as it was (a
 * shared prefix block, still cached). */
static int lease_block_changed(Native *n, uint8_t *l, int64_t i) {
    int32_t b = lease_ids(l)[i];
    if (b < 0 || b >= n->nb) return 1;
    uint8_t *r = blk(n, b);
    return U4(r + BF_GENERATION) != lease_gens(n, l)[i] || rec_released(r);
}

/* The lease's end inside the open transaction (free lock held): each block's count less (a
 * quarantined one left with none is free again: ring_pop takes it), the record emptied. */
static int lease_drop(Native *n, uint8_t *l) {
    int64_t k = U4(l + LS_NUM_BLOCKS);
    if (k > n->max_bps) k = n->max_bps;
    uint8_t *h = lease_head(n);
    if (jsave(n, n->off_leases, LEASE_COUNTS) || jsave(n, (size_t)(l - n->seg), LS_BLOCKS) ||
        jsave_counts(n, lease_ids(l), k))
        return UNHANDLED;
    uint32_t *cnt = lease_counts(n);
    for (int64_t i = 0; i < k; i++) {
        int32_t b = lease_ids(l)[i];
        if (b < 0 || b >= n->nb || cnt[b] == 0) continue;
        if (--cnt[b] == 0 && blk(n, b)[BF_STATE] == B_QUARANTINED && U4(h + LH_QUARANTINED))
            U4(h + LH_QUARANTINED) -= 1;
    }
    if (U4(h + LH_ACTIVE)) U4(h + LH_ACTIVE) -= 1;
    l[LS_STATE] = L_EMPTY;
    return OK;
}

/* A finding about lease l: kind fk, about its block i, the lease's request and its holder's
 * pid. OK or ERROR. */
static int lease_finding(Native *n, int fk, uint8_t *l, int64_t i, PyObject *message) {
    int32_t b = U4(l + LS_NUM_BLOCKS) ? lease_ids(l)[i] : -1;
    Seen s = {.block = b, .owner_pid = I4(l + LS_HOLDER_PID), .site = -1, .refcount = 0};
    if (b >= 0 && b < n->nb) {
        s.site = I4(blk(n, b) + BF_SITE);
        s.refcount = I4(blk(n, b) + BF_REFCOUNT);
    }
    memcpy(s.request, l + LS_REQUEST, REQUEST_BYTES);
    return message ? finding_report(n, fk, &s, message) : ERROR;
}

static PyObject *text_of(const uint8_t *b) { return request_text((const char *)b); }

/* ", taken at FILE:LINE FUNC" for lease l, or "" when its site was not recorded. */
static PyObject *taken_at(Native *n, uint8_t *l) {
    return site_words(n, I4(l + LS_SITE), ", taken at ");
}

/* The transfer_after_free message of write lease l's block i (why: lease_changed). */
static PyObject *late_message(Native *n, uint8_t *l, int64_t i, const char *why) {
    PyObject *holder = text_of(l + LS_HOLDER), *req = text_of(l + LS_REQUEST), *msg = NULL;
    PyObject *at = taken_at(n, l);
    uint32_t was = lease_gens(n, l)[i], now = U4(blk(n, lease_ids(l)[i]) + BF_GENERATION);
    /* (the generation it has now only where it moved on) */
    PyObject *gen = was != now ? PyUnicode_FromFormat("generation %u, now %u", was, now)
                               : PyUnicode_FromFormat("generation %u", was);
    if (holder && req && at && gen)
        msg = PyUnicode_FromFormat(
            "write lease %llu of holder %R (pid %d%U) completed into block %d of request %R "
            "after %s (%U)",
            (unsigned long long)U8(l + LS_LEASE_ID), holder, I4(l + LS_HOLDER_PID), at,
            (int)lease_ids(l)[i], req, why, gen);
    Py_XDECREF(holder);
    Py_XDECREF(req);
    Py_XDECREF(at);
    Py_XDECREF(gen);
    return msg;
}

/* The lease_leak message of lease l (`how`: why it is a leak). */
static PyObject *leak_message(Native *n, uint8_t *l, const char *how) {
    PyObject *holder = text_of(l + LS_HOLDER), *req = text_of(l + LS_REQUEST), *msg = NULL;
    PyObject *at = taken_at(n, l);
    if (holder && req && at)
        msg = PyUnicode_FromFormat(
            "%s lease %llu of holder %R (pid %d%U) on %u block(s) of request %R %s",
            l[LS_MODE] == LM_WRITE ? "write" : "read", (unsigned long long)U8(l + LS_LEASE_ID),
            holder, I4(l + LS_HOLDER_PID), at, U4(l + LS_NUM_BLOCKS), req, how);
    Py_XDECREF(holder);
    Py_XDECREF(req);
    Py_XDECREF(at);
    return msg;
}

/* lease_release(pool, record, lease id) -> bool: the lease's transfer completed; False when
 * the lease is no longer held (reclaimed, or released already). A write lease into a block
 * that changed since it was taken is a transfer_after_free finding (once, about the first
 * such block: the first whose own record changed, where one did). The lease-leak fault
 * strikes here: a read lease's release never happens. */
static PyObject *N_lease_release_body(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "lease_release(pool, record, lease_id)");
        return NULL;
    }
    long long rec = PyLong_AsLongLong(args[1]);
    unsigned long long id = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (rec < 0 || rec >= n->lease_cap) {
        pool_error("no lease record %lld", rec);
        return NULL;
    }
    uint8_t *l = lease_at(n, rec);
    if (l[LS_STATE] == L_EMPTY || U8(l + LS_LEASE_ID) != id) Py_RETURN_FALSE;
    if (I4(l + LS_HOLDER_CLIENT) != n->client || I4(l + LS_HOLDER_PID) != n->pid) {
        pool_error("lease %llu is held by pid %d; release it there", id, I4(l + LS_HOLDER_PID));
        return NULL;
    }
    if (l[LS_MODE] == LM_READ && fault_opportunity(n, FT_LEASE_LEAK)) {
        fault_fired(n, FT_LEASE_LEAK);
        n->ops_done++;
        Py_RETURN_TRUE;
    }
    /* (read before the end: the record is emptied) */
    int64_t k = U4(l + LS_NUM_BLOCKS), bad = -1;
    const char *why = NULL;
    if (k > n->max_bps) k = n->max_bps;
    for (int64_t i = 0; l[LS_MODE] == LM_WRITE && i < k && why == NULL; i++)
        if ((why = lease_changed(n, l, i)) != NULL) bad = i;
    /* (the first block that itself changed, where there is one: its sequence's end changes
     * every block's answer, a shared one still cached too) */
    for (int64_t i = bad; why != NULL && i < k; i++)
        if (lease_block_changed(n, l, i)) {
            bad = i;
            why = lease_changed(n, l, i);
            break;
        }
    PyObject *msg = why ? late_message(n, l, bad, why) : NULL;
    if (why && msg == NULL) return NULL;
    char request[REQUEST_BYTES];
    memcpy(request, l + LS_REQUEST, REQUEST_BYTES);
    int32_t ids_s[CHUNK], *ids = ids_s;
    if (k > CHUNK && (ids = PyMem_Malloc(sizeof(int32_t) * (size_t)k)) == NULL) {
        Py_XDECREF(msg);
        return PyErr_NoMemory();
    }
    memcpy(ids, lease_ids(l), sizeof(int32_t) * (size_t)k);
    int mode = l[LS_MODE];
    int rc = txn_begin(n, lock_bit(n->lock_free));
    /* (lease_drop saves the section's header) */
    if (rc == OK && (rc = lease_drop(n, l)) == OK) {
        U8(lease_head(n) + LH_RELEASED) += 1;
        if (why) U8(lease_head(n) + LH_LATE) += 1;
    }
    PyObject *result = NULL;
    if (rc == OK) {
        txn_commit(n);
        ev_record(n, E_LEASE_END, ids, k, request, mode);
        n->ops_done++;
        /* (the record is empty now: the finding names what it held, from the copy) */
        if (msg) {
            Seen s = {.block = ids[bad], .owner_pid = n->pid, .site = I4(blk(n, ids[bad]) + BF_SITE),
                      .refcount = I4(blk(n, ids[bad]) + BF_REFCOUNT)};
            memcpy(s.request, request, REQUEST_BYTES);
            if (finding_report(n, FK_TRANSFER_AFTER_FREE, &s, msg) == OK) result = Py_NewRef(Py_True);
        } else {
            result = Py_NewRef(Py_True);
        }
    } else if (rc == UNHANDLED) {
        txn_abort(n);
        unhandled(n);
    }
    if (ids != ids_s) PyMem_Free(ids);
    Py_XDECREF(msg);
    return result;
}

static PyObject *N_lease_release(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return N_lease_release_body(n, args, nargs); /* (its TypeError) */
    GATE(n, args[0]);
    if (n->oplog == NULL) {
        PyObject *r = N_lease_release_body(n, args, nargs);
        drop_mutex(n);
        return r;
    }
    /* recorded: which lease, and what it held before its end empties its record */
    LeaseRec o;
    lease_rec_init(n, &o, OP_LEASE_RELEASE);
    Py_ssize_t armed0 = n->faults_armed ? PyDict_GET_SIZE(n->faults_armed) : 0;
    long long rec = PyLong_Check(args[1]) ? PyLong_AsLongLong(args[1]) : -1;
    unsigned long long id = PyLong_Check(args[2]) ? PyLong_AsUnsignedLongLong(args[2]) : 0;
    if (PyErr_Occurred()) PyErr_Clear();
    o.record = rec >= INT32_MIN && rec <= INT32_MAX ? (int32_t)rec : -1;
    o.lease_id = id;
    int32_t ids_s[CHUNK], *ids = ids_s;
    if (rec >= 0 && rec < n->lease_cap) {
        uint8_t *l = lease_at(n, rec);
        int64_t k = U4(l + LS_NUM_BLOCKS);
        if (l[LS_STATE] != L_EMPTY && U8(l + LS_LEASE_ID) == id && k <= n->max_bps &&
            (k <= CHUNK || (ids = PyMem_Malloc(sizeof(int32_t) * (size_t)k)) != NULL)) {
            o.mode = l[LS_MODE];
            memcpy(o.holder, l + LS_HOLDER, REQUEST_BYTES);
            memcpy(o.request, l + LS_REQUEST, REQUEST_BYTES);
            o.seq_id = l[LS_ON_SEQ] ? (int64_t)U8(l + LS_SEQ_ID) : -1;
            memcpy(ids, lease_ids(l), sizeof(int32_t) * (size_t)k);
            o.blocks = ids;
            o.n_blocks = k;
        }
        if (ids == NULL) ids = ids_s;
    }
    PyObject *r = N_lease_release_body(n, args, nargs);
    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    if (r == NULL) {
        PyErr_Fetch(&et, &ev, &etb);
        o.status = op_status(et);
    }
    o.result = r == Py_True;
    if (o.result == 0) o.blocks = NULL; /* (ended nothing) */
    if (n->faults_armed && PyDict_GET_SIZE(n->faults_armed) < armed0) o.fault = 1;
    oplog_lease(n, &o);
    if (ids != ids_s) PyMem_Free(ids);
    if (r == NULL) PyErr_Restore(et, ev, etb);
    drop_mutex(n);
    return r;
}

/* -- leaks -------------------------------------------------------------------------------------- */

/* lease_expire(pool, now_ns) -> int: every held lease of the pool (any process's) whose
 * deadline is at or before now_ns (CLOCK_MONOTONIC; -1: now) is a lease_leak, reported once:
 * its record marked LEAKED (it stays held, its blocks quarantined, until released or its
 * holder closes). How many it reported. */
static PyObject *N_lease_expire_body(Native *n, PyObject *const *args, Py_ssize_t nargs,
                                     uint64_t *now_out) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "lease_expire(pool, now_ns)");
        return NULL;
    }
    long long now_in = PyLong_AsLongLong(args[1]);
    if (now_in == -1 && PyErr_Occurred()) return NULL;
    uint64_t now = now_in < 0 ? mono_ns() : (uint64_t)now_in;
    *now_out = now;
    int64_t found = 0;
    if (!leases_any(n)) return PyLong_FromLong(0);
    int64_t *late = PyMem_Malloc(sizeof(int64_t) * (size_t)n->lease_cap);
    if (late == NULL) return PyErr_NoMemory();
    if (txn_begin(n, lock_bit(n->lock_free))) {
        PyMem_Free(late);
        return NULL;
    }
    int rc = OK;
    for (int64_t i = 0; i < n->lease_cap && rc == OK; i++) {
        uint8_t *l = lease_at(n, i);
        if (l[LS_STATE] != L_HELD || U8(l + LS_DEADLINE_NS) > now) continue;
        if (jsave(n, (size_t)(l - n->seg), 1) || jsave(n, n->off_leases, LEASE_COUNTS)) {
            rc = UNHANDLED;
            break;
        }
        l[LS_STATE] = L_LEAKED;
        U8(lease_head(n) + LH_LEAKED) += 1;
        late[found++] = i;
    }
    if (rc != OK) {
        txn_abort(n);
        PyMem_Free(late);
        return unhandled(n);
    }
    txn_commit(n);
    n->ops_done++;
    /* (reported after the commit, with no pool lock held: the records stay held) */
    for (int64_t j = 0; j < found; j++) {
        uint8_t *l = lease_at(n, late[j]);
        double past = (double)(now - U8(l + LS_DEADLINE_NS)) / 1e9;
        char how[96];
        snprintf(how, sizeof how, "held %.3f s past its deadline", past);
        PyObject *msg = leak_message(n, l, how);
        int bad = lease_finding(n, FK_LEASE_LEAK, l, 0, msg);
        Py_XDECREF(msg);
        if (bad) {
            PyMem_Free(late);
            return NULL;
        }
    }
    PyMem_Free(late);
    return PyLong_FromLongLong(found);
}

static PyObject *N_lease_expire(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t now = 0;
    if (nargs != 2) return N_lease_expire_body(n, args, nargs, &now); /* (its TypeError) */
    GATE(n, args[0]);
    LeaseRec o;
    int recording = n->oplog != NULL; /* (as the call began: another thread may start it) */
    if (recording) lease_rec_init(n, &o, OP_EXPIRE_LEASES);
    PyObject *r = N_lease_expire_body(n, args, nargs, &now);
    if (recording) {
        /* recorded: the now it compared the deadlines with (a replay's, not its clock) */
        PyObject *et = NULL, *ev = NULL, *etb = NULL;
        if (r == NULL) {
            PyErr_Fetch(&et, &ev, &etb);
            o.status = op_status(et);
        }
        o.arg = now <= INT64_MAX ? (int64_t)now : -1;
        o.result = r && PyLong_Check(r) ? PyLong_AsLongLong(r) : 0;
        if (PyErr_Occurred()) PyErr_Clear();
        oplog_lease(n, &o);
        if (r == NULL) PyErr_Restore(et, ev, etb);
    }
    drop_mutex(n);
    return r;
}

/* The leases this handle still holds when it closes (recovery.c N_detach): each a lease_leak
 * (outliving its request: the holder is going away), unless reported already, then released in
 * a transaction under the free lock. OK, or what the transaction answers. */
static int leases_at_close(Native *n) {
    if (!leases_any(n)) return OK;
    for (int64_t i = 0; i < n->lease_cap; i++) {
        uint8_t *l = lease_at(n, i);
        if (l[LS_STATE] == L_EMPTY || I4(l + LS_HOLDER_CLIENT) != n->client ||
            I4(l + LS_HOLDER_PID) != n->pid)
            continue;
        int leaked = l[LS_STATE] == L_HELD;
        if (leaked) {
            Py_ssize_t found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
            PyObject *msg = leak_message(n, l, "still held when its holder closed the pool");
            if (lease_finding(n, FK_LEASE_LEAK, l, 0, msg)) PyErr_WriteUnraisable(n->name);
            Py_XDECREF(msg);
            /* (recorded as a REPORT: a replay replays it as this close) */
            if (n->oplog) oplog_found_report(n, found0, (const char *)l + LS_REQUEST);
        }
        int rc = txn_begin(n, lock_bit(n->lock_free));
        if (rc != OK) return rc;
        if (lease_drop(n, l) != OK) {
            txn_abort(n);
            return UNHANDLED;
        }
        U8(lease_head(n) + LH_RECLAIMED) += 1;
        /* (a lease_leak: counted as one, as expire_leases counts its own) */
        if (leaked) U8(lease_head(n) + LH_LEAKED) += 1;
        txn_commit(n);
    }
    return OK;
}

/* Recovery step (recovery.c reclaim_one, under every lock): every lease dead client d held,
 * released (a transaction's worth; *arg: how many). */
static int leases_step_reclaim(Native *n, int32_t client, int32_t pid, int64_t *done) {
    *done = 0;
    if (!leases_any(n)) return OK;
    for (int64_t i = 0; i < n->lease_cap; i++) {
        uint8_t *l = lease_at(n, i);
        if (l[LS_STATE] == L_EMPTY || I4(l + LS_HOLDER_CLIENT) != client ||
            I4(l + LS_HOLDER_PID) != pid)
            continue;
        /* (a drop saves everything before it writes: one the journal cannot hold wrote
         * nothing, and waits for the next step) */
        int rc = lease_drop(n, l);
        if (rc == UNHANDLED && *done > 0) return OK;
        if (rc != OK) return rc;
        U8(lease_head(n) + LH_RECLAIMED) += 1;
        (*done)++;
    }
    return OK;
}
