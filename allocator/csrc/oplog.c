/* The operation log (docs/REPLAY.md): while a handle records (PoolConfig(record_ops=PATH),
 * KVSCOPE_RECORD_OPS=PATH: `kvscope run --record-ops`), every public operation of the core
 * appends one record to the log file, written with one write(2) on a descriptor opened
 * O_APPEND, so every process and handle recording into one file appends whole records. The
 * record's layout is records.py's OPLOG_FIELDS (OR_* in layout.h); its `seq` is the segment's
 * global operation number (the header's op_seq, an atomic add by every recording process),
 * taken when the operation returns. Off (no log), an operation costs one test of `n->oplog`.
 * Part of _native.c. */

typedef PyObject *(*FastFn)(Native *, PyObject *const *, Py_ssize_t);

/* Records are composed into `out` and written with one write(2) when it fills, when a record
 * says something happened (a status other than ok, a finding, a fault, a START, a LOST, a
 * report), and when recording stops: the log on disk holds every record up to the last such
 * one, and a process killed loses at most the ordinary records since (a reader sees the gap). */
#define OPLOG_OUT (64 * 1024)

typedef struct Oplog {
    int fd;
    int32_t owner;  /* the process that opened it (a forked child's copy never writes) */
    uint8_t *out;   /* records not yet written, out_n bytes of them, out_recs records */
    size_t out_n;
    int64_t out_recs;
    int32_t *tok;   /* the open call's tokens, as the core read them (oplog_tokens) */
    int64_t ntok, cap_tok;
    int have_tok;
    int depth; /* calls in flight on this handle's thread (a call from inside one is refused) */
    uint64_t key;   /* redaction: tokens and request ids written as keyed hashes (0: off) */
    size_t off_seq; /* the header's op_seq */
    uint32_t tag;   /* the pool's tag, in every record */
    uint64_t lost;  /* records a failed write lost since the last one written */
    int64_t *pre;   /* the seq ids the call in flight preempted (oplog_preempted) */
    int64_t n_pre, cap_pre;
    uint8_t *buf; /* the record being composed */
    size_t cap;
} Oplog;

/* The record's check (allocator/oplog.py record_check): fmix64 of the sum of its 64-bit words,
 * word i weighted by 2i + 1, with the check itself 0. Any one word changed changes it. */
static uint64_t record_check(const uint8_t *r, size_t size) {
    const uint64_t *w = (const uint64_t *)r;
    uint64_t h = 0;
    for (size_t i = 0; i < size / 8; i++) h += w[i] * (2 * (uint64_t)i + 1);
    return fmix64(h);
}

/* This thread's id (cached: gettid is a system call), fetched again in a forked child. */
static __thread int32_t tl_tid;
static __thread int tl_gen = -1;
static inline int32_t thread_id(void) {
    if (tl_gen != fork_gen) {
        tl_tid = (int32_t)syscall(SYS_gettid);
        tl_gen = fork_gen;
    }
    return tl_tid;
}

/* The open call's tokens, as N_allocate / N_append read them (their hook). */
static void oplog_tokens(Native *n, const int32_t *v, Py_ssize_t k) {
    Oplog *L = n->oplog;
    if (k > L->cap_tok) {
        int32_t *t = PyMem_Realloc(L->tok, sizeof(int32_t) * (size_t)k);
        if (t == NULL) return;
        L->tok = t;
        L->cap_tok = k;
    }
    memcpy(L->tok, v, sizeof(int32_t) * (size_t)k);
    L->ntok = k;
    L->have_tok = 1;
}

/* Write the records composed so far (by the process that opened the log only). */
static void oplog_flush(Oplog *L) {
    if (L->out_n == 0) return;
    if (L->owner == (int32_t)getpid()) {
        size_t done = 0;
        while (done < L->out_n) {
            ssize_t w = write(L->fd, L->out + done, L->out_n - done);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) break;
            done += (size_t)w;
        }
        if (done < L->out_n) L->lost += (uint64_t)L->out_recs;
    }
    L->out_n = 0;
    L->out_recs = 0;
}

/* A preemption of the open call: the Sequence's id, kept for the call's record. */
static void oplog_preempted(Native *n, PyObject *seq) {
    Oplog *L = n->oplog;
    PyObject *id = sfield(n, seq, F_SEQ_ID);
    int64_t v = id ? PyLong_AsLongLong(id) : -1;
    Py_XDECREF(id);
    if (PyErr_Occurred()) PyErr_Clear();
    if (L->n_pre == L->cap_pre) {
        int64_t cap = L->cap_pre ? 2 * L->cap_pre : 16;
        int64_t *p = PyMem_Realloc(L->pre, sizeof(int64_t) * (size_t)cap);
        if (p == NULL) return; /* (the record lists fewer; replay compares what it lists) */
        L->pre = p;
        L->cap_pre = cap;
    }
    L->pre[L->n_pre++] = v;
}

static inline int32_t oplog_token(Oplog *L, int32_t t) {
    return L->key ? (int32_t)(fmix64(L->key ^ (uint64_t)(uint32_t)t) & 0x7FFFFFFF) : t;
}

/* What one record holds besides its fixed fields. */
typedef struct {
    int op, status, flags;
    int64_t seq_id, src_id, arg, result;
    char request[REQUEST_BYTES];
    const void *text; /* START: the JSON text, n_text bytes */
    int64_t n_text;
    const int32_t *blocks; /* the block ids (a sequence record's table, or a copy) */
    int64_t n_blocks;
    PyObject *copies;  /* a list of (src, dst), or NULL */
    Py_ssize_t found0; /* KVPool._found's length when the call began (-1: `found_at` only) */
    int64_t found_at;  /* a REPORT's ring position */
    int scratch;       /* the call's tokens and preemptions go in (an operation's record) */
} OpRec;

/* A request id's 32 bytes as the log keeps them (redacted: 'h' and 16 hex digits). */
static void oplog_request(Oplog *L, const char *in, char *out) {
    memcpy(out, in, REQUEST_BYTES);
    if (!L->key || out[0] == 0) return;
    uint64_t h = L->key;
    for (int i = 0; i < REQUEST_BYTES && in[i]; i++) h = fmix64(h ^ (uint8_t)in[i]);
    memset(out, 0, REQUEST_BYTES);
    snprintf(out, REQUEST_BYTES, "h%016llx", (unsigned long long)h);
}

/* Room for `size` more bytes in the output buffer (what is there written first); NULL where
 * a record is larger than the buffer and no memory is left for it. */
static uint8_t *oplog_room(Oplog *L, size_t size, uint8_t **big) {
    *big = NULL;
    if (L->out_n + size > OPLOG_OUT) oplog_flush(L);
    if (size <= OPLOG_OUT) return L->out + L->out_n;
    return *big = PyMem_Malloc(size);
}

/* Compose one record into the output buffer. Errors are never raised: a record that cannot be
 * written is counted lost, and the next one written is preceded by a LOST record saying how
 * many (its number taken too: readers see where). */
static void oplog_write(Native *n, OpRec *o) {
    Oplog *L = n->oplog;
    if (n->seg == NULL) return;
    Py_ssize_t nc = o->copies && PyList_Check(o->copies) ? PyList_GET_SIZE(o->copies) : 0;
    Py_ssize_t nf = 0;
    if (o->found0 >= 0 && n->found) nf = PyList_GET_SIZE(n->found) - o->found0;
    if (o->found0 < 0) nf = 1;
    if (nf < 0) nf = 0;
    if (nf > 255) nf = 255;
    int64_t nt = o->scratch && L->have_tok ? L->ntok : 0;
    int64_t npre = o->scratch ? L->n_pre : 0;
    size_t text_bytes = o->op == OP_START ? (size_t)o->n_text : 4 * (size_t)nt;
    size_t size = OPLOG_HEAD + text_bytes + 4 * (size_t)o->n_blocks + 8 * (size_t)nc +
                  8 * (size_t)npre + OPLOG_FOUND * (size_t)nf;
    size = (size + 7) & ~(size_t)7;
    uint64_t *op_seq = (uint64_t *)(n->seg + L->off_seq);
    if (L->lost) {
        uint8_t *big, *mark = oplog_room(L, OPLOG_HEAD, &big);
        memset(mark, 0, OPLOG_HEAD);
        U4(mark + OR_MAGIC) = OPLOG_MAGIC;
        U4(mark + OR_SIZE) = OPLOG_HEAD;
        U8(mark + OR_SEQ) = __atomic_add_fetch(op_seq, 1, __ATOMIC_SEQ_CST);
        U8(mark + OR_TIME_NS) = clock_ns(CLOCK_REALTIME_COARSE);
        I4(mark + OR_PID) = n->pid;
        I4(mark + OR_TID) = thread_id();
        U4(mark + OR_POOL) = L->tag;
        mark[OR_OP] = OP_LOST;
        U8(mark + OR_SEQ_ID) = (uint64_t)-1;
        U8(mark + OR_SRC_ID) = (uint64_t)-1;
        U8(mark + OR_ARG) = L->lost;
        U8(mark + OR_CHECK) = record_check(mark, OPLOG_HEAD);
        L->lost = 0;
        L->out_n += OPLOG_HEAD;
        L->out_recs++;
        oplog_flush(L);
    }
    uint8_t *big, *r = size > UINT32_MAX ? NULL : oplog_room(L, size, &big);
    if (r == NULL) {
        L->lost++;
        return;
    }
    memset(r, 0, OPLOG_HEAD);
    U4(r + OR_MAGIC) = OPLOG_MAGIC;
    U4(r + OR_SIZE) = (uint32_t)size;
    U8(r + OR_TIME_NS) = clock_ns(CLOCK_REALTIME_COARSE);
    I4(r + OR_PID) = n->pid;
    I4(r + OR_TID) = thread_id();
    r[OR_OP] = (uint8_t)o->op;
    r[OR_STATUS] = (uint8_t)o->status;
    r[OR_FLAGS] = (uint8_t)(o->flags | (L->key && o->op != OP_START ? OPLOG_REDACTED : 0));
    r[OR_N_FOUND] = (uint8_t)nf;
    U4(r + OR_PROBES) = (uint32_t)*n->probe_bits;
    U4(r + OR_N_TOKENS) = (uint32_t)(o->op == OP_START ? o->n_text : nt);
    U4(r + OR_N_BLOCKS) = (uint32_t)o->n_blocks;
    U4(r + OR_N_COPIES) = (uint32_t)nc;
    U4(r + OR_N_PREEMPTED) = (uint32_t)npre;
    U4(r + OR_POOL) = L->tag;
    U8(r + OR_SEQ_ID) = (uint64_t)o->seq_id;
    U8(r + OR_SRC_ID) = (uint64_t)o->src_id;
    U8(r + OR_ARG) = (uint64_t)o->arg;
    U8(r + OR_RESULT) = (uint64_t)o->result;
    oplog_request(L, o->request, (char *)r + OR_REQUEST);
    uint8_t *p = r + OPLOG_HEAD;
    if (o->op == OP_START) memcpy(p, o->text, text_bytes);
    else if (!L->key) memcpy(p, L->tok, text_bytes);
    else
        for (int64_t i = 0; i < nt; i++) I4(p + 4 * i) = oplog_token(L, L->tok[i]);
    p += text_bytes;
    memcpy(p, o->blocks, 4 * (size_t)o->n_blocks);
    p += 4 * (size_t)o->n_blocks;
    for (Py_ssize_t i = 0; i < nc; i++, p += 8) {
        PyObject *pair = PyList_GET_ITEM(o->copies, i);
        int ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2;
        I4(p) = ok ? (int32_t)PyLong_AsLong(PyTuple_GET_ITEM(pair, 0)) : -1;
        I4(p + 4) = ok ? (int32_t)PyLong_AsLong(PyTuple_GET_ITEM(pair, 1)) : -1;
    }
    if (npre) memcpy(p, L->pre, 8 * (size_t)npre);
    p += 8 * (size_t)npre;
    for (Py_ssize_t i = 0; i < nf; i++, p += OPLOG_FOUND) {
        uint64_t pos = o->found0 < 0 ? (uint64_t)o->found_at
                                     : PyLong_AsUnsignedLongLong(
                                           PyList_GET_ITEM(n->found, o->found0 + i));
        const uint8_t *f =
            n->seg + n->off_findings + (size_t)(pos % (uint64_t)n->fd_cap) * n->fd_size;
        I4(p + OF_BLOCK) = I4(f + n->fd_block);
        size_t kl = n->fd_kind_bytes < OPLOG_FOUND - OF_KIND ? n->fd_kind_bytes
                                                              : OPLOG_FOUND - OF_KIND;
        memcpy(p + OF_KIND, f + n->fd_kind, kl);
        memset(p + OF_KIND + kl, 0, OPLOG_FOUND - OF_KIND - kl);
    }
    memset(p, 0, (size_t)(r + size - p)); /* (the padding) */
    if (PyErr_Occurred()) PyErr_Clear(); /* (an int that did not fit: written as -1) */
    U8(r + OR_SEQ) = __atomic_add_fetch(op_seq, 1, __ATOMIC_SEQ_CST);
    U8(r + OR_CHECK) = record_check(r, size);
    if (big) {
        oplog_flush(L);
        ssize_t w = L->owner == (int32_t)getpid() ? write(L->fd, big, size) : (ssize_t)size;
        if (w != (ssize_t)size) L->lost++;
        PyMem_Free(big);
        return;
    }
    L->out_n += size;
    L->out_recs++;
    /* something happened: on disk now */
    if (o->status != OS_OK || nf || o->flags || o->op == OP_START || o->op == OP_REPORT)
        oplog_flush(L);
}

/* The live slot a Sequence names (its slot field, in the table's range), else -1. */
static int64_t slot_of(Native *n, PyObject *seq) {
    if (seq == NULL || !PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) return -1;
    PyObject *v = *(PyObject **)((char *)seq + n->seq_off[F_SLOT]);
    int64_t s = v && PyLong_CheckExact(v) ? PyLong_AsLongLong(v) : -1;
    if (s == -1 && PyErr_Occurred()) PyErr_Clear();
    return s >= 0 && s < n->max_seqs ? s : -1;
}

/* A Sequence's integer field (-1: none). */
static int64_t seq_int(Native *n, PyObject *seq, int field) {
    if (seq == NULL || !PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) return -1;
    PyObject *v = *(PyObject **)((char *)seq + n->seq_off[field]);
    int64_t x = v && PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
    if (x == -1 && PyErr_Occurred()) PyErr_Clear();
    return x;
}

/* A slot's table and seq id, from its record in the segment. */
static void slot_table(Native *n, int64_t slot, OpRec *o) {
    const uint8_t *s = seqrec(n, slot);
    uint32_t k = U4(s + SF_NUM_BLOCKS);
    o->blocks = (const int32_t *)(s + SF_TABLE);
    o->n_blocks = k <= (uint64_t)n->max_bps ? k : 0;
}

/* The request id of an argument, as the segment keeps it (its str's first 32 bytes). */
static void oplog_rid(PyObject *rid, char *out) {
    memset(out, 0, REQUEST_BYTES);
    PyObject *s = rid ? request_str(rid) : NULL;
    if (s == NULL || request_of(s, out)) PyErr_Clear();
    Py_XDECREF(s);
}

/* One public operation run and recorded: `fn` called as it is, its record written after. */
static PyObject *oplog_op(Native *n, int op, FastFn fn, PyObject *const *args, Py_ssize_t nargs) {
    Oplog *L = n->oplog;
    /* (the call's tokens and preemptions are set after its gate, so by this call only: another
     * thread's operation on the handle waits there; both are cleared once its record is
     * written) */
    OpRec o;
    o.op = op;
    o.scratch = L->depth == 0;
    o.status = OS_OK;
    o.flags = 0;
    o.seq_id = o.src_id = -1;
    o.arg = o.result = 0;
    o.n_blocks = 0;
    o.blocks = NULL;
    o.copies = NULL;
    o.found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    Py_ssize_t armed0 = n->faults_armed ? PyDict_Size(n->faults_armed) : 0;
    PyObject *seq = nargs >= 2 && op != OP_ALLOCATE && op != OP_EVICT ? args[1] : NULL;
    int64_t slot = slot_of(n, seq);
    int32_t before_s[64], *before = before_s; /* free, abort: the table the release drops */
    int64_t n_before = 0;
    if (slot >= 0) {
        memcpy(o.request, seqrec(n, slot) + SF_REQUEST, REQUEST_BYTES);
        if (op == OP_FREE || op == OP_ABORT) {
            OpRec t;
            slot_table(n, slot, &t);
            if (t.n_blocks > 64) before = PyMem_Malloc(4 * (size_t)t.n_blocks);
            if (before == NULL) before = before_s;
            else {
                memcpy(before, t.blocks, 4 * (size_t)t.n_blocks);
                n_before = t.n_blocks;
            }
        }
    } else {
        memset(o.request, 0, REQUEST_BYTES);
        if (seq && PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) {
            PyObject *rid = *(PyObject **)((char *)seq + n->seq_off[F_REQUEST_ID]);
            if (rid) oplog_rid(rid, o.request);
        }
    }
    int64_t id_before = seq_int(n, seq, F_SEQ_ID);

    L->depth++;
    PyObject *res = fn(n, args, nargs);
    L->depth--;

    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    if (res == NULL) {
        o.status = et == NULL ? OS_ERROR
                   : PoolExhaustedType && PyErr_GivenExceptionMatches(et, PoolExhaustedType)
                       ? OS_EXHAUSTED
                   : PoolErrorType && PyErr_GivenExceptionMatches(et, PoolErrorType) ? OS_REFUSED
                                                                                     : OS_ERROR;
    }
    if (n->faults_armed && PyDict_Size(n->faults_armed) < armed0) o.flags |= OPLOG_FAULT;
    int64_t after = -1;
    switch (op) {
    case OP_ALLOCATE:
        if (nargs == 3) oplog_rid(args[2], o.request);
        if (res) {
            after = slot_of(n, res);
            o.result = seq_int(n, res, F_CACHED);
        }
        break;
    case OP_APPEND:
        o.seq_id = id_before;
        after = slot_of(n, seq);
        if (res && PyList_Check(res)) o.copies = res;
        break;
    case OP_FORK:
        o.src_id = id_before;
        if (res) after = slot_of(n, res);
        if (nargs == 3) oplog_rid(args[2], o.request);
        break;
    case OP_MARK_COMPUTED: {
        o.seq_id = id_before;
        int over = 0;
        o.arg = nargs == 3 && PyLong_Check(args[2]) ? PyLong_AsLongLongAndOverflow(args[2], &over)
                                                    : 0;
        if (over) o.arg = over > 0 ? INT64_MAX : INT64_MIN;
        if (res && PyLong_Check(res)) o.result = PyLong_AsLongLong(res);
        break;
    }
    case OP_FREE:
    case OP_ABORT:
        o.seq_id = id_before;
        if (res) {
            o.blocks = before;
            o.n_blocks = n_before;
        }
        break;
    case OP_SET_STATE:
        o.seq_id = id_before;
        if (nargs == 3 && PyUnicode_Check(args[2]))
            o.arg = PyUnicode_CompareWithASCIIString(args[2], "running") == 0   ? 1
                    : PyUnicode_CompareWithASCIIString(args[2], "waiting") == 0 ? 2
                                                                                : 0;
        break;
    case OP_RESUME:
        o.src_id = id_before;
        o.seq_id = seq_int(n, seq, F_SEQ_ID);
        after = slot_of(n, seq);
        if (res && PyLong_Check(res)) o.result = PyLong_AsLongLong(res);
        break;
    case OP_EVICT:
        o.arg = nargs == 2 && PyLong_Check(args[1]) ? PyLong_AsLongLong(args[1]) : 0;
        if (res && PyLong_Check(res)) o.result = PyLong_AsLongLong(res);
        break;
    }
    if (after >= 0) {
        slot_table(n, after, &o);
        if (op == OP_ALLOCATE || op == OP_FORK) o.seq_id = (int64_t)U8(seqrec(n, after) + SF_SEQ_ID);
    }
    if (PyErr_Occurred()) PyErr_Clear();
    oplog_write(n, &o);
    if (before != before_s) PyMem_Free(before);
    PyErr_Restore(et, ev, etb);
    if (o.scratch) {
        L->n_pre = 0;
        L->have_tok = 0;
    }
    return res;
}

/* The recorded entry points (module.c's table): each the operation itself while no log is
 * open (one test), else run through oplog_op. */
#define RECORDED(name, op, fn)                                                                 \
    static PyObject *name(Native *n, PyObject *const *args, Py_ssize_t nargs) {                \
        if (n->oplog == NULL) return fn(n, args, nargs);                                       \
        return oplog_op(n, op, fn, args, nargs);                                               \
    }
RECORDED(R_allocate, OP_ALLOCATE, N_allocate)
RECORDED(R_append, OP_APPEND, N_append)
RECORDED(R_fork, OP_FORK, N_fork)
RECORDED(R_mark_computed, OP_MARK_COMPUTED, N_mark_computed)
RECORDED(R_set_state, OP_SET_STATE, N_set_state)
RECORDED(R_resume, OP_RESUME, N_resume)
RECORDED(R_evict, OP_EVICT, N_evict)

static PyObject *R_end(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (n->oplog == NULL) return N_end(n, args, nargs);
    long final = nargs == 3 ? PyLong_AsLong(args[2]) : 0;
    if (final == -1 && PyErr_Occurred()) PyErr_Clear();
    return oplog_op(n, final == 4 ? OP_ABORT : OP_FREE, N_end, args, nargs);
}

/* report(...): a finding reported between operations, recorded as a REPORT. */
static PyObject *R_report(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *res = N_report(n, args, nargs);
    if (n->oplog == NULL || res == NULL) return res;
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = OP_REPORT;
    o.seq_id = o.src_id = -1;
    o.found0 = -1;
    o.found_at = (int64_t)PyLong_AsUnsignedLongLong(res);
    if (nargs == 7) oplog_rid(args[5], o.request);
    oplog_write(n, &o);
    if (PyErr_Occurred()) PyErr_Clear();
    return res;
}

static void oplog_free(Native *n) {
    Oplog *L = n->oplog;
    if (L == NULL) return;
    n->oplog = NULL;
    oplog_flush(L);
    if (L->fd >= 0) close(L->fd);
    PyMem_Free(L->pre);
    PyMem_Free(L->out);
    PyMem_Free(L->tok);
    PyMem_Free(L);
}

/* oplog_open(path, key, start_text, off_op_seq, tag): start recording into the file at `path`
 * (created 0600 if missing, appended to), with a START record holding start_text (the
 * handle's geometry, probes and armed faults as JSON: allocator/oplog.py); `key` non-zero
 * redacts; `tag` is the pool's, in every record. A log already open is closed first. */
static PyObject *N_oplog_open(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "oplog_open(path, key, start_text, off_op_seq, tag)");
        return NULL;
    }
    if (unusable(n)) return NULL;
    PyObject *path = PyUnicode_EncodeFSDefault(args[0]);
    if (path == NULL) return NULL;
    uint64_t key = PyLong_AsUnsignedLongLongMask(args[1]);
    Py_ssize_t tl;
    const char *text = PyUnicode_AsUTF8AndSize(args[2], &tl);
    int64_t off = PyLong_AsLongLong(args[3]);
    uint32_t tag = (uint32_t)PyLong_AsUnsignedLongMask(args[4]);
    if (text == NULL || PyErr_Occurred()) {
        Py_DECREF(path);
        return NULL;
    }
    if (off < 0 || (off & 7) || (size_t)off + 8 > (size_t)n->buf.len) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_ValueError, "op_seq outside the header");
        return NULL;
    }
    int fd = open(PyBytes_AS_STRING(path), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, args[0]);
        Py_DECREF(path);
        return NULL;
    }
    Py_DECREF(path);
    oplog_free(n);
    Oplog *L = PyMem_Calloc(1, sizeof(Oplog));
    uint8_t *out = L ? PyMem_Malloc(OPLOG_OUT) : NULL;
    if (out == NULL) {
        PyMem_Free(L);
        close(fd);
        return PyErr_NoMemory();
    }
    L->fd = fd;
    L->owner = (int32_t)getpid();
    L->out = out;
    L->key = key;
    L->off_seq = (size_t)off;
    L->tag = tag;
    n->oplog = L;
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = OP_START;
    o.seq_id = o.src_id = -1;
    o.text = text;
    o.n_text = tl;
    o.found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    oplog_write(n, &o);
    if (L->lost) {
        oplog_free(n);
        return PyErr_Format(PyExc_OSError, "cannot write the operation log %R", args[0]);
    }
    Py_RETURN_NONE;
}

static PyObject *N_oplog_close(Native *n, PyObject *unused) {
    oplog_free(n);
    Py_RETURN_NONE;
}

/* oplog_flush(): write the records composed so far (tests, and a program about to exit). */
static PyObject *N_oplog_flush(Native *n, PyObject *unused) {
    if (n->oplog) oplog_flush(n->oplog);
    Py_RETURN_NONE;
}
