/* The checks of K/V the core cannot reach (a CUDA pool), launched by the core itself and read
 * back later, with no call into Python per check (docs/FORMAT.md "The core").
 *
 * A serving step makes a dozen or more checks (a digest for each block published, a poison
 * check for each block handed out). Here a check is: its block ids and the records it needs
 * later written into a ring of page-locked memory the kernel reads, one cuLaunchKernel of
 * kernels/checks.py's compiled kernel (its handle, launch geometry and parameters worked out
 * once by allocator/devicechecks.py, which compares a launch made here with Triton's own
 * before it hands them over), and an entry in a queue.
 *
 * Their answers are read back and applied by the core between operations (`device_take`,
 * devanswers.c). Where the queue or the ring is full, the oldest answers are waited for and
 * read first (applied at the next settle): a check is never dropped. A driver error turns the
 * checks off for the handle, said once (a RuntimeWarning naming the call and its CUresult;
 * device_stats()["broken"]).
 *
 * libcuda is not linked: its entry points are looked up in the process (torch loaded it) when
 * the checks are configured. On a CPU pool (a test seam: devicechecks.DEFERRED_ON_CPU, the
 * tests' way to run this queue without a GPU) the "launch" computes the same answer at once
 * with the loops of kvdata.c. Part of _native.c. */

#include <dlfcn.h>

/* The driver API, as far as used here (cuda.h is not needed to build: the types are opaque). */
typedef int CUres;
typedef void *CUhandle;
#define CU_NOT_READY 600
#define CU_EVENT_DISABLE_TIMING 2

typedef struct {
    CUres (*launch)(CUhandle f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                    unsigned bz, unsigned shared, CUhandle stream, void **params, void **extra);
    CUres (*ev_create)(CUhandle *ev, unsigned flags);
    CUres (*ev_record)(CUhandle ev, CUhandle stream);
    CUres (*ev_query)(CUhandle ev);
    CUres (*ev_sync)(CUhandle ev);
    CUres (*ev_destroy)(CUhandle ev);
    CUres (*stream_sync)(CUhandle stream);
    CUres (*ctx_get)(CUhandle *ctx);
    CUres (*ctx_set)(CUhandle ctx);
    CUres (*primary_retain)(CUhandle *ctx, int device);
    /* (dst, value, elements, stream): a broken canary put back */
    CUres (*memset8)(uint64_t dst, unsigned char v, size_t n, CUhandle s);
    CUres (*memset16)(uint64_t dst, unsigned short v, size_t n, CUhandle s);
    CUres (*memset32)(uint64_t dst, unsigned int v, size_t n, CUhandle s);
} CuApi;

/* kernels/checks.py modes */
enum {
    M_DIGEST = 0,
    M_COUNTS = 1,
    M_CANARY = 2,
    M_POISON = 3,
    M_SLOTS = 4,
    M_DIGEST_SLOTS = 5,
    M_CANARY_POISON = 6,
    N_MODES = 7
};
/* (DK_*, what a check is for: core.h) */
static const int DK_MODE[N_DK] = {M_DIGEST,       M_DIGEST,       M_COUNTS,       M_CANARY,
                                  M_POISON,       M_COUNTS,       M_SLOTS,        M_SLOTS,
                                  M_DIGEST_SLOTS, M_DIGEST_SLOTS, M_CANARY_POISON};
static const char *DK_NAME[N_DK] = {"stamp",           "verify",           "poison",
                                    "canary",          "fill",             "unwritten",
                                    "provenance hash", "provenance check", "stamp and hash",
                                    "prefix hit",      "canary and fill"};

#define DEV_ENTRIES 8192 /* checks waiting at most (then the oldest are taken first) */
/* Digests answered whose records an error kept the core from writing: kept for the next
 * settle, at most this many (then the oldest are dropped, and their blocks go unverified). */
#define STAMPS_KEPT 65536
#define DEV_PARAMS 16

typedef struct {
    uint8_t kind, done;
    int32_t n;        /* blocks */
    int32_t ev;       /* the event recorded after it (-1: none yet) */
    int64_t at, end;  /* its ring words: ids [at, at+n), the answer, then what it keeps */
    int64_t extra;    /* unwritten: the request's positions whose K/V must be written;
                       * provenance check: where (0 a prefix hit, 1 the sweep) */
    PyObject *tag;    /* a reference: verify's (and a prefix hit's) moment, in a finding's words
                       * (a str); unwritten's request id; else NULL */
    uint64_t op;      /* the recorded operation it belongs to (OP_UNNAMED: the handle's next
                       * operation record; 0: none), for a finding's REPORT (devanswers.c) */
} DevEntry;

/* A digest answered, on its way into its block's record (write_digest_words). */
typedef struct {
    int32_t b;
    uint32_t g; /* the generation it was taken in */
    uint64_t w; /* the record's kv_digest word */
} Stamp;

typedef struct DevChecks {
    CuApi cu;
    int cuda;                    /* 0: a CPU pool's bytes, answered at once */
    int64_t *ring;               /* page-locked (CUDA) words: ids in, answers out */
    int64_t ring_words, head;
    PyObject *ring_obj, *kv_obj; /* kept alive while the core may use them */
    uint8_t *cpu_kv;             /* a CPU pool: its bytes */
    uint64_t kv_dev;             /* a CUDA pool: its K/V's device address (canaries put back) */
    PyObject *stream_fn;         /* () -> the current stream's raw handle */
    CUhandle fn[N_MODES];
    unsigned threads[N_MODES], shared[N_MODES];
    int nparams, ids_param, out_param, device;
    uint64_t pval[DEV_PARAMS];
    int64_t max_pending;         /* past this many waiting, the overdue word is set */
    DevEntry q[DEV_ENTRIES];
    int64_t q_tail, q_count, open_from; /* entries [open_from, tail + count) have no event */
    CUhandle open_stream;
    CUhandle ev[DEV_ENTRIES];
    int32_t ev_free[DEV_ENTRIES];
    int64_t n_ev_free;
    CUres broken;                /* the first failed driver call (then the checks are off) */
    int said;                    /* the warning that they are off was given */
    uint64_t launched;
    uint64_t recorded; /* events recorded (device_stats()["events"]) */
    /* a batch of publications (mark_computed_many, between dev_batch_begin and dev_batch_end):
     * the blocks whose check (pub_kind) waits for the batch's end, queued then as one */
    int batching, pub_kind;
    int32_t *pub_ids;
    uint32_t *pub_gen; /* (each block's generation as published) */
    int64_t n_pub, cap_pub, cap_gen;
    /* answers read and not yet applied (devanswers.c dev_apply): digests for the records,
     * findings for the ring (a broken canary's with it put back first) */
    Stamp *stamps;
    int64_t n_stamps, cap_stamps;
    Pending *found;
    int64_t n_found, cap_found;
    uint64_t reading; /* the op of the check whose answer is being read (dev_read) */
} DevChecks;

static int dev_take_oldest(Native *n); /* devanswers.c */
static int dev_grow(void **arr, int64_t *cap, int64_t need, size_t size);

static inline DevEntry *dev_at(DevChecks *d, int64_t i) {
    return &d->q[(d->q_tail + i) % DEV_ENTRIES];
}

/* Words a block's record takes in the ring. */
static inline int64_t rec_words(Native *n) { return (n->rec + 7) / 8; }

/* Block i's record, as the operation saw it, among the words a check keeps. */
static inline uint8_t *kept_rec(Native *n, const int64_t *kept, int64_t i) {
    return (uint8_t *)kept + (size_t)(i * rec_words(n) * 8);
}

/* The answer's words (kernels/checks.py answer_words) and what the entry keeps after it. */
static int64_t dev_answer_words(Native *n, int kind, int64_t k) {
    int mode = DK_MODE[kind];
    return mode == M_COUNTS || mode == M_SLOTS ? k * n->bs
           : mode == M_DIGEST_SLOTS            ? k * (n->bs + 1)
           : mode == M_POISON                  ? 0
                                               : k;
}
/* A provenance check keeps, per block: its record, the reading request's 32 bytes, and its
 * slots' provenance records, as the operation saw them (provenance.c prov_check_later); a
 * prefix hit's check (dev_hit_check) the same, the record also what its digest check reads. */
static inline int64_t prov_keep_words(Native *n) {
    return rec_words(n) + REQUEST_BYTES / 8 + n->bs * PROVENANCE / 8;
}
static int64_t dev_keep_words(Native *n, int kind, int64_t k) {
    if (kind == DK_STAMP || kind == DK_PROV_STAMP || kind == DK_STAMP_PROV) return k; /* gens */
    if (kind == DK_FILL || kind == DK_UNWRITTEN) return 0;
    if (kind == DK_PROV_CHECK || kind == DK_HIT_CHECK) return k * prov_keep_words(n);
    return k * rec_words(n); /* the records as the operation saw them */
}

/* A span of `words` ring words (rounded up to two: 16-byte aligned), or -1 while the ring has
 * no room (the oldest checks are taken first: dev_check). */
static int64_t dev_take_words(DevChecks *d, int64_t words) {
    words += words & 1;
    int64_t tail = d->q_count ? dev_at(d, 0)->at : -1, head = d->head, start = -1;
    if (tail < 0) {
        start = words <= d->ring_words ? 0 : -1;
    } else if (head > tail) { /* in use: [tail, head) */
        if (head + words <= d->ring_words) start = head;
        else if (words < tail) start = 0;
    } else if (head + words < tail) { /* in use: [tail, end) and [0, head) */
        start = head;
    }
    if (start >= 0) d->head = start + words;
    return start;
}

/* -- a CPU pool: the answer at once (kvdata.c's loops, the kernel's meaning) ------------------ */

static void dev_cpu_answer(Native *n, DevChecks *d, int mode, const int32_t *ids, int64_t k,
                           int64_t *out) {
    int64_t slot_m = n->kv_slot_bytes / n->kv_esize, m = n->bs * slot_m;
    size_t guard = (size_t)(n->kv_spb - 1) * (size_t)n->kv_slot_bytes;
    for (int64_t i = 0; i < k; i++) {
        uint8_t *base = d->cpu_kv + (size_t)ids[i] * n->kv_block_stride;
        if (mode == M_DIGEST || mode == M_SLOTS || mode == M_DIGEST_SLOTS) {
            /* (DIGEST_SLOTS: the digest word, then the slots', a block's words) */
            int64_t *o = mode == M_DIGEST_SLOTS ? out + i * (n->bs + 1) : NULL;
            if (mode != M_SLOTS) {
                uint64_t sum = 0, jm = DIGEST_ADD;
                for (int64_t r = 0; r < n->kv_rows; r++)
                    sum = digest_row(n, base + (size_t)r * n->kv_row_stride, m, &jm, sum);
                *(o ? o++ : out + i) = (int64_t)sum; /* raw, as the kernel's: fmix64 when taken */
            }
            for (int64_t s = 0; s < n->bs && mode != M_DIGEST; s++) {
                uint64_t sum = 0, jm = DIGEST_ADD;
                for (int64_t r = 0; r < n->kv_rows; r++)
                    sum = digest_row(n, base + (size_t)r * n->kv_row_stride + s * n->kv_slot_bytes,
                                     slot_m, &jm, sum);
                *(o ? o++ : out + i * n->bs + s) = (int64_t)sum;
            }
        } else if (mode == M_COUNTS) {
            for (int64_t s = 0; s < n->bs; s++) {
                int64_t c = 0;
                for (int64_t r = 0; r < n->kv_rows; r++)
                    c += count_not(n, base + (size_t)r * n->kv_row_stride + s * n->kv_slot_bytes,
                                   slot_m, n->nan_bits);
                out[i * n->bs + s] = c;
            }
        } else if (mode == M_CANARY || mode == M_CANARY_POISON) {
            int bad = 0;
            for (int64_t r = 0; r < n->kv_rows && !bad; r++)
                bad = !all_bits(n, base + (size_t)r * n->kv_row_stride + guard, slot_m, n->canary);
            out[i] = bad;
            /* (CANARY_POISON: then the token slots' fill, which leaves the guard slot) */
            for (int64_t r = 0; r < n->kv_rows && mode == M_CANARY_POISON; r++)
                fill_bits(n, base + (size_t)r * n->kv_row_stride, m, n->nan_bits);
        } else {
            for (int64_t r = 0; r < n->kv_rows; r++)
                fill_bits(n, base + (size_t)r * n->kv_row_stride, m, n->nan_bits);
        }
    }
}

/* The device's primary context current on this thread, as Triton's launcher makes it (a
 * thread that has not used CUDA yet has none). OK, or UNHANDLED with `broken` set. */
static int dev_context(DevChecks *d) {
    CUhandle ctx = NULL;
    CUres rc = d->cu.ctx_get(&ctx);
    if (rc == 0 && ctx == NULL) {
        rc = d->cu.primary_retain(&ctx, d->device);
        if (rc == 0) rc = d->cu.ctx_set(ctx);
    }
    if (rc != 0) d->broken = rc;
    return rc == 0 ? OK : UNHANDLED;
}

/* Once the driver failed (`broken`): said once, as a RuntimeWarning (the checks are off for
 * the handle from then on: no answer after the failure is the GPU's). OK, or ERROR where the
 * warning is made an exception (-W error). */
static int dev_off(Native *n) {
    DevChecks *d = n->dev;
    if (d == NULL || !d->broken || d->said) return OK;
    d->said = 1;
    return PyErr_WarnFormat(PyExc_RuntimeWarning, 1,
                            "kvscope: a CUDA driver call of the pool's K/V checks failed "
                            "(CUresult %d): guard mode and the digest probe check no more of "
                            "this handle's blocks",
                            d->broken) < 0
               ? ERROR
               : OK;
}

/* -- events ------------------------------------------------------------------------------------ */

/* One event after the checks launched since the last (on the stream they went to). */
static int dev_cover(DevChecks *d) {
    int64_t end = d->q_count;
    if (d->broken) return UNHANDLED;
    if (!d->cuda || d->open_from >= end) {
        d->open_from = end;
        return OK;
    }
    if (d->n_ev_free == 0) return UNHANDLED; /* (cannot be: an entry holds at most one event) */
    int32_t e = d->ev_free[--d->n_ev_free];
    CUres rc = 0;
    if (d->ev[e] == NULL) rc = d->cu.ev_create(&d->ev[e], CU_EVENT_DISABLE_TIMING);
    if (rc == 0) rc = d->cu.ev_record(d->ev[e], d->open_stream);
    if (rc != 0) {
        d->ev_free[d->n_ev_free++] = e;
        d->broken = rc;
        return UNHANDLED;
    }
    for (int64_t i = d->open_from; i < end; i++) dev_at(d, i)->ev = e;
    d->open_from = end;
    d->recorded++;
    return OK;
}

/* -- launching --------------------------------------------------------------------------------- */

/* Whether a check of this kind can report a finding (the others write digests and hashes, or
 * poison). */
static inline int dev_finds(int kind) {
    return kind == DK_VERIFY || kind == DK_POISON || kind == DK_CANARY || kind == DK_UNWRITTEN ||
           kind == DK_PROV_CHECK || kind == DK_HIT_CHECK || kind == DK_RELEASE;
}

/* Check `kind` of blocks ids[0..k) (kvdata.c, where the data is not this process's), queued:
 * OK (also once the driver failed: the checks are off, dev_off); UNHANDLED with `need_mutex`
 * set where another thread holds the op mutex (the launch may let go of the GIL: the operation
 * rolls back, waits for the mutex and runs again, eviction.c rolled_back); ERROR with an
 * exception set (no checks configured, a check larger than the ring, the warning of dev_off
 * made an error). Where the queue or the ring is full the oldest checks are waited for and
 * read first. */
static int dev_check(Native *n, int kind, const int32_t *ids, int64_t k, const char *when,
                     int64_t extra, PyObject *tag) {
    DevChecks *d = n->dev;
    if (k == 0) return OK;
    if (d == NULL) {
        PyErr_SetString(PyExc_RuntimeError,
                        "kvscope: the pool's K/V checks are not configured (guard mode and the "
                        "digest probe on a pool whose K/V this process does not map: "
                        "allocator/devicechecks.py)");
        return ERROR;
    }
    int mode = DK_MODE[kind];
    if (d->cuda && d->fn[mode] == NULL) {
        PyErr_Format(PyExc_RuntimeError,
                     "kvscope: the check kernel's mode for %s checks was not compiled",
                     DK_NAME[kind]);
        return ERROR;
    }
    if (d->broken) return OK;
    if (d->cuda && dev_context(d) != OK) return dev_off(n);
    int held = hold_mutex(n);
    if (held == ERROR) return ERROR;
    if (held != OK) {
        n->need_mutex = 1;
        return UNHANDLED;
    }
    int64_t ans = dev_answer_words(n, kind, k), keep = dev_keep_words(n, kind, k);
    int64_t words = k + ans + keep;
    if (words + (words & 1) > d->ring_words) {
        PyErr_Format(PyExc_RuntimeError,
                     "kvscope: a check of %lld blocks takes %lld words, more than the K/V "
                     "checks' ring holds (%lld)",
                     (long long)k, (long long)words, (long long)d->ring_words);
        return ERROR;
    }
    int64_t at = -1;
    while (d->q_count >= DEV_ENTRIES - 1 || (at = dev_take_words(d, words)) < 0) {
        if (dev_take_oldest(n) != OK) return ERROR;
        if (d->broken) return dev_off(n);
        /* (what it read is applied at the next settle, which the pool's append and
         * mark_computed call where this word is set) */
        *n->overdue = 1;
    }
    /* (verify's moment is copied: the caller's may be a buffer of its own) */
    PyObject *own = kind == DK_VERIFY && when != NULL ? PyUnicode_FromString(when) : NULL;
    if (kind == DK_VERIFY && when != NULL && own == NULL) {
        d->head = at;
        return ERROR;
    }
    int64_t *w = d->ring + at;
    for (int64_t i = 0; i < k; i++) w[i] = ids[i];
    int64_t *kept = w + k + ans;
    if (kind == DK_STAMP || kind == DK_PROV_STAMP || kind == DK_STAMP_PROV) {
        for (int64_t i = 0; i < k; i++) kept[i] = U4(blk(n, ids[i]) + BF_GENERATION);
    } else if (kind == DK_PROV_CHECK || kind == DK_HIT_CHECK) {
        /* (`when`: the reading request's 32 bytes, for each block) */
        for (int64_t i = 0; i < k; i++) {
            uint8_t *p = (uint8_t *)(kept + i * prov_keep_words(n));
            memcpy(p, blk(n, ids[i]), (size_t)n->rec);
            p += rec_words(n) * 8;
            memcpy(p, when + i * REQUEST_BYTES, REQUEST_BYTES);
            memcpy(p + REQUEST_BYTES, prov_rec(n, ids[i], 0), (size_t)n->bs * PROVENANCE);
        }
    } else if (kind != DK_FILL && kind != DK_UNWRITTEN) {
        for (int64_t i = 0; i < k; i++)
            memcpy(kept_rec(n, kept, i), blk(n, ids[i]), (size_t)n->rec);
    }
    int done = 1;
    if (d->cuda) {
        PyObject *s = PyObject_CallNoArgs(d->stream_fn);
        CUhandle stream = s ? PyLong_AsVoidPtr(s) : NULL;
        Py_XDECREF(s);
        if (PyErr_Occurred()) {
            d->head = at; /* (nothing queued: the span is free again) */
            Py_XDECREF(own);
            return ERROR;
        }
        if (d->open_from < d->q_count && stream != d->open_stream && dev_cover(d) != OK) {
            d->head = at;
            Py_XDECREF(own);
            return dev_off(n);
        }
        d->open_stream = stream;
        uint64_t pv[DEV_PARAMS + 2];
        void *params[DEV_PARAMS + 2];
        memcpy(pv, d->pval, sizeof d->pval);
        pv[d->ids_param] = (uint64_t)at;
        pv[d->out_param] = (uint64_t)(at + k);
        for (int i = 0; i < d->nparams; i++) params[i] = &pv[i];
        /* Triton's hidden scratch pointers (global, profile: none of this kernel's), where the
         * compiled kernel has them; a kernel without reads no more than its own. */
        pv[d->nparams] = pv[d->nparams + 1] = 0;
        params[d->nparams] = &pv[d->nparams];
        params[d->nparams + 1] = &pv[d->nparams + 1];
        CUres rc = d->cu.launch(d->fn[mode], (unsigned)k, 1, 1, d->threads[mode], 1, 1,
                                d->shared[mode], stream, params, NULL);
        if (rc != 0) {
            d->broken = rc;
            d->head = at;
            Py_XDECREF(own);
            return dev_off(n);
        }
        done = 0;
    } else {
        dev_cpu_answer(n, d, mode, ids, k, w + k);
    }
    DevEntry *e = dev_at(d, d->q_count++);
    e->kind = (uint8_t)kind;
    e->done = (uint8_t)done;
    e->n = (int32_t)k;
    e->ev = -1;
    e->at = at;
    e->end = at + words;
    e->extra = extra;
    e->tag = own != NULL ? own : Py_XNewRef(tag);
    /* While the handle records, a check that can find something belongs to the operation it
     * was queued in (a finish check, queued just before its free: the free), whose record is
     * written as it returns: that record names it (oplog.c oplog_name_checks), so that a
     * finding its answer shows at a later settle is recorded as that operation's (a REPORT,
     * devanswers.c dev_apply). The provenance sweep's checks belong to no operation. */
    e->op = 0;
    if (n->oplog != NULL && dev_finds(kind) && !(kind == DK_PROV_CHECK && extra == 1)) {
        e->op = OP_UNNAMED;
        n->checks_unnamed++;
        oplog_check_queued(n);
    }
    d->launched++;
    /* (the word pool.append and mark_computed read: they take the answers) */
    if (d->q_count > d->max_pending) *n->overdue = 1;
    return OK;
}

/* -- a prefix hit ------------------------------------------------------------------------------ */

static int dev_hit_check(Native *n, const int32_t *table, int64_t hits, const char *when,
                         const char *request) {
    enum { SOME = 256 };
    int32_t some[SOME];
    char who[SOME * REQUEST_BYTES];
    PyObject *tag = PyUnicode_FromString(when);
    if (tag == NULL) return ERROR;
    int rc = OK;
    int64_t m = 0;
    for (int64_t i = 0; i <= hits && rc == OK; i++) {
        if (m == SOME || (i == hits && m)) {
            rc = dev_check(n, DK_HIT_CHECK, some, m, who, 0, tag);
            m = 0;
        }
        if (i == hits) break;
        if (!digest_current(n, blk(n, table[i])) && !prov_hashed(n, table[i])) continue;
        some[m] = table[i];
        memcpy(who + m * REQUEST_BYTES, request, REQUEST_BYTES);
        m++;
    }
    Py_DECREF(tag);
    return rc;
}

/* -- a guarded release -------------------------------------------------------------------------- */

static inline int dev_release_later(Native *n) { return n->kv == NULL && n->poison_ok; }

static int dev_release_check(Native *n, const int32_t *ids, int64_t k) {
    return dev_check(n, DK_RELEASE, ids, k, NULL, 0, NULL);
}

/* -- a batch of publications ------------------------------------------------------------------ */

/* A publication's check of blocks ids[0..k) (DK_STAMP, DK_STAMP_PROV, DK_PROV_STAMP: their
 * digests, their recorded slots' hashes), from inside its transaction: queued now (dev_check);
 * or, in a batch (dev_batch_begin), kept for the batch's end, which queues the blocks of every
 * sequence it published as one check, one launch (a serving step publishes a few sequences: a
 * launch, a stream lookup and the op mutex each, where one does). Either way the kernel reads
 * the K/V after the forward that wrote it (the current stream's, behind it). A check of
 * another kind than the kept ones (the probes changed within the batch) is queued now. OK,
 * UNHANDLED, ERROR as dev_check (the caller rolls back: dev_batch_undo). */
static int dev_publish_check(Native *n, int kind, const int32_t *ids, int64_t k) {
    DevChecks *d = n->dev;
    if (k == 0) return OK;
    if (d == NULL || !d->batching || d->broken || (d->n_pub && d->pub_kind != kind))
        return dev_check(n, kind, ids, k, NULL, 0, NULL);
    if (dev_grow((void **)&d->pub_ids, &d->cap_pub, d->n_pub + k, sizeof *d->pub_ids) ||
        dev_grow((void **)&d->pub_gen, &d->cap_gen, d->n_pub + k, sizeof *d->pub_gen))
        return ERROR;
    for (int64_t i = 0; i < k; i++) {
        d->pub_ids[d->n_pub + i] = ids[i];
        d->pub_gen[d->n_pub + i] = U4(blk(n, ids[i]) + BF_GENERATION);
    }
    d->n_pub += k;
    d->pub_kind = kind;
    return OK;
}

/* How many blocks the batch keeps so far (a transaction's mark: dev_batch_undo). */
static int64_t dev_batch_mark(Native *n) { return n->dev ? n->dev->n_pub : 0; }

/* A transaction rolled back: the blocks it kept since `mark` dropped (its publication is
 * undone; run again, it keeps them again). */
static void dev_batch_undo(Native *n, int64_t mark) {
    if (n->dev && n->dev->n_pub > mark) n->dev->n_pub = mark;
}

/* A batch of publications begins: their checks kept until dev_batch_end. */
static void dev_batch_begin(Native *n) {
    if (n->dev) n->dev->batching = 1;
}

/* The batch ends: the checks it kept queued, one for all its blocks (in as few as the ring
 * holds, a quarter of it each: the checks queued before them keep their room), under the op
 * mutex, outside any transaction, after the publications' commits. A block no longer
 * published in the generation it was published in (only another thread's operation on the
 * handle, between two of the batch's sequences, could have released it) is left out, as
 * its answer would be (devanswers.c): it is not checked against a later holder's K/V. OK
 * (also where the driver failed: the checks are off), or ERROR with an exception set: those
 * blocks have no digest, as blocks published before a driver error. */
static int dev_batch_end(Native *n) {
    DevChecks *d = n->dev;
    if (d == NULL) return OK;
    d->batching = 0;
    int kind = d->pub_kind, rc = OK;
    int64_t k = 0;
    for (int64_t i = 0; i < d->n_pub; i++) {
        uint8_t *r = blk(n, d->pub_ids[i]);
        if (r[BF_INDEXED] == 1 && U4(r + BF_GENERATION) == d->pub_gen[i])
            d->pub_ids[k++] = d->pub_ids[i];
    }
    int64_t per_block = 1 + dev_answer_words(n, kind, 1) + dev_keep_words(n, kind, 1);
    int64_t most = d->ring_words / 4 / per_block;
    if (most < CHUNK) most = CHUNK; /* (what one transaction's check takes, unbatched) */
    /* (dev_check calls Python, the current stream's lookup: the queue is looked at again) */
    for (int64_t i = 0; i < k && rc == OK && n->dev == d; i += most)
        rc = dev_check(n, kind, d->pub_ids + i, k - i < most ? k - i : most, NULL, 0, NULL);
    if (n->dev == d) d->n_pub = 0;
    if (rc == UNHANDLED && !PyErr_Occurred()) unhandled(n); /* (no transaction: cannot be) */
    return rc == OK ? OK : ERROR;
}

/* device_queue(kind, ids, when): a check queued as the core's operations queue theirs (tests
 * and benchmarks of the queue): kind one of "stamp", "verify", "poison", "canary", "fill";
 * `when` a verification's moment (else None). Under the handle's op mutex (the caller holds
 * it). */
static PyObject *N_device_queue(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    const char *name;
    if (nargs != 3 || (name = PyUnicode_AsUTF8(args[0])) == NULL || !PyList_Check(args[1]) ||
        (args[2] != Py_None && !PyUnicode_Check(args[2]))) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "device_queue(kind: str, ids: list, when: str | None)");
        return NULL;
    }
    int kind = 0;
    while (kind < DK_UNWRITTEN && strcmp(DK_NAME[kind], name) != 0) kind++;
    if (kind == DK_UNWRITTEN) {
        PyErr_Format(PyExc_ValueError, "device_queue: no check %s", name);
        return NULL;
    }
    const char *when = args[2] == Py_None ? NULL : PyUnicode_AsUTF8(args[2]);
    if (args[2] != Py_None && when == NULL) return NULL;
    Py_ssize_t k = PyList_GET_SIZE(args[1]);
    int32_t *ids = PyMem_Malloc((size_t)(k ? k : 1) * sizeof *ids);
    if (ids == NULL) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < k; i++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(args[1], i));
        if (b < 0 || b >= n->nb) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "block id out of range");
            PyMem_Free(ids);
            return NULL;
        }
        ids[i] = (int32_t)b;
    }
    int mh = n->mutex_held;
    n->mutex_held = 1; /* (the caller holds the op mutex) */
    int rc = n->seg == NULL || n->fork_gen != fork_gen ? OK
                                                       : dev_check(n, kind, ids, k, when, 0, NULL);
    n->mutex_held = mh;
    PyMem_Free(ids);
    if (rc != OK) return NULL;
    Py_RETURN_NONE;
}
