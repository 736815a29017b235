/* The crash points (crash.py) and the injectable faults (faults.py), struck by the core's own
 * operations: one counter for each, in arrays crash.py and faults.py share with the core (armed
 * there, counted down here). Part of _native.c. */

/* -- crash points ----------------------------------------------------------------------------- */

/* crash.CRASH_POINTS, in its order (N_init checks that the two lists agree). */
enum { CP_AFTER_LOCKS, CP_AFTER_LOCAL_POP, CP_AFTER_RING_POP, CP_AFTER_EVICT, CP_AFTER_RECORDS,
       CP_AFTER_RELEASE_RECORDS, CP_AFTER_RING_PUSH, CP_AFTER_CLAIM, CP_AFTER_TABLE,
       CP_AFTER_RELEASE, CP_AFTER_PREFIX_KEY, CP_AFTER_HIT, CP_AFTER_INSERT, CP_BEFORE_COMMIT,
       NUM_CRASH_POINTS };
static const char *const CRASH_NAMES[NUM_CRASH_POINTS] = {
    "txn.after_locks",         "blocks.after_local_pop", "blocks.after_ring_pop",
    "blocks.after_evict",      "blocks.after_records",   "blocks.after_release_records",
    "blocks.after_ring_push",  "seqs.after_claim",       "seqs.after_table",
    "seqs.after_release",      "seqs.after_prefix_key",  "prefix.after_hit",
    "prefix.after_insert",     "txn.before_commit"};

static inline void crash_point(Native *n, int point) {
    int64_t *armed = n->crash;
    if (__builtin_expect(armed[0] == point + 1, 0) && --armed[1] <= 0) {
        if (n->oplog) oplog_dying(n);
        kill(getpid(), SIGKILL);
    }
}

/* crash.configure(f"{point}:{hits}") */
static inline void crash_arm(Native *n, int point, int64_t hits) {
    n->crash[0] = point + 1;
    n->crash[1] = hits;
}

/* -- faults ----------------------------------------------------------------------------------- */

/* faults.FAULTS, in its order (N_init checks that the two lists agree). */
enum { FT_DOUBLE_FREE, FT_LEAK, FT_OOB_WRITE, FT_HEADER_SCRIBBLE, FT_BLOCK_SCRIBBLE,
       FT_USE_AFTER_FREE, FT_REFCOUNT_SKEW, FT_KILL_HOLDING_LOCK, FT_LOCK_INVERSION,
       FT_STALE_PADDING_ROW, FT_GIL_WAIT, FT_TRANSFER_AFTER_FREE, FT_LEASE_LEAK,
       FT_FOREIGN_SLOT, NUM_FAULTS };
static const char *const FAULT_NAMES[NUM_FAULTS] = {
    "double-free",    "leak",          "oob-write",         "header-scribble", "block-scribble",
    "use-after-free", "refcount-skew", "kill-holding-lock", "lock-inversion",
    "stale-padding-row", "gil-wait", "transfer-after-free", "lease-leak",
    "foreign-slot"};
/* (stale-padding-row strikes outside the pool: the example engine's padded block table, on
 * faults.py `opportunity`; the core only names it; transfer-after-free and lease-leak strike in
 * leases.c, foreign-slot in provenance.c) */
static PyObject *fault_str[NUM_FAULTS]; /* the names, interned once */

static inline int faults_armed(Native *n) { return PyDict_GET_SIZE(n->faults_armed) != 0; }

static int fault_opportunity(Native *n, int f) {
    if (!faults_armed(n)) return 0;
    PyObject *left = PyDict_GetItemWithError(n->faults_armed, fault_str[f]);
    long v = left ? PyLong_AsLong(left) : 0;
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (v != 1) {
        PyObject *less = v > 1 ? PyLong_FromLong(v - 1) : NULL;
        if (less && PyDict_SetItem(n->faults_armed, fault_str[f], less)) PyErr_Clear();
        Py_XDECREF(less);
        return 0;
    }
    return 1;
}

static void fault_fired(Native *n, int f) {
    PyObject *r = PyObject_CallOneArg(n->fault_fired, fault_str[f]);
    if (r == NULL) PyErr_WriteUnraisable(n->fault_fired);
    Py_XDECREF(r);
    /* The operation log's next record says so: this operation's, written before the GIL is
     * let go again. Set after the announcement, not before: its print lets the GIL go, and
     * another thread's operation that runs then (this one holds no lock: a lease release's)
     * would take the mark into its own record, and the replay diverge there. */
    n->oplog_fired |= 1u << f;
}

/* The opportunity and the announcement in one, for acts that cannot fail. */
static int fault_fire(Native *n, int f) {
    if (!fault_opportunity(n, f)) return 0;
    fault_fired(n, f);
    return 1;
}

static void end_faults(Native *n, const int32_t *ids, int64_t k, int64_t *skip, int *stale) {
    *skip = -1;
    *stale = 0;
    int64_t last_private = -1;
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        if (r[BF_INDEXED] == 0 && I4(r + BF_REFCOUNT) == 1) last_private = i;
    }
    if (last_private < 0) return;
    if (fault_opportunity(n, FT_LEAK))
        *skip = last_private;
    else if (fault_opportunity(n, FT_USE_AFTER_FREE))
        *stale = 1;
}

static void kill_fault(Native *n, uint64_t locks) {
    if (locks && fault_opportunity(n, FT_KILL_HOLDING_LOCK)) {
        crash_arm(n, CP_AFTER_LOCKS, 1);
        fault_fired(n, FT_KILL_HOLDING_LOCK);
    }
}

static void double_free_fired(Native *n, int32_t b, PyObject *rec, const char *request) {
    fault_fired(n, FT_DOUBLE_FREE);
    if (!(n->probes & ~P_LOCKDEP)) return;
    const uint8_t *r = (const uint8_t *)PyBytes_AS_STRING(rec);
    Seen s = {.block = b, .owner_pid = I4(r + BF_OWNER_PID), .site = I4(r + BF_SITE),
              .refcount = I4(r + BF_REFCOUNT)};
    memcpy(s.request, r + BF_REQUEST, REQUEST_BYTES);
    PyObject *req = request_text(request);
    PyObject *msg = req ? PyUnicode_FromFormat("block released a second time after request %R "
                                               "ended: it is already free",
                                               req)
                        : NULL;
    Py_XDECREF(req);
    if (msg == NULL || finding_report(n, FK_DOUBLE_FREE, &s, msg)) PyErr_WriteUnraisable(n->pool);
    Py_XDECREF(msg);
}

/* The faults that strike while a sequence grows, once a chunk of its append that ran a
 * transaction (a new block, a copy) is done: a KV write one slot past its last block
 * (faults.write_past: the data is a tensor the core may not map), the header's num_blocks and
 * its first block's refcount scribbled over (raw bytes, not through the allocator: their
 * checksums no longer match). */
static int append_faults(Native *n, PyObject *pool, PyObject *table) {
    if (!faults_armed(n)) return OK;
    Py_ssize_t nb = PyList_GET_SIZE(table);
    if (nb == 0) return OK;
    if (fault_fire(n, FT_OOB_WRITE)) {
        PyObject *r = PyObject_CallFunctionObjArgs(n->write_past, pool,
                                                   PyList_GET_ITEM(table, nb - 1), NULL);
        if (r == NULL) return ERROR;
        Py_DECREF(r);
    }
    if (fault_fire(n, FT_HEADER_SCRIBBLE))
        memcpy(n->seg + HDR_NUM_BLOCKS, "\xde\xad\xbe\xef", 4);
    if (fault_fire(n, FT_BLOCK_SCRIBBLE)) {
        long b = PyLong_AsLong(PyList_GET_ITEM(table, 0));
        if (b < 0 || b >= n->nb) return PyErr_Occurred() ? ERROR : OK;
        I4(blk(n, b) + BF_REFCOUNT) = 0x5A5A5A5A;
    }
    return OK;
}

static int refcount_skew(Native *n, const int32_t *ids, int64_t k) {
    if (k == 0 || !fault_opportunity(n, FT_REFCOUNT_SKEW)) return 0;
    I4(blk(n, ids[0]) + BF_REFCOUNT) += 1;
    seal(n, ids[0]);
    return 1;
}

/* `lock-inversion`: a transaction of more than one lock takes them in the reverse
 * of the documented order. 1 at its opportunity. */
static int lock_inversion(Native *n, uint64_t mask) {
    return (mask & (mask - 1)) && fault_opportunity(n, FT_LOCK_INVERSION);
}

/* lockdep's view of an inverted transaction (probes.c lockdep_ok with the order reversed): each
 * pair of traced locks of different classes taken high index first is the order edge
 * class(high) -> class(low), learned into the segment's lock graph (probes.c lg_learn, which
 * reports the lock_order_cycle such an edge closes). OK, or ERROR with an exception set. */
static int lg_learn(Native *n, int i, int j);
static int lockdep_inverted_ok(Native *n, uint64_t mask) {
    mask &= n->traced;
    for (uint64_t m = mask; m; m &= m - 1) {
        int j = __builtin_ctzll(m);
        uint64_t above = mask & ~((lock_bit(j) << 1) - 1) & ~n->same_class[j];
        for (; above; above &= above - 1) {
            int i = __builtin_ctzll(above);
            if (n->known_into[j] & lock_bit(i)) continue;
            if (lg_learn(n, i, j) != OK) return ERROR;
            n->known_into[j] |= lock_bit(i);
        }
    }
    return OK;
}

/* `gil-wait`: a transaction's first lock is waited for with the GIL kept (as a binding that
 * waits without Py_BEGIN_ALLOW_THREADS does), announced once its locks are taken. Its index
 * at the opportunity, else -1. Lockdep reports the wait before it (probes.c gil_wait_report). */
static int gil_wait(Native *n, uint64_t mask) {
    if (!mask || !fault_opportunity(n, FT_GIL_WAIT)) return -1;
    uint64_t traced = mask & n->traced;
    return __builtin_ctzll(traced ? traced : mask);
}

/* -- the handle's share ----------------------------------------------------------------------- */

/* A tuple of str equal, in order, to names[0..k). */
static int names_agree(PyObject *t, const char *const *names, Py_ssize_t k) {
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != k) return 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *s = PyTuple_GET_ITEM(t, i);
        if (!PyUnicode_Check(s) || PyUnicode_CompareWithASCIIString(s, names[i]) != 0) return 0;
    }
    return 1;
}

/* N_init's part: crash.ARMED (a writable array of 2 int64), faults.ARMED (a dict), the callables
 * faults.fired and faults.write_past, the two name lists as crash.py and faults.py have them.
 * 0, or -1 with an exception set. */
static int faults_init(Native *n, PyObject *d) {
    PyObject *crash = PyDict_GetItemString(d, "crash_armed");
    PyObject *points = PyDict_GetItemString(d, "crash_points");
    PyObject *names = PyDict_GetItemString(d, "fault_names");
    if (!crash || !points || !names || !PyDict_Check(n->faults_armed)) {
        PyErr_SetString(PyExc_KeyError,
                        "native core needs crash_armed, crash_points, fault_names, faults_armed");
        return -1;
    }
    if (!names_agree(points, CRASH_NAMES, NUM_CRASH_POINTS) ||
        !names_agree(names, FAULT_NAMES, NUM_FAULTS)) {
        PyErr_SetString(PyExc_ValueError,
                        "the core's crash points or faults are not crash.py's and faults.py's: "
                        "rebuild it (pip install -e .)");
        return -1;
    }
    if (PyObject_GetBuffer(crash, &n->crash_buf, PyBUF_WRITABLE) < 0) return -1;
    if (n->crash_buf.len < 16) {
        PyBuffer_Release(&n->crash_buf);
        PyErr_SetString(PyExc_ValueError, "crash_armed: two int64 words");
        return -1;
    }
    n->crash = n->crash_buf.buf;
    if (!PyCallable_Check(n->fault_fired) || !PyCallable_Check(n->write_past)) {
        PyErr_SetString(PyExc_TypeError, "fault_fired, write_past: callables");
        return -1;
    }
    for (int f = 0; f < NUM_FAULTS; f++)
        if (fault_str[f] == NULL && (fault_str[f] = PyUnicode_InternFromString(FAULT_NAMES[f])) == NULL)
            return -1;
    return 0;
}
