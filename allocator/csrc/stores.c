/* The store check (probes/stores.py Writers; docs/PROBES.md "The writer named at the store"): a
 * K/V store told its writers, the requests whose positions its tokens are, checked against the
 * pool's block records. Part of _native.c (after oplog.c: a finding's REPORT record).
 *
 * One call per check (`store_check`): the slot each token's position has in its writer's block
 * table (its expected slot), then
 * - the blocks that hold the written positions: one the prefix index holds
 *   (published_block_modified) or one not allocated (use_after_free);
 * - the slot mapping against the expected slots: a token's slot elsewhere (not -1: a padding
 *   row) lands in a block the writer does not map (unmapped_write), or one published or freed.
 * Each finding names the writer (its request, this process) and the line that called the store,
 * written into the findings ring by finding_report (once per kind and block for the handle),
 * and, while the handle records, as a REPORT record after it, as KVPool.report's are: the
 * binding hands them to `on_finding` (deliver_findings). Nothing found costs no Python object:
 * the line is looked up at the first finding. */

/* One check's writers: span i is positions [start[i], end[i]) of the sequence seq[i]
 * (borrowed: the spans hold it), its tokens from tok0[i] on in the store; tab[i] the block
 * table it is checked against (a list or tuple, a new reference); expected[t] the slot of
 * token t (-2: a position outside its table). */
typedef struct {
    PyObject *spans; /* the Writers' spans: a list or tuple of (seq, start, end) */
    PyObject *site;  /* the line that called the store (a new reference; NULL: not yet looked up) */
    Py_ssize_t n_spans;
    int64_t n_tok, spb;
    int64_t *start, *end, *tok0, *expected;
    PyObject **tab, **seq;
} StoreCheck;

#define STORE_NOWHERE (-2)

/* A writer's attribute (a new reference): a Sequence's field at its slot, else getattr. */
static PyObject *store_attr(Native *n, PyObject *seq, int field, const char *name) {
    if (Py_IS_TYPE(seq, (PyTypeObject *)n->seq_type)) return sfield(n, seq, field);
    return PyObject_GetAttrString(seq, name);
}

/* Whether table (a list or tuple) holds block b. */
static int store_maps(PyObject *table, int32_t b) {
    for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(table); j++) {
        PyObject *v = PySequence_Fast_GET_ITEM(table, j);
        int over;
        if (PyLong_Check(v) && PyLong_AsLongLongAndOverflow(v, &over) == b && !over) return 1;
    }
    PyErr_Clear();
    return 0;
}

static void store_clear(StoreCheck *c) {
    if (c->tab != NULL)
        for (Py_ssize_t i = 0; i < c->n_spans; i++) Py_XDECREF(c->tab[i]);
    PyMem_Free(c->tab);
    PyMem_Free(c->start);
    PyMem_Free(c->expected);
    Py_CLEAR(c->site);
}

/* The spans read, their tables (`tables`: the ones kept at the store, one per span; None: each
 * writer's block_table now) and each token's expected slot. OK, or ERROR with an exception set
 * (the caller clears c). */
static int store_read(Native *n, StoreCheck *c, PyObject *tables) {
    Py_ssize_t k = c->n_spans;
    if (tables != Py_None && (!PyList_Check(tables) || PyList_GET_SIZE(tables) != k)) {
        PyErr_SetString(PyExc_TypeError, "store_check: tables is None or a list, one per span");
        return ERROR;
    }
    c->tab = PyMem_Calloc(2 * (size_t)k + 1, sizeof(PyObject *));
    c->start = PyMem_Malloc(((size_t)k * 3 + 1) * sizeof(int64_t));
    if (c->tab == NULL || c->start == NULL) {
        PyErr_NoMemory();
        return ERROR;
    }
    c->seq = c->tab + k;
    c->end = c->start + k;
    c->tok0 = c->end + k;
    int64_t n_tok = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *span = PySequence_Fast_GET_ITEM(c->spans, i);
        if ((!PyTuple_Check(span) && !PyList_Check(span)) || PySequence_Fast_GET_SIZE(span) != 3) {
            PyErr_SetString(PyExc_TypeError, "store_check: each span is (seq, start, end)");
            return ERROR;
        }
        PyObject *seq = c->seq[i] = PySequence_Fast_GET_ITEM(span, 0);
        c->start[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(span, 1));
        c->end[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(span, 2));
        if (PyErr_Occurred()) return ERROR;
        if (c->end[i] < c->start[i]) c->end[i] = c->start[i];
        c->tok0[i] = n_tok;
        n_tok += c->end[i] - c->start[i];
        PyObject *t = tables == Py_None ? store_attr(n, seq, F_BLOCK_TABLE, "block_table")
                                        : Py_NewRef(PyList_GET_ITEM(tables, i));
        if (t == NULL) return ERROR;
        c->tab[i] = PySequence_Fast(t, "store_check: a block table is a list of block ids");
        Py_DECREF(t);
        if (c->tab[i] == NULL) return ERROR;
    }
    c->n_tok = n_tok;
    c->expected = PyMem_Malloc(((size_t)n_tok + 1) * sizeof(int64_t));
    if (c->expected == NULL) {
        PyErr_NoMemory();
        return ERROR;
    }
    int64_t bs = n->bs;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *tab = c->tab[i];
        int64_t held = PySequence_Fast_GET_SIZE(tab), *out = c->expected + c->tok0[i];
        /* (each table entry read once: a prompt chunk's tokens share their blocks) */
        int64_t at = -1, base = 0;
        for (int64_t p = c->start[i]; p < c->end[i]; p++) {
            int64_t j = p >= 0 ? p / bs : -1;
            if (j < 0 || j >= held) {
                out[p - c->start[i]] = STORE_NOWHERE;
                continue;
            }
            if (j != at) {
                base = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(tab, j)) * c->spb;
                if (base == -1 * c->spb && PyErr_Occurred()) return ERROR;
                at = j;
            }
            out[p - c->start[i]] = base + p % bs;
        }
    }
    return OK;
}

/* Block b of the pool's records is one a store must not write (not allocated, or published). */
static inline int store_bad_block(Native *n, int64_t b) {
    const uint8_t *r = blk(n, b);
    return r[BF_STATE] != B_ALLOCATED || r[BF_INDEXED] == 1;
}

/* The line that called the store (a new reference, or NULL with an exception set): the first
 * frame outside kvscope and its callers outside kvscope, `frame <- caller <- ...` as an
 * allocation site's stack reads, up to STORE_SITE_FRAMES frames, or N where the ownership probe
 * records stacks (KVSCOPE_STACK_DEPTH=N): an engine's store is often a helper of its own
 * (`write_kv`), called from where the slots were worked out, which is the line to blame. Looked
 * up at a finding only, so the callers cost nothing on a clean store. */
enum { STORE_SITE_CHARS = 100, STORE_SITE_FRAMES = 3 };

static PyObject *store_site(Native *n) {
    int err;
    PyFrameObject *f = frame_outward(n, (PyFrameObject *)Py_XNewRef(PyEval_GetFrame()), 0, &err);
    if (err) return NULL;
    if (f == NULL) return PyUnicode_FromString("<kvscope>");
    int depth = (n->probes & P_SITES_EACH) ? (int)((n->probes >> P_SITE_DEPTH_SHIFT) & 0x1f)
                                           : STORE_SITE_FRAMES;
    PyObject *text = frame_text(f);
    PyFrameObject *g = PyFrame_GetBack(f);
    Py_DECREF(f);
    for (int k = 1; text != NULL && g != NULL && k < depth; k++) {
        PyCodeObject *c = PyFrame_GetCode(g);
        int out = code_outside(n, c);
        Py_DECREF(c);
        if (out < 0) {
            Py_CLEAR(text);
            break;
        }
        if (out != 1) break; /* (kvscope's or the bootstrap's frame: the stack ends there) */
        PyObject *more = frame_text(g);
        if (more == NULL) {
            Py_CLEAR(text);
            break;
        }
        /* (the findings ring keeps 200 bytes of a message: callers only while the line leaves
         * room for the rest of it, the block's holder) */
        if (PyUnicode_GET_LENGTH(text) + 4 + PyUnicode_GET_LENGTH(more) > STORE_SITE_CHARS) {
            Py_DECREF(more);
            break;
        }
        PyObject *joined = PyUnicode_FromFormat("%U <- %U", text, more);
        Py_DECREF(more);
        Py_SETREF(text, joined);
        PyFrameObject *back = PyFrame_GetBack(g);
        Py_DECREF(g);
        g = back;
    }
    Py_XDECREF(g);
    return text;
}

/* The finding about span i's writer storing K/V into block b (`mapped`: its table holds b), of
 * the kind block b's record says (none: its own block at another position). OK, or ERROR with
 * an exception set. */
static int store_report(Native *n, StoreCheck *c, Py_ssize_t i, int32_t b, int mapped) {
    const uint8_t *r = blk(n, b);
    int fk;
    if (r[BF_STATE] != B_ALLOCATED && r[BF_STATE] != B_CACHED)
        fk = FK_USE_AFTER_FREE;
    else if (r[BF_INDEXED] == 1)
        fk = FK_PUBLISHED_BLOCK_MODIFIED;
    else if (!mapped)
        fk = FK_UNMAPPED_WRITE;
    else
        return OK;
    if (n->reported != NULL && n->reported[(size_t)fk * (size_t)(n->nb + 1) + (size_t)b])
        return OK; /* (reported already: finding_report would drop it) */
    if (c->site == NULL) {
        /* sites.caller_site: the first frame outward from this call's caller outside kvscope
         * (with its callers: store_site) */
        c->site = store_site(n);
        if (c->site == NULL) return ERROR;
    }
    PyObject *rid = store_attr(n, c->seq[i], F_REQUEST_ID, "request_id");
    PyObject *name = rid ? PyObject_Str(rid) : NULL;
    Py_XDECREF(rid);
    /* (the writer's request id as its first 32 characters; the holder's as the record keeps
     * it, trailing zero bytes dropped as numpy's bytes do, decoded with replacement) */
    PyObject *who = name ? PyUnicode_Substring(name, 0, REQUEST_BYTES) : NULL;
    Py_XDECREF(name);
    /* The holder named: for an unmapped write, a live sequence whose table maps the block (the
     * block record keeps the request that allocated it, which a fork's sibling or the writer
     * itself, after a copy-on-write gave it a copy, may no longer be); else the record's. */
    const uint8_t *held = r + BF_REQUEST;
    /* (a free block's record may be in another process's local cache, which its owner pid then
     * names: the pid that freed it is freed_by's) */
    int pid = fk == FK_USE_AFTER_FREE ? freed_by(r) : I4(r + BF_OWNER_PID), mapper = 0;
    long long mapper_seq = -1;
    if (fk == FK_UNMAPPED_WRITE) {
        for (int64_t slot = 0; slot < n->max_seqs && !mapper; slot++) {
            const uint8_t *q = seqrec(n, slot);
            if (q[SF_STATE] == S_EMPTY) continue;
            uint32_t nb = U4(q + SF_NUM_BLOCKS);
            if (nb > (uint32_t)n->max_bps) nb = (uint32_t)n->max_bps;
            const int32_t *t = (const int32_t *)(q + SF_TABLE);
            for (uint32_t j = 0; j < nb && !mapper; j++) mapper = t[j] == b;
            if (mapper) {
                held = q + SF_REQUEST;
                pid = I4(q + SF_OWNER_PID);
                mapper_seq = (long long)U8(q + SF_SEQ_ID);
            }
        }
    }
    Py_ssize_t ol = REQUEST_BYTES;
    while (ol > 0 && held[ol - 1] == 0) ol--;
    PyObject *owner = who ? PyUnicode_DecodeUTF8((const char *)held, ol, "replace") : NULL;
    PyObject *msg = NULL;
    if (owner != NULL) {
        if (fk == FK_USE_AFTER_FREE && U4(r + BF_GENERATION) == 0)
            msg = PyUnicode_FromFormat("request %R stored K/V into block %d at %U: the block is "
                                       "free (never allocated)",
                                       who, (int)b, c->site);
        else if (fk == FK_USE_AFTER_FREE)
            msg = PyUnicode_FromFormat("request %R stored K/V into block %d at %U: the block is "
                                       "free (last held by request %R, pid %d)",
                                       who, (int)b, c->site, owner, pid);
        else if (fk == FK_PUBLISHED_BLOCK_MODIFIED)
            msg = PyUnicode_FromFormat("request %R stored K/V into block %d at %U: published by "
                                       "request %R (pid %d), shared by prefix hits",
                                       who, (int)b, c->site, owner, pid);
        else if (mapper && PyUnicode_Compare(who, owner) == 0)
            /* (forks share their request's id: the holder is a sibling sequence) */
            msg = PyUnicode_FromFormat("request %R stored K/V into block %d at %U, which this "
                                       "sequence does not map (held by another sequence of "
                                       "the request, seq %lld: a fork's sibling, pid %d)",
                                       who, (int)b, c->site, mapper_seq, pid);
        else if (mapper)
            msg = PyUnicode_FromFormat("request %R stored K/V into block %d at %U, which it "
                                       "does not map (held by request %R, pid %d)",
                                       who, (int)b, c->site, owner, pid);
        else
            msg = PyUnicode_FromFormat("request %R stored K/V into block %d at %U, which it "
                                       "does not map (no live sequence maps it; allocated by "
                                       "request %R, pid %d)",
                                       who, (int)b, c->site, owner, pid);
    }
    int rc = ERROR;
    Seen s;
    seen_of(n, b, &s);
    s.owner_pid = n->pid; /* (the writer's process: this one) */
    if (msg != NULL && request_of(who, s.request) == OK) {
        Py_ssize_t before = PyList_GET_SIZE(n->found);
        rc = finding_report(n, fk, &s, msg);
        /* its REPORT record, naming the writer (oplog.c: what a finding between operations
         * writes) */
        if (rc == OK) oplog_found_report(n, before, s.request);
    }
    Py_XDECREF(who);
    Py_XDECREF(owner);
    Py_XDECREF(msg);
    return rc;
}

/* The check's first part: each block that holds written positions, once per writer, in token
 * order. OK or ERROR. */
static int store_blocks(Native *n, StoreCheck *c) {
    for (Py_ssize_t i = 0; i < c->n_spans; i++) {
        const int64_t *e = c->expected + c->tok0[i];
        int64_t last = -1;
        for (int64_t t = 0; t < c->end[i] - c->start[i]; t++) {
            if (e[t] < 0) continue;
            int64_t b = e[t] / c->spb;
            if (b == last || b >= n->nb) continue;
            last = b;
            if (store_bad_block(n, b) && store_report(n, c, i, (int32_t)b, 1) == ERROR)
                return ERROR;
        }
    }
    return OK;
}

/* The check's second part: slots[0, m) (the store's slot mapping) against the expected slots;
 * a slot elsewhere in the pool (not -1) reported by where it landed. A mapping of another
 * length than the writers' tokens is not compared. OK or ERROR. */
static int store_slots(Native *n, StoreCheck *c, const int64_t *slots, int64_t m) {
    if (m != c->n_tok) return OK;
    Py_ssize_t i = 0;
    for (int64_t t = 0; t < m; t++) {
        int64_t s = slots[t];
        if (s == c->expected[t] || s < 0) continue; /* (-1: a padding row; others: no block) */
        int64_t b = s / c->spb;
        if (b >= n->nb) continue; /* (outside the tensor: guard mode's kernels report it) */
        while (i + 1 < c->n_spans && t >= c->tok0[i + 1]) i++;
        int mapped = store_maps(c->tab[i], (int32_t)b);
        if (store_report(n, c, i, (int32_t)b, mapped) == ERROR) return ERROR;
    }
    return OK;
}

/* store_check(spans, slots, tables, site, what) -> int: one store check (probes/stores.py),
 * `what` 1 the writers' blocks, 2 the slots, 3 both (a STORE record's); `spans` the writers,
 * (seq, start, end) in slot order; `slots` the slot mapping, a C-contiguous int64 buffer (None
 * without 2); `tables` the writers' block tables kept at the store (None: each one's now);
 * `site` the line that called the store (None: the first frame outside kvscope, looked up at
 * the first finding). The findings it wrote (KVPool._found; the caller holds op_mutex and
 * delivers them). */
static PyObject *N_store_check(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "store_check(spans, slots, tables, site, what)");
        return NULL;
    }
    if (py_caller_unusable(n)) return NULL;
    long what = PyLong_AsLong(args[4]);
    if (what == -1 && PyErr_Occurred()) return NULL;
    if (args[3] != Py_None && !PyUnicode_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "store_check: site is None or a str");
        return NULL;
    }
    StoreCheck c;
    memset(&c, 0, sizeof c);
    c.spb = n->kv_spb > 0 ? n->kv_spb : n->bs;
    c.site = args[3] == Py_None ? NULL : Py_NewRef(args[3]);
    c.spans = PySequence_Fast(args[0], "store_check: spans is a sequence of (seq, start, end)");
    if (c.spans == NULL) {
        Py_CLEAR(c.site);
        return NULL;
    }
    c.n_spans = PySequence_Fast_GET_SIZE(c.spans);
    Py_ssize_t found0 = PyList_GET_SIZE(n->found);
    Py_buffer view;
    int have_view = 0, rc = store_read(n, &c, args[2]);
    if (rc == OK && (what & 1)) rc = store_blocks(n, &c);
    if (rc == OK && (what & 2)) {
        if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != OK) {
            rc = ERROR;
        } else {
            have_view = 1;
            const char *fmt = view.format ? view.format : "q";
            char last = fmt[0] ? fmt[strlen(fmt) - 1] : 0;
            if (view.itemsize != 8 || (last != 'q' && last != 'l')) {
                PyErr_SetString(PyExc_TypeError, "store_check: slots are int64");
                rc = ERROR;
            } else {
                rc = store_slots(n, &c, view.buf, (int64_t)(view.len / 8));
            }
        }
    }
    if (have_view) PyBuffer_Release(&view);
    store_clear(&c);
    Py_DECREF(c.spans);
    if (rc == ERROR) return NULL;
    return PyLong_FromSsize_t(PyList_GET_SIZE(n->found) - found0);
}
