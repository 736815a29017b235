/* The block-table audit (KVPool.audit_block_table): the table a kernel will read, held against
 * the tables of the sequences its rows belong to, as the segment's sequence records hold them.
 * Part of _native.c.
 *
 * The comparison is written once, here: the expected table (each live row's blocks in order up
 * to the blocks its length covers, the sentinel everywhere else: past a row's length and in
 * every padding row) is made from the records this handle's own sequences occupy, and either
 * compared with the table (a table in host memory: one call), or written out for the CUDA
 * pool's kernel to compare on the device (kernels/audit.py, one launch, its answer reported
 * through `report` by allocator/audit.py). The records are read, not written: a handle's own
 * sequences change only in its own operations, which the gate keeps out meanwhile. */

/* A 1- or 2-dimensional C-contiguous integer buffer of 4- or 8-byte items: its view (released
 * by the caller), or ERROR with an exception set naming `what`. */
static int int_buffer(PyObject *o, Py_buffer *v, int writable, int dims, const char *what) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(o, v, flags) != 0) {
        PyErr_Clear();
        return pool_error("%s: expected a C-contiguous integer array (numpy, or a CPU tensor's "
                          ".numpy()), got %s",
                          what, Py_TYPE(o)->tp_name);
    }
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    int ok = strlen(f) == 1 && strchr("ilqILQ", *f) != NULL &&
             (v->itemsize == 4 || v->itemsize == 8) && v->ndim == dims;
    if (!ok) {
        int nd = v->ndim;
        PyBuffer_Release(v);
        return pool_error("%s: expected a %d-dimensional array of 32- or 64-bit integers, got "
                          "%d dimension(s) of format '%s'",
                          what, dims, nd, f);
    }
    return OK;
}

static inline int64_t int_at(const Py_buffer *v, int64_t i) {
    return v->itemsize == 4 ? (int64_t)((const int32_t *)v->buf)[i] : ((const int64_t *)v->buf)[i];
}

/* What the first bad entry was, for the finding. */
typedef struct {
    int64_t row, col, found, expected, bad, bad_rows, tokens;
    int32_t slot;
} AuditBad;

/* The block_table_mismatch finding about the first bad entry (one per audit: the count of the
 * others in its message), about the block the kernel would read there (a pool block: its
 * holder named), else the block the row should read. */
static int audit_report(Native *n, const AuditBad *a, int64_t rows, int64_t live, int64_t width,
                        int64_t sentinel) {
    int64_t b = a->found >= 0 && a->found < n->nb ? a->found
                : a->expected >= 0 && a->expected < n->nb ? a->expected : -1;
    Seen s = {.block = (int32_t)b, .owner_pid = 0, .site = -1};
    memset(s.request, 0, REQUEST_BYTES);
    if (b >= 0) seen_of(n, (int32_t)b, &s);
    char req[REQUEST_BYTES + 1] = {0}, held[REQUEST_BYTES + 1] = {0};
    if (a->row < live) memcpy(req, seqrec(n, a->slot) + SF_REQUEST, REQUEST_BYTES);
    if (b >= 0 && a->found == b) memcpy(held, blk(n, b) + BF_REQUEST, REQUEST_BYTES);
    char what[160];
    if (a->found >= 0 && a->found < n->nb)
        snprintf(what, sizeof what, "block %lld (%s%s%s)", (long long)a->found,
                 held[0] ? "held by request '" : "held by no request",
                 held[0] ? held : "", held[0] ? "'" : "");
    else
        snprintf(what, sizeof what, "%lld (no block of the pool)", (long long)a->found);
    PyObject *msg;
    const char *tail = "";
    if (a->row >= live) {
        tail = "a padded lane reads or writes that block";
        msg = PyUnicode_FromFormat("block table padding row %lld entry %lld is %s, not the "
                                   "padding %lld: %s; %lld bad entries in %lld row(s) of %lldx%lld "
                                   "(%lld live rows)",
                                   (long long)a->row, (long long)a->col, what, (long long)sentinel,
                                   tail, (long long)a->bad, (long long)a->bad_rows,
                                   (long long)rows, (long long)width, (long long)live);
    } else if (a->expected == sentinel) {
        msg = PyUnicode_FromFormat("block table row %lld (request '%s') entry %lld, past its %lld "
                                   "tokens, is %s, not the padding %lld; %lld bad entries in "
                                   "%lld row(s) of %lldx%lld",
                                   (long long)a->row, req, (long long)a->col, (long long)a->tokens,
                                   what, (long long)sentinel, (long long)a->bad,
                                   (long long)a->bad_rows, (long long)rows, (long long)width);
    } else {
        msg = PyUnicode_FromFormat("block table row %lld (request '%s') entry %lld is %s, but the "
                                   "sequence holds block %lld there; %lld bad entries in %lld "
                                   "row(s) of %lldx%lld",
                                   (long long)a->row, req, (long long)a->col, what,
                                   (long long)a->expected, (long long)a->bad,
                                   (long long)a->bad_rows, (long long)rows, (long long)width);
    }
    if (msg == NULL) return ERROR;
    /* (where the program audited the table: the line that reads it, or builds it, is near) */
    int32_t site = site_now(n);
    PyObject *at = site == SITE_ERROR ? NULL : site_words(n, site, "; audited at ");
    PyObject *whole = at ? PyUnicode_Concat(msg, at) : NULL;
    Py_XDECREF(at);
    Py_DECREF(msg);
    if (whole == NULL) return ERROR;
    msg = whole;
    int rc = finding_report(n, FK_BLOCK_TABLE_MISMATCH, &s, msg);
    Py_DECREF(msg);
    return rc;
}

/* audit_table(pool, table, rows, lengths, sentinel, expect) -> int: the audit of a [R, W]
 * table whose first len(rows) rows are those sequences' (this handle's live Sequences), each
 * reading `lengths[i]` tokens (None: the sequence's tokens), the rest padding rows.
 * With `table` (a host array): the bad entries counted, the first reported as
 * block_table_mismatch (once per block, as every finding); the count. With `expect` (a
 * writable int32 [R, W] array) instead: the expected table written there, for the device's
 * comparison; 0. PoolError for a bad argument: a row that is not a live sequence of this
 * handle, more rows than the table, a length past the table's width or the sequence's blocks,
 * a sentinel that is a block of the pool. */
static PyObject *N_audit_table(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "audit_table(pool, table, rows, lengths, sentinel, expect)");
        return NULL;
    }
    GATE(n, args[0]);
    Py_ssize_t found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    PyObject *table = args[1], *lens = args[3], *expect = args[5];
    int64_t sentinel = PyLong_AsLongLong(args[4]);
    if (sentinel == -1 && PyErr_Occurred()) return NULL;
    if (sentinel >= 0 && sentinel < n->nb) {
        pool_error("padding %lld is block %lld of the pool: a kernel reading a padded entry "
                   "reads that block (use a value outside 0..%lld, such as -1)",
                   (long long)sentinel, (long long)sentinel, (long long)(n->nb - 1));
        return NULL;
    }
    PyObject *rows = PySequence_Fast(args[2], "rows: expected a sequence of Sequences");
    if (rows == NULL) return NULL;
    Py_buffer t = {0}, e = {0}, l = {0};
    int have_t = 0, have_e = 0, have_l = 0;
    PyObject *lens_fast = NULL, *out = NULL;
    int64_t live = PySequence_Fast_GET_SIZE(rows);
    if (expect != Py_None) {
        if (int_buffer(expect, &e, 1, 2, "expect")) goto done;
        have_e = 1;
        if (e.itemsize != 4) {
            pool_error("expect: an int32 array");
            goto done;
        }
    } else {
        if (int_buffer(table, &t, 0, 2, "table")) goto done;
        have_t = 1;
    }
    const Py_buffer *shape = have_e ? &e : &t;
    int64_t R = shape->shape[0], W = shape->shape[1];
    if (live > R) {
        pool_error("%lld rows for a table of %lld rows", (long long)live, (long long)R);
        goto done;
    }
    if (lens != Py_None) {
        if (PyObject_CheckBuffer(lens)) {
            if (int_buffer(lens, &l, 0, 1, "lengths")) goto done;
            have_l = 1;
            if (l.shape[0] != live) {
                pool_error("lengths: %lld for %lld rows", (long long)l.shape[0], (long long)live);
                goto done;
            }
        } else {
            lens_fast = PySequence_Fast(lens, "lengths: expected a sequence of ints");
            if (lens_fast == NULL) goto done;
            if (PySequence_Fast_GET_SIZE(lens_fast) != live) {
                pool_error("lengths: %zd for %lld rows", PySequence_Fast_GET_SIZE(lens_fast),
                           (long long)live);
                goto done;
            }
        }
    }
    AuditBad a = {.row = -1};
    int64_t last_bad_row = -1;
    for (int64_t r = 0; r < R; r++) {
        int64_t need = 0, slot = -1, tokens = 0;
        const int32_t *tbl = NULL;
        if (r < live) {
            slot = own_slot(n, PySequence_Fast_GET_ITEM(rows, r));
            if (slot < 0) goto done;
            const uint8_t *s = seqrec(n, slot);
            int64_t held = I4(s + SF_NUM_BLOCKS);
            tbl = (const int32_t *)(s + SF_TABLE);
            if (have_l) tokens = int_at(&l, r);
            else if (lens_fast != NULL) {
                tokens = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(lens_fast, r));
                if (tokens == -1 && PyErr_Occurred()) goto done;
            } else
                tokens = I4(s + SF_NUM_TOKENS);
            need = tokens <= 0 ? 0 : (tokens + n->bs - 1) / n->bs;
            if (need > W || need > held) {
                pool_error("row %lld: %lld tokens need %lld blocks, past %s (%lld)", (long long)r,
                           (long long)tokens, (long long)need,
                           need > W ? "the table's width" : "the blocks the sequence holds",
                           (long long)(need > W ? W : held));
                goto done;
            }
        }
        if (have_e) {
            int32_t *o = (int32_t *)e.buf + r * W;
            for (int64_t c = 0; c < W; c++) o[c] = c < need ? tbl[c] : (int32_t)sentinel;
            continue;
        }
        if (t.itemsize == 4 && sentinel >= INT32_MIN && sentinel <= INT32_MAX) {
            /* (the common table: int32 rows, each compared whole first) */
            const int32_t *row = (const int32_t *)t.buf + r * W;
            int same = need == 0 || memcmp(row, tbl, (size_t)need * 4) == 0;
            for (int64_t c = need; same && c < W; c++) same = row[c] == (int32_t)sentinel;
            if (same) continue;
        }
        for (int64_t c = 0; c < W; c++) {
            int64_t want = c < need ? (int64_t)tbl[c] : sentinel, got = int_at(&t, r * W + c);
            if (got == want) continue;
            if (a.bad++ == 0) {
                a.row = r;
                a.col = c;
                a.found = got;
                a.expected = want;
                a.slot = (int32_t)slot;
                a.tokens = tokens;
            }
            if (last_bad_row != r) {
                a.bad_rows++;
                last_bad_row = r;
            }
        }
    }
    if (a.bad && audit_report(n, &a, R, live, W, sentinel)) goto done;
    /* what it found, with its input (the table, its rows' sequences and lengths), in the
     * operation log: a replay audits the recorded table there again */
    if (a.bad && have_t && n->oplog)
        oplog_audit(n, found0, rows, live, &t, R, W, have_l ? &l : NULL, lens_fast, sentinel);
    out = PyLong_FromLongLong(a.bad);
done:
    if (have_t) PyBuffer_Release(&t);
    if (have_e) PyBuffer_Release(&e);
    if (have_l) PyBuffer_Release(&l);
    Py_XDECREF(lens_fast);
    Py_DECREF(rows);
    return out;
}
