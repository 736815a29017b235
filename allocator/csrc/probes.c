/* The light probes, run by the core itself: flight-recorder events, allocation sites, leak
 * accounting, record checksums, the lock-order graph. A finding the core detects it writes into
 * the segment's findings ring itself (finding_report), where the binding reads it back for
 * `on_finding` (a release's table holding a freed block or a scribbled record: allocate.c
 * unsealed_left, already_free; a block an append fills whose record is scribbled: append.c
 * extend_chain). The checks the handle runs between operations (probing.py PoolProbes:
 * verify(), the canary scan) report through KVPool.report. The ring and the site table have no
 * other writer: KVPool.report writes through N_report, and the core interns the sites it
 * composes (site_now). Part of _native.c. */

/* -- the flight recorder ---------------------------------------------------------------------- */

static void ev_record(Native *n, int op, const int32_t *ids, int64_t k, const char *request,
                      int64_t arg) {
    if (!(n->probes & P_EVENTS) || n->ev_cap == 0) return;
    int32_t none = -1;
    if (k == 0) {
        ids = &none;
        k = 1;
    }
    if (k > (int64_t)n->ev_cap) {
        ids += k - (int64_t)n->ev_cap;
        k = (int64_t)n->ev_cap;
    }
    uint64_t h = U8(n->seg + n->c_event_head), now = wall_ns();
    if (op == E_EXHAUSTED && h > 0) {
        /* A take that fails again as the one before it, nothing recorded between (an engine
         * retrying one request on a full pool, thousands of times), moves that event's time
         * on: a storm of them does not push the ring's history out (the count is the
         * client's num_exhausted). */
        uint8_t *e = n->seg + n->off_ev + ((h - 1) % n->ev_cap) * EV_SIZE;
        if (e[EV_OP] == E_EXHAUSTED && *(int64_t *)(e + EV_ARG) == arg &&
            memcmp(e + EV_REQUEST, request, REQUEST_BYTES) == 0) {
            U8(e + EV_TIME) = now;
            return;
        }
    }
    for (int64_t i = 0; i < k; i++) {
        uint8_t *e = n->seg + n->off_ev + ((h + (uint64_t)i) % n->ev_cap) * EV_SIZE;
        U8(e + EV_TIME) = now;
        I4(e + EV_PID) = n->pid;
        e[EV_OP] = (uint8_t)op;
        I4(e + EV_BLOCK) = ids[i];
        U4(e + EV_GENERATION) = ids[i] >= 0 ? U4(blk(n, ids[i]) + BF_GENERATION) : 0;
        *(int64_t *)(e + EV_ARG) = arg;
        memcpy(e + EV_REQUEST, request, REQUEST_BYTES);
    }
    U8(n->seg + n->c_event_head) = h + (uint64_t)k;
}

/* -- allocation sites ------------------------------------------------------------------------- */

static inline size_t ptr_hash(const void *p, int salt) {
    uint64_t h = (uint64_t)(uintptr_t)p * 0x9E3779B97F4A7C15ull + (uint64_t)salt * KSUM[1];
    return (size_t)(h >> 40);
}

/* Forget every cached code object (the cache is full). */
static void site_cache_clear(Native *n) {
    for (int i = 0; i < SITE_CACHE; i++) {
        Py_CLEAR(n->site_code[i]);
        Py_CLEAR(n->out_code[i]);
    }
    n->site_used = n->out_used = 0;
}

/* sites._SKIP: the bootstrap that started the script (a file name ending so is no site) */
static const char *const SITE_SKIP[] = {"<frozen runpy>", "<frozen importlib", "/runpy.py"};

/* Whether a code object lies outside kvscope's own folders: 0 inside, 1 outside (sites._outside),
 * 2 outside them but a bootstrap frame (sites._SKIP); -1 with an exception set. Cached per code
 * object. */
static int code_outside(Native *n, PyCodeObject *code) {
    size_t i = ptr_hash(code, 0) & (SITE_CACHE - 1);
    while (n->out_code[i]) {
        if (n->out_code[i] == (PyObject *)code) return n->out_flag[i];
        i = (i + 1) & (SITE_CACHE - 1);
    }
    int out = 1;
    PyObject *name = code->co_filename;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(n->kv_dirs); d++) {
        Py_ssize_t hit = PyUnicode_Tailmatch(name, PyTuple_GET_ITEM(n->kv_dirs, d), 0,
                                             PY_SSIZE_T_MAX, -1);
        if (hit < 0) return -1;
        if (hit) out = 0;
    }
    for (size_t k = 0; out == 1 && k < sizeof SITE_SKIP / sizeof *SITE_SKIP; k++) {
        PyObject *tail = PyUnicode_FromString(SITE_SKIP[k]);
        Py_ssize_t hit = tail ? PyUnicode_Tailmatch(name, tail, 0, PY_SSIZE_T_MAX, 1) : -1;
        Py_XDECREF(tail);
        if (hit < 0) return -1;
        if (hit) out = 2;
    }
    if (n->out_used * 4 >= SITE_CACHE * 3) {
        site_cache_clear(n);
        return code_outside(n, code);
    }
    n->out_code[i] = Py_NewRef((PyObject *)code);
    n->out_flag[i] = (uint8_t)out;
    n->out_used++;
    return out;
}

/* The site table's id of text[0, len) (cut to the field's bytes), appended when there is none
 * (the entry first, then the count: a death in between leaves an unused entry): -1 when the
 * table is full. The caller holds the sites lock. */
static int64_t site_find_or_add(Native *n, const char *raw, size_t len) {
    size_t tl = len < SR_TEXT_BYTES ? len : SR_TEXT_BYTES;
    int64_t used = (int64_t)U4(n->seg + HDR_NUM_SITES_USED), id = -1;
    if (used > NUM_SITES) used = NUM_SITES;
    for (int64_t i = 0; i < used && id < 0; i++) {
        const uint8_t *t = n->seg + n->off_sites + (size_t)i * SITE_SIZE;
        /* (a stored text is NUL-padded: equal bytes, then nothing) */
        if (memcmp(t, raw, tl) == 0 && (tl == SR_TEXT_BYTES || t[tl] == 0)) id = i;
    }
    if (id < 0 && used < NUM_SITES) {
        uint8_t *t = n->seg + n->off_sites + (size_t)used * SITE_SIZE;
        memset(t, 0, SR_TEXT_BYTES);
        memcpy(t, raw, tl);
        U4(n->seg + HDR_NUM_SITES_USED) = (uint32_t)used + 1;
        id = used;
    }
    return id;
}

enum { SITE_ERROR = -2 };
static int leaf_take(Native *n, int i, int *mh);
static void leaf_drop(Native *n, int i, int taken, int mh);

/* site_find_or_add for the core, before its operation takes any pool lock: the sites lock is
 * waited for, and a dead holder of it recovered (leaf_take), rather than the site left out: a
 * block's site is what its findings (a leak, a use after free) name, for as long as it is
 * held, and the wait cannot close a cycle (this call holds no other lock; the lock is a leaf,
 * under which nothing else is taken). Inside a transaction (where site_now never runs) a lock
 * not to be had then gives no site (-1). SITE_ERROR with an exception set. */
static int64_t site_intern(Native *n, PyObject *text) {
    Py_ssize_t len;
    const char *raw = PyUnicode_AsUTF8AndSize(text, &len);
    if (raw == NULL) return SITE_ERROR;
    int mh, taken = leaf_take(n, n->lock_sites, &mh);
    if (taken == ERROR) return SITE_ERROR;
    if (taken == UNHANDLED) return -1;
    int64_t id = site_find_or_add(n, raw, (size_t)len);
    leaf_drop(n, n->lock_sites, taken, mh);
    return id;
}

/* sites.frame_text: `file:line function`, the file relative to the working directory when
 * under it. A new reference, or NULL with an exception set. */
static PyObject *frame_text(PyFrameObject *f) {
    PyCodeObject *code = PyFrame_GetCode(f);
    PyObject *name = code->co_filename, *shown = NULL, *out = NULL;
    char cwd[4096];
    if (getcwd(cwd, sizeof cwd - 1) != NULL) {
        strcat(cwd, "/");
        PyObject *prefix = PyUnicode_DecodeFSDefault(cwd);
        Py_ssize_t hit =
            prefix ? PyUnicode_Tailmatch(name, prefix, 0, PY_SSIZE_T_MAX, -1) : -1;
        if (hit > 0)
            shown = PyUnicode_Substring(name, PyUnicode_GET_LENGTH(prefix), PY_SSIZE_T_MAX);
        else if (hit == 0)
            shown = Py_NewRef(name);
        Py_XDECREF(prefix);
    } else {
        shown = Py_NewRef(name);
    }
    if (shown != NULL)
        out = PyUnicode_FromFormat("%U:%d %U", shown, PyFrame_GetLineNumber(f), code->co_name);
    Py_XDECREF(shown);
    Py_DECREF(code);
    return out;
}

/* The first frame outward from f (taken over: a new reference or NULL) whose code lies outside
 * kvscope's folders (code_outside 1; a bootstrap frame too, 2, with `bootstrap`): a new
 * reference, or NULL when there is none, or NULL with *err set and an exception on an error. */
static PyFrameObject *frame_outward(Native *n, PyFrameObject *f, int bootstrap, int *err) {
    *err = 0;
    while (f != NULL) {
        PyCodeObject *c = PyFrame_GetCode(f);
        int out = code_outside(n, c);
        Py_DECREF(c);
        if (out < 0) {
            Py_DECREF(f);
            *err = 1;
            return NULL;
        }
        if (out == 1 || (bootstrap && out == 2)) return f;
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    return NULL;
}

/* The site id of one frame's text (sites.caller_site from frame f: the first frame from f
 * outward that is outside kvscope and no bootstrap frame; `<kvscope>` when none), through the
 * core's cache by (code object, instruction). f: borrowed. */
static int64_t frame_site(Native *n, PyFrameObject *f) {
    PyCodeObject *code = PyFrame_GetCode(f);
    int lasti = PyFrame_GetLasti(f);
    Py_DECREF(code); /* (alive while f is: the cache keeps its own reference) */
    size_t i = ptr_hash(code, lasti) & (SITE_CACHE - 1);
    while (n->site_code[i]) {
        if (n->site_code[i] == (PyObject *)code && n->site_lasti[i] == lasti)
            return n->site_id[i];
        i = (i + 1) & (SITE_CACHE - 1);
    }
    int err;
    PyFrameObject *g = frame_outward(n, (PyFrameObject *)Py_NewRef(f), 0, &err);
    if (err) return SITE_ERROR;
    PyObject *text = g != NULL ? frame_text(g) : PyUnicode_FromString("<kvscope>");
    Py_XDECREF(g);
    if (text == NULL) return SITE_ERROR;
    int64_t sid = site_intern(n, text);
    Py_DECREF(text);
    if (sid < -1) return sid;
    if (n->site_used * 4 >= SITE_CACHE * 3) return sid; /* full: cleared at the next miss */
    n->site_code[i] = Py_NewRef((PyObject *)code);
    n->site_lasti[i] = lasti;
    n->site_id[i] = (int32_t)sid;
    n->site_used++;
    return sid;
}

/* The stack from f (borrowed) outward, up to `depth` frames outside
 * kvscope, up to the first frame of kvscope or of the bootstrap after them; each frame its own
 * entry, the stack one more (`stack: ID ID ...`); one frame, or a full table: the allocation
 * frame's id. */
static int64_t stack_site(Native *n, PyFrameObject *f, int depth) {
    int64_t ids[MAX_STACK_DEPTH];
    int k = 0;
    PyFrameObject *g = (PyFrameObject *)Py_NewRef(f);
    while (g != NULL && k < depth) {
        PyCodeObject *c = PyFrame_GetCode(g);
        int out = code_outside(n, c);
        Py_DECREF(c);
        int64_t id = 0;
        if (out == 1) id = frame_site(n, g);
        if (out < 0 || id < -1) {
            Py_DECREF(g);
            return out < 0 ? SITE_ERROR : id;
        }
        if (out == 1)
            ids[k++] = id;
        else if (k > 0) {
            Py_DECREF(g);
            g = NULL;
            break;
        }
        PyFrameObject *back = PyFrame_GetBack(g);
        Py_DECREF(g);
        g = back;
    }
    Py_XDECREF(g);
    if (k == 0) return -1;
    int64_t low = ids[0];
    for (int j = 1; j < k; j++) low = ids[j] < low ? ids[j] : low;
    if (k == 1 || low < 0) return ids[0];
    char buf[8 + MAX_STACK_DEPTH * 21];
    size_t at = (size_t)snprintf(buf, sizeof buf, "stack:");
    for (int j = 0; j < k; j++)
        at += (size_t)snprintf(buf + at, sizeof buf - at, " %lld", (long long)ids[j]);
    PyObject *text = PyUnicode_FromStringAndSize(buf, (Py_ssize_t)at);
    if (text == NULL) return SITE_ERROR;
    int64_t stack = site_intern(n, text);
    Py_DECREF(text);
    if (stack < -1) return stack;
    return stack >= 0 ? stack : ids[0];
}

static int32_t site_now(Native *n) {
    if (!(n->probes & (P_SITES | P_SITES_EACH))) return -1;
    int err;
    PyFrameObject *f = frame_outward(n, (PyFrameObject *)Py_XNewRef(PyEval_GetFrame()), 1, &err);
    if (err) return SITE_ERROR;
    if (f == NULL) return -1; /* every frame is kvscope's */
    int depth = (n->probes >> P_SITE_DEPTH_SHIFT) & 0x1f;
    int64_t sid = (n->probes & P_SITES) || depth <= 1 ? frame_site(n, f) : stack_site(n, f, depth);
    Py_DECREF(f);
    return (int32_t)sid;
}

/* The text of site id `site` in the site table (NUL-padded), or NULL for none; a stack's
 * ("stack: ID ID ...", sites.py) is its first frame's. */
static const char *site_text_at(Native *n, int32_t site, size_t *len) {
    for (int hop = 0; hop < 2; hop++) {
        if (site < 0 || site >= NUM_SITES || (uint32_t)site >= U4(n->seg + HDR_NUM_SITES_USED))
            return NULL;
        const char *t = (const char *)(n->seg + n->off_sites + (size_t)site * SITE_SIZE);
        *len = strnlen(t, SR_TEXT_BYTES);
        if (*len < 7 || memcmp(t, "stack: ", 7) != 0) return t;
        site = (int32_t)strtol(t + 7, NULL, 10);
    }
    return NULL;
}

/* `lead` and the text of site id `site` ("; audited at FILE:LINE FUNC"), or "" where the site
 * was not recorded; NULL with an exception set. */
static PyObject *site_words(Native *n, int32_t site, const char *lead) {
    size_t len = 0;
    const char *t = site_text_at(n, site, &len);
    if (t == NULL) return PyUnicode_FromString("");
    PyObject *text = PyUnicode_DecodeUTF8(t, (Py_ssize_t)len, "replace");
    if (text == NULL) return NULL;
    PyObject *out = PyUnicode_FromFormat("%s%U", lead, text);
    Py_DECREF(text);
    return out;
}

/* -- findings --------------------------------------------------------------------------------- */

/* The kinds of FK_* (core.h), as findings.FindingKind names them. */
static const char *const FK_NAMES[FK_COUNT] = {
    "leak_finished",   "free_list_corrupt", "header_corrupt",       "refcount_mismatch",
    "use_after_free",  "guard_violation",   "published_block_modified", "lock_dead_holder",
    "leak_dead_owner", "kv_never_written",  "double_free", "block_header_corrupt",
    "lock_order_cycle", "block_table_mismatch", "wait_holds_gil", "transfer_after_free",
    "lease_leak", "foreign_slot", "unmapped_write"};

static void seen_of(Native *n, int32_t b, Seen *s) {
    uint8_t *r = blk(n, b);
    s->block = b;
    s->owner_pid = I4(r + BF_OWNER_PID);
    s->site = I4(r + BF_SITE);
    s->refcount = I4(r + BF_REFCOUNT);
    memcpy(s->request, r + BF_REQUEST, REQUEST_BYTES);
}

/* A pending finding's block record read now, where it was to be read when reported
 * (`seen_later`; its request kept where the finding is about a request of its own). */
static void seen_when_reported(Native *n, Pending *p) {
    if (!p->seen_later) return;
    char request[REQUEST_BYTES];
    memcpy(request, p->seen.request, REQUEST_BYTES);
    seen_of(n, p->seen.block, &p->seen);
    if (p->seen_later == SEEN_LATER_BUT_REQUEST) memcpy(p->seen.request, request, REQUEST_BYTES);
}

/* Lock i, a leaf of the lock order (sites, findings), for one write: OK when taken here
 * (leaf_drop lets go of it), HELD when this thread holds it already (a transaction of this
 * handle, or of another handle on the pool in this thread: its record names this process and
 * thread),
 * ERROR with an exception set. Holding no other lock, the core waits for it (and for the op
 * mutex) and recovers a dead holder first (recovery.c); inside a transaction, UNHANDLED when it
 * is not to be had then (its record names a dead holder, or another thread holds the op mutex:
 * hold_mutex). *mh: whether the op mutex was held before. */
enum { HELD = 2 };
/* Lock i's record names this thread of this process as its holder. */
static int record_names_me(Native *n, int i) {
    uint8_t *r = n->seg + n->off_locks + (size_t)i * LOCK_SIZE;
    return I4(r + LF_HOLDER_PID) == n->pid && U8(r + LF_HOLDER_START) == n->start &&
           U8(r + LF_HOLDER_TID) == (uint64_t)syscall(SYS_gettid);
}

static int leaf_held(Native *n, int i) { return holds(n, i) || record_names_me(n, i); }

static int leaf_take(Native *n, int i, int *mh) {
    *mh = n->mutex_held;
    if (leaf_held(n, i)) return HELD;
    int rc = n->held ? lock_take(n, i) : lock_take_alone(n, i);
    if (rc != OK && !*mh) drop_mutex(n);
    return rc == OK || rc == ERROR ? rc : UNHANDLED;
}

/* leaf_take for a Python caller (N_report, N_learn_edge, ...): HELD at once where
 * this thread holds the lock already, by its record (another handle's transaction that called
 * Python), whatever operation is in flight; else another thread's operation on the handle in
 * flight (its lock bookkeeping is the handle's) is waited for first (wait_others), and one of
 * this thread's own (Python it called, reporting) keeps its locks: a leaf not to be had under
 * them then is a PoolError naming `what`. OK, HELD, ERROR. */
static int leaf_take_py(Native *n, int i, int *mh, const char *what) {
    *mh = n->mutex_held;
    if (record_names_me(n, i)) return HELD;
    int mine;
    if (wait_others(n, &mine, NULL)) return ERROR;
    if (py_caller_unusable(n)) return ERROR; /* (closed meanwhile) */
    int taken = leaf_take(n, i, mh);
    if (taken == UNHANDLED)
        PyErr_Format(PoolErrorType ? PoolErrorType : PyExc_RuntimeError,
                     "%s: its lock is held by a dead process, or waited for by another thread, "
                     "while this thread is inside a transaction of the pool (a callback of its "
                     "operation)",
                     what);
    return taken == UNHANDLED ? ERROR : taken;
}

static void leaf_drop(Native *n, int i, int taken, int mh) {
    if (taken != OK) return;
    lock_drop(n, i);
    if (!mh) drop_mutex(n);
}

/* Append a finding to the segment's findings ring (the caller holds the findings lock): the
 * record first, then the head (a death in between leaves nothing half written, so no journal);
 * the kind as text (up to its field's bytes), s->block (-1: none), s->owner_pid (0: none),
 * s->site (-1: none; stored + 1), s->request, the message's first bytes. Its position. */
static uint64_t ring_put(Native *n, const char *kind, uint8_t severity, const Seen *s,
                         const char *text, size_t len) {
    uint64_t head = U8(n->seg + HDR_FINDINGS_HEAD);
    uint8_t *r = n->seg + n->off_findings + (size_t)(head % FINDINGS_CAPACITY) * FINDING_SIZE;
    memset(r, 0, FINDING_SIZE);
    U8(r + FD_TIME_NS) = wall_ns();
    size_t kl = strlen(kind);
    memcpy(r + FD_KIND, kind, kl < FD_KIND_BYTES ? kl : FD_KIND_BYTES);
    r[FD_SEVERITY] = severity;
    I4(r + FD_BLOCK) = s->block;
    I4(r + FD_OWNER_PID) = s->owner_pid;
    U4(r + FD_SITE) = s->site >= 0 ? (uint32_t)s->site + 1 : 0;
    memcpy(r + FD_REQUEST, s->request, REQUEST_BYTES);
    memcpy(r + FD_MESSAGE, text, len < FD_MESSAGE_BYTES ? len : FD_MESSAGE_BYTES);
    U8(n->seg + HDR_FINDINGS_HEAD) = head + 1;
    return head;
}

/* A finding of kind fk written into the ring (the caller holds the findings lock) and its
 * position appended to KVPool._found, for the binding to hand to `on_finding` after the call
 * (recovery.c's findings). OK, or ERROR with an exception set. */
static int finding_write(Native *n, int fk, const Seen *s, const char *text, Py_ssize_t len) {
    uint64_t head = ring_put(n, FK_NAMES[fk], n->fk_severity[fk], s, text, (size_t)len);
    return append_new(n->found, PyLong_FromUnsignedLongLong(head)) ? ERROR : OK;
}

/* Report a finding of kind fk about s->block (-1: none), once per
 * (kind, block) for the handle: a FINDING event in the flight recorder, then the finding
 * written under the findings lock (finding_write), from where the binding hands it to
 * `on_finding` after the call (with the site text and the block's events, read then:
 * findings.finding_at). The message is composed here, from what only the finding's moment
 * knows (a request id, a refcount), so every reader of the ring reads the same text. OK, or
 * ERROR with an exception set. A findings lock whose record names a dead holder is recovered
 * first (recovery.c) where no other lock is held; else the finding is dropped, and not marked
 * reported. */
static int finding_report(Native *n, int fk, const Seen *s, PyObject *message) {
    int64_t key = s->block >= 0 && s->block < n->nb ? s->block : n->nb;
    if (n->reported == NULL &&
        (n->reported = PyMem_Calloc((size_t)FK_COUNT * (size_t)(n->nb + 1), 1)) == NULL) {
        PyErr_NoMemory();
        return ERROR;
    }
    uint8_t *done = n->reported + (size_t)fk * (size_t)(n->nb + 1) + (size_t)key;
    /* (a double_free or use_after_free about no block, a refused call on an ended sequence, is
     * counted by request: entry.c ended_use; a leak_finished about no block, a preempted sequence at a close, is each
     * sequence's: entry.c seqs_at_close) */
    if (*done &&
        !((fk == FK_DOUBLE_FREE || fk == FK_LEAK_FINISHED || fk == FK_USE_AFTER_FREE) &&
          s->block < 0))
        return OK;
    Py_ssize_t len;
    const char *text = PyUnicode_AsUTF8AndSize(message, &len);
    if (text == NULL) return ERROR;
    /* The FINDING event first, as the probe records it: a reader finds it at or before the
     * finding's time (analysis.py's suspects). */
    ev_record(n, E_FINDING, &s->block, 1, s->request, 0);
    int mh, taken = leaf_take(n, n->lock_findings, &mh);
    if (taken != OK && taken != HELD) return taken == ERROR ? ERROR : OK;
    int rc = finding_write(n, fk, s, text, len);
    leaf_drop(n, n->lock_findings, taken, mh);
    *done = 1;
    return rc;
}

/* A Python caller's check of the handle (N_report, eviction, the stores): 1 with unusable's
 * error set (PoolError: closed; HandleInherited: a forked parent's handle), else 0. */
static int py_caller_unusable(Native *n) { return unusable(n) ? 1 : 0; }

/* An argument of N_report: a str's UTF-8 bytes (NULL with an exception set). */
static const char *utf8_arg(PyObject *o, Py_ssize_t *len) {
    if (!PyUnicode_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "report: kind, request and message are str");
        return NULL;
    }
    return PyUnicode_AsUTF8AndSize(o, len);
}

/* report(kind, severity, block, owner_pid, site, request, message) -> int: KVPool.report's
 * write: a finding someone else composed (severity 1 error, 2 warning; block -1, owner_pid 0,
 * site -1: none) appended to the findings ring as it is, with no event and not counted among
 * the handle's reported ones; the request and message cut to their fields' bytes. Its ring
 * position. The findings lock is waited for, a dead holder of it recovered (leaf_take_py). */
static PyObject *N_report(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "report(kind, severity, block, owner_pid, site, request, message)");
        return NULL;
    }
    if (py_caller_unusable(n)) return NULL;
    Py_ssize_t kl, rl, ml;
    const char *kind = utf8_arg(args[0], &kl), *req = utf8_arg(args[5], &rl),
               *text = utf8_arg(args[6], &ml);
    long sev = PyLong_AsLong(args[1]), block = PyLong_AsLong(args[2]),
         owner = PyLong_AsLong(args[3]), site = PyLong_AsLong(args[4]);
    if (kind == NULL || req == NULL || text == NULL || PyErr_Occurred()) return NULL;
    char name[64] = {0};
    memcpy(name, kind, (size_t)kl < sizeof name - 1 ? (size_t)kl : sizeof name - 1);
    Seen s = {.block = (int32_t)block, .owner_pid = (int32_t)owner, .site = (int32_t)site};
    memset(s.request, 0, REQUEST_BYTES);
    memcpy(s.request, req, (size_t)rl < REQUEST_BYTES ? (size_t)rl : REQUEST_BYTES);
    /* (the FINDING event first, as finding_report records it: the core writes the flight
     * recorder, whoever found the finding) */
    ev_record(n, E_FINDING, &s.block, 1, s.request, 0);
    int mh, taken = leaf_take_py(n, n->lock_findings, &mh, "report");
    if (taken == ERROR) return NULL;
    uint64_t head = ring_put(n, name, (uint8_t)sev, &s, text, (size_t)ml);
    leaf_drop(n, n->lock_findings, taken, mh);
    return PyLong_FromUnsignedLongLong(head);
}

static int finding_later(Native *n, int fk, const Seen *s, PyObject *message) {
    if (message == NULL) return ERROR;
    if (n->pend == NULL && (n->pend = PyMem_Calloc(2 * CHUNK, sizeof(Pending))) == NULL) {
        Py_DECREF(message);
        PyErr_NoMemory();
        return ERROR;
    }
    if (n->n_pend == 2 * CHUNK) {
        /* (more than a transaction hands out: one per block at most) */
        Py_DECREF(message);
        return OK;
    }
    Pending *p = &n->pend[n->n_pend++];
    p->fk = fk;
    p->seen = *s;
    p->message = message;
    p->event = 0;
    p->seen_later = 0;
    p->pre = n->n_pre;
    p->op = 0;
    return OK;
}

static void findings_first(Native *n, int64_t upto) {
    if (upto > n->n_pend) upto = n->n_pend;
    for (int64_t i = 0; i < upto; i++) {
        Pending *p = &n->pend[i];
        static const char no_request[REQUEST_BYTES];
        if (p->event) ev_record(n, p->event, &p->seen.block, 1, no_request, 0);
        seen_when_reported(n, p);
        if (finding_report(n, p->fk, &p->seen, p->message)) PyErr_WriteUnraisable(n->pool);
        Py_CLEAR(p->message);
    }
    if (upto > 0) memmove(n->pend, n->pend + upto, (size_t)(n->n_pend - upto) * sizeof(Pending));
    n->n_pend -= upto;
    if (n->n_pend == 0) n->pend_hold = 0;
}

/* At a commit: what the transaction found, unless its operation holds them to report each where
 * its FINDING event falls among the operation's events (findings_hold; findings_first after the
 * events that come before). */
static void findings_flush(Native *n) {
    if (!n->pend_hold) findings_first(n, n->n_pend);
}

static void findings_hold(Native *n) { n->pend_hold = 1; }

static void findings_before(Native *n, int64_t upto, int64_t pre) {
    int64_t k = 0;
    while (k < upto && k < n->n_pend && n->pend[k].pre <= pre) k++;
    findings_first(n, k);
}

static void findings_drop(Native *n) {
    for (int64_t i = 0; i < n->n_pend; i++) Py_CLEAR(n->pend[i].message);
    n->n_pend = 0;
    n->pend_hold = 0;
}

/* first_report(kind, block) -> True | False | None: whether a finding of `kind` about `block`
 * (-1: none) is the handle's first (and it is now reported), for PoolProbes.report; None for a
 * kind the core does not count (the probe keeps those): one it does not report, a
 * lock_order_cycle (each cycle is its own), a double_free or use_after_free about no block (a
 * refused call on an ended sequence, counted by request). */
static PyObject *N_first_report(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    const char *kind;
    long block;
    if (nargs != 2 || (kind = PyUnicode_AsUTF8(args[0])) == NULL ||
        ((block = PyLong_AsLong(args[1])) == -1 && PyErr_Occurred())) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "first_report(kind, block)");
        return NULL;
    }
    int fk = 0;
    while (fk < FK_COUNT && strcmp(FK_NAMES[fk], kind) != 0) fk++;
    if (fk == FK_COUNT || fk == FK_LOCK_ORDER_CYCLE ||
        ((fk == FK_DOUBLE_FREE || fk == FK_USE_AFTER_FREE) && block < 0))
        Py_RETURN_NONE;
    if (n->reported == NULL &&
        (n->reported = PyMem_Calloc((size_t)FK_COUNT * (size_t)(n->nb + 1), 1)) == NULL)
        return PyErr_NoMemory();
    int64_t key = block >= 0 && block < n->nb ? block : n->nb;
    uint8_t *done = n->reported + (size_t)fk * (size_t)(n->nb + 1) + (size_t)key;
    int first = !*done;
    *done = 1;
    return PyBool_FromLong(first);
}

/* -- magic: record checksums ------------------------------------------------------------------ */

/* Block b's record, about to be saved and changed, is checked against its checksum (once per
 * transaction: an operation may change a record in steps and save it again). One that does
 * not match (something outside the allocator wrote it) is a block_header_corrupt finding, as
 * the record reads now, reported when the transaction commits; the
 * operation goes on and reseals it. OK, or ERROR with an exception set. */
static int record_sealed(Native *n, int64_t b) {
    if (n->checked == NULL &&
        (n->checked = PyMem_Calloc((size_t)n->nb, sizeof(uint32_t))) == NULL) {
        PyErr_NoMemory();
        return ERROR;
    }
    if (n->checked[b] == n->txn_stamp) return OK;
    n->checked[b] = n->txn_stamp;
    if (U8(blk(n, b) + BF_CHECKSUM) == checksum(n, b)) return OK;
    Seen s;
    seen_of(n, b, &s);
    return finding_later(n, FK_BLOCK_HEADER_CORRUPT, &s,
                         PyUnicode_FromString("block record checksum mismatch when the allocator "
                                              "was about to change it: its header was "
                                              "overwritten outside the allocator"));
}

/* The block records conservation compares, counted (the caller holds the free lock): *free_
 * the free and quarantined ones, *mine this client's LOCAL ones. */
static void free_tally(Native *n, int64_t *free_, int64_t *mine) {
    int64_t f = 0, m = 0;
    for (int64_t b = 0; b < n->nb; b++) {
        uint8_t *r = blk(n, b);
        f += r[BF_STATE] == B_FREE || r[BF_STATE] == B_QUARANTINED;
        m += r[BF_STATE] == B_LOCAL && I4(r + BF_OWNER_CLIENT) == n->client;
    }
    *free_ = f;
    *mine = m;
}

/* Conservation, counted under the free lock: the ring holds exactly the free (and quarantined)
 * blocks, this client's local cache exactly its LOCAL blocks; a free_list_corrupt finding (the
 * first difference) when not. Run by the gate, before the call's operation, and by
 * pool.verify() (entry.c N_verify): the op mutex a wait took is let go again. OK, or ERROR
 * with an exception set. */
static int conservation(Native *n) {
    /* Asked for between operations (a read such as stats()), it does not wait for the free
     * lock: a holder that is stopped (SIGSTOP, a debugger) would stop the reader too, which
     * without the probe reads on. It is taken up again at the next call (the clock reset). */
    pthread_mutex_t *fm = lock_mutex(n, n->lock_free);
    if (n->verify_between && !holds(n, n->lock_free) &&
        __atomic_load_n(&fm->__data.__lock, __ATOMIC_RELAXED) != 0) {
        n->last_verify_ns = 0;
        return OK;
    }
    int mh = n->mutex_held;
    int rc = txn_begin(n, lock_bit(n->lock_free));
    if (rc != OK) {
        if (!mh) drop_mutex(n);
        return rc == ERROR ? ERROR : OK;
    }
    int64_t free_, mine;
    free_tally(n, &free_, &mine);
    int64_t ring = (int64_t)U4(ringh(n) + RING_COUNT), local = (int64_t)local_count(n);
    txn_commit(n);
    if (!mh) drop_mutex(n);
    PyObject *msg = NULL;
    if (free_ != ring)
        msg = PyUnicode_FromFormat("%lld blocks are free but the free ring holds %lld: blocks "
                                   "were lost or freed twice",
                                   (long long)free_, (long long)ring);
    else if (mine != local)
        msg = PyUnicode_FromFormat("this process has %lld LOCAL blocks but its local cache "
                                   "lists %lld",
                                   (long long)mine, (long long)local);
    else
        return OK;
    Seen none = {.block = -1, .site = -1};
    rc = msg ? finding_report(n, FK_FREE_LIST_CORRUPT, &none, msg) : ERROR;
    Py_XDECREF(msg);
    return rc;
}

/* The header's checked bytes (up to and with its checksum) changed since
 * this handle attached: a header_corrupt finding naming the first byte that differs, its
 * field, and 8 bytes found and expected from there (byte -1, "?", when only the checksum
 * differs). OK, or ERROR with an exception set. */
static int header_changed(Native *n) {
    int64_t body = n->hdr_len - 8, diff = -1;
    for (int64_t i = 0; i < body && diff < 0; i++)
        if (n->seg[i] != n->hdr_copy[i]) diff = i;
    char found[17] = "?", want[17] = "?";
    const char *field = "?";
    if (diff >= 0) {
        int64_t end = diff + 8 < body ? diff + 8 : body;
        for (int64_t i = diff; i < end; i++) {
            snprintf(found + 2 * (i - diff), 3, "%02x", n->seg[i]);
            snprintf(want + 2 * (i - diff), 3, "%02x", n->hdr_copy[i]);
        }
        for (size_t f = 0; f < sizeof HEADER_CHECKED / sizeof *HEADER_CHECKED; f++) {
            int64_t off = HEADER_CHECKED[f].off;
            if (off <= diff && diff < off + HEADER_CHECKED[f].size) {
                field = HEADER_CHECKED[f].name;
                break;
            }
        }
    }
    PyObject *msg = PyUnicode_FromFormat(
        "segment header changed at byte %lld (%s): found %s, expected %s; something outside "
        "the allocator wrote into the pool's metadata",
        (long long)diff, field, found, want);
    if (msg == NULL) return ERROR;
    Seen none = {.block = -1, .site = -1};
    int rc = finding_report(n, FK_HEADER_CORRUPT, &none, msg);
    Py_DECREF(msg);
    return rc;
}

static int verify_now(Native *n, uint64_t now) {
    n->last_verify_ns = now;
    if (memcmp(n->hdr_copy, n->seg, n->hdr_len) != 0) return header_changed(n);
    return n->probes & P_LEAKS ? conservation(n) : OK;
}

/* -- leaks ------------------------------------------------------------------------------------ */

/* The scratch counts per block, new for one check: a count is valid only where its stamp is
 * this check's, so no pass is needed to clear them afterwards. 0, or -1 without memory. */
static int leak_scratch(Native *n) {
    if (n->refs == NULL) {
        n->refs = PyMem_Calloc((size_t)n->nb, sizeof(int32_t));
        n->refs_stamp = PyMem_Calloc((size_t)n->nb, sizeof(uint32_t));
        if (n->refs == NULL || n->refs_stamp == NULL) return 0;
    }
    if (++n->refs_epoch == 0) {
        memset(n->refs_stamp, 0, (size_t)n->nb * sizeof(uint32_t));
        n->refs_epoch = 1;
    }
    return 1;
}

static inline void ref_add(Native *n, int32_t b) {
    if (n->refs_stamp[b] != n->refs_epoch) {
        n->refs_stamp[b] = n->refs_epoch;
        n->refs[b] = 0;
    }
    n->refs[b] += 1;
}

static inline int32_t ref_get(Native *n, int32_t b) {
    return n->refs_stamp[b] == n->refs_epoch ? n->refs[b] : 0;
}

static void maybe_live_add(Native *n, int64_t slot) {
    if (n->maybe_valid && !n->in_maybe[slot]) {
        n->in_maybe[slot] = 1;
        n->maybe_live[n->n_maybe++] = (int32_t)slot;
    }
}

static inline uint64_t client_seq_of(Native *n, int64_t c) {
    return U8(n->seg + n->c_seq + (c - n->client) * CLIENT_SIZE);
}

/* The slots that may hold a live sequence: the cache while every client's transaction count
 * is as seen (this core's own claims are added as it makes them), else a scan of the whole
 * sequence table. 0, or -1 without memory. */
static int maybe_live_sync(Native *n) {
    if (n->maybe_live == NULL || n->maybe_foreign == NULL) {
        size_t seqs = (size_t)n->max_seqs;
        if (n->maybe_live == NULL) n->maybe_live = PyMem_Calloc(seqs, sizeof(int32_t));
        if (n->maybe_foreign == NULL) n->maybe_foreign = PyMem_Calloc(seqs, sizeof(int32_t));
        if (n->in_maybe == NULL) n->in_maybe = PyMem_Calloc(seqs, 1);
        if (n->seen_seq == NULL)
            n->seen_seq = PyMem_Calloc((size_t)n->max_clients, sizeof(uint64_t));
        if (!n->maybe_live || !n->in_maybe || !n->seen_seq || !n->maybe_foreign) return -1;
    }
    if (n->maybe_valid) {
        int64_t c = 0;
        while (c < n->max_clients && client_seq_of(n, c) == n->seen_seq[c]) c++;
        if (c == n->max_clients) return 0;
    }
    for (int64_t c = 0; c < n->max_clients; c++) n->seen_seq[c] = client_seq_of(n, c);
    memset(n->in_maybe, 0, (size_t)n->max_seqs);
    n->n_maybe = n->n_foreign = 0;
    for (int64_t s = 0; s < n->max_seqs; s++) {
        const uint8_t *q = seqrec(n, s);
        if (q[SF_STATE] == S_EMPTY) continue;
        n->in_maybe[s] = 1;
        n->maybe_live[n->n_maybe++] = (int32_t)s;
        if (I4(q + SF_OWNER_CLIENT) != n->client) n->maybe_foreign[n->n_foreign++] = (int32_t)s;
    }
    n->maybe_valid = 1;
    return 0;
}

/* This handle's own live tables counted per block (own_refs: sequences.c own_note keeps them
 * from then on), unless they are already. 0, or -1 without memory (the callers then read the
 * tables). */
static int own_refs_ready(Native *n) {
    if (n->own_valid) return 0;
    if (n->own_refs == NULL) n->own_refs = PyMem_Calloc((size_t)n->nb, sizeof(int32_t));
    if (n->own_refs == NULL) return -1;
    memset(n->own_refs, 0, (size_t)n->nb * sizeof(int32_t));
    for (int64_t slot = 0; slot < n->max_seqs; slot++) {
        const uint8_t *q = seqrec(n, slot);
        if (q[SF_STATE] == S_EMPTY || I4(q + SF_OWNER_CLIENT) != n->client) continue;
        uint32_t nb = U4(q + SF_NUM_BLOCKS);
        if (nb > (uint32_t)n->max_bps) nb = (uint32_t)n->max_bps;
        const int32_t *t = (const int32_t *)(q + SF_TABLE);
        for (uint32_t j = 0; j < nb; j++)
            if (t[j] >= 0 && t[j] < n->nb) n->own_refs[t[j]] += 1;
    }
    n->own_n = 0;
    n->own_built = n->txn_stamp;
    n->own_valid = !n->borrowed;
    return 0;
}

/* Whether the counts of this handle's tables can answer now (the leaks probe on, a record of
 * its own): counted first where they are not kept. */
static inline int own_refs_here(Native *n) {
    return !n->borrowed && own_refs_ready(n) == 0 && n->own_valid;
}

/* How many of the nb entries of table t are block b (four at a time with SSE2). */
static inline int32_t table_count(const int32_t *t, uint32_t nb, int32_t b) {
    uint32_t j = 0;
    int32_t c = 0;
#if defined(__SSE2__)
    __m128i want = _mm_set1_epi32(b), acc = _mm_setzero_si128();
    for (; j + 4 <= nb; j += 4) /* (a match is -1 in its lane) */
        acc = _mm_sub_epi32(acc, _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(t + j)), want));
    int32_t lanes[4];
    _mm_storeu_si128((__m128i *)lanes, acc);
    c = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
    for (; j < nb; j++) c += t[j] == b;
    return c;
}

/* Whether any of the nb entries of table t is block b (four at a time with SSE2). */
static inline int table_has(const int32_t *t, uint32_t nb, int32_t b) {
    uint32_t j = 0;
#if defined(__SSE2__)
    __m128i want = _mm_set1_epi32(b), any = _mm_setzero_si128();
    for (; j + 4 <= nb; j += 4)
        any = _mm_or_si128(any, _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(t + j)), want));
    if (_mm_movemask_epi8(any)) return 1;
#endif
    for (; j < nb; j++)
        if (t[j] == b) return 1;
    return 0;
}

/* Count, in the scratch counts, the blocks of `slot`'s table (the segment's copy). */
static void count_table(Native *n, int64_t slot) {
    uint8_t *s = seqrec(n, slot);
    uint32_t nb = U4(s + SF_NUM_BLOCKS);
    if (nb > (uint32_t)n->max_bps) nb = (uint32_t)n->max_bps;
    int32_t *t = (int32_t *)(s + SF_TABLE);
    for (uint32_t j = 0; j < nb; j++)
        if (t[j] >= 0 && t[j] < n->nb) ref_add(n, t[j]);
}

/* Count every live sequence of this handle's table (the handle's live sequences, the core's
 * registry, are the live slots of its client: read from the segment, not the registry). */
static int count_handle_tables(Native *n, int64_t skip_slot) {
    if (maybe_live_sync(n)) {
        PyErr_NoMemory();
        return ERROR;
    }
    for (int64_t m = 0; m < n->n_maybe; m++) {
        int64_t slot = n->maybe_live[m];
        uint8_t *q = seqrec(n, slot);
        if (q[SF_STATE] == S_EMPTY || I4(q + SF_OWNER_CLIENT) != n->client || slot == skip_slot)
            continue;
        count_table(n, slot);
    }
    return OK;
}

static int refcounts_match(Native *n, const int32_t *ids, int64_t k, PyObject *rid) {
    if (!(n->probes & P_LEAKS) || k == 0) return OK;
    /* The blocks it checks (unindexed, allocated: a request's own, usually its last, unpublished
     * one); a few are counted by comparing every table entry with them, more in the scratch
     * counts. */
    enum { FEW = 4 };
    int32_t few[FEW], nfew = 0, many = 0;
    for (int64_t i = 0; i < k && !many; i++) {
        uint8_t *r = blk(n, ids[i]);
        if (r[BF_INDEXED] || r[BF_STATE] != B_ALLOCATED) continue;
        if (nfew == FEW)
            many = 1;
        else
            few[nfew++] = ids[i];
    }
    if (nfew == 0) return OK;
    int32_t few_refs[FEW] = {0};
    int own = own_refs_here(n);
    if (own) {
        /* (the count of this handle's tables, kept by the core) */
    } else if (many) {
        if (!leak_scratch(n)) {
            PyErr_NoMemory();
            return ERROR;
        }
        if (count_handle_tables(n, -1)) return ERROR;
    } else {
        if (maybe_live_sync(n)) {
            PyErr_NoMemory();
            return ERROR;
        }
        for (int64_t m = 0; m < n->n_maybe; m++) {
            uint8_t *q = seqrec(n, n->maybe_live[m]);
            if (q[SF_STATE] == S_EMPTY || I4(q + SF_OWNER_CLIENT) != n->client) continue;
            uint32_t nb = U4(q + SF_NUM_BLOCKS);
            if (nb > (uint32_t)n->max_bps) nb = (uint32_t)n->max_bps;
            const int32_t *t = (const int32_t *)(q + SF_TABLE);
            for (int32_t f = 0; f < nfew; f++) few_refs[f] += table_count(t, nb, few[f]);
        }
    }
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        if (r[BF_INDEXED] || r[BF_STATE] != B_ALLOCATED) continue;
        int32_t rc = I4(r + BF_REFCOUNT), refs = 0;
        if (own) {
            refs = n->own_refs[ids[i]];
        } else if (many) {
            refs = ref_get(n, ids[i]);
        } else {
            for (int32_t f = 0; f < nfew; f++)
                if (few[f] == ids[i]) refs = few_refs[f];
        }
        if (rc == refs) continue;
        Seen s;
        seen_of(n, ids[i], &s);
        PyObject *msg = PyUnicode_FromFormat(
            "refcount is %d but %d sequence(s) of this process map the block (at the end of "
            "request %R)",
            rc, refs, rid);
        int bad = msg == NULL || finding_report(n, FK_REFCOUNT_MISMATCH, &s, msg);
        Py_XDECREF(msg);
        if (bad) return ERROR;
    }
    return OK;
}

/* A str of up to REQUEST_BYTES bytes of a record (undecodable bytes replaced). */
static PyObject *request_text(const char *b) {
    return PyUnicode_DecodeUTF8(b, (Py_ssize_t)strnlen(b, REQUEST_BYTES), "replace");
}

/* A use_after_free finding for each block of ids a live table maps, the first time it is found,
 * in the order of the tables (by slot) and their entries. OK, or ERROR. */
static int stale_findings(Native *n, const int32_t *ids, int64_t k, const char *request) {
    PyObject *taker = request_text(request);
    if (taker == NULL) return ERROR;
    int32_t done[CHUNK];
    int64_t nd = 0;
    int rc = OK;
    for (int64_t slot = 0; slot < n->max_seqs && rc == OK; slot++) {
        uint8_t *q = seqrec(n, slot);
        if (q[SF_STATE] == S_EMPTY) continue;
        uint32_t nb = U4(q + SF_NUM_BLOCKS);
        if (nb > (uint32_t)n->max_bps) nb = (uint32_t)n->max_bps;
        const int32_t *t = (const int32_t *)(q + SF_TABLE);
        for (uint32_t j = 0; j < nb && rc == OK; j++) {
            int mine = 0, seen = 0;
            for (int64_t i = 0; i < k; i++) mine |= ids[i] == t[j];
            for (int64_t i = 0; i < nd; i++) seen |= done[i] == t[j];
            if (!mine || seen || nd == CHUNK) continue;
            done[nd++] = t[j];
            Seen s;
            seen_of(n, t[j], &s);
            s.owner_pid = I4(q + SF_OWNER_PID);
            memcpy(s.request, q + SF_REQUEST, REQUEST_BYTES);
            PyObject *holder = request_text(s.request);
            PyObject *msg = holder ? PyUnicode_FromFormat(
                                         "block is being handed to request %R but request %R of "
                                         "pid %d still maps it: it was freed while that "
                                         "request's block table was in use",
                                         taker, holder, s.owner_pid)
                                   : NULL;
            Py_XDECREF(holder);
            rc = finding_later(n, FK_USE_AFTER_FREE, &s, msg);
        }
    }
    Py_DECREF(taker);
    return rc;
}

static int unmapped(Native *n, const int32_t *ids, int64_t k, const char *request) {
    if (!(n->probes & P_LEAKS) || k == 0) return OK;
    if (maybe_live_sync(n)) {
        PyErr_NoMemory();
        return ERROR;
    }
    /* A few blocks (a decode step's new block, an allocation's own): each compared with each
     * table's entries, four at a time; more: a mark per block in the scratch counts. */
    enum { FEW = 4 };
    if (k > FEW) {
        if (!leak_scratch(n)) {
            PyErr_NoMemory();
            return ERROR;
        }
        for (int64_t i = 0; i < k; i++) ref_add(n, ids[i]);
    }
    /* This handle's own tables: their count per block, kept by the core (own_refs); then
     * only the tables of other clients are read. */
    int own = own_refs_here(n), hit = 0;
    for (int64_t i = 0; own && i < k && !hit; i++) hit = n->own_refs[ids[i]] != 0;
    const int32_t *slots = own ? n->maybe_foreign : n->maybe_live;
    int64_t nslots = own ? n->n_foreign : n->n_maybe;
    for (int64_t m = 0; m < nslots && !hit; m++) {
        uint8_t *q = seqrec(n, slots[m]);
        if (q[SF_STATE] == S_EMPTY || (own && I4(q + SF_OWNER_CLIENT) == n->client)) continue;
        uint32_t nb = U4(q + SF_NUM_BLOCKS);
        if (nb > (uint32_t)n->max_bps) nb = (uint32_t)n->max_bps;
        const int32_t *t = (const int32_t *)(q + SF_TABLE);
        if (k <= FEW) {
            for (int64_t i = 0; i < k && !hit; i++) hit = table_has(t, nb, ids[i]);
            continue;
        }
        for (uint32_t j = 0; j < nb; j++)
            if (t[j] >= 0 && t[j] < n->nb && ref_get(n, t[j])) {
                hit = 1;
                break;
            }
    }
    return hit ? stale_findings(n, ids, k, request) : OK;
}

static int64_t leaked_blocks(Native *n, const int32_t *ids, int64_t k, int64_t slot) {
    n->n_leak = 0;
    if (!(n->probes & P_LEAKS)) return 0;
    int any = 0;
    for (int64_t i = 0; i < k && !any; i++) {
        uint8_t *r = blk(n, ids[i]);
        any = r[BF_STATE] == B_ALLOCATED && !r[BF_INDEXED] && I4(r + BF_REFCOUNT) > 0 &&
              I4(r + BF_OWNER_CLIENT) == n->client;
    }
    if (!any) return 0;
    if (n->leak == NULL && (n->leak = PyMem_Calloc(CHUNK, sizeof(Seen))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (!leak_scratch(n)) {
        PyErr_NoMemory();
        return -1;
    }
    if (count_handle_tables(n, slot)) return -1;
    for (int64_t i = 0; i < k && n->n_leak < CHUNK; i++) {
        uint8_t *r = blk(n, ids[i]);
        if (r[BF_STATE] != B_ALLOCATED || r[BF_INDEXED] || I4(r + BF_REFCOUNT) <= 0 ||
            I4(r + BF_OWNER_CLIENT) != n->client || ref_get(n, ids[i]))
            continue;
        int dup = 0;
        for (int64_t j = 0; j < i; j++) dup |= ids[j] == ids[i];
        if (dup) continue;
        Seen *s = &n->leak[n->n_leak++];
        seen_of(n, ids[i], s);
        s->refcount = I4(r + BF_REFCOUNT);
    }
    return n->n_leak;
}

/* after_release: a leak_finished finding for each block leaked_blocks found, once the handle
 * has forgotten the sequence (the message names its request id, `request`). OK or ERROR. */
static int report_leaked(Native *n, PyObject *request) {
    for (int64_t i = 0; i < n->n_leak; i++) {
        Seen *s = &n->leak[i];
        PyObject *msg = PyUnicode_FromFormat(
            "request %R ended but its block is still allocated (refcount %d) and no sequence "
            "maps it",
            request, s->refcount);
        if (msg == NULL || finding_report(n, FK_LEAK_FINISHED, s, msg)) {
            Py_XDECREF(msg);
            return ERROR;
        }
        Py_DECREF(msg);
    }
    n->n_leak = 0;
    return OK;
}

/* -- lockdep (probes/lockdep.py LockDep) ------------------------------------------------------ */

/* Where the segment's lock-order graph, findings ring and site table lie (native.py
 * probe_layout; how their records read is layout.h's, from records.py), each lock's class as
 * the graph stores it, the findings' severities and KVPool._found. 0, or -1 with an exception
 * set. */
static int probes_init(Native *n, PyObject *d) {
    /* the sections' offsets; their records' fields are layout.h's (records.py) */
    struct {
        const char *key;
        size_t *dst;
    } at[] = {{"off_lockgraph", &n->off_lockgraph},
              {"off_findings", &n->off_findings},
              {"off_sites", &n->off_sites}};
    for (size_t i = 0; i < sizeof at / sizeof *at; i++) {
        PyObject *v = PyDict_GetItemString(d, at[i].key);
        if (v == NULL) {
            PyErr_Format(PyExc_KeyError, "native core needs %s", at[i].key);
            return -1;
        }
        *at[i].dst = (size_t)PyLong_AsSsize_t(v);
    }
    /* Each kind of FK_NAMES, and its severity, from findings.py (a kind it lacks: an error). */
    PyObject *sev = PyDict_GetItemString(d, "finding_severity");
    n->found = PyDict_GetItemString(d, "found");
    if (sev == NULL || !PyDict_Check(sev) || n->found == NULL || !PyList_Check(n->found)) {
        n->found = NULL;
        PyErr_SetString(PyExc_KeyError, "native core needs finding_severity (a dict), found");
        return -1;
    }
    Py_INCREF(n->found);
    for (int k = 0; k < FK_COUNT; k++) {
        PyObject *v = PyDict_GetItemString(sev, FK_NAMES[k]);
        if (v == NULL) {
            PyErr_Format(PyExc_KeyError, "findings.py has no kind %s", FK_NAMES[k]);
            return -1;
        }
        n->fk_severity[k] = (uint8_t)PyLong_AsLong(v);
    }
    /* magic: the header's checked bytes as this handle attached */
    n->msg_canary = PyDict_GetItemString(d, "canary_message");
    n->msg_poison = PyDict_GetItemString(d, "poison_message");
    if (n->msg_canary == NULL || n->msg_poison == NULL) {
        n->msg_canary = n->msg_poison = NULL;
        PyErr_SetString(PyExc_KeyError, "native core needs canary_message and poison_message");
        return -1;
    }
    Py_INCREF(n->msg_canary);
    Py_INCREF(n->msg_poison);
    n->msg_modified = PyDict_GetItemString(d, "modified_message");
    n->msg_blank = PyDict_GetItemString(d, "blank_modified_message");
    if (n->msg_modified == NULL || n->msg_blank == NULL) {
        n->msg_modified = n->msg_blank = NULL;
        PyErr_SetString(PyExc_KeyError, "native core needs the modified_message templates");
        return -1;
    }
    Py_INCREF(n->msg_modified);
    Py_INCREF(n->msg_blank);
    if ((n->hdr_copy = PyMem_Malloc((size_t)n->hdr_len)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(n->hdr_copy, n->seg, (size_t)n->hdr_len);
    PyObject *fl = PyDict_GetItemString(d, "lock_findings");
    PyObject *sl = PyDict_GetItemString(d, "lock_sites");
    PyObject *classes = PyDict_GetItemString(d, "lock_classes");
    if (fl == NULL || sl == NULL || classes == NULL) {
        PyErr_SetString(PyExc_KeyError, "native core needs lock_findings and lock_sites");
        return -1;
    }
    n->lock_findings = (int)PyLong_AsLong(fl);
    n->lock_sites = (int)PyLong_AsLong(sl);
    if (PyErr_Occurred()) return -1;
    memset(n->lock_cls, 0, sizeof n->lock_cls);
    for (int i = 0; i < n->num_locks; i++) {
        PyObject *c = PyTuple_GET_ITEM(classes, i);
        if (c == Py_None) continue;
        Py_ssize_t len;
        const char *text = PyUnicode_AsUTF8AndSize(c, &len);
        if (text == NULL) return -1;
        memcpy(n->lock_cls[i], text, (size_t)(len < 16 ? len : 16));
    }
    return 0;
}

static inline uint8_t *lg_edge(Native *n, int64_t e) {
    return n->seg + n->off_lockgraph + (size_t)e * LOCKGRAPH_SIZE;
}

/* lockgraph.find_path over the graph's first `used` edges: the shortest chain of edges from
 * class `from` to class `to` (16 stored bytes each), found as find_path finds it (breadth first
 * over classes, each class's edges in the graph's order), into path (edge numbers, `from`'s
 * first); its length, 0 when there is none. */
static int64_t lg_chain(Native *n, int64_t used, const char *from, const char *to, int32_t *path) {
    int64_t cap = used + 1, nn = 1;
    const uint8_t *node[cap];
    int32_t came[cap];  /* the edge that reached node k (-1: `from`) */
    int64_t parent[cap];
    node[0] = (const uint8_t *)from;
    came[0] = -1;
    parent[0] = -1;
    for (int64_t k = 0; k < nn; k++) {
        if (memcmp(node[k], to, 16) == 0) {
            int64_t len = 0;
            for (int64_t at = k; came[at] >= 0; at = parent[at]) path[len++] = came[at];
            for (int64_t a = 0, b = len - 1; a < b; a++, b--) {
                int32_t t = path[a];
                path[a] = path[b];
                path[b] = t;
            }
            return len;
        }
        for (int64_t e = 0; e < used; e++) {
            const uint8_t *r = lg_edge(n, e);
            if (memcmp(r + LG_SRC, node[k], 16) != 0) continue;
            int seen = 0;
            for (int64_t m = 0; m < nn && !seen; m++)
                seen = memcmp(node[m], r + LG_DST, 16) == 0;
            if (seen || nn == cap) continue;
            node[nn] = r + LG_DST;
            came[nn] = (int32_t)e;
            parent[nn++] = k;
        }
    }
    return 0;
}

/* Append `pid P takes|took SRC -> DST at SITE` to the text at *at (of cap bytes; what does not
 * fit is cut). */
static void lg_say(char *out, size_t cap, size_t *at, const char *sep, int32_t pid,
                   const char *verb, const char *src, const char *dst, const char *site,
                   size_t site_bytes) {
    if (*at >= cap) return;
    int w = snprintf(out + *at, cap - *at, "%spid %d %s %.*s -> %.*s at %.*s", sep, pid, verb,
                     (int)strnlen(src, 16), src, (int)strnlen(dst, 16), dst,
                     (int)strnlen(site, site_bytes), site);
    *at = w < 0 ? cap : *at + (size_t)w < cap ? *at + (size_t)w : cap;
}

/* The lock_order_cycle finding (lockgraph.cycle_finding) of the edge src -> dst (classes, 16
 * stored bytes each) this process takes at `site`, which closes the chain `path` (np edges of
 * the graph, dst first), written into the findings ring (the caller holds the findings lock)
 * and its position appended to KVPool._found. OK, or ERROR with an exception set. */
static int lg_cycle(Native *n, const char *src, const char *dst, const char *site,
                    const int32_t *path, int64_t np) {
    /* (cut at 512 bytes: the ring keeps the first 200) */
    char text[512];
    size_t at = 0, field = FD_MESSAGE_BYTES < sizeof text ? FD_MESSAGE_BYTES : sizeof text;
    lg_say(text, sizeof text, &at, "", n->pid, "takes", src, dst, site, LG_SITE_BYTES);
    for (int64_t k = 0; k < np; k++) {
        const uint8_t *e = lg_edge(n, path[k]);
        lg_say(text, sizeof text, &at, "; ", I4(e + LG_PID), "took",
               (const char *)e + LG_SRC, (const char *)e + LG_DST,
               (const char *)e + LG_SITE, LG_SITE_BYTES);
    }
    char tail[80];
    int tl = snprintf(tail, sizeof tail, ": %s when they overlap",
                      np == 1 ? "opposite orders deadlock"
                              : "these orders form a cycle that deadlocks");
    /* the tail only where the whole text fits the field with it */
    if (at + (size_t)tl <= field) {
        memcpy(text + at, tail, (size_t)tl);
        at += (size_t)tl;
    }
    Seen s = {.block = -1, .owner_pid = n->pid, .site = -1};
    memset(s.request, 0, REQUEST_BYTES);
    int fk = FK_LOCK_ORDER_CYCLE;
    uint64_t head = ring_put(n, FK_NAMES[fk], n->fk_severity[fk], &s, text,
                             at < sizeof text ? at : sizeof text);
    return append_new(n->found, PyLong_FromUnsignedLongLong(head)) ? ERROR : OK;
}

/* lockgraph.call_site: `file:line function` of the innermost frame outside kvscope (and the
 * contextlib/threading glue), into out (NUL-padded, cap bytes); "?" when every frame is ours. */
static void caller_text(Native *n, char *out, size_t cap) {
    memset(out, 0, cap);
    PyFrameObject *f = PyEval_GetFrame();
    Py_XINCREF(f);
    while (f != NULL) {
        PyCodeObject *code = PyFrame_GetCode(f);
        int outside = code_outside(n, code);
        const char *file = PyUnicode_AsUTF8(code->co_filename);
        if (outside < 0 || file == NULL) {
            PyErr_Clear();
            outside = 0;
        }
        size_t len = file ? strlen(file) : 0;
        int glue = len >= 12 && (strcmp(file + len - 12, "/contextlib.py") == 0 ||
                                 strcmp(file + len - 12, "/threading.py") == 0);
        if (outside && !glue) {
            const char *base = strrchr(file, '/');
            const char *name = PyUnicode_AsUTF8(code->co_name);
            char text[512];
            snprintf(text, sizeof text, "%s:%d %s", base ? base + 1 : file,
                     PyFrame_GetLineNumber(f), name ? name : "?");
            PyErr_Clear();
            memcpy(out, text, strlen(text) < cap ? strlen(text) : cap);
            Py_DECREF(code);
            Py_DECREF(f);
            return;
        }
        Py_DECREF(code);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    out[0] = '?';
}

/* The edge src -> dst (classes, 16 stored bytes each) in the segment's graph, the caller holding
 * the findings lock: nothing when the graph holds it; else appended, the record first and the
 * count last (a death in between leaves an unused record, which the next edge overwrites; a full
 * graph takes no more), at `site` (lg_site_bytes, NUL-padded; NULL: the caller's, caller_text),
 * and when the graph already holds a chain dst -> ... -> src the lock_order_cycle it closes
 * reported (lg_cycle) with `say_cycle`, as lockdep does before the thread waits. LG_HAD,
 * LG_ADDED, LG_FULL (the cycle still reported), or ERROR with an exception set. */
enum { LG_HAD, LG_ADDED, LG_FULL };
static int lg_put(Native *n, const char *src, const char *dst, const char *site, int say_cycle) {
    int64_t used = (int64_t)U4(n->seg + HDR_LOCKGRAPH_USED);
    if (used > LOCKGRAPH_CAPACITY) used = LOCKGRAPH_CAPACITY;
    for (int64_t e = 0; e < used; e++) {
        uint8_t *r = lg_edge(n, e);
        if (memcmp(r + LG_SRC, src, 16) == 0 && memcmp(r + LG_DST, dst, 16) == 0)
            return LG_HAD;
    }
    char here[256];
    size_t sb = LG_SITE_BYTES < sizeof here ? LG_SITE_BYTES : sizeof here;
    if (site == NULL) {
        caller_text(n, here, sb);
        site = here;
    }
    int32_t path[used > 0 ? used : 1];
    int64_t np = lg_chain(n, used, dst, src, path);
    int out = LG_FULL;
    if (used < LOCKGRAPH_CAPACITY) {
        uint8_t *r = lg_edge(n, used);
        memset(r, 0, LOCKGRAPH_SIZE);
        memcpy(r + LG_SRC, src, 16);
        memcpy(r + LG_DST, dst, 16);
        I4(r + LG_PID) = n->pid;
        memcpy(r + LG_SITE, site, sb);
        U4(n->seg + HDR_LOCKGRAPH_USED) = (uint32_t)used + 1;
        out = LG_ADDED;
    }
    if (np > 0 && say_cycle && lg_cycle(n, src, dst, site, path, np) != OK) return ERROR;
    return out;
}

/* Add the order edge src -> dst (classes, 16 stored bytes each) to the segment's graph under
 * the findings lock (lg_put), taken before the transaction takes its locks: waited for, a dead
 * holder recovered. OK, or ERROR with an exception set. */
static int lg_learn_edge(Native *n, const char *src, const char *dst, int say_cycle);
static int lg_learn_classes(Native *n, const char *src, const char *dst) {
    return lg_learn_edge(n, src, dst, 1);
}

/* lg_learn_classes, the cycle the edge closes reported only with `say_cycle` (a caller that
 * reports the edge's deadlock in words of its own: gil_wait_report). */
static int lg_learn_edge(Native *n, const char *src, const char *dst, int say_cycle) {
    if (lock_take_alone(n, n->lock_findings) != OK) return ERROR;
    int rc = lg_put(n, src, dst, NULL, say_cycle);
    lock_drop(n, n->lock_findings);
    return rc == ERROR ? ERROR : OK;
}

/* A str argument of learn_edge as the graph stores it: its UTF-8 bytes, cut to cap, NUL-padded
 * (0, or -1 with an exception set). */
static int lg_text(PyObject *o, char *out, size_t cap) {
    Py_ssize_t len;
    const char *text = PyUnicode_Check(o) ? PyUnicode_AsUTF8AndSize(o, &len) : NULL;
    if (text == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "learn_edge: src, dst, site are str");
        return -1;
    }
    memset(out, 0, cap);
    memcpy(out, text, (size_t)len < cap ? (size_t)len : cap);
    return 0;
}

/* learn_edge(src, dst, site) -> bool: probes/lockgraph.py SegmentGraph's write: the order edge
 * src -> dst (lock classes) that this process saw at `site` added to the segment's graph unless
 * it is there (lg_put: a cycle it closes reported into the findings ring, its position in
 * KVPool._found for the binding to hand over), under the findings lock, taken as N_report takes
 * it (leaf_take_py: waited for, a dead holder recovered). True when the graph holds the edge now,
 * False when it is full. */
static PyObject *N_learn_edge(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "learn_edge(src, dst, site)");
        return NULL;
    }
    char src[16], dst[16], site[256];
    size_t sb = LG_SITE_BYTES < sizeof site ? LG_SITE_BYTES : sizeof site;
    if (lg_text(args[0], src, 16) || lg_text(args[1], dst, 16) || lg_text(args[2], site, sb))
        return NULL;
    if (py_caller_unusable(n)) return NULL;
    int mh, taken = leaf_take_py(n, n->lock_findings, &mh, "learn_edge");
    if (taken == ERROR) return NULL;
    int rc = lg_put(n, src, dst, site, 1);
    leaf_drop(n, n->lock_findings, taken, mh);
    if (rc == ERROR) return NULL;
    return PyBool_FromLong(rc != LG_FULL);
}

/* The GIL as lockdep's graph names its class (lockgraph.GIL), 16 stored bytes. */
static const char GIL_CLASS[16] = "gil";

/* A wait of the core's for pool lock i that keeps the GIL (the gil-wait fault's; the core's own
 * waits let it go: locks.c lock_take_as, hold_mutex, wait_others), reported before the wait:
 * the edge gil -> class(i) learned into the segment's graph (the cycle it closes with the core's
 * class(i) -> gil is this report, not a lock_order_cycle too) and the wait_holds_gil finding,
 * once per handle. OK, or ERROR with an exception set. */
static int gil_wait_report(Native *n, int i) {
    /* (the cycle it closes through the core's own class(i) -> gil is this finding's) */
    if (lg_learn_edge(n, GIL_CLASS, n->lock_cls[i], 0) != OK) return ERROR;
    char site[257] = {0}, name[32];
    caller_text(n, site, LG_SITE_BYTES < 256 ? LG_SITE_BYTES : 256);
    lock_name(n, i, name, sizeof name);
    PyObject *msg = PyUnicode_FromFormat(
        "pid %d waits for pool lock '%s' at %s holding the GIL: a thread of this process that "
        "holds the lock needs the GIL to let it go, so they deadlock",
        (int)n->pid, name, site);
    if (msg == NULL) return ERROR;
    Seen s = {.block = -1, .owner_pid = n->pid, .site = -1};
    memset(s.request, 0, REQUEST_BYTES);
    int rc = finding_report(n, FK_WAIT_HOLDS_GIL, &s, msg);
    Py_DECREF(msg);
    return rc;
}

/* The order edge class(i) -> class(j) of two pool locks (lg_learn_classes). */
static int lg_learn(Native *n, int i, int j) {
    return lg_learn_classes(n, n->lock_cls[i], n->lock_cls[j]);
}

/* -- traced user locks (probes/lockdep.py TracedLock) ----------------------------------------- */

/* held_here() -> int: the pool locks whose records name this thread of this process as their
 * holder (bit i: lock i), whichever handle's core took them (in an operation that called
 * Python): the sources of lockdep.py's edges into a traced user lock taken now. */
static PyObject *N_held_here(Native *n, PyObject *unused) {
    uint64_t mask = 0;
    if (n->seg != NULL) {
        uint64_t tid = (uint64_t)syscall(SYS_gettid);
        for (int i = 0; i < n->num_locks; i++) {
            const uint8_t *r = n->seg + n->off_locks + (size_t)i * LOCK_SIZE;
            if (I4(r + LF_HOLDER_PID) == n->pid && U8(r + LF_HOLDER_TID) == tid)
                mask |= lock_bit(i);
        }
    }
    return PyLong_FromUnsignedLongLong(mask);
}

/* The traced user locks this thread holds, oldest first: each one's class as the graph stores
 * it (S16) and the graph its edges go to (the uid of the pool handle whose graph it records
 * into; 0: the process's own, lockgraph.LocalGraph). TracedLock pushes one after it takes the
 * lock and pops it after it lets go (module.c M_traced_lock_*); Python threads are OS threads,
 * so one stack per thread serves every handle of the process. Past USER_HELD_MAX (nesting no
 * program does) the deeper ones are only counted, and give no edges. */
#define USER_HELD_MAX 32
typedef struct {
    char cls[16];
    int64_t graph;
} UserHeld;
static _Thread_local UserHeld user_held[USER_HELD_MAX];
static _Thread_local int user_kept, user_over;

static void user_held_push(const char cls[16], int64_t graph) {
    if (user_kept == USER_HELD_MAX) {
        user_over++;
        return;
    }
    memcpy(user_held[user_kept].cls, cls, 16);
    user_held[user_kept++].graph = graph;
}

/* Forget the newest entry of this class and graph (one past USER_HELD_MAX if none is kept). */
static void user_held_pop(const char cls[16], int64_t graph) {
    for (int k = user_kept - 1; k >= 0; k--)
        if (user_held[k].graph == graph && memcmp(user_held[k].cls, cls, 16) == 0) {
            memmove(user_held + k, user_held + k + 1, sizeof *user_held * (size_t)(user_kept - 1 - k));
            user_kept--;
            return;
        }
    if (user_over > 0) user_over--;
}

/* The edges held user class -> class(j) of a lock this handle's transaction is about to take,
 * as LockDep.before makes them between traced locks: from each user lock whose graph is this
 * pool's or the process's own (a lock recording into another pool's graph is not ordered
 * against this pool's locks), each learned once per handle (n->uk_*: a full table asks the
 * segment each time). OK, or ERROR with an exception set. */
static int lockdep_user_into(Native *n, int j) {
    for (int k = 0; k < user_kept; k++) {
        const UserHeld *u = &user_held[k];
        if (u->graph != 0 && u->graph != n->uid) continue;
        int at = 0;
        while (at < n->uk_used && memcmp(n->uk_cls[at], u->cls, 16) != 0) at++;
        if (at < n->uk_used && (n->uk_into[at] & lock_bit(j))) continue;
        if (lg_learn_classes(n, u->cls, n->lock_cls[j]) != OK) return ERROR;
        if (at == n->uk_used) {
            if (at == USER_KNOWN_MAX) continue;
            memcpy(n->uk_cls[at], u->cls, 16);
            n->uk_into[at] = 0;
            n->uk_used++;
        }
        n->uk_into[at] |= n->same_class[j];
    }
    return OK;
}

/* A transaction takes the locks of `mask` in ascending order: each pair (i < j) of traced
 * locks of different classes is an order edge class(i) -> class(j), and each traced user lock
 * this thread holds an edge into class(j) (lockdep_user_into), made for each j in turn, the
 * user locks' first; and each traced class an edge class(j) -> gil (the core's wait for lock j
 * lets the GIL go and takes it back holding the lock: only an edge out of gil, a wait that keeps
 * it, closes a cycle through it: gil_wait_report). OK when the segment's graph holds every one (a bit matrix here of those
 * seen; lg_learn for the others: the findings lock waited for, a dead holder of it recovered),
 * ERROR with an exception set.
 *
 * The core's pool-lock edges alone never form a cycle: they run from a lower lock index to a
 * higher one, and the traced pool classes follow the lock index (seqs, index shards, free;
 * sites and findings are not traced), so a cycle needs an edge back from a later class to an
 * earlier one (the lock-inversion fault's: faults.c lockdep_inverted_ok), or through a user
 * lock. A traced user lock taken while the thread holds pool locks (in Python an operation
 * called; lockdep.py reads them from their records) has its edges added by N_learn_edge, which
 * finds the core's edges in the segment and reports the cycle its edge closes; an edge of the
 * core's that closes one (a user lock held across an operation, an edge of the lock-inversion
 * fault) the core reports itself (lg_learn_classes), before it waits for the lock. */
static int lockdep_ok(Native *n, uint64_t mask) {
    mask &= n->traced;
    for (uint64_t m = mask; m; m &= m - 1) {
        int j = __builtin_ctzll(m);
        if (user_kept && lockdep_user_into(n, j) != OK) return ERROR;
        /* class(j) -> gil: a wait for lock j lets the GIL go and takes it back holding the lock
         * (known: lock j's own bit of known_into[j], which no order edge uses) */
        if (!(n->known_into[j] & lock_bit(j))) {
            if (lg_learn_classes(n, n->lock_cls[j], GIL_CLASS) != OK) return ERROR;
            n->known_into[j] |= lock_bit(j);
            for (int k = 0; k < n->num_locks; k++)
                if (n->same_class[j] & lock_bit(k)) n->known_into[k] |= lock_bit(k);
        }
        uint64_t need = mask & (lock_bit(j) - 1) & ~n->same_class[j] & ~n->known_into[j];
        for (; need; need &= need - 1) {
            int i = __builtin_ctzll(need);
            if (lg_learn(n, i, j) != OK) return ERROR;
            n->known_into[j] |= lock_bit(i);
        }
    }
    return OK;
}
