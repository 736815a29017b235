/* The operation log (docs/REPLAY.md): while a handle records (PoolConfig(record_ops=PATH),
 * KVSCOPE_RECORD_OPS=PATH: `kvscope run --record-ops`), every public operation of the core
 * appends one record to the log file, written with one write(2) on a descriptor opened
 * O_APPEND, so every process and handle recording into one file appends whole records. The
 * record's layout is records.py's OPLOG_FIELDS (OR_* in layout.h); its `seq` is the segment's
 * global operation number (the header's op_seq, an atomic add by every recording process),
 * taken when the operation returns. Off (no log), an operation costs one test of `n->oplog`.
 * Part of _native.c. */

typedef PyObject *(*FastFn)(Native *, PyObject *const *, Py_ssize_t);

typedef struct Oplog {
    int fd;
    uint64_t key;   /* redaction: tokens and request ids written as keyed hashes (0: off) */
    size_t off_seq; /* the header's op_seq */
    uint32_t tag;   /* the pool's tag, in every record */
    uint64_t lost;  /* records a failed write lost since the last one written */
    int64_t *pre;   /* the seq ids the call in flight preempted (oplog_preempted) */
    int64_t n_pre, cap_pre;
    uint8_t *buf; /* the record being composed */
    size_t cap;
} Oplog;

/* The record's check: CRC-32 (zlib's, as Python's zlib.crc32 computes it). */
static uint32_t crc_table[256];
static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[i] = c;
    }
}
static uint32_t crc32_of(const uint8_t *p, size_t len) {
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < len; i++) c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
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

static int oplog_room(Oplog *L, size_t size) {
    if (size <= L->cap) return OK;
    size_t cap = L->cap ? L->cap : 1024;
    while (cap < size) cap *= 2;
    uint8_t *b = PyMem_Realloc(L->buf, cap);
    if (b == NULL) return ERROR;
    L->buf = b;
    L->cap = cap;
    return OK;
}

static inline int32_t oplog_token(Oplog *L, int32_t t) {
    return L->key ? (int32_t)(fmix64(L->key ^ (uint64_t)(uint32_t)t) & 0x7FFFFFFF) : t;
}

/* What one record holds besides its fixed fields. */
typedef struct {
    int op, status, flags;
    int64_t seq_id, src_id, arg, result;
    char request[REQUEST_BYTES];
    const int32_t *tokens; /* (START: the JSON text's bytes, n_tokens of them) */
    int64_t n_tokens;
    PyObject *blocks; /* a list of ints, or NULL */
    PyObject *copies; /* a list of (src, dst), or NULL */
    Py_ssize_t found0; /* KVPool._found's length when the call began (-1: `found_at` only) */
    int64_t found_at;  /* a REPORT's ring position */
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

/* Compose and write one record. Errors are never raised: a record that cannot be written is
 * counted lost, and the next one written is preceded by a LOST record saying how many. */
static void oplog_write(Native *n, OpRec *o) {
    Oplog *L = n->oplog;
    if (n->seg == NULL) return;
    Py_ssize_t nb = o->blocks && PyList_Check(o->blocks) ? PyList_GET_SIZE(o->blocks) : 0;
    Py_ssize_t nc = o->copies && PyList_Check(o->copies) ? PyList_GET_SIZE(o->copies) : 0;
    Py_ssize_t nf = 0;
    if (o->found0 >= 0 && n->found) nf = PyList_GET_SIZE(n->found) - o->found0;
    if (o->found0 < 0) nf = 1;
    if (nf < 0) nf = 0;
    if (nf > 255) nf = 255;
    size_t tok_bytes = o->op == OP_START ? (size_t)o->n_tokens : 4 * (size_t)o->n_tokens;
    size_t size = OPLOG_HEAD + tok_bytes + 4 * (size_t)nb + 8 * (size_t)nc +
                  8 * (size_t)L->n_pre + OPLOG_FOUND * (size_t)nf;
    size = (size + 7) & ~(size_t)7;
    if (size > UINT32_MAX || oplog_room(L, size)) {
        L->lost++;
        return;
    }
    uint8_t *r = L->buf;
    memset(r, 0, size);
    U4(r + OR_MAGIC) = OPLOG_MAGIC;
    U4(r + OR_SIZE) = (uint32_t)size;
    U8(r + OR_TIME_NS) = wall_ns();
    I4(r + OR_PID) = n->pid;
    I4(r + OR_TID) = (int32_t)syscall(SYS_gettid);
    r[OR_OP] = (uint8_t)o->op;
    r[OR_STATUS] = (uint8_t)o->status;
    r[OR_FLAGS] = (uint8_t)(o->flags | (L->key && o->op != OP_START ? OPLOG_REDACTED : 0));
    r[OR_N_FOUND] = (uint8_t)nf;
    U4(r + OR_PROBES) = (uint32_t)*n->probe_bits;
    U4(r + OR_N_TOKENS) = (uint32_t)o->n_tokens;
    U4(r + OR_N_BLOCKS) = (uint32_t)nb;
    U4(r + OR_N_COPIES) = (uint32_t)nc;
    U4(r + OR_N_PREEMPTED) = (uint32_t)L->n_pre;
    U4(r + OR_POOL) = L->tag;
    U8(r + OR_SEQ_ID) = (uint64_t)o->seq_id;
    U8(r + OR_SRC_ID) = (uint64_t)o->src_id;
    U8(r + OR_ARG) = (uint64_t)o->arg;
    U8(r + OR_RESULT) = (uint64_t)o->result;
    oplog_request(L, o->request, (char *)r + OR_REQUEST);
    uint8_t *p = r + OPLOG_HEAD;
    if (o->op == OP_START) {
        memcpy(p, o->tokens, tok_bytes);
    } else {
        for (int64_t i = 0; i < o->n_tokens; i++) I4(p + 4 * i) = oplog_token(L, o->tokens[i]);
    }
    p += tok_bytes;
    for (Py_ssize_t i = 0; i < nb; i++, p += 4)
        I4(p) = (int32_t)PyLong_AsLong(PyList_GET_ITEM(o->blocks, i));
    for (Py_ssize_t i = 0; i < nc; i++, p += 8) {
        PyObject *pair = PyList_GET_ITEM(o->copies, i);
        if (PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2) {
            I4(p) = (int32_t)PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
            I4(p + 4) = (int32_t)PyLong_AsLong(PyTuple_GET_ITEM(pair, 1));
        }
    }
    for (int64_t i = 0; i < L->n_pre; i++, p += 8) U8(p) = (uint64_t)L->pre[i];
    for (Py_ssize_t i = 0; i < nf; i++, p += OPLOG_FOUND) {
        uint64_t pos = o->found0 < 0 ? (uint64_t)o->found_at
                                     : PyLong_AsUnsignedLongLong(
                                           PyList_GET_ITEM(n->found, o->found0 + i));
        const uint8_t *f = n->seg + n->off_findings + (size_t)(pos % (uint64_t)n->fd_cap) * n->fd_size;
        I4(p + OF_BLOCK) = I4(f + n->fd_block);
        size_t kl = n->fd_kind_bytes < OPLOG_FOUND - OF_KIND ? n->fd_kind_bytes
                                                              : OPLOG_FOUND - OF_KIND;
        memcpy(p + OF_KIND, f + n->fd_kind, kl);
    }
    if (PyErr_Occurred()) PyErr_Clear(); /* (an int that did not fit: written as -1) */
    uint64_t *op_seq = (uint64_t *)(n->seg + L->off_seq);
    if (L->lost) {
        uint8_t mark[OPLOG_HEAD];
        memset(mark, 0, sizeof mark);
        U4(mark + OR_MAGIC) = OPLOG_MAGIC;
        U4(mark + OR_SIZE) = OPLOG_HEAD;
        U8(mark + OR_SEQ) = __atomic_add_fetch(op_seq, 1, __ATOMIC_SEQ_CST);
        U8(mark + OR_TIME_NS) = wall_ns();
        I4(mark + OR_PID) = n->pid;
        U4(mark + OR_POOL) = L->tag;
        mark[OR_OP] = OP_LOST;
        U8(mark + OR_SEQ_ID) = (uint64_t)-1;
        U8(mark + OR_SRC_ID) = (uint64_t)-1;
        U8(mark + OR_ARG) = L->lost;
        U8(mark + OR_CHECK) = crc32_of(mark, OPLOG_HEAD);
        if (write(L->fd, mark, OPLOG_HEAD) == (ssize_t)OPLOG_HEAD) L->lost = 0;
        else {
            L->lost++;
            return;
        }
    }
    U8(r + OR_SEQ) = __atomic_add_fetch(op_seq, 1, __ATOMIC_SEQ_CST);
    U8(r + OR_CHECK) = crc32_of(r, size);
    ssize_t w = write(L->fd, r, size);
    if (w != (ssize_t)size) L->lost++;
}

static int64_t seq_id_of(Native *n, PyObject *seq) {
    if (seq == NULL || !PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) return -1;
    PyObject *id = sfield(n, seq, F_SEQ_ID);
    int64_t v = id && PyLong_Check(id) ? PyLong_AsLongLong(id) : -1;
    Py_XDECREF(id);
    if (PyErr_Occurred()) PyErr_Clear();
    return v;
}

/* A Sequence's field as a list (a new reference), or NULL (no error set). */
static PyObject *seq_list(Native *n, PyObject *seq, int field) {
    if (seq == NULL || !PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) return NULL;
    PyObject *v = sfield(n, seq, field);
    if (v == NULL) PyErr_Clear();
    if (v && !PyList_Check(v)) Py_CLEAR(v);
    return v;
}

static int64_t seq_int(Native *n, PyObject *seq, int field) {
    if (seq == NULL || !PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) return -1;
    PyObject *v = sfield(n, seq, field);
    int64_t x = v && PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
    Py_XDECREF(v);
    if (PyErr_Occurred()) PyErr_Clear();
    return x;
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
    L->n_pre = 0;
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = op;
    o.seq_id = o.src_id = -1;
    o.found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    Py_ssize_t armed0 = n->faults_armed ? PyDict_Size(n->faults_armed) : 0;
    PyObject *seq = nargs >= 2 && op != OP_ALLOCATE && op != OP_EVICT ? args[1] : NULL;
    PyObject *before = NULL; /* free, abort: the table the release drops */
    int64_t id_before = seq_id_of(n, seq);
    if (op == OP_FREE || op == OP_ABORT) before = seq_list(n, seq, F_BLOCK_TABLE);
    if (seq) {
        if (PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) {
            PyObject *r = sfield(n, seq, F_REQUEST_ID);
            if (r) oplog_rid(r, o.request);
            else PyErr_Clear();
            Py_XDECREF(r);
        }
    }

    PyObject *res = fn(n, args, nargs);

    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    if (res == NULL) {
        o.status = et == NULL                                                     ? OS_ERROR
                   : PoolExhaustedType && PyErr_GivenExceptionMatches(et, PoolExhaustedType) ? OS_EXHAUSTED
                   : PoolErrorType && PyErr_GivenExceptionMatches(et, PoolErrorType)         ? OS_REFUSED
                                                                                             : OS_ERROR;
    }
    if (n->faults_armed && PyDict_Size(n->faults_armed) < armed0) o.flags |= OPLOG_FAULT;
    Tokens t;
    int have_tokens = 0;
    PyObject *after = NULL;
    switch (op) {
    case OP_ALLOCATE:
        oplog_rid(nargs == 3 ? args[2] : NULL, o.request);
        have_tokens = nargs == 3 && tokens_read(args[1], &t, 0) == OK;
        if (res) {
            o.seq_id = seq_id_of(n, res);
            o.result = seq_int(n, res, F_CACHED);
            after = seq_list(n, res, F_BLOCK_TABLE);
        }
        break;
    case OP_APPEND:
        o.seq_id = id_before;
        have_tokens = nargs == 3 && tokens_read(args[2], &t, 0) == OK;
        after = seq_list(n, seq, F_BLOCK_TABLE);
        if (res && PyList_Check(res)) o.copies = res;
        break;
    case OP_FORK:
        o.src_id = id_before;
        if (res) {
            o.seq_id = seq_id_of(n, res);
            after = seq_list(n, res, F_BLOCK_TABLE);
        }
        oplog_rid(nargs == 3 ? args[2] : NULL, o.request);
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
        after = before ? Py_NewRef(before) : NULL;
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
        o.seq_id = res ? seq_id_of(n, seq) : id_before;
        after = seq_list(n, seq, F_BLOCK_TABLE);
        if (res && PyLong_Check(res)) o.result = PyLong_AsLongLong(res);
        break;
    case OP_EVICT:
        o.arg = nargs == 2 && PyLong_Check(args[1]) ? PyLong_AsLongLong(args[1]) : 0;
        if (res && PyLong_Check(res)) o.result = PyLong_AsLongLong(res);
        break;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    if (have_tokens) {
        o.tokens = t.v;
        o.n_tokens = t.n;
    }
    o.blocks = after;
    oplog_write(n, &o);
    if (have_tokens) tokens_done(&t);
    if (PyErr_Occurred()) PyErr_Clear();
    Py_XDECREF(after);
    Py_XDECREF(before);
    PyErr_Restore(et, ev, etb);
    L->n_pre = 0;
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
    n->oplog->n_pre = 0;
    if (nargs == 7) oplog_rid(args[5], o.request);
    oplog_write(n, &o);
    if (PyErr_Occurred()) PyErr_Clear();
    return res;
}

static void oplog_free(Native *n) {
    Oplog *L = n->oplog;
    if (L == NULL) return;
    n->oplog = NULL;
    if (L->fd >= 0) close(L->fd);
    PyMem_Free(L->pre);
    PyMem_Free(L->buf);
    PyMem_Free(L);
}

/* oplog_open(path, key, start_text, off_op_seq, tag): start recording into the file at `path`
 * (created 0600 if missing, appended to), with a START record holding start_text (the
 * handle's geometry, probes and armed faults as JSON: allocator/oplog.py); `key` non-zero
 * redacts. A log already open is closed first. */
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
    if (L == NULL) {
        close(fd);
        return PyErr_NoMemory();
    }
    if (crc_table[1] == 0) crc_init();
    L->fd = fd;
    L->key = key;
    L->off_seq = (size_t)off;
    L->tag = tag;
    n->oplog = L;
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = OP_START;
    o.seq_id = o.src_id = -1;
    o.tokens = (const int32_t *)text;
    o.n_tokens = tl;
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
