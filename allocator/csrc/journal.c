/* The undo journal: save before every write, roll back, commit. Part of _native.c. */

/* -- the journal ------------------------------------------------------------------------------ */

static int jsave(Native *n, size_t off, uint32_t len) {
    if (n->jcount + 1 > JOURNAL_ENTRIES || n->jused + len > JOURNAL_BYTES) {
        /* (the operation rolls back: eviction.c rolled_back) */
        n->jfull = 1;
        n->jfull_entries = n->jcount + 1;
        n->jfull_bytes = n->jused + len;
        return UNHANDLED;
    }
    if (n->crash_at > 0 && --n->crash_at == 0) kill(getpid(), SIGKILL);
    uint8_t *e = n->seg + n->c_journal + (size_t)n->jcount * JENTRY;
    U8(e + JE_OFFSET) = off;
    U4(e + JE_LENGTH) = len;
    U4(e + JE_DATA_OFF) = n->jused;
    U8(e + JE_OP) = 0;
    memcpy(n->seg + n->c_jdata + n->jused, n->seg + off, len);
    n->jused += len;
    n->jcount += 1;
    U4(n->seg + n->c_jused) = n->jused;
    /* The count is written last: an entry exists only once its bytes are saved. */
    __atomic_store_n((uint32_t *)(n->seg + n->c_jcount), n->jcount, __ATOMIC_RELEASE);
    return OK;
}

static inline int jsave_block(Native *n, int64_t b) {
    /* magic: a record something else wrote is reported before it is changed and resealed */
    if ((n->probes & P_MAGIC) && record_sealed(n, b)) return ERROR;
    return jsave(n, n->off_blocks + b * n->rec, (uint32_t)n->rec);
}

static inline int jsave_head(Native *n, int64_t slot) {
    return jsave(n, n->off_seqs + (size_t)slot * n->seq_rec, SF_TABLE);
}

/* Restore the first cnt entries of a journal, newest first, and empty it: this handle's own
 * (delta 0), or the one `delta` bytes past it (another client's record: recovery.c). */
static void jundo(Native *n, ptrdiff_t delta, uint32_t cnt) {
    for (int64_t i = (int64_t)cnt - 1; i >= 0; i--) {
        uint8_t *e = n->seg + n->c_journal + delta + (size_t)i * JENTRY;
        memmove(n->seg + U8(e + JE_OFFSET), n->seg + n->c_jdata + delta + U4(e + JE_DATA_OFF),
                U4(e + JE_LENGTH));
    }
    __atomic_store_n((uint32_t *)(n->seg + n->c_jcount + delta), 0, __ATOMIC_RELEASE);
    U4(n->seg + n->c_jused + delta) = 0;
    if (delta == 0) n->jcount = n->jused = 0;
}

static void jrollback(Native *n) { jundo(n, 0, n->jcount); }

static void jcommit(Native *n) {
    if (n->jcount || n->jused) {
        __atomic_store_n((uint32_t *)(n->seg + n->c_jcount), 0, __ATOMIC_RELEASE);
        U4(n->seg + n->c_jused) = 0;
    }
    n->jcount = n->jused = 0;
}

static int journal_full(Native *n) {
    if (JournalFullType == NULL) return pool_error("the undo journal is full");
    PyObject *msg = PyUnicode_FromFormat("operation too large for the undo journal (%u entries, "
                                         "%u bytes); use smaller batches",
                                         n->jfull_entries, n->jfull_bytes);
    PyObject *err = msg ? PyObject_CallOneArg(JournalFullType, msg) : NULL;
    if (err) PyErr_SetObject(JournalFullType, err);
    Py_XDECREF(msg);
    Py_XDECREF(err);
    return ERROR;
}

static int core_bug(const char *what) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_RuntimeError, "kvscope core: %s (a bug)", what);
    return ERROR;
}

/* Room a transaction keeps besides its blocks' saves: the sequence's head (twice), the ring's
 * header and slots, the local cache's count (blocks_fit). */
#define TXN_SLACK_ENTRIES 16
#define TXN_SLACK_BYTES 8192

static int64_t blocks_fit(Native *n, int64_t recs, int64_t bytes, int64_t entries) {
    int64_t by_bytes = ((int64_t)JOURNAL_BYTES - TXN_SLACK_BYTES) / (recs * n->rec + bytes);
    int64_t by_entries = ((int64_t)JOURNAL_ENTRIES - TXN_SLACK_ENTRIES) / entries;
    int64_t k = by_bytes < by_entries ? by_bytes : by_entries;
    return k < 1 ? 1 : k > CHUNK ? CHUNK : k;
}
