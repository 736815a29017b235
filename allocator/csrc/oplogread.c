/* Reading the operation log (docs/REPLAY.md): oplog_expand(data) turns a log file's chunks of
 * compact records (oplog.c) into records of the fixed layout OPLOG_FIELDS (allocator/oplog.py
 * decodes those), in the order of their pools and numbers, each with its whole block table (an
 * append's record holds only what changed) and request id. Reads only its argument. Part of
 * _native.c. */

/* One compact record, decoded; its arrays in the reader's int64 arena. */
typedef struct {
    uint64_t seq, time_ns;
    int32_t pid, tid;
    uint32_t pool, probes;
    int op, status, flags, tmode, has_req;
    uint32_t faults;
    int64_t seq_id, src_id, arg, result;
    char request[REQUEST_BYTES];
    int64_t chunk; /* the chunk's offset in the file */
    int64_t tok, n_tok; /* arena positions (START: text's offset in the data, n_tok bytes) */
    int64_t keep, tab, n_tab;
    int64_t cop, n_cop, pre, n_pre;
    int64_t fnd, n_fnd; /* n_fnd (block, kind offset in the data, kind length) triples */
    /* a lease operation's lease part (its blocks' generations: tok, n_tok) */
    int mode;
    int64_t record;
    uint64_t lease_id, timeout_ns, deadline_ns;
    char holder[REQUEST_BYTES];
    /* a STORE's spans (n_spn (seq id, start, end) triples in the arena; its slots: tok, n_tok) */
    int64_t spn, n_spn;
} DRec;

/* The records whose tokens are bytes (a START's JSON, a SNAPSHOT's state: oplog.c). */
static inline int text_op(int op) { return op == OP_START || op == OP_SNAPSHOT; }

/* The operations whose records hold a lease part in place of tokens (oplog.c oplog_lease). */
static inline int lease_op(int op) { return op >= OP_LEASE && op <= OP_EXPIRE_LEASES; }

/* The bytes of an expanded record's tokens (START: its text; STORE: none, its slots are in its
 * store part) and of the part after its findings (a lease operation's, a STORE's). */
static size_t tok_bytes(const DRec *r) {
    return text_op(r->op) ? (size_t)r->n_tok : r->op == OP_STORE ? 0 : 4 * (size_t)r->n_tok;
}
static size_t part_bytes(const DRec *r) {
    if (lease_op(r->op)) return OPLOG_LEASE;
    if (r->op == OP_STORE) return OPLOG_STORE + 24 * (size_t)r->n_spn + 8 * (size_t)r->n_tok;
    return 0;
}

typedef struct {
    int64_t *a;
    size_t n, cap;
} Arena;

static int arena_push(Arena *A, int64_t v) {
    if (A->n == A->cap) {
        size_t cap = A->cap ? 2 * A->cap : 4096;
        int64_t *p = PyMem_Realloc(A->a, cap * sizeof(int64_t));
        if (p == NULL) return ERROR;
        A->a = p;
        A->cap = cap;
    }
    A->a[A->n++] = v;
    return OK;
}

/* A varint at *p before end (ERROR: cut short or longer than 10 bytes). */
static int get_u(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    uint64_t x = 0;
    for (int s = 0; s < 70 && *p < end; s += 7) {
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7F) << s;
        if (!(b & 0x80)) {
            *v = x;
            return OK;
        }
    }
    return ERROR;
}
static int get_s(const uint8_t **p, const uint8_t *end, int64_t *v) {
    uint64_t u;
    if (get_u(p, end, &u) != OK) return ERROR;
    *v = (int64_t)(u >> 1) ^ -(int64_t)(u & 1);
    return OK;
}

/* `n` signed varints into the arena (their first position in *at). */
static int get_many(const uint8_t **p, const uint8_t *end, Arena *A, int64_t n, int64_t *at) {
    *at = (int64_t)A->n;
    for (int64_t i = 0; i < n; i++) {
        int64_t v;
        if (get_s(p, end, &v) != OK || arena_push(A, v) != OK) return ERROR;
    }
    return OK;
}

/* One compact record at *p (chunk state in prev_*); ERROR where it is not one a core writes. */
static int decode_record(const uint8_t **pp, const uint8_t *end, const uint8_t *data, DRec *r,
                         Arena *A, uint64_t *prev_seq, int32_t *prev_tid, uint32_t *prev_probes,
                         uint64_t base_time) {
    const uint8_t *p = *pp;
    uint64_t u;
    if (end - p < 2) return ERROR;
    r->op = *p++;
    int bits = *p++;
    if (r->op < OP_START || r->op > OP_FLUSH) return ERROR;
    r->status = bits & 3;
    r->flags |= bits & CR_FAULT ? OPLOG_FAULT : 0;
    if (get_u(&p, end, &u) != OK) return ERROR;
    r->seq = *prev_seq += u;
    if (get_u(&p, end, &u) != OK) return ERROR;
    r->time_ns = base_time + (u << CR_TIME_SHIFT);
    if (bits & CR_TID) {
        if (get_u(&p, end, &u) != OK) return ERROR;
        *prev_tid = (int32_t)u;
    }
    r->tid = *prev_tid;
    if (bits & CR_PROBES) {
        if (get_u(&p, end, &u) != OK) return ERROR;
        *prev_probes = (uint32_t)u;
    }
    r->probes = *prev_probes;
    if (get_s(&p, end, &r->seq_id) != OK) return ERROR;
    if (bits & CR_FAULT) {
        if (get_u(&p, end, &u) != OK) return ERROR;
        r->faults = (uint32_t)u;
    }
    r->src_id = -1;
    if (bits & CR_ARGS) {
        if (get_s(&p, end, &r->src_id) != OK || get_s(&p, end, &r->arg) != OK ||
            get_s(&p, end, &r->result) != OK)
            return ERROR;
    }
    if (bits & CR_REQUEST) {
        if (p >= end || *p > REQUEST_BYTES || end - p < 1 + *p) return ERROR;
        memcpy(r->request, p + 1, *p);
        r->has_req = 1;
        p += 1 + *p;
    }
    if (lease_op(r->op)) {
        /* mode, holder, record, lease id, timeout, deadline, then the generations */
        if (end - p < 2 || p[1] > REQUEST_BYTES || end - p < 2 + p[1]) return ERROR;
        r->mode = p[0];
        memcpy(r->holder, p + 2, p[1]);
        p += 2 + p[1];
        if (get_s(&p, end, &r->record) != OK || get_u(&p, end, &r->lease_id) != OK ||
            get_u(&p, end, &r->timeout_ns) != OK || get_u(&p, end, &r->deadline_ns) != OK)
            return ERROR;
    }
    if (r->op == OP_STORE) {
        /* its spans: a count, then each one's seq id, start and length */
        if (get_u(&p, end, &u) != OK || u > (uint64_t)(end - p)) return ERROR;
        r->n_spn = (int64_t)u;
        r->spn = (int64_t)A->n;
        for (int64_t i = 0; i < r->n_spn; i++) {
            int64_t id, start, len;
            if (get_s(&p, end, &id) != OK || get_s(&p, end, &start) != OK ||
                get_s(&p, end, &len) != OK || arena_push(A, id) != OK ||
                arena_push(A, start) != OK ||
                arena_push(A, (int64_t)((uint64_t)start + (uint64_t)len)) != OK)
                return ERROR;
        }
    }
    if (get_u(&p, end, &u) != OK) return ERROR;
    if (text_op(r->op)) {
        if (u > (uint64_t)(end - p)) return ERROR;
        r->tok = p - data;
        r->n_tok = (int64_t)u;
        p += u;
    } else {
        if (u > (uint64_t)(end - p)) return ERROR;
        r->n_tok = (int64_t)u;
        if (get_many(&p, end, A, r->n_tok, &r->tok) != OK) return ERROR;
        if (r->op == OP_STORE) { /* (its slots, written as differences) */
            int64_t *v = A->a + r->tok;
            for (int64_t j = 1; j < r->n_tok; j++)
                v[j] = (int64_t)((uint64_t)v[j] + (uint64_t)v[j - 1]);
        }
    }
    if (p >= end) return ERROR;
    r->tmode = *p++;
    if (r->tmode > TM_OWN) return ERROR;
    if (r->tmode != TM_NONE) {
        if (r->tmode == TM_OWN && get_u(&p, end, &u) != OK) return ERROR;
        r->keep = r->tmode == TM_OWN ? (int64_t)u : 0;
        if (get_u(&p, end, &u) != OK || u > (uint64_t)(end - p) || r->keep > INT32_MAX)
            return ERROR;
        r->n_tab = (int64_t)u;
        if (get_many(&p, end, A, r->n_tab, &r->tab) != OK) return ERROR;
    }
    if (bits & CR_EXTRA) {
        if (get_u(&p, end, &u) != OK || u > (uint64_t)(end - p)) return ERROR;
        r->n_cop = (int64_t)u;
        if (get_many(&p, end, A, 2 * r->n_cop, &r->cop) != OK) return ERROR;
        if (get_u(&p, end, &u) != OK || u > (uint64_t)(end - p)) return ERROR;
        r->n_pre = (int64_t)u;
        if (get_many(&p, end, A, r->n_pre, &r->pre) != OK) return ERROR;
        if (get_u(&p, end, &u) != OK || u > 255) return ERROR;
        r->n_fnd = (int64_t)u;
        r->fnd = (int64_t)A->n;
        for (int64_t i = 0; i < r->n_fnd; i++) {
            int64_t block;
            if (get_s(&p, end, &block) != OK || p >= end || *p > OPLOG_FOUND - OF_KIND ||
                end - p < 1 + *p)
                return ERROR;
            if (arena_push(A, block) != OK || arena_push(A, p + 1 - data) != OK ||
                arena_push(A, *p) != OK)
                return ERROR;
            p += 1 + *p;
        }
    }
    *pp = p;
    return OK;
}

static int drec_order(const void *a, const void *b) {
    const DRec *x = *(const DRec *const *)a, *y = *(const DRec *const *)b;
    if (x->pool != y->pool) return x->pool < y->pool ? -1 : 1;
    if (x->seq != y->seq) return x->seq < y->seq ? -1 : 1;
    return x < y ? -1 : x > y;
}

/* The last table and request each sequence of each pool was recorded with. */
typedef struct {
    uint32_t pool;
    int used;
    int64_t id;
    int64_t tab, n_tab; /* in the arena */
    char request[REQUEST_BYTES];
} SeqEntry;

typedef struct {
    SeqEntry *e;
    size_t cap, n;
} SeqMap;

static SeqEntry *seqmap_get(SeqMap *M, uint32_t pool, int64_t id, int add) {
    if (add && 2 * (M->n + 1) > M->cap) {
        size_t cap = M->cap ? 2 * M->cap : 1024;
        SeqEntry *e = PyMem_Calloc(cap, sizeof(SeqEntry));
        if (e == NULL) return NULL;
        for (size_t i = 0; i < M->cap; i++) {
            if (!M->e[i].used) continue;
            size_t h = (size_t)fmix64((uint64_t)M->e[i].id ^ ((uint64_t)M->e[i].pool << 32));
            while (e[h & (cap - 1)].used) h++;
            e[h & (cap - 1)] = M->e[i];
        }
        PyMem_Free(M->e);
        M->e = e;
        M->cap = cap;
    }
    if (M->cap == 0) return NULL;
    size_t h = (size_t)fmix64((uint64_t)id ^ ((uint64_t)pool << 32));
    for (;; h++) {
        SeqEntry *s = &M->e[h & (M->cap - 1)];
        if (!s->used) {
            if (!add) return NULL;
            memset(s, 0, sizeof *s);
            s->used = 1;
            s->pool = pool;
            s->id = id;
            M->n++;
            return s;
        }
        if (s->pool == pool && s->id == id) return s;
    }
}

static PyObject *expand_error(const char *what, int64_t at) {
    PyErr_Format(PyExc_ValueError, what, (long long)at);
    return NULL;
}

/* oplog_expand(data: bytes) -> (records, chunks, offsets, lists, heads):
 * the log's records in the layout of OPLOG_FIELDS (with their checks), sorted by pool and
 * number, the file offset of each one's chunk and each one's offset in `records` (int64s), and
 * each one's tokens and block table as lists (2 a record), and the records' fixed parts one
 * after another (bytes); ValueError (one line) where the data is not whole chunks a core
 * wrote. */
static PyObject *M_oplog_expand(PyObject *mod, PyObject *arg) {
    Py_buffer in;
    if (PyObject_GetBuffer(arg, &in, PyBUF_SIMPLE) != OK) return NULL;
    const uint8_t *data = in.buf;
    int64_t len = in.len;
    Arena A = {0};
    DRec *recs = NULL;
    DRec **order = NULL;
    SeqMap M = {0};
    size_t nr = 0, cap_r = 0;
    PyObject *out = NULL, *offs = NULL, *at = NULL, *lists = NULL, *heads = NULL, *res = NULL;
    int64_t pos = 0;
    while (pos < len) {
        if (len - pos < OPLOG_CHUNK) {
            expand_error("truncated: the bytes at offset %lld are not a chunk", pos);
            goto done;
        }
        const uint8_t *c = data + pos;
        uint32_t magic = U4(c + OC_MAGIC), size = U4(c + OC_SIZE);
        if (magic != OPLOG_CHUNK_MAGIC) {
            expand_error("offset %lld is not a chunk of records (bad magic)", pos);
            goto done;
        }
        if (size < OPLOG_CHUNK || size % 8) {
            expand_error("the chunk at offset %lld has an impossible size", pos);
            goto done;
        }
        if ((int64_t)size > len - pos) {
            expand_error("truncated: the chunk at offset %lld is cut short", pos);
            goto done;
        }
        uint8_t *copy = PyMem_Malloc(size);
        if (copy == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(copy, c, size);
        U8(copy + OC_CHECK) = 0;
        uint64_t check = record_check(copy, size);
        PyMem_Free(copy);
        if (check != U8(c + OC_CHECK)) {
            expand_error("the chunk at offset %lld fails its check: the log was edited or "
                         "damaged",
                         pos);
            goto done;
        }
        uint64_t prev_seq = U8(c + OC_SEQ);
        int32_t prev_tid = I4(c + OC_PID);
        uint32_t prev_probes = 0;
        const uint8_t *p = c + OPLOG_CHUNK, *end = c + size;
        uint32_t n_in = U4(c + OC_N_RECORDS);
        for (uint32_t k = 0; k < n_in; k++) {
            if (nr == cap_r) {
                cap_r = cap_r ? 2 * cap_r : 1024;
                DRec *g = PyMem_Realloc(recs, cap_r * sizeof(DRec));
                if (g == NULL) {
                    PyErr_NoMemory();
                    goto done;
                }
                recs = g;
            }
            DRec *r = &recs[nr];
            memset(r, 0, sizeof *r);
            r->pid = I4(c + OC_PID);
            r->pool = U4(c + OC_POOL);
            r->chunk = pos;
            if (decode_record(&p, end, data, r, &A, &prev_seq, &prev_tid, &prev_probes,
                              U8(c + OC_TIME_NS)) != OK) {
                if (!PyErr_Occurred())
                    expand_error("the chunk at offset %lld holds what no core writes", pos);
                goto done;
            }
            if (!text_op(r->op) && (U4(c + OC_FLAGS) & OPLOG_REDACTED))
                r->flags |= OPLOG_REDACTED;
            nr++;
        }
        pos += size;
    }
    order = PyMem_Malloc((nr ? nr : 1) * sizeof(DRec *));
    if (order == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (size_t i = 0; i < nr; i++) order[i] = &recs[i];
    qsort(order, nr, sizeof(DRec *), drec_order);
    /* each record's whole table, and its size expanded */
    size_t total = 0;
    for (size_t i = 0; i < nr; i++) {
        DRec *r = order[i];
        if (r->tmode != TM_NONE) {
            SeqEntry *base = r->tmode == TM_OWN ? seqmap_get(&M, r->pool, r->seq_id, 0) : NULL;
            int64_t at = (int64_t)A.n;
            for (int64_t j = 0; j < r->keep; j++)
                if (arena_push(&A, base && j < base->n_tab ? A.a[base->tab + j] : -1) != OK)
                    goto nomem;
            for (int64_t j = 0; j < r->n_tab; j++)
                if (arena_push(&A, A.a[r->tab + j]) != OK) goto nomem;
            r->tab = at;
            r->n_tab += r->keep;
        }
        /* (a lease operation's table is the lease's, its request the lease's: neither is its
         * sequence's next base) */
        if (r->seq_id >= 0 && !lease_op(r->op) && (r->tmode != TM_NONE || r->has_req)) {
            SeqEntry *s = seqmap_get(&M, r->pool, r->seq_id, 1);
            if (s == NULL) goto nomem;
            if (r->tmode != TM_NONE) {
                s->tab = r->tab;
                s->n_tab = r->n_tab;
            }
            if (r->has_req) memcpy(s->request, r->request, REQUEST_BYTES);
        }
        if (!r->has_req) {
            SeqEntry *s = r->seq_id >= 0 ? seqmap_get(&M, r->pool, r->seq_id, 0) : NULL;
            if ((s == NULL || !s->request[0]) && r->src_id >= 0 && r->op != OP_STORE)
                s = seqmap_get(&M, r->pool, r->src_id, 0);
            if (s) memcpy(r->request, s->request, REQUEST_BYTES);
            if (s && r->seq_id >= 0 && !lease_op(r->op) && !seqmap_get(&M, r->pool, r->seq_id, 0)) {
                char req[REQUEST_BYTES];
                memcpy(req, s->request, REQUEST_BYTES);
                SeqEntry *t = seqmap_get(&M, r->pool, r->seq_id, 1);
                if (t == NULL) goto nomem;
                memcpy(t->request, req, REQUEST_BYTES);
            }
        }
        size_t sz = OPLOG_HEAD + tok_bytes(r) + 4 * (size_t)r->n_tab + 8 * (size_t)r->n_cop +
                    8 * (size_t)r->n_pre + OPLOG_FOUND * (size_t)r->n_fnd + part_bytes(r);
        total += (sz + 7) & ~(size_t)7;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    offs = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * nr));
    at = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(8 * nr));
    lists = PyList_New((Py_ssize_t)(2 * nr));
    heads = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(OPLOG_HEAD * nr));
    if (out == NULL || offs == NULL || at == NULL || lists == NULL || heads == NULL) goto done;
    uint8_t *w = (uint8_t *)PyBytes_AS_STRING(out);
    memset(w, 0, total);
    for (size_t i = 0; i < nr; i++) {
        DRec *r = order[i];
        ((int64_t *)PyBytes_AS_STRING(offs))[i] = r->chunk;
        ((int64_t *)PyBytes_AS_STRING(at))[i] = w - (uint8_t *)PyBytes_AS_STRING(out);
        /* (each record's tokens and table as lists too: what a reader makes of them) */
        int64_t nl[2] = {text_op(r->op) || r->op == OP_STORE ? 0 : r->n_tok, r->n_tab};
        int64_t from[2] = {r->tok, r->tab};
        for (int k = 0; k < 2; k++) {
            PyObject *l = PyList_New((Py_ssize_t)nl[k]);
            if (l == NULL) goto done;
            for (int64_t j = 0; j < nl[k]; j++) {
                PyObject *v = PyLong_FromLongLong((int32_t)A.a[from[k] + j]);
                if (v == NULL) {
                    Py_DECREF(l);
                    goto done;
                }
                PyList_SET_ITEM(l, (Py_ssize_t)j, v);
            }
            PyList_SET_ITEM(lists, (Py_ssize_t)(2 * i + k), l);
        }
        size_t tb = tok_bytes(r);
        size_t sz = (OPLOG_HEAD + tb + 4 * (size_t)r->n_tab + 8 * (size_t)r->n_cop +
                     8 * (size_t)r->n_pre + OPLOG_FOUND * (size_t)r->n_fnd + part_bytes(r) + 7) &
                    ~(size_t)7;
        U4(w + OR_MAGIC) = OPLOG_MAGIC;
        U4(w + OR_SIZE) = (uint32_t)sz;
        U8(w + OR_SEQ) = r->seq;
        U8(w + OR_TIME_NS) = r->time_ns;
        I4(w + OR_PID) = r->pid;
        I4(w + OR_TID) = r->tid;
        w[OR_OP] = (uint8_t)r->op;
        w[OR_STATUS] = (uint8_t)r->status;
        w[OR_FLAGS] = (uint8_t)r->flags;
        w[OR_N_FOUND] = (uint8_t)r->n_fnd;
        U4(w + OR_PROBES) = r->probes;
        U4(w + OR_N_TOKENS) = r->op == OP_STORE ? 0 : (uint32_t)r->n_tok;
        U4(w + OR_N_BLOCKS) = (uint32_t)r->n_tab;
        U4(w + OR_N_COPIES) = (uint32_t)r->n_cop;
        U4(w + OR_N_PREEMPTED) = (uint32_t)r->n_pre;
        U4(w + OR_POOL) = r->pool;
        U4(w + OR_FAULTS) = r->faults;
        U8(w + OR_SEQ_ID) = (uint64_t)r->seq_id;
        U8(w + OR_SRC_ID) = (uint64_t)r->src_id;
        U8(w + OR_ARG) = (uint64_t)r->arg;
        U8(w + OR_RESULT) = (uint64_t)r->result;
        memcpy(w + OR_REQUEST, r->request, REQUEST_BYTES);
        uint8_t *q = w + OPLOG_HEAD;
        if (text_op(r->op)) memcpy(q, data + r->tok, tb);
        else if (r->op != OP_STORE)
            for (int64_t j = 0; j < r->n_tok; j++) I4(q + 4 * j) = (int32_t)A.a[r->tok + j];
        q += tb;
        for (int64_t j = 0; j < r->n_tab; j++, q += 4) I4(q) = (int32_t)A.a[r->tab + j];
        for (int64_t j = 0; j < 2 * r->n_cop; j++, q += 4) I4(q) = (int32_t)A.a[r->cop + j];
        for (int64_t j = 0; j < r->n_pre; j++, q += 8) U8(q) = (uint64_t)A.a[r->pre + j];
        for (int64_t j = 0; j < r->n_fnd; j++, q += OPLOG_FOUND) {
            I4(q + OF_BLOCK) = (int32_t)A.a[r->fnd + 3 * j];
            memcpy(q + OF_KIND, data + A.a[r->fnd + 3 * j + 1], (size_t)A.a[r->fnd + 3 * j + 2]);
        }
        if (lease_op(r->op)) {
            q[OL_MODE] = (uint8_t)r->mode;
            I4(q + OL_RECORD) = (int32_t)r->record;
            U8(q + OL_LEASE_ID) = r->lease_id;
            U8(q + OL_TIMEOUT_NS) = r->timeout_ns;
            U8(q + OL_DEADLINE_NS) = r->deadline_ns;
            memcpy(q + OL_HOLDER, r->holder, REQUEST_BYTES);
        }
        if (r->op == OP_STORE) {
            U4(q + OW_N_SPANS) = (uint32_t)r->n_spn;
            U4(q + OW_N_SLOTS) = (uint32_t)r->n_tok;
            q += OPLOG_STORE;
            for (int64_t j = 0; j < 3 * r->n_spn; j++, q += 8) U8(q) = (uint64_t)A.a[r->spn + j];
            for (int64_t j = 0; j < r->n_tok; j++, q += 8) U8(q) = (uint64_t)A.a[r->tok + j];
        }
        U8(w + OR_CHECK) = record_check(w, sz);
        memcpy(PyBytes_AS_STRING(heads) + OPLOG_HEAD * i, w, OPLOG_HEAD);
        w += sz;
    }
    res = PyTuple_Pack(5, out, offs, at, lists, heads);
    goto done;
nomem:
    PyErr_NoMemory();
done:
    Py_XDECREF(out);
    Py_XDECREF(offs);
    Py_XDECREF(at);
    Py_XDECREF(lists);
    Py_XDECREF(heads);
    PyMem_Free(A.a);
    PyMem_Free(recs);
    PyMem_Free(order);
    PyMem_Free(M.e);
    PyBuffer_Release(&in);
    return res;
}
