/* The answers of the checks devchecks.c launched, read back once the GPU is past them and
 * applied by the core (`device_take`, from devicechecks.DeviceChecks.settle between
 * operations), oldest first: a digest of a block just published becomes the kv_digest word of
 * its record (write_digest_words, entry.c: a transaction per CHUNK, only while the block is
 * still published in the generation it was taken in, under its shard lock); an answer that
 * shows a problem (a published block changed, a freed block written, a guard slot overwritten,
 * a finished request's slots never written) is a finding the core writes into the findings
 * ring (finding_report), with the block's record as the operation saw it, where the binding
 * reads it back for `on_finding` (KVPool._found). Part of _native.c. */

/* -- the answers read, waiting to be applied ---------------------------------------------------- */

static int dev_grow(void **arr, int64_t *cap, int64_t need, size_t size) {
    if (need <= *cap) return 0;
    int64_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *p = PyMem_Realloc(*arr, (size_t)c * size);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *arr = p;
    *cap = c;
    return 0;
}

/* A finding an answer shows (message: a new reference, taken over), reported when the answers
 * are applied: with the block's record `rec` as the operation saw it, or as it is then (NULL).
 * 0, or -1 with an exception set. */
static int dev_found_add(Native *n, int fk, int32_t b, const uint8_t *rec, PyObject *message) {
    DevChecks *d = n->dev;
    if (message == NULL) return -1;
    if (dev_grow((void **)&d->found, &d->cap_found, d->n_found + 1, sizeof(Pending))) {
        Py_DECREF(message);
        return -1;
    }
    Pending *p = &d->found[d->n_found++];
    memset(p, 0, sizeof *p);
    p->fk = fk;
    p->message = message;
    p->seen.block = b;
    p->seen_later = rec == NULL;
    if (rec != NULL) {
        /* (seen_of, of the record as it was) */
        p->seen.owner_pid = fk == FK_USE_AFTER_FREE ? freed_by(rec) : I4(rec + BF_OWNER_PID);
        p->seen.site = I4(rec + BF_SITE);
        p->seen.refcount = I4(rec + BF_REFCOUNT);
        memcpy(p->seen.request, rec + BF_REQUEST, REQUEST_BYTES);
    }
    /* a guard violation's event comes first, as the release's own (canaries_intact) */
    p->event = fk == FK_GUARD_VIOLATION ? E_GUARD_VIOLATION : 0;
    p->op = d->reading;
    return 0;
}

/* The finding dev_found_add added last is about `request` (the block's record read when it is
 * reported, its request not). */
static void dev_found_about(Native *n, const char request[REQUEST_BYTES]) {
    Pending *p = &n->dev->found[n->dev->n_found - 1];
    p->seen_later = SEEN_LATER_BUT_REQUEST;
    memcpy(p->seen.request, request, REQUEST_BYTES);
}

/* Slot provenance's hashes of blocks w[0, k) (answers a: a raw sum per slot, block i's from
 * a[i * stride]; kept: the generation each block had when published), written into the records
 * of the slots recorded in that generation while the block is still in it. Records are not
 * journaled (provenance.c): a block handed out again meanwhile has another generation, and its
 * records are left alone. */
static int prov_stamp_read(Native *n, const int64_t *w, int64_t k, const int64_t *a,
                           int64_t stride, const int64_t *kept) {
    for (int64_t i = 0; i < k; i++) {
        int32_t b = (int32_t)w[i];
        uint32_t gen = (uint32_t)kept[i];
        if (U4(blk(n, b) + BF_GENERATION) != gen) continue;
        for (int64_t off = 0; off < n->bs; off++) {
            uint8_t *p = prov_rec(n, b, off);
            if (__atomic_load_n((uint32_t *)(p + PV_GENERATION), __ATOMIC_ACQUIRE) == gen)
                U4(p + PV_KV_HASH) = prov_hash_of((uint64_t)a[i * stride + off]);
        }
    }
    return 0;
}

/* Slot provenance's check of blocks w[0, k) (answers a: a raw sum per slot, block i's from
 * a[i * stride]; kept, per block: its record, the reading request, its slots' records, as the
 * hit or the sweep saw them): the first slot of a block whose K/V no longer hashes as its
 * record says is a foreign_slot finding, as provenance.c's prov_check_block reports one. 0, or
 * -1 with an exception set. */
static int prov_check_read(Native *n, const DevEntry *e, const int64_t *w, int64_t k,
                           const int64_t *a, int64_t stride, const int64_t *kept) {
    const char *where = e->extra ? "provenance sweep" : "a prefix hit";
    for (int64_t i = 0; i < k; i++) {
        const uint8_t *rec = (const uint8_t *)(kept + i * prov_keep_words(n));
        const char *reader = (const char *)rec + rec_words(n) * 8;
        const uint8_t *slots = (const uint8_t *)reader + REQUEST_BYTES;
        uint32_t gen = U4(rec + BF_GENERATION);
        for (int64_t off = 0; off < n->bs; off++) {
            const uint8_t *p = slots + off * PROVENANCE;
            uint32_t h = U4(p + PV_KV_HASH), now = prov_hash_of((uint64_t)a[i * stride + off]);
            if (U4(p + PV_GENERATION) != gen || h == 0 || now == h) continue;
            int32_t b = (int32_t)w[i];
            PyObject *msg = prov_message(n, where, b, off, reader, I4(p + PV_POSITION),
                                         I4(p + PV_TOKEN), p, now);
            if (dev_found_add(n, FK_FOREIGN_SLOT, b, rec, msg)) return -1;
            /* (the finding names the request that reads the slot and its process, this one,
             * as prov_check_block's) */
            memcpy(n->dev->found[n->dev->n_found - 1].seen.request, reader, REQUEST_BYTES);
            n->dev->found[n->dev->n_found - 1].seen.owner_pid = n->pid;
            break;
        }
    }
    return 0;
}

/* A digest check's answer for block b (its raw digest; rec: its record as the check saw it):
 * where it is not the record's digest, a published_block_modified finding, named by the
 * check's moment (e->tag). 0, or -1 with an exception set. */
static int verify_read(Native *n, const DevEntry *e, int32_t b, const uint8_t *rec,
                       int64_t raw) {
    uint64_t got = fmix64((uint64_t)raw) >> 32, want = U8(rec + n->off_kv_digest) >> 32;
    if (got == want) return 0;
    const char *when = e->tag != NULL ? PyUnicode_AsUTF8(e->tag) : "a check";
    if (when == NULL) return -1;
    return dev_found_add(n, FK_PUBLISHED_BLOCK_MODIFIED, b, rec,
                         modified_message(n, rec, when, got, want))
               ? -1
               : 0;
}

/* A prefix hit's check of blocks w[0, k) (devchecks.c dev_hit_check; answers a: a block's raw
 * digest, then its slots' sums; kept: prov_keep_words a block): the digest check of the blocks
 * whose record, as the hit saw it, holds a digest of its generation (the ones digests_intact
 * would have checked), every block's first, then slot provenance's check (its slots' records
 * say which were hashed): the findings in the order of the two checks it stands for. 0, or -1
 * with an exception set. */
static int hit_check_read(Native *n, const DevEntry *e, const int64_t *w, int64_t k,
                          const int64_t *a, const int64_t *kept) {
    int64_t stride = n->bs + 1;
    for (int64_t i = 0; i < k; i++) {
        const uint8_t *rec = (const uint8_t *)(kept + i * prov_keep_words(n));
        if (digest_current(n, rec) && verify_read(n, e, (int32_t)w[i], rec, a[i * stride]))
            return -1;
    }
    return prov_check_read(n, e, w, k, a + 1, stride, kept);
}

/* Entry e's answer (its ring words at w) read into the stamps and findings to apply. 0, or -1
 * with an exception set. */
static int dev_read(Native *n, DevEntry *e, int64_t *w) {
    DevChecks *d = n->dev;
    int64_t k = e->n;
    const int64_t *a = w + k;
    int64_t ans = dev_answer_words(n, e->kind, k);
    const int64_t *kept = w + k + ans;
    if (e->kind == DK_FILL) return 0;
    if (e->kind == DK_UNWRITTEN) {
        /* a slot still poisoned in every row: none of its elements unpoisoned */
        uint8_t *blank = PyMem_Malloc((size_t)(k * n->bs));
        if (blank == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        int32_t *ids = PyMem_Malloc((size_t)k * sizeof *ids);
        if (ids == NULL) {
            PyMem_Free(blank);
            PyErr_NoMemory();
            return -1;
        }
        for (int64_t i = 0; i < k * n->bs; i++) blank[i] = a[i] == 0;
        for (int64_t i = 0; i < k; i++) ids[i] = (int32_t)w[i];
        int rc = unwritten_report(n, ids, k, e->extra, blank, e->tag, 1);
        PyMem_Free(blank);
        PyMem_Free(ids);
        return rc == OK ? 0 : -1;
    }
    if (e->kind == DK_PROV_STAMP) return prov_stamp_read(n, w, k, a, n->bs, kept);
    if (e->kind == DK_PROV_CHECK) return prov_check_read(n, e, w, k, a, n->bs, kept);
    if (e->kind == DK_HIT_CHECK) return hit_check_read(n, e, w, k, a, kept);
    if (e->kind == DK_STAMP || e->kind == DK_STAMP_PROV) {
        /* (DK_STAMP_PROV: a block's digest word, then its slots' sums) */
        int64_t stride = e->kind == DK_STAMP ? 1 : n->bs + 1;
        if (e->kind == DK_STAMP_PROV && prov_stamp_read(n, w, k, a + 1, stride, kept)) return -1;
        if (dev_grow((void **)&d->stamps, &d->cap_stamps, d->n_stamps + k, sizeof(Stamp)))
            return -1;
        for (int64_t i = 0; i < k; i++) {
            uint64_t dg = fmix64((uint64_t)a[i * stride]);
            Stamp *s = &d->stamps[d->n_stamps++];
            s->b = (int32_t)w[i];
            s->g = (uint32_t)(kept[i] & GEN_MASK);
            s->w = ((dg >> 32) << 32) | ((uint64_t)kept[i] & GEN_MASK);
        }
        return 0;
    }
    for (int64_t i = 0; i < k; i++) {
        const uint8_t *rec = kept_rec(n, kept, i);
        int32_t b = (int32_t)w[i];
        if (e->kind == DK_VERIFY) {
            if (verify_read(n, e, b, rec, a[i])) return -1;
        } else if (e->kind == DK_POISON) {
            int64_t c = 0;
            for (int64_t s = 0; s < n->bs; s++) c += a[i * n->bs + s];
            if (c && dev_found_add(n, FK_USE_AFTER_FREE, b, rec, poison_message(n, rec, c)))
                return -1;
        } else if (a[i] != 0) { /* DK_CANARY, DK_RELEASE */
            if (dev_found_add(n, FK_GUARD_VIOLATION, b, rec, Py_NewRef(n->msg_canary))) return -1;
        }
    }
    return 0;
}

/* Whether the GPU is past the oldest check (with `wait`, once it is: waited for). After a
 * driver error (`broken`) every check counts as done: its answer is not read. */
static int dev_ready(DevChecks *d, int wait) {
    DevEntry *e = dev_at(d, 0);
    if (e->done || d->broken) return 1;
    CUres rc;
    if (e->ev < 0) {
        /* not covered (a driver error on the way): wait for its stream */
        Py_BEGIN_ALLOW_THREADS
        rc = d->cu.stream_sync(d->open_stream);
        Py_END_ALLOW_THREADS
    } else {
        CUhandle ev = d->ev[e->ev];
        rc = d->cu.ev_query(ev);
        if (rc == CU_NOT_READY) {
            if (!wait) return 0;
            Py_BEGIN_ALLOW_THREADS
            rc = d->cu.ev_sync(ev);
            Py_END_ALLOW_THREADS
        }
    }
    if (rc != 0) d->broken = rc;
    /* the event's other checks are done too */
    for (int64_t i = 0; i < d->q_count && dev_at(d, i)->ev == e->ev; i++)
        dev_at(d, i)->done = 1;
    e->done = 1;
    return 1;
}

/* The oldest check (done) read into what is to be applied, and dropped from the queue. 0, or
 * -1 with an exception set (the check is dropped either way). */
static int dev_pop(Native *n) {
    DevChecks *d = n->dev;
    DevEntry *e = dev_at(d, 0);
    int64_t found0 = d->n_found;
    d->reading = e->op;
    int rc = d->broken ? 0 : dev_read(n, e, d->ring + e->at);
    d->reading = 0;
    /* (a check read before its operation's record named it, where the queue was full inside
     * the operation: the findings it showed are named in its place) */
    if (e->op == OP_UNNAMED) n->checks_unnamed += d->n_found - found0 - 1;
    int32_t ev = e->ev;
    Py_CLEAR(e->tag);
    d->q_tail = (d->q_tail + 1) % DEV_ENTRIES;
    d->q_count--;
    d->open_from = d->open_from > 0 ? d->open_from - 1 : 0;
    if (ev >= 0 && (d->q_count == 0 || dev_at(d, 0)->ev != ev)) d->ev_free[d->n_ev_free++] = ev;
    if (d->q_count == 0) d->head = 0;
    return rc;
}

/* dev_check's way out of a full queue or ring: the oldest check waited for and read (applied
 * at the next settle). OK, or ERROR with an exception set. */
static int dev_take_oldest(Native *n) {
    DevChecks *d = n->dev;
    if (d->q_count == 0) return OK;
    dev_cover(d);
    dev_ready(d, 1);
    return dev_pop(n) ? ERROR : OK;
}

/* -- applying them ------------------------------------------------------------------------------- */

/* Block b's guard slot given its canary back, in every row (a guard violation reported: the
 * next one is a new write). OK, or what dev_off says. */
static int canary_back(Native *n, int32_t b) {
    DevChecks *d = n->dev;
    size_t guard = (size_t)(n->kv_spb - 1) * (size_t)n->kv_slot_bytes;
    int64_t m = n->kv_slot_bytes / n->kv_esize;
    if (!d->cuda) {
        for (int64_t r = 0; r < n->kv_rows; r++)
            fill_bits(n, d->cpu_kv + (size_t)r * n->kv_row_stride + (size_t)b * n->kv_block_stride +
                             guard,
                      m, n->canary);
        return OK;
    }
    if (d->broken) return OK;
    PyObject *s = PyObject_CallNoArgs(d->stream_fn);
    CUhandle stream = s ? PyLong_AsVoidPtr(s) : NULL;
    Py_XDECREF(s);
    if (PyErr_Occurred()) return ERROR;
    /* the slot of each row (layer x K/V): `m` elements; one memset a row (rows are far apart:
     * a whole layer's K or V) */
    uint64_t c = n->canary;
    CUres rc = 0;
    for (int64_t r = 0; r < n->kv_rows && rc == 0; r++) {
        uint64_t dst = d->kv_dev + (uint64_t)r * (uint64_t)n->kv_row_stride +
                       (uint64_t)b * (uint64_t)n->kv_block_stride + guard;
        switch (n->kv_esize) {
        case 1: rc = d->cu.memset8(dst, (unsigned char)c, (size_t)m, stream); break;
        case 2: rc = d->cu.memset16(dst, (unsigned short)c, (size_t)m, stream); break;
        case 4: rc = d->cu.memset32(dst, (unsigned int)c, (size_t)m, stream); break;
        default:
            /* (8-byte elements: a canary of two equal halves, as kernels/canary.py's 0) */
            if ((c >> 32) == (c & 0xFFFFFFFFull))
                rc = d->cu.memset32(dst, (unsigned int)c, (size_t)(2 * m), stream);
            break;
        }
    }
    if (rc != 0) d->broken = rc;
    return dev_off(n);
}

/* What the answers read showed, applied: the digests into their records (those an error
 * stopped kept for the next settle), then the findings into the ring. 0, or -1 with
 * an exception set. */
static int dev_apply(Native *n, PyObject *pool) {
    DevChecks *d = n->dev;
    int64_t done = 0;
    while (done < d->n_stamps) {
        int32_t b[CHUNK];
        uint32_t g[CHUNK];
        uint64_t w[CHUNK];
        int64_t k = d->n_stamps - done < CHUNK ? d->n_stamps - done : CHUNK;
        for (int64_t i = 0; i < k; i++) {
            b[i] = d->stamps[done + i].b;
            g[i] = d->stamps[done + i].g;
            w[i] = d->stamps[done + i].w;
        }
        PyObject *r = write_digest_words(n, pool, b, g, w, k);
        if (r == NULL) break;
        Py_DECREF(r);
        done += k;
    }
    if (d->n_stamps - done > STAMPS_KEPT) done = d->n_stamps - STAMPS_KEPT;
    memmove(d->stamps, d->stamps + done, (size_t)(d->n_stamps - done) * sizeof(Stamp));
    d->n_stamps -= done;
    if (PyErr_Occurred()) return -1;
    n->probes = (int)*n->probe_bits;
    n->pool = pool;
    int64_t i = 0;
    int rc = 0;
    for (; i < d->n_found && rc == 0; i++) {
        Pending *p = &d->found[i];
        static const char no_request[REQUEST_BYTES];
        if (p->fk == FK_GUARD_VIOLATION && canary_back(n, p->seen.block) != OK) rc = -1;
        if (p->event) ev_record(n, p->event, &p->seen.block, 1, no_request, 0);
        seen_when_reported(n, p);
        Py_ssize_t found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
        if (rc == 0 && finding_report(n, p->fk, &p->seen, p->message) != OK) rc = -1;
        /* while the handle records, in the log as the operation's whose check it answers (a
         * CPU pool's core reports it in that operation: a replay compares it there) */
        if (rc == 0 && n->oplog) oplog_answer_report(n, found0, p->seen.request, p->op);
        if (p->op == OP_UNNAMED && n->checks_unnamed > 0) n->checks_unnamed--;
        Py_CLEAR(p->message);
    }
    for (int64_t j = i; j < d->n_found; j++) {
        if (d->found[j].op == OP_UNNAMED && n->checks_unnamed > 0) n->checks_unnamed--;
        Py_CLEAR(d->found[j].message);
    }
    d->n_found = 0;
    return rc;
}

/* device_take(pool, wait, most): the answers the GPU is past, oldest first (every one,
 * waiting, with `wait`; the oldest, waiting, until no more than `most` are left, where
 * most >= 0), applied here with what an earlier full queue read: digests into the records,
 * findings into the ring (their positions appended to KVPool._found). Under the handle's op
 * mutex (devicechecks.settle). */
static PyObject *N_device_take(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "device_take(pool, wait: bool, most: int)");
        return NULL;
    }
    DevChecks *d = n->dev;
    /* (in a forked child the parent's queue and its GPU handles are not this process's) */
    if (d == NULL || n->seg == NULL || n->fork_gen != fork_gen) Py_RETURN_NONE;
    int wait = PyObject_IsTrue(args[1]);
    long long most = PyLong_AsLongLong(args[2]);
    if (wait < 0 || (most == -1 && PyErr_Occurred())) return NULL;
    int rc = 0;
    if (d->q_count) {
        if (d->cuda && !d->broken) dev_context(d);
        /* A settle between operations (not waiting, not overdue: every allocation and release
         * of an engine's step) takes the answers of the checks an event covers that the GPU is
         * past, and only then, where no covered check is left, covers the rest with a new
         * event and queries it once: an engine's last step is done on the GPU by its next
         * allocation (its tokens were read back), so what that step published is verified by
         * the next prefix hit. One event record at most a settle, none recorded while the GPU
         * is behind. Waiting, every check is covered first (a failure leaves the open ones
         * to be waited for, stream by stream). */
        int lazy = d->cuda && !d->broken && !wait && most < 0;
        if (!lazy) dev_cover(d);
        while (d->q_count && rc == 0 && (!lazy || d->open_from > 0) &&
               dev_ready(d, wait || (most >= 0 && d->q_count > most)))
            rc = dev_pop(n);
        if (lazy && rc == 0 && d->q_count && d->open_from == 0 && dev_cover(d) == OK)
            while (d->q_count && rc == 0 && d->open_from > 0 && dev_ready(d, 0)) rc = dev_pop(n);
    }
    if (rc == 0 && dev_off(n) != OK) rc = -1;
    if (rc == 0 && (d->n_stamps || d->n_found)) rc = dev_apply(n, args[0]);
    if (rc != 0) return NULL;
    Py_RETURN_NONE;
}
