/* Sequences: reading their fields and arguments, slot claims from the reserve, table
 * writes (sequence.py). Part of _native.c. */

/* -- argument helpers ------------------------------------------------------------------------- */

/* obj.__dict__[name] as a new reference, else the generic lookup. */
static PyObject *field(PyObject *obj, PyObject *name) {
    PyObject *d = PyObject_GenericGetDict(obj, NULL);
    if (d != NULL) {
        PyObject *v = PyDict_GetItemWithError(d, name);
        Py_DECREF(d);
        if (v != NULL) return Py_NewRef(v);
        if (PyErr_Occurred()) return NULL;
    } else {
        PyErr_Clear();
    }
    return PyObject_GetAttr(obj, name);
}

/* Field i of a Sequence (F_* below; its type is checked by own_slot or made here): the
 * dataclass has __slots__, read and written at their offsets. */
enum { F_REQUEST_ID, F_TOKENS, F_BLOCK_TABLE, F_SLOT, F_SEQ_ID, F_POOL_UID, F_CACHED, F_STATE,
       F_CHAIN, F_PUBLISHED };

static PyObject *sfield(Native *n, PyObject *seq, int i) {
    PyObject *v = *(PyObject **)((char *)seq + n->seq_off[i]);
    if (v == NULL) PyErr_SetObject(PyExc_AttributeError, PyTuple_GET_ITEM(n->seq_fields, i));
    return Py_XNewRef(v);
}

static void sset(Native *n, PyObject *seq, int i, PyObject *v) {
    Py_XSETREF(*(PyObject **)((char *)seq + n->seq_off[i]), Py_NewRef(v));
}

/* Append `item` (a new reference, NULL if making it failed) to `list`; the reference is
 * consumed either way. */
static int append_new(PyObject *list, PyObject *item) {
    if (item == NULL) return ERROR;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc ? ERROR : OK;
}

/* Token ids list[start:start + n] (ints) into `out` (int32, as the records store them);
 * FALLBACK on anything else (Python raises its own error). */
static int tokens_of(PyObject *list, Py_ssize_t start, int32_t *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, start + i);
        if (!PyLong_CheckExact(o)) {
            /* a numpy or torch integer in a list: its __index__, as int() would take it */
            PyObject *v = PyNumber_Index(o);
            if (v == NULL) {
                PyErr_Clear();
                return FALLBACK;
            }
            long x = PyLong_AsLong(v);
            Py_DECREF(v);
            if ((x == -1 && PyErr_Occurred()) || x < INT32_MIN || x > INT32_MAX) {
                PyErr_Clear();
                return FALLBACK;
            }
            out[i] = (int32_t)x;
            continue;
        }
#if PY_VERSION_HEX < 0x030C0000
        /* Up to 3.11 an int below 2**30 is one 30-bit digit with the sign in ob_size. */
        Py_ssize_t size = Py_SIZE(o);
        if (size >= -1 && size <= 1) {
            out[i] = (int32_t)(size * (long)((PyLongObject *)o)->ob_digit[0]);
            continue;
        }
#endif
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return FALLBACK;
        }
        if (v < INT32_MIN || v > INT32_MAX) return FALLBACK;
        out[i] = (int32_t)v;
    }
    return OK;
}


/* A block table (a list of at most cap block ids) into ids; the lock bits of the index
 * shards of its indexed blocks into *shards. FALLBACK on anything else. */
static int table_of(Native *n, PyObject *list, int32_t *ids, Py_ssize_t cap, Py_ssize_t *k,
                    uint64_t *shards) {
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) > cap) return FALLBACK;
    *k = PyList_GET_SIZE(list);
    *shards = 0;
    for (Py_ssize_t i = 0; i < *k; i++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(list, i));
        if (b < 0 || b >= n->nb) {
            PyErr_Clear();
            return FALLBACK;
        }
        ids[i] = (int32_t)b;
        if (blk(n, b)[BF_INDEXED] == 1) *shards |= block_shard_lock(n, b);
    }
    return OK;
}

/* OK when no Python-path operation of another thread is half done on this mapping. */
static int take_mutex(Native *n) { return *n->busy ? FALLBACK : OK; }

/* End of a call: give back the op mutex if waiting for a lock (or a handback) made it take
 * it. An exception already raised (a handback's) is kept across the call to release(): a call
 * made with one pending fails, and clearing that failure would lose it. */
static void drop_mutex(Native *n) {
    if (!n->mutex_held) return;
    n->mutex_held = 0;
    *n->busy -= 1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(n->mutex, s_release);
    if (r == NULL)
        PyErr_Clear();
    else
        Py_DECREF(r);
    PyErr_Restore(type, value, tb);
}

static PyObject *fallback(Native *n) {
    n->fallbacks++;
    Py_RETURN_NONE;
}

/* A sequence slot being claimed (SeqTable.claim): from this process's reserve, or, on a pool
 * too small for reserves, from the table under the seqs lock (`direct`). */
typedef struct {
    int64_t slot;
    uint64_t seq_id;
    int direct;
} Claim;

/* Before the transaction: the reserve's next slot and id; on a pool without reserves, the seqs
 * lock to add to the transaction's (*locks). FALLBACK when the reserve must be refilled
 * (runner.reserve_ready does that before the call: a reserve emptied meanwhile). */
static int claim_plan(Native *n, Claim *c, uint64_t *locks) {
    c->direct = n->slot_batch == 0;
    if (c->direct) {
        *locks |= lock_bit(n->lock_seqs);
        return OK;
    }
    Py_ssize_t r = PyList_GET_SIZE(n->reserve);
    if (r == 0) return FALLBACK;
    uint64_t next = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(n->ids, 0));
    uint64_t end = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(n->ids, 1));
    if (PyErr_Occurred()) return ERROR;
    if (next >= end) return FALLBACK;
    c->slot = PyLong_AsLongLong(PyList_GET_ITEM(n->reserve, r - 1));
    c->seq_id = next;
    return OK;
}

/* Inside the transaction, a direct claim: the lowest EMPTY slot no process reserves
 * (SeqTable.claim without a reserve), and the header's next sequence id (_take_ids). FALLBACK
 * when the table is full (the Python path raises its error). */
static int claim_take(Native *n, Claim *c) {
    if (!c->direct) return OK;
    int64_t found = -1;
    for (int64_t s = 0; s < n->max_seqs && found < 0; s++) {
        uint8_t *r = seqrec(n, s);
        if (r[SF_STATE] == S_EMPTY && r[SF_RESERVED] == 0) found = s;
    }
    if (found < 0) return FALLBACK;
    if (jsave(n, n->off_next_seq_id, 8)) return FALLBACK;
    uint64_t id = U8(n->seg + n->off_next_seq_id) + 1;
    U8(n->seg + n->off_next_seq_id) = id;
    c->slot = found;
    c->seq_id = id;
    return OK;
}

/* After commit: a claim from the reserve takes its slot and id out of it. */
static int claim_done(Native *n, const Claim *c) {
    if (c->direct) return OK;
    Py_ssize_t r = PyList_GET_SIZE(n->reserve);
    if (PyList_SetSlice(n->reserve, r - 1, r, NULL)) return ERROR;
    PyObject *v = PyLong_FromUnsignedLongLong(c->seq_id + 1);
    if (v == NULL) return ERROR;
    return PyList_SetItem(n->ids, 0, v);
}

/* SeqTable.claim's record writes (the slot is reserved by this client). */
static int write_claim(Native *n, int64_t slot, uint64_t seq_id, const char *request,
                       uint64_t now, int32_t site) {
    uint8_t *s = seqrec(n, slot);
    if (jsave_head(n, slot)) return FALLBACK;
    U2(s + SF_SITE) = (uint16_t)(site < 0 ? 0 : site + 1);
    I4(s + SF_OWNER_PID) = n->pid;
    I4(s + SF_OWNER_CLIENT) = n->client;
    U8(s + SF_OWNER_START) = n->start;
    memcpy(s + SF_REQUEST, request, REQUEST_BYTES);
    U8(s + SF_SEQ_ID) = seq_id;
    U8(s + SF_CREATED_NS) = now;
    U8(s + SF_NUM_TOKENS) = 0;
    U4(s + SF_NUM_BLOCKS) = 0;
    s[SF_STATE] = S_RUNNING;
    maybe_live_add(n, slot);
    crash_point(n, CP_AFTER_CLAIM);
    return OK;
}

/* SeqTable.write_blocks */
static int write_blocks(Native *n, int64_t slot, int64_t start, const int32_t *ids, int64_t k) {
    if (start + k > n->max_bps) return FALLBACK;
    uint8_t *s = seqrec(n, slot);
    if (jsave_head(n, slot)) return FALLBACK;
    if (k) {
        size_t off = n->off_seqs + (size_t)slot * n->seq_rec + SF_TABLE + 4 * (size_t)start;
        if (jsave(n, off, (uint32_t)(4 * k))) return FALLBACK;
        memcpy(s + SF_TABLE + 4 * start, ids, 4 * (size_t)k);
    }
    U4(s + SF_NUM_BLOCKS) = (uint32_t)(start + k);
    crash_point(n, CP_AFTER_TABLE);
    return OK;
}

/* reserve.fill: token ids at positions [first, first + k) of the table's blocks. */
static void fill(Native *n, const int32_t *table, int64_t first, const int32_t *toks, int64_t k) {
    int64_t pos = first, i = 0;
    while (i < k) {
        int64_t b = table[pos / n->bs], off = pos % n->bs;
        int64_t m = n->bs - off < k - i ? n->bs - off : k - i;
        memcpy(blk(n, b) + BF_TOKENS + 4 * off, toks + i, 4 * (size_t)m);
        U4(blk(n, b) + BF_NUM_TOKENS) = (uint32_t)(off + m);
        pos += m;
        i += m;
    }
}

/* sequence.request_bytes of a str: its UTF-8, truncated to 32 bytes, zero-padded. */
static int request_of(PyObject *rid, char *out) {
    Py_ssize_t len;
    const char *u = PyUnicode_AsUTF8AndSize(rid, &len);
    if (u == NULL) return ERROR;
    memset(out, 0, REQUEST_BYTES);
    memcpy(out, u, len < REQUEST_BYTES ? (size_t)len : REQUEST_BYTES);
    return OK;
}
