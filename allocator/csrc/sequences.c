/* Sequences: reading their fields and arguments, slot claims from the reserve, table
 * writes. Part of _native.c. */

/* -- argument helpers ------------------------------------------------------------------------- */

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
 * UNHANDLED on anything else (the caller raises: seq_changed). */
static int tokens_of(PyObject *list, Py_ssize_t start, int32_t *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, start + i);
        if (!PyLong_CheckExact(o)) {
            /* a numpy or torch integer in a list: its __index__, as int() would take it */
            PyObject *v = PyNumber_Index(o);
            if (v == NULL) {
                PyErr_Clear();
                return UNHANDLED;
            }
            long x = PyLong_AsLong(v);
            Py_DECREF(v);
            if ((x == -1 && PyErr_Occurred()) || x < INT32_MIN || x > INT32_MAX) {
                PyErr_Clear();
                return UNHANDLED;
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
            return UNHANDLED;
        }
        if (v < INT32_MIN || v > INT32_MAX) return UNHANDLED;
        out[i] = (int32_t)v;
    }
    return OK;
}


static int seq_changed(const char *what) {
    PyErr_Clear();
    return pool_error("a Sequence's %s was changed outside the pool; use Sequences only as the "
                      "pool returns them",
                      what);
}

static int table_of(Native *n, PyObject *list, int32_t *ids, Py_ssize_t cap, Py_ssize_t *k,
                    uint64_t *shards) {
    if (!PyList_CheckExact(list) || PyList_GET_SIZE(list) > cap) return seq_changed("block table");
    *k = PyList_GET_SIZE(list);
    *shards = 0;
    for (Py_ssize_t i = 0; i < *k; i++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(list, i));
        if (b < 0 || b >= n->nb) return seq_changed("block table");
        ids[i] = (int32_t)b;
        if (blk(n, b)[BF_INDEXED] == 1) *shards |= block_shard_lock(n, b);
    }
    return OK;
}


static void drop_mutex(Native *n) {
    if (!n->mutex_held) return;
    n->mutex_held = 0;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(n->mutex, s_release);
    if (r == NULL)
        PyErr_Clear();
    else
        Py_DECREF(r);
    PyErr_Restore(type, value, tb);
}

/* Wait for the handle's op mutex (another thread holds it), then hold it until the operation
 * ends (drop_mutex): after a rollback, holding no pool lock, so that thread cannot be waiting
 * for one of this one's. OK, or ERROR with an exception set. */
static int mutex_wait(Native *n) {
    if (n->mutex_held) return OK;
    uint64_t want = n->want_locks; /* (another thread's operation may run meanwhile) */
    PyObject *r = PyObject_CallMethodNoArgs(n->mutex, s_acquire);
    n->want_locks = want;
    if (r == NULL) return ERROR;
    Py_DECREF(r);
    n->mutex_held = 1;
    n->op_thread = PyThread_get_thread_ident();
    return OK;
}

static PyObject *unhandled_at(Native *n, const char *where, int line) {
    if (PyErr_Occurred()) return NULL;
    n->unhandled++;
    PyErr_Format(PyExc_RuntimeError,
                 "kvscope core: a case the core does not handle (a bug): at %s:%d", where, line);
    return NULL;
}

/* -- the slot reserve ---------------------------------------------------------------------- */

/* This process's reserve of sequence slots (docs/FORMAT.md "Slot reserves"): the core owns it
 * (n->res, n->id_next/id_end). reserve_run refills it when empty and gives a batch back when
 * full, each in a transaction of its own under the seqs lock, before an operation that claims
 * or releases a slot, so that the operation itself needs neither. */

static inline int reserve_keeps(Native *n, int64_t slot, int64_t taking) {
    uint8_t *s = seqrec(n, slot);
    return n->res_n - taking < 2 * n->slot_batch && s[SF_RESERVED] == 1 &&
           I4(s + SF_OWNER_CLIENT) == n->client;
}

static inline int reserve_due(Native *n, int claiming) {
    if (n->slot_batch == 0) return 0;
    if (claiming) return n->res_n == 0 || n->id_next >= n->id_end;
    return n->res_n >= 2 * n->slot_batch;
}

/* The refill's journaled writes (seqs lock held): a batch of EMPTY slots no
 * process reserves, cyclically from res_hint, marked reserved by this process, into got[]
 * (*ngot: none when the table has none: the claim then takes the table's own way and reports
 * a full one), and, when the ids are out, the header's next SEQ_ID_BATCH ids (*first). */
static int reserve_fill(Native *n, int32_t *got, int64_t *ngot, uint64_t *first) {
    *ngot = 0;
    *first = 0;
    if (n->res_n == 0) {
        for (int64_t i = 0; i < n->max_seqs && *ngot < n->slot_batch; i++) {
            int64_t s = (n->res_hint + i) % n->max_seqs;
            uint8_t *r = seqrec(n, s);
            if (r[SF_STATE] == S_EMPTY && r[SF_RESERVED] == 0) got[(*ngot)++] = (int32_t)s;
        }
        for (int64_t i = 0; i < *ngot; i++) {
            uint8_t *r = seqrec(n, got[i]);
            if (jsave_head(n, got[i])) return UNHANDLED;
            r[SF_RESERVED] = 1;
            I4(r + SF_OWNER_CLIENT) = n->client;
            I4(r + SF_OWNER_PID) = n->pid;
            U8(r + SF_OWNER_START) = n->start;
        }
        if (*ngot == 0) return OK;
    }
    if (n->id_next >= n->id_end) {
        if (jsave(n, HDR_NEXT_SEQ_ID, 8)) return UNHANDLED;
        *first = U8(n->seg + HDR_NEXT_SEQ_ID) + 1;
        U8(n->seg + HDR_NEXT_SEQ_ID) = *first + (uint64_t)SEQ_ID_BATCH - 1;
    }
    return OK;
}

/* The trim's journaled writes (seqs lock held): the batch claims would take
 * last (the reserve's start) back to the table. */
static int reserve_trim(Native *n) {
    for (int64_t i = 0; i < n->slot_batch; i++) {
        if (jsave_head(n, n->res[i])) return UNHANDLED;
        seqrec(n, n->res[i])[SF_RESERVED] = 0;
    }
    return OK;
}

static int reserve_run(Native *n, PyObject *pool, int claiming) {
    /* (another thread's operation waiting for a lock in the core holds it: this waits) */
    PyObject *r = PyObject_CallMethodNoArgs(n->mutex, s_acquire);
    if (r == NULL) return -1;
    Py_DECREF(r);
    int mine;
    if (wait_others(n, &mine, NULL)) {
        r = PyObject_CallMethodNoArgs(n->mutex, s_release);
        Py_XDECREF(r);
        return -1;
    }
    if (mine) {
        /* this thread's already, inside an operation (whose locks it may hold): not now */
        r = PyObject_CallMethodNoArgs(n->mutex, s_release);
        if (r == NULL) return -1;
        Py_DECREF(r);
        return 0;
    }
    n->mutex_held = 1;
    n->op_thread = PyThread_get_thread_ident();
    int rc = OK;
    int32_t got[2 * CHUNK];
    int64_t ngot = 0;
    uint64_t first = 0;
    if (!reserve_due(n, claiming) || ungated(n, pool)) goto out; /* (done meanwhile) */
    rc = txn_begin(n, lock_bit(n->lock_seqs));
    if (rc != OK) goto out;
    rc = claiming ? reserve_fill(n, got, &ngot, &first) : reserve_trim(n);
    if (rc != OK) {
        txn_abort(n);
        goto out;
    }
    txn_commit(n);
    if (claiming) {
        /* popped from the end: the lowest slot first */
        for (int64_t i = 0; i < ngot; i++) n->res[i] = got[ngot - 1 - i];
        if (ngot) n->res_n = ngot, n->res_hint = (got[ngot - 1] + 1) % n->max_seqs;
        if (first) n->id_next = first, n->id_end = first + (uint64_t)SEQ_ID_BATCH;
    } else {
        n->res_n -= n->slot_batch;
        memmove(n->res, n->res + n->slot_batch, sizeof(int32_t) * (size_t)n->res_n);
    }
out:
    drop_mutex(n);
    if (PyErr_Occurred()) return -1;
    return rc == OK;
}

/* reserve_state() -> (slots, next_id, end_id): the reserve as it is (a read, for tests). */
static PyObject *N_reserve_state(Native *n, PyObject *unused) {
    PyObject *slots = PyTuple_New(n->res_n);
    if (slots == NULL) return NULL;
    for (int64_t i = 0; i < n->res_n; i++) PyTuple_SET_ITEM(slots, i, PyLong_FromLong(n->res[i]));
    return Py_BuildValue("(NKK)", slots, (unsigned long long)n->id_next,
                         (unsigned long long)n->id_end);
}

static void claim_plan(Native *n, Claim *c, uint64_t *locks) {
    c->direct = n->slot_batch == 0 || n->res_n == 0 || n->id_next >= n->id_end;
    if (c->direct) {
        *locks |= lock_bit(n->lock_seqs);
        return;
    }
    c->slot = n->res[n->res_n - 1];
    c->seq_id = n->id_next;
}

static int claim_take(Native *n, Claim *c) {
    if (!c->direct) return OK;
    int64_t found = -1, held = 0;
    for (int64_t s = 0; s < n->max_seqs && found < 0; s++) {
        uint8_t *r = seqrec(n, s);
        if (r[SF_STATE] == S_EMPTY && r[SF_RESERVED] == 0) found = s;
    }
    if (found < 0) {
        for (int64_t s = 0; s < n->max_seqs; s++)
            held += seqrec(n, s)[SF_STATE] == S_EMPTY && seqrec(n, s)[SF_RESERVED] == 1;
        return pool_error("sequence table full: %lld live sequences and %lld empty slots reserved "
                          "by attached processes (PoolConfig.max_seqs is %lld); free finished "
                          "ones or create the pool with a larger max_seqs",
                          (long long)(n->max_seqs - held), (long long)held,
                          (long long)n->max_seqs);
    }
    if (jsave(n, HDR_NEXT_SEQ_ID, 8)) return UNHANDLED;
    uint64_t id = U8(n->seg + HDR_NEXT_SEQ_ID) + 1;
    U8(n->seg + HDR_NEXT_SEQ_ID) = id;
    c->slot = found;
    c->seq_id = id;
    return OK;
}

static int claim_done(Native *n, const Claim *c) {
    if (c->direct) return OK;
    n->res_n--;
    n->id_next++;
    return OK;
}

static int write_claim(Native *n, int64_t slot, uint64_t seq_id, const char *request,
                       uint64_t now, int32_t site) {
    uint8_t *s = seqrec(n, slot);
    if (jsave_head(n, slot)) return UNHANDLED;
    U2(s + SF_SITE) = (uint16_t)(site < 0 ? 0 : site + 1);
    I4(s + SF_OWNER_PID) = n->pid;
    I4(s + SF_OWNER_CLIENT) = n->client;
    U8(s + SF_OWNER_START) = n->start;
    memcpy(s + SF_REQUEST, request, REQUEST_BYTES);
    U8(s + SF_SEQ_ID) = seq_id;
    U8(s + SF_CREATED_NS) = now;
    seq_touch(n, slot);
    U8(s + SF_NUM_TOKENS) = 0;
    U4(s + SF_NUM_BLOCKS) = 0;
    s[SF_STATE] = S_RUNNING;
    maybe_live_add(n, slot);
    crash_point(n, CP_AFTER_CLAIM);
    return OK;
}

/* -- this handle's tables, counted per block ------------------------------------------------ */

/* The leaks probe asks, of every block handed out, whether a live table maps it, and of a
 * release's blocks, how many of this handle's tables map them. This handle's own tables change
 * only in its own transactions, here (write_blocks, set_block), so the core keeps their count
 * per block (own_refs) as it changes them, instead of reading every table for each question;
 * other clients' tables are still read (probes.c unmapped). Kept only while the leaks probe is
 * on: a change made without it, by a record borrowed to reclaim a dead one, or in a rollback
 * other than the transaction's own (recovery.c) drops the counts, and they are counted afresh
 * from the segment when next asked (probes.c own_refs_ready). */

/* Whether the counts follow a change to the table of `slot` now: they are kept, the slot is
 * this handle's own and live. */
static inline int own_follows(Native *n, int64_t slot) {
    if (!n->own_valid) return 0;
    if (!(n->probes & P_LEAKS) || n->borrowed) {
        n->own_valid = 0;
        return 0;
    }
    const uint8_t *s = seqrec(n, slot);
    return s[SF_STATE] != S_EMPTY && I4(s + SF_OWNER_CLIENT) == n->client;
}

/* An entry naming block b added to (d = 1) or removed from (d = -1) one of this handle's live
 * tables, logged for the transaction's rollback (the counts dropped where the log cannot grow). */
static void own_note(Native *n, int32_t b, int32_t d) {
    if (!n->own_valid || b < 0 || b >= n->nb) return;
    if (d < 0 && n->own_refs[b] <= 0) {
        /* (an entry the core did not write: the table was written from outside it) */
        n->own_valid = 0;
        return;
    }
    if (n->own_n == n->own_cap) {
        int64_t cap = n->own_cap ? 2 * n->own_cap : 256;
        int32_t *p = PyMem_Realloc(n->own_log, sizeof(int32_t) * (size_t)cap);
        if (p == NULL) {
            n->own_valid = 0;
            return;
        }
        n->own_log = p;
        n->own_cap = cap;
    }
    n->own_refs[b] += d;
    n->own_log[n->own_n++] = d > 0 ? b + 1 : -(b + 1);
}

/* write_blocks of `slot`, where the counts are kept: the entries from `start` on leave the
 * table, ids[0, k) join it. (Out of line: the write stays small where no probe counts.) */
static __attribute__((noinline)) void own_entries(Native *n, int64_t slot, int64_t start,
                                                  const int32_t *ids, int64_t k) {
    if (!own_follows(n, slot)) return;
    const uint8_t *s = seqrec(n, slot);
    const int32_t *t = (const int32_t *)(s + SF_TABLE);
    int64_t had = U4(s + SF_NUM_BLOCKS);
    if (had > n->max_bps) had = n->max_bps;
    for (int64_t j = start; j < had; j++) own_note(n, t[j], -1);
    for (int64_t j = 0; j < k; j++) own_note(n, ids[j], 1);
}

/* A transaction rolled back (its commit forgets the log): its changes to the counts undone,
 * newest first, unless the counts were counted inside it (they saw its changes: dropped). */
static void own_rollback(Native *n) {
    if (n->own_built == n->txn_stamp) {
        n->own_valid = 0;
    } else {
        for (int64_t i = n->own_n - 1; i >= 0; i--) {
            int32_t e = n->own_log[i];
            n->own_refs[e > 0 ? e - 1 : -e - 1] -= e > 0 ? 1 : -1;
        }
    }
    n->own_n = 0;
}

static int write_blocks(Native *n, int64_t slot, int64_t start, const int32_t *ids, int64_t k) {
    if (start + k > n->max_bps)
        return pool_error("sequence needs %lld blocks but PoolConfig.max_blocks_per_seq is %lld",
                          (long long)(start + k), (long long)n->max_bps);
    uint8_t *s = seqrec(n, slot);
    if (jsave_head(n, slot)) return UNHANDLED;
    if (n->own_valid) own_entries(n, slot, start, ids, k);
    if (k) {
        size_t off = n->off_seqs + (size_t)slot * n->seq_rec + SF_TABLE + 4 * (size_t)start;
        if (jsave(n, off, (uint32_t)(4 * k))) return UNHANDLED;
        memcpy(s + SF_TABLE + 4 * start, ids, 4 * (size_t)k);
    }
    U4(s + SF_NUM_BLOCKS) = (uint32_t)(start + k);
    crash_point(n, CP_AFTER_TABLE);
    return OK;
}

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

static int request_of(PyObject *rid, char *out) {
    Py_ssize_t len;
    const char *u = PyUnicode_AsUTF8AndSize(rid, &len);
    if (u == NULL) return ERROR;
    memset(out, 0, REQUEST_BYTES);
    memcpy(out, u, len < REQUEST_BYTES ? (size_t)len : REQUEST_BYTES);
    return OK;
}

/* -- the handle's live sequences (its registry) and the slots sampled guard mode guards ------- */

/* A slot argument: its int, or -1 with an exception set. */
static int64_t slot_arg(Native *n, PyObject *o) {
    int64_t slot = PyLong_AsLongLong(o);
    if (slot == -1 && PyErr_Occurred()) return -1;
    if (slot < 0 || slot >= n->max_seqs) {
        PyErr_Format(PyExc_ValueError, "slot %lld out of range", (long long)slot);
        return -1;
    }
    return slot;
}

/* live() -> {slot: Sequence}: a copy of the handle's live sequences, in the order they were
 * entered (the leaks probe and close read it). */
static PyObject *N_live(Native *n, PyObject *unused) {
    (void)unused;
    return PyDict_Copy(n->seqs);
}

/* guarded(slot) -> bool: whether sampled guard mode guards that slot's release. */
static PyObject *N_guarded(Native *n, PyObject *slot) {
    if (slot_arg(n, slot) < 0) return NULL;
    int in = PySet_Contains(n->guarded, slot);
    return in < 0 ? NULL : PyBool_FromLong(in);
}

/* -- a replay restored from a snapshot (kvscope/replay.py, allocator/checkpoint.py) ----------- */

/* adopt(seq): register a Sequence for a live record of this handle's client (its slot field
 * names it: RUNNING, WAITING or PREEMPTED, owned by this client, of the Sequence's seq id) as
 * the handle's own, its pool_uid set to this handle's: what a restored segment's sequences
 * need to be operated on. Writes nothing in the segment. ValueError where the record is not
 * one. */
static PyObject *N_adopt(Native *n, PyObject *seq) {
    if (n->seg == NULL || !PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) {
        PyErr_SetString(PyExc_TypeError, "adopt(seq): a Sequence, on an open handle");
        return NULL;
    }
    PyObject *slot_o = sfield(n, seq, F_SLOT), *id_o = sfield(n, seq, F_SEQ_ID);
    int64_t slot = slot_o ? PyLong_AsLongLong(slot_o) : -1;
    uint64_t id = id_o ? PyLong_AsUnsignedLongLong(id_o) : 0;
    if (PyErr_Occurred()) goto bad;
    if (slot < 0 || slot >= n->max_seqs) {
        PyErr_SetString(PyExc_ValueError, "adopt: slot out of range");
        goto bad;
    }
    const uint8_t *r = seqrec(n, slot);
    int st = r[SF_STATE];
    if ((st != S_RUNNING && st != S_WAITING && st != S_PREEMPTED) ||
        I4(r + SF_OWNER_CLIENT) != n->client || U8(r + SF_SEQ_ID) != id) {
        PyErr_Format(PyExc_ValueError, "adopt: slot %lld holds no live sequence %llu of this "
                     "client", (long long)slot, (unsigned long long)id);
        goto bad;
    }
    if (PyDict_Contains(n->seqs, slot_o)) {
        PyErr_Format(PyExc_ValueError, "adopt: slot %lld is registered already", (long long)slot);
        goto bad;
    }
    PyObject *uid = PyLong_FromLongLong(n->uid);
    if (uid == NULL) goto bad;
    sset(n, seq, F_POOL_UID, uid);
    Py_DECREF(uid);
    if (PyDict_SetItem(n->seqs, slot_o, seq)) goto bad;
    Py_DECREF(slot_o);
    Py_DECREF(id_o);
    Py_RETURN_NONE;
bad:
    Py_XDECREF(slot_o);
    Py_XDECREF(id_o);
    return NULL;
}

/* adopt_reserve(slots, next_id, end_id): take this reserve (reserve_state's) as the handle's:
 * the slots (EMPTY, reserved by this client in the table) and the sequence ids [next_id,
 * end_id) a snapshot's process held, which the segment does not name (its core held them).
 * Writes nothing in the segment. */
static PyObject *N_adopt_reserve(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "adopt_reserve(slots, next_id, end_id)");
        return NULL;
    }
    PyObject *slots = PySequence_Fast(args[0], "adopt_reserve: slots is a sequence");
    if (slots == NULL) return NULL;
    uint64_t next = PyLong_AsUnsignedLongLong(args[1]), end = PyLong_AsUnsignedLongLong(args[2]);
    Py_ssize_t k = PySequence_Fast_GET_SIZE(slots);
    if (PyErr_Occurred() || k > 2 * n->slot_batch || next > end) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "adopt_reserve: not a reserve of this pool");
        Py_DECREF(slots);
        return NULL;
    }
    int32_t *got = PyMem_Malloc(sizeof(int32_t) * (size_t)(k + 1));
    if (got == NULL) {
        Py_DECREF(slots);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t s = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(slots, i));
        if (s == -1 && PyErr_Occurred()) break;
        if (s < 0 || s >= n->max_seqs || seqrec(n, s)[SF_STATE] != S_EMPTY ||
            seqrec(n, s)[SF_RESERVED] != 1 || I4(seqrec(n, s) + SF_OWNER_CLIENT) != n->client) {
            PyErr_Format(PyExc_ValueError, "adopt_reserve: slot %lld is not reserved by this "
                         "client", (long long)s);
            break;
        }
        got[i] = (int32_t)s;
    }
    Py_DECREF(slots);
    if (!PyErr_Occurred()) memcpy(n->res, got, sizeof(int32_t) * (size_t)k);
    PyMem_Free(got);
    if (PyErr_Occurred()) return NULL;
    n->res_n = k;
    n->id_next = next;
    n->id_end = end;
    Py_RETURN_NONE;
}
