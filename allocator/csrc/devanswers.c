/* The answers of the checks devchecks.c launched, read back once the GPU is past them
 * (`device_take`, from devicechecks.DeviceChecks.settle between operations), oldest first: a
 * digest of a block just published becomes the kv_digest word of its record, written here a
 * transaction per CHUNK (write_digest_words, entry.c); an answer that shows a problem (a
 * published block changed, a freed block written, a guard slot overwritten, a finished
 * request's slots never written) goes back to Python with the records as the operation saw
 * them, to be reported exactly as devicechecks' own queue reports it. Part of _native.c. */

static PyObject *id_list(const int64_t *w, int64_t k) {
    PyObject *l = PyList_New(k);
    for (int64_t i = 0; l && i < k; i++) {
        PyObject *v = PyLong_FromLongLong(w[i]);
        if (v == NULL) {
            Py_CLEAR(l);
            break;
        }
        PyList_SET_ITEM(l, i, v);
    }
    return l;
}

/* Digests taken, on their way into the records: with the pool (device_take's), written a
 * transaction per CHUNK of them, not one per check; without, listed for the caller. */
typedef struct {
    PyObject *pool; /* NULL: none written here */
    Py_ssize_t k;
    int32_t b[CHUNK];
    uint32_t g[CHUNK];
    uint64_t w[CHUNK];
} StampBuf;

/* The digests in `sb` into their records; those the core does not write now (or, without
 * the pool, every one) go to `stamps` as (block, generation, word) for devicechecks to write
 * (stamps.py). 0, or -1 with an exception set. */
static int stamps_flush(Native *n, StampBuf *sb, PyObject *stamps) {
    if (sb->k == 0) return 0;
    Py_ssize_t k = sb->k;
    sb->k = 0;
    int done = 0;
    if (sb->pool != NULL) {
        PyObject *r = write_digest_words(n, sb->pool, sb->b, sb->g, sb->w, k);
        if (r == NULL) return -1;
        done = r != Py_None;
        Py_DECREF(r);
    }
    for (Py_ssize_t i = 0; !done && i < k; i++) {
        PyObject *t = Py_BuildValue("(lkK)", (long)sb->b[i], (unsigned long)sb->g[i],
                                    (unsigned long long)sb->w[i]);
        if (t == NULL || PyList_Append(stamps, t) != 0) {
            Py_XDECREF(t);
            return -1;
        }
        Py_DECREF(t);
    }
    return 0;
}

/* The entry's answer as stamps (a digest for a record, through `sb`) or a finding for Python
 * to report: (kind, when, ids, answer, records). 0, or -1 with an exception set. */
static int dev_read(Native *n, DevEntry *e, int64_t *w, PyObject *stamps, PyObject *found,
                    StampBuf *sb) {
    int64_t k = e->n;
    const int64_t *a = w + k;
    int64_t ans = dev_answer_words(n, e->kind, k);
    const int64_t *kept = w + k + ans;
    if (e->kind == DK_FILL) return 0;
    if (e->kind == DK_UNWRITTEN) {
        /* integrity.unwritten_in: a slot of the first `extra` positions still poisoned, while
         * not all of them are (a program that writes no K/V at all) */
        int64_t blank = 0, checked = 0;
        for (int64_t p = 0; p < e->extra && p < k * n->bs; p++, checked++) blank += a[p] == 0;
        if (blank == 0 || blank == checked) return 0;
        PyObject *ids = id_list(w, k), *answer = ids ? id_list(a, k * n->bs) : NULL;
        PyObject *t = answer ? Py_BuildValue("(sOOOL)", DK_NAME[e->kind], e->tag, ids, answer,
                                             (long long)e->extra)
                             : NULL;
        int rc = t != NULL && PyList_Append(found, t) == 0 ? 0 : -1;
        Py_XDECREF(ids);
        Py_XDECREF(answer);
        Py_XDECREF(t);
        return rc;
    }
    if (e->kind == DK_STAMP) {
        for (int64_t i = 0; i < k; i++) {
            uint64_t dg = fmix64((uint64_t)a[i]);
            sb->b[sb->k] = (int32_t)w[i];
            sb->g[sb->k] = (uint32_t)(kept[i] & GEN_MASK);
            sb->w[sb->k++] = ((dg >> 32) << 32) | ((uint64_t)kept[i] & GEN_MASK);
            if (sb->k == CHUNK && stamps_flush(n, sb, stamps) != 0) return -1;
        }
        return 0;
    }
    /* the answer per block: a digest, a count of slots' unpoisoned elements, a flag */
    int64_t per[CHUNK + EVICT_BATCH];
    int bad = 0;
    if (k > CHUNK + EVICT_BATCH) return 0; /* (cannot be: the core's checks are that small) */
    for (int64_t i = 0; i < k; i++) {
        if (e->kind == DK_VERIFY) {
            uint64_t got = fmix64((uint64_t)a[i]);
            uint64_t want = U8(kept_rec(n, kept, i) + n->off_kv_digest);
            per[i] = (int64_t)got;
            bad |= (got >> 32) != (want >> 32);
        } else if (e->kind == DK_POISON) {
            int64_t c = 0;
            for (int64_t s = 0; s < n->bs; s++) c += a[i * n->bs + s];
            per[i] = c;
            bad |= c != 0;
        } else {
            per[i] = a[i];
            bad |= a[i] != 0;
        }
    }
    if (!bad) return 0;
    PyObject *ids = id_list(w, k), *answer = NULL, *recs = NULL, *t = NULL;
    if (ids) {
        answer = PyList_New(k);
        for (int64_t i = 0; answer && i < k; i++) {
            PyObject *v = e->kind == DK_VERIFY ? PyLong_FromUnsignedLongLong((uint64_t)per[i])
                                               : PyLong_FromLongLong(per[i]);
            if (v == NULL) {
                Py_CLEAR(answer);
                break;
            }
            PyList_SET_ITEM(answer, i, v);
        }
    }
    if (answer) {
        recs = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(k * n->rec));
        for (int64_t i = 0; recs && i < k; i++)
            memcpy(PyBytes_AS_STRING(recs) + i * n->rec, kept_rec(n, kept, i), (size_t)n->rec);
    }
    if (recs)
        t = Py_BuildValue("(sOOOO)", DK_NAME[e->kind], e->tag ? e->tag : Py_None, ids, answer,
                          recs);
    int rc = t != NULL && PyList_Append(found, t) == 0 ? 0 : -1;
    Py_XDECREF(ids);
    Py_XDECREF(answer);
    Py_XDECREF(recs);
    Py_XDECREF(t);
    return rc;
}

/* device_take(wait, most[, pool]) -> (stamps, found) | None: the answers the GPU is past,
 * oldest first (every one, waiting, with `wait`; the oldest, waiting, until no more than `most`
 * are left, where most >= 0). None when none waits. With the pool its digests are written into
 * the records here (write_digest_words: no list of them through Python) and `stamps` holds
 * only those the core did not write. Under the handle's op mutex (devicechecks.settle). */
static PyObject *N_device_take(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "device_take(wait: bool, most: int[, pool])");
        return NULL;
    }
    StampBuf sb;
    sb.pool = nargs == 3 && args[2] != Py_None ? args[2] : NULL;
    sb.k = 0;
    DevChecks *d = n->dev;
    /* (in a forked child the parent's queue and its GPU handles are not this process's) */
    if (d == NULL || d->q_count == 0 || n->fork_gen != fork_gen) Py_RETURN_NONE;
    int wait = PyObject_IsTrue(args[0]);
    long long most = PyLong_AsLongLong(args[1]);
    if (wait < 0 || (most == -1 && PyErr_Occurred())) return NULL;
    PyObject *stamps = PyList_New(0), *found = PyList_New(0);
    if (stamps == NULL || found == NULL) goto fail;
    if (d->cuda && !d->broken) dev_context(d);
    dev_cover(d); /* (a failure leaves the open ones to be waited for below, stream by stream) */
    while (d->q_count) {
        DevEntry *e = dev_at(d, 0);
        if (!e->done && !d->broken) {
            int behind = most >= 0 && d->q_count > most;
            if (e->ev < 0) {
                /* not covered (a driver error): wait for its stream */
                CUres rc;
                Py_BEGIN_ALLOW_THREADS
                rc = d->cu.stream_sync(d->open_stream);
                Py_END_ALLOW_THREADS
                if (rc != 0) d->broken = rc;
            } else {
                CUhandle ev = d->ev[e->ev];
                CUres rc = d->cu.ev_query(ev);
                if (rc == CU_NOT_READY) {
                    if (!wait && !behind) break;
                    Py_BEGIN_ALLOW_THREADS
                    rc = d->cu.ev_sync(ev);
                    Py_END_ALLOW_THREADS
                }
                if (rc != 0 && rc != CU_NOT_READY) d->broken = rc;
            }
            /* the event's other checks are done too */
            for (int64_t i = 0; i < d->q_count && dev_at(d, i)->ev == e->ev; i++)
                dev_at(d, i)->done = 1;
            e->done = 1;
        }
        /* (after a driver error the answers are not the GPU's: dropped, and every later check
         * hands back to Python, which meets the same error) */
        int rc = d->broken ? 0 : dev_read(n, e, d->ring + e->at, stamps, found, &sb);
        int32_t ev = e->ev;
        Py_CLEAR(e->tag);
        d->q_tail = (d->q_tail + 1) % DEV_ENTRIES;
        d->q_count--;
        d->open_from = d->open_from > 0 ? d->open_from - 1 : 0;
        if (ev >= 0 && (d->q_count == 0 || dev_at(d, 0)->ev != ev)) d->ev_free[d->n_ev_free++] = ev;
        if (d->q_count == 0) d->head = 0;
        if (rc != 0) goto fail;
    }
    if (stamps_flush(n, &sb, stamps) != 0) goto fail;
    PyObject *out = PyTuple_Pack(2, stamps, found);
    Py_DECREF(stamps);
    Py_DECREF(found);
    return out;
fail:
    Py_XDECREF(stamps);
    Py_XDECREF(found);
    return NULL;
}

