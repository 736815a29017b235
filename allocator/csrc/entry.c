/* The pool's entry points: the gate, the handle's checks, building Sequences, fork.
 * Part of _native.c. */

/* -- entry points: the gate, the handle's checks, the Sequence ------------------------------- */

static int fork_gen = 0; /* bumped in a forked child: a handle made before the fork is not ours */
static void atfork_child(void) { fork_gen++; }

/* KVPool._check_process: ERROR with PoolError when the handle is closed, HandleInherited
 * (errors.py composes its message) when it is a forked child's copy of its parent's (opened by
 * another process); OK otherwise. */
static int unusable(Native *n) {
    if (n->seg == NULL) return pool_error("pool %R is closed", n->name);
    if (n->fork_gen == fork_gen) return OK;
    if (HandleInheritedType == NULL) return pool_error("pool %R: another process's handle", n->name);
    PyObject *err = PyObject_CallFunction(HandleInheritedType, "Oi", n->name, (int)n->pid);
    if (err != NULL) PyErr_SetObject(HandleInheritedType, err);
    Py_XDECREF(err);
    return ERROR;
}

/* OK when this call may run: the handle is open and this process's (else ERROR with the
 * PoolError: unusable). Another thread's operation on the handle in flight (waiting for a lock,
 * or in Python it called) is waited for first, and the handle looked at again; one of this
 * thread's own (a pool operation called from Python the core called) is a PoolError. The probes
 * are the handle's probe word, read at every call (they can come at any time): the core runs
 * every one itself (probes.c), lockdep with the traced user locks this thread holds
 * (lockdep_ok). ERROR with an exception set otherwise. Armed faults and crash points strike the
 * core's operations themselves (faults.c). */
static int gate(Native *n, PyObject *pool) {
    if (unusable(n)) return ERROR;
    if (n->mutex_held || n->held || n->mutex_wanted) {
        int mine, waited;
        if (wait_others(n, &mine, &waited)) return ERROR;
        if (mine) {
            PyErr_SetString(PoolErrorType ? PoolErrorType : PyExc_RuntimeError,
                            "a pool operation was called from inside another operation of the "
                            "same pool handle (Python that operation called)");
            return ERROR;
        }
        if (waited) return gate(n, pool); /* (the handle looked at again) */
    }
    n->probes = (int)*n->probe_bits;
    n->op_ns = mono_coarse_ns(); /* (verify_often's clock, and seq_touch's) */
    if (!(n->probes & P_LOCKDEP)) n->lockdep_was_on = 0;
    else if (!n->lockdep_was_on) {
        /* (re)instrumented: the edges it knows are asked for again */
        memset(n->known_into, 0, sizeof n->known_into);
        n->uk_used = 0;
        n->lockdep_was_on = 1;
    }
    n->pool = pool;
    /* KVPool._check_process: the magic probe re-verifies the header now and then. */
    if ((n->probes & P_MAGIC) && verify_often(n)) return ERROR;
    return OK;
}

/* own_slot's answer for a sequence already freed or aborted (its slot -1). */
enum { OWN_ENDED = -2 };

/* own_slot's refusal of a Sequence (not `mine`: another handle's; `ended`: its slot is -1):
 * its PoolError; -1, or OWN_ENDED. */
static int64_t own_refused(Native *n, PyObject *seq, int mine, int ended) {
    PyObject *rid = sfield(n, seq, F_REQUEST_ID), *state = NULL;
    if (rid == NULL) return -1;
    if (!mine)
        pool_error("sequence %R belongs to another pool handle, not to pool %R", rid, n->name);
    else if (ended && (state = sfield(n, seq, F_STATE)) != NULL)
        pool_error("sequence %R was already %S", rid, state);
    else if (!ended)
        /* (the handle's registry holds each live one at its slot: a copy of one, or one made
         * by hand, would write another sequence's records) */
        pool_error("sequence %R is not a live sequence of this handle on pool %R (a copy of "
                   "one, or made outside the pool)",
                   rid, n->name);
    Py_DECREF(rid);
    Py_XDECREF(state);
    return mine && ended ? OWN_ENDED : -1;
}

/* KVPool._own: the slot of a live Sequence of this handle (the one in its registry, not a
 * copy); else -1, or OWN_ENDED for one already ended, with PoolError set (own_refused; an
 * AttributeError for a Sequence missing a field). */
static int64_t own_slot(Native *n, PyObject *seq) {
    PyTypeObject *tp = Py_TYPE(seq);
    if (tp != (PyTypeObject *)n->seq_type && !PyType_IsSubtype(tp, (PyTypeObject *)n->seq_type)) {
        const char *name = strrchr(tp->tp_name, '.'); /* type(seq).__name__ */
        pool_error("expected a Sequence, got %s", name ? name + 1 : tp->tp_name);
        return -1;
    }
    PyObject *uid = sfield(n, seq, F_POOL_UID), *slot = uid ? sfield(n, seq, F_SLOT) : NULL;
    if (slot == NULL) {
        Py_XDECREF(uid);
        return -1;
    }
    int over = 0, is_int = PyLong_Check(slot);
    int mine = PyLong_Check(uid) && PyLong_AsLongLongAndOverflow(uid, &over) == n->uid && !over;
    int64_t at = is_int ? PyLong_AsLongLongAndOverflow(slot, &over) : 0;
    int live = mine && is_int && !over && at >= 0 && at < n->max_seqs &&
               PyDict_GetItemWithError(n->seqs, slot) == seq;
    Py_DECREF(uid);
    Py_DECREF(slot);
    if (live) return at;
    if (PyErr_Occurred()) return -1;
    return own_refused(n, seq, mine, is_int && !over && at < 0);
}

/* Under a probe, a call on a sequence of this handle already finished or aborted (own_slot's
 * OWN_ENDED, its PoolError set and kept), before the pool refuses it: `op` NULL, a second free
 * or abort, is a double_free finding about no block; else (`op` names the call: an append, a
 * publication, a fork, a state change, a resume, a lease) the program still uses the handle of
 * a request it ended, a use_after_free about no block. Once per request and kind. A failure to
 * report it is written as unraisable. */
static void ended_use(Native *n, PyObject *seq, const char *op) {
    if (!(n->probes & ~P_LOCKDEP)) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int fk = op ? FK_USE_AFTER_FREE : FK_DOUBLE_FREE;
    PyObject *state = sfield(n, seq, F_STATE), *rid = sfield(n, seq, F_REQUEST_ID);
    PyObject *text = NULL, *key = NULL, *seen = NULL, *site = NULL, *msg = NULL;
    int ended = state && PyUnicode_Check(state) &&
                (PyUnicode_CompareWithASCIIString(state, "finished") == 0 ||
                 PyUnicode_CompareWithASCIIString(state, "aborted") == 0);
    /* (the request as the finding keeps it: its first 32 characters) */
    int fresh = ended && rid && (text = PyObject_Str(rid)) != NULL &&
                (key = PyUnicode_Substring(text, 0, REQUEST_BYTES)) != NULL &&
                (seen = Py_BuildValue("(iO)", fk, key)) != NULL &&
                PySet_Contains(n->ended_used, seen) == 0 && PySet_Add(n->ended_used, seen) == 0;
    if (fresh) {
        int err;
        PyFrameObject *f =
            frame_outward(n, (PyFrameObject *)Py_XNewRef(PyEval_GetFrame()), 0, &err);
        site = err ? NULL : f ? frame_text(f) : PyUnicode_FromString("<kvscope>");
        Py_XDECREF(f);
        if (site && op)
            msg = PyUnicode_FromFormat("request %R was already %S and is used again at %U "
                                       "(%s): the pool refused it (PoolError), but the program "
                                       "kept its sequence after ending it",
                                       rid, state, site, op);
        else if (site)
            msg = PyUnicode_FromFormat("request %R was already %S and is released again at "
                                       "%U: the pool refused it (PoolError), but the caller "
                                       "frees twice",
                                       rid, state, site);
        Seen s = {.block = -1, .owner_pid = n->pid, .site = -1};
        if (msg && request_of(key, s.request) == OK) finding_report(n, fk, &s, msg);
    }
    if (PyErr_Occurred()) PyErr_WriteUnraisable(n->pool);
    Py_XDECREF(state);
    Py_XDECREF(rid);
    Py_XDECREF(text);
    Py_XDECREF(key);
    Py_XDECREF(seen);
    Py_XDECREF(site);
    Py_XDECREF(msg);
    PyErr_Restore(type, value, tb);
}

/* own_slot for a call `op` on the sequence: one already ended is also ended_use's finding. */
static int64_t own_used(Native *n, PyObject *seq, const char *op) {
    int64_t slot = own_slot(n, seq);
    if (slot == OWN_ENDED) ended_use(n, seq, op);
    return slot;
}

/* A new Sequence with these 10 field values (the dataclass's order: its __init__ only assigns
 * them), registered in the handle's live sequences
 * under `slot`. */
static PyObject *new_sequence(Native *n, PyObject *const *fields, PyObject *slot) {
    PyTypeObject *tp = (PyTypeObject *)n->seq_type;
    PyObject *seq = tp->tp_alloc(tp, 0);
    if (seq == NULL) return NULL;
    for (int i = 0; i < 10; i++) sset(n, seq, i, fields[i]);
    if (PyDict_SetItem(n->seqs, slot, seq)) Py_CLEAR(seq);
    return seq;
}

/* An entry point's gate: NULL (the exception set) where the call may not run. */
#define GATE(n, pool)                                                                        \
    do {                                                                                     \
        if (gate(n, pool) != OK) return NULL;                                                \
    } while (0)

/* N_append once its tokens are read. */
static PyObject *append_read(Native *n, PyObject *pool, PyObject *seq, const Tokens *t) {
    GATE(n, pool);
    int64_t slot = own_used(n, seq, "append");
    if (n->oplog) oplog_tokens(n, t->v, t->n, slot); /* (after the gate: this call's own) */
    if (slot < 0) return NULL;
    seq_touch(n, slot);
    if (seqrec(n, slot)[SF_STATE] == S_PREEMPTED) {
        /* (its blocks went back at the preemption: set_state's words, not a table mismatch) */
        pool_error("a preempted sequence must be resumed with pool.resume(seq) first");
        return NULL;
    }
    if (t->n == 0) return PyList_New(0);
    /* more than max_blocks_per_seq blocks refused (a PoolError), before anything is
     * appended */
    PyObject *had = sfield(n, seq, F_TOKENS);
    if (had == NULL) return NULL;
    int64_t need = ((PyList_Check(had) ? PyList_GET_SIZE(had) : 0) + t->n + n->bs - 1) / n->bs;
    Py_DECREF(had);
    if (need > n->max_bps) {
        pool_error("sequence needs %lld blocks but PoolConfig.max_blocks_per_seq is %lld",
                   (long long)need, (long long)n->max_bps);
        return NULL;
    }
    return core_append(n, pool, seq, slot, t->v, t->n);
}

static PyObject *end_read(Native *n, PyObject *seq, int64_t slot, long final);

/* A sequence the operation that made it could not finish (a long prompt's or resume's rest
 * failed) aborted. An exception pending is kept (an abort that fails raises its own, the first
 * as its context). OK or ERROR. */
static int abandon(Native *n, PyObject *seq, int64_t slot) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    n->abandoning = 1; /* (its abort events: arg 1, not the program's pool.abort) */
    PyObject *ended = end_read(n, seq, slot, 4);
    n->abandoning = 0;
    if (ended != NULL) {
        Py_DECREF(ended);
        PyErr_Restore(type, value, tb);
        return OK;
    }
    if (type != NULL) {
        PyObject *t2, *v2, *tb2;
        PyErr_Fetch(&t2, &v2, &tb2);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL) PyException_SetTraceback(value, tb);
        PyErr_NormalizeException(&t2, &v2, &tb2);
        PyException_SetContext(v2, value); /* (steals value) */
        Py_DECREF(type);
        Py_XDECREF(tb);
        PyErr_Restore(t2, v2, tb2);
    }
    return ERROR;
}

/* A long prompt's tokens after those its first transaction held (toks[0..k)) appended to its
 * new Sequence, a transaction per CHUNK blocks' worth (core_append). On an error the sequence
 * is aborted and the error raised. (An append a transaction that could not begin stopped
 * leaves it shorter: KVPool.allocate appends the rest.) */
static PyObject *allocate_rest(Native *n, PyObject *pool, PyObject *seq, int64_t slot,
                               const int32_t *toks, int64_t k) {
    PyObject *copies = core_append(n, pool, seq, slot, toks, k);
    if (copies != NULL) {
        Py_DECREF(copies);
        return seq;
    }
    abandon(n, seq, slot);
    Py_DECREF(seq);
    return NULL;
}

/* N_allocate once its arguments are read: the tokens, the request id as a str. */
static PyObject *allocate_read(Native *n, PyObject *pool, const Tokens *t, PyObject *rid) {
    GATE(n, pool);
    if (n->oplog) oplog_tokens(n, t->v, t->n, -1); /* (after the gate: this call's own) */
    char request[REQUEST_BYTES];
    if (request_of(rid, request)) return NULL;
    int32_t site = site_now(n);
    if (site == SITE_ERROR) return NULL;
    PyObject *got = core_allocate(n, t->v, t->n, request, site, -1);
    if (got == NULL) return NULL;
    /* (slot, seq_id, table, chain, hits) -> Sequence(request_id, tokens, block_table, slot,
     * seq_id, pool_uid, num_cached_tokens, state, chain, num_published) */
    PyObject *tokens = tokens_list(t);
    /* a long prompt: the tokens its first transaction holds (the rest are appended below) */
    Py_ssize_t held = PyList_GET_SIZE(PyTuple_GET_ITEM(got, 2)) * n->bs;
    int64_t slot = PyLong_AsLongLong(PyTuple_GET_ITEM(got, 0));
    if (tokens && held < t->n) Py_SETREF(tokens, PyList_GetSlice(tokens, 0, held));
    PyObject *uid = PyLong_FromLongLong(n->uid);
    PyObject *cached =
        PyLong_FromLongLong(PyLong_AsLongLong(PyTuple_GET_ITEM(got, 4)) * n->bs);
    PyObject *seq = NULL;
    if (tokens && uid && cached) {
        PyObject *a[10] = {rid,        tokens, PyTuple_GET_ITEM(got, 2), PyTuple_GET_ITEM(got, 0),
                           PyTuple_GET_ITEM(got, 1), uid, cached, s_running,
                           PyTuple_GET_ITEM(got, 3), PyTuple_GET_ITEM(got, 4)};
        seq = new_sequence(n, a, PyTuple_GET_ITEM(got, 0));
    }
    Py_XDECREF(tokens);
    Py_XDECREF(uid);
    Py_XDECREF(cached);
    Py_DECREF(got);
    if (seq == NULL || held >= t->n) return seq;
    return allocate_rest(n, pool, seq, slot, t->v + held, t->n - held);
}

/* allocate(pool, tokens, request_id) -> Sequence: tokens as tokens.c reads them, any
 * request id (its str). */
static PyObject *N_allocate(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "allocate(pool, tokens, request_id)");
        return NULL;
    }
    if (unusable(n)) return NULL; /* (before its arguments, as KVPool._check_process) */
    Tokens t;
    if (tokens_read(args[1], &t, 1)) {
        tokens_done(&t);
        return NULL;
    }
    PyObject *rid = NULL, *seq = NULL;
    if (t.n == 0)
        pool_error("allocate needs at least one token");
    else if ((rid = request_str(args[2])) != NULL)
        seq = allocate_read(n, args[0], &t, rid);
    Py_XDECREF(rid);
    tokens_done(&t);
    return seq;
}

/* The moment a release verifies its published blocks, in a published_block_modified finding's
 * words ("its release by request 'id'"), with *hold the string that
 * keeps them (a new reference, or NULL). NULL with an exception set. */
static const char *release_words(Native *n, PyObject *seq, PyObject **hold) {
    *hold = NULL;
    if (!(n->probes & P_DIGEST)) return "its release";
    PyObject *rid = sfield(n, seq, F_REQUEST_ID);
    if (rid == NULL) return NULL;
    /* (every release under the digest probe words them, seldom used: a str whose repr is
     * itself in single quotes, printable ASCII with neither quote nor backslash, put together
     * here; PyUnicode_FromFormat's %R took about 1,500 instructions a free, callgrind) */
    static const char pre[] = "its release by request '";
    const Py_ssize_t pl = (Py_ssize_t)sizeof pre - 1;
    Py_ssize_t len = PyUnicode_CheckExact(rid) && PyUnicode_IS_ASCII(rid) ? PyUnicode_GET_LENGTH(rid) : -1;
    const Py_UCS1 *c = len >= 0 ? PyUnicode_1BYTE_DATA(rid) : NULL;
    for (Py_ssize_t i = 0; i < len; i++)
        if (c[i] < 0x20 || c[i] > 0x7e || c[i] == '\'' || c[i] == '\\') len = -1;
    if (len >= 0 && (*hold = PyUnicode_New(pl + len + 1, 127)) != NULL) {
        Py_UCS1 *out = PyUnicode_1BYTE_DATA(*hold);
        memcpy(out, pre, (size_t)pl);
        memcpy(out + pl, c, (size_t)len);
        out[pl + len] = '\'';
    } else if (len < 0) {
        *hold = PyUnicode_FromFormat("its release by request %R", rid);
    }
    Py_DECREF(rid);
    return *hold ? PyUnicode_AsUTF8(*hold) : NULL;
}

/* end(pool, seq, final_state) -> True: free (FINISHED, 3) or abort (ABORTED, 4). */
static PyObject *N_end(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    long final = nargs == 3 ? PyLong_AsLong(args[2]) : 0;
    if (final != 3 && final != 4) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "end(pool, seq, final_state: 3 or 4)");
        return NULL;
    }
    GATE(n, args[0]);
    PyObject *seq = args[1];
    int64_t slot = own_used(n, seq, NULL);
    if (slot < 0) return NULL;
    return end_read(n, seq, slot, final);
}

/* Guard mode, a request that finished (not aborted), whose release guard mode guards: the K/V
 * of every position but its last was written into its own blocks (an engine may end a request
 * before feeding back its last sampled token). Token slots still poisoned, from the pool's
 * creation or the block's last free, mean the writes went elsewhere: kv_never_written, reported
 * now on a CPU pool, at the next settle on a CUDA pool, whose queue is the op mutex's (taken
 * here for it). Checked in the free's call, before the release (kvdata.c N_unwritten). OK or
 * ERROR. */
static int finish_check(Native *n, PyObject *seq, PyObject *table) {
    if (!PyList_Check(table) || PyList_GET_SIZE(table) == 0) return OK;
    PyObject *tokens = sfield(n, seq, F_TOKENS), *rid = tokens ? sfield(n, seq, F_REQUEST_ID) : NULL;
    PyObject *num = NULL, *req = NULL, *r = NULL;
    int took = 0;
    if (rid == NULL) goto out;
    num = PyLong_FromSsize_t((PyList_Check(tokens) ? PyList_GET_SIZE(tokens) : 0) - 1);
    req = PyUnicode_CheckExact(rid) ? Py_NewRef(rid) : PyObject_Str(rid);
    if (num == NULL || req == NULL) goto out;
    if (n->kv == NULL && !n->mutex_held) {
        if (hold_mutex(n) != OK) {
            if (!PyErr_Occurred()) unhandled(n); /* (no pool lock is held here) */
            goto out;
        }
        took = 1;
    }
    PyObject *a[3] = {table, num, req};
    r = N_unwritten(n, a, 3);
    if (took) drop_mutex(n);
out:
    Py_XDECREF(tokens);
    Py_XDECREF(rid);
    Py_XDECREF(num);
    Py_XDECREF(req);
    if (r == NULL) return ERROR;
    Py_DECREF(r);
    return OK;
}

/* N_end once its arguments are read (the gate passed): seq, a live sequence of this handle in
 * `slot`, released as FINISHED (3) or ABORTED (4) -> True. */
static PyObject *end_read(Native *n, PyObject *seq, int64_t slot, long final) {
    int guard = guard_release(n, slot);
    if (guard < 0) return NULL;
    PyObject *table = sfield(n, seq, F_BLOCK_TABLE);
    if (table == NULL) return NULL;
    if (guard && final == 3 && n->poison_ok && finish_check(n, seq, table) != OK) {
        Py_DECREF(table);
        return NULL;
    }
    PyObject *when;
    const char *w = release_words(n, seq, &when);
    if (w == NULL) {
        Py_XDECREF(when);
        Py_DECREF(table);
        return NULL;
    }
    PyObject *rid = sfield(n, seq, F_REQUEST_ID);
    PyObject *done = rid ? core_release(n, seq, table, slot, final, guard, w, rid) : NULL;
    Py_XDECREF(when);
    Py_DECREF(table);
    if (done == NULL) {
        Py_XDECREF(rid);
        return NULL;
    }
    /* sampled guard mode forgets the slot */
    if (guard && (n->probes & P_GUARD_SAMPLED)) {
        PyObject *key = PyLong_FromLongLong(slot);
        if (key == NULL || PySet_Discard(n->guarded, key) < 0) PyErr_Clear();
        Py_XDECREF(key);
    }
    Py_DECREF(done);
    /* The handle forgets the sequence; the Sequence is ended (empty table, slot -1). */
    PyObject *key = PyLong_FromLongLong(slot), *empty = PyList_New(0);
    PyObject *minus = PyLong_FromLong(-1);
    int bad = !key || !empty || !minus;
    if (!bad && PyDict_DelItem(n->seqs, key)) PyErr_Clear();
    if (!bad) {
        sset(n, seq, F_BLOCK_TABLE, empty);
        sset(n, seq, F_STATE, final == 3 ? s_finished : s_aborted);
        sset(n, seq, F_SLOT, minus);
    }
    Py_XDECREF(key);
    Py_XDECREF(empty);
    Py_XDECREF(minus);
    /* the blocks the release left held that nothing maps (the leaks probe's), reported
     * once the handle has forgotten the sequence */
    bad = bad || report_leaked(n, rid) != OK;
    Py_DECREF(rid);
    if (bad) return NULL;
    Py_RETURN_TRUE;
}

/* The block a sequence left at a close is reported by: the first its own request allocated
 * (its record names that request, and its site is the request's own `allocate`), not a shared
 * prefix block another request allocated; else the first naming its request; else the last
 * (a fork holding only its parent's blocks). -1 for an empty table. */
static int32_t own_block(Native *n, const uint8_t *s) {
    int64_t k = U4(s + SF_NUM_BLOCKS);
    if (k > n->max_bps) k = n->max_bps;
    const int32_t *t = (const int32_t *)(s + SF_TABLE);
    int32_t named = -1, last = -1;
    for (int64_t i = 0; i < k; i++) {
        if (t[i] < 0 || t[i] >= n->nb) continue;
        const uint8_t *r = blk(n, t[i]);
        last = t[i];
        if (memcmp(r + BF_REQUEST, s + SF_REQUEST, REQUEST_BYTES) != 0) continue;
        if (r[BF_INDEXED] != 1) return t[i];
        if (named < 0) named = t[i];
    }
    return named >= 0 ? named : last;
}

/* The sequences this handle still holds as it closes (recovery.c N_detach): nothing can end
 * them once the handle is gone, so each holding blocks is a leak_finished finding (its request,
 * own_block, the site of the call that created it), and so is each preempted one, which holds
 * none (a request its engine lost while it waited: no block, but a sequence slot and a
 * request never ended), recorded as a REPORT where the handle records (a replay replays it as
 * this close). They stay as they are, their blocks held under
 * the detached record, as a dump shows them. OK, or ERROR with an exception set. */
static int seqs_at_close(Native *n, PyObject *pool) {
    if (n->seqs == NULL || PyDict_GET_SIZE(n->seqs) == 0) return OK;
    if (gate(n, pool) != OK) return ERROR;
    PyObject *slot_o, *seq;
    Py_ssize_t pos = 0;
    while (PyDict_Next(n->seqs, &pos, &slot_o, &seq)) {
        int64_t slot = PyLong_AsLongLong(slot_o);
        if (slot < 0 || slot >= n->max_seqs) {
            if (!PyErr_Occurred()) core_bug("a live sequence's slot outside the table");
            return ERROR;
        }
        const uint8_t *s = seqrec(n, slot);
        int64_t held = U4(s + SF_NUM_BLOCKS);
        if (held <= 0 && s[SF_STATE] != S_PREEMPTED) continue;
        Py_ssize_t found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
        Seen seen = {.block = own_block(n, s), .owner_pid = n->pid,
                     .site = (int32_t)U2(s + SF_SITE) - 1, .refcount = 0};
        memcpy(seen.request, s + SF_REQUEST, REQUEST_BYTES);
        PyObject *rid = sfield(n, seq, F_REQUEST_ID);
        PyObject *msg = rid == NULL ? NULL
                        : held > 0
                            ? PyUnicode_FromFormat(
                                  "request %R still held %lld block(s) when the pool was closed: "
                                  "free or abort every sequence when its request ends",
                                  rid, (long long)held)
                            : PyUnicode_FromFormat(
                                  "request %R was preempted and neither resumed nor ended when "
                                  "the pool was closed: free or abort every sequence when its "
                                  "request ends, a preempted one too",
                                  rid);
        Py_XDECREF(rid);
        int rc = msg == NULL ? ERROR : finding_report(n, FK_LEAK_FINISHED, &seen, msg);
        Py_XDECREF(msg);
        if (rc != OK) return ERROR;
        if (n->oplog) oplog_found_report(n, found0, (const char *)s + SF_REQUEST);
    }
    return OK;
}

/* append(pool, seq, tokens) -> copies: tokens as tokens.c reads them (core_append). */
static PyObject *N_append(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "append(pool, seq, tokens)");
        return NULL;
    }
    if (unusable(n)) return NULL; /* (before its arguments, as KVPool._check_process) */
    Tokens t;
    PyObject *out = NULL;
    if (tokens_read(args[2], &t, 0) == OK) out = append_read(n, args[0], args[1], &t);
    tokens_done(&t);
    return out;
}

/* mark_computed(pool, seq, num_tokens) -> int: every full block of positions [0, num_tokens),
 * a transaction per CHUNK of them (core_publish); num_tokens any integer (its __index__;
 * TypeError otherwise): one past the tokens publishes every full block, a negative one none. */
static PyObject *N_mark_computed(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "mark_computed(pool, seq, num_tokens)");
        return NULL;
    }
    GATE(n, args[0]);
    int64_t slot = own_used(n, args[1], "mark_computed");
    if (slot < 0) return NULL;
    seq_touch(n, slot);
    PyObject *o = PyNumber_Index(args[2]);
    if (o == NULL) return NULL;
    int over;
    long long v = PyLong_AsLongLongAndOverflow(o, &over);
    Py_DECREF(o);
    if (v == -1 && PyErr_Occurred()) return NULL;
    /* (past any list: every full block, or none) */
    Py_ssize_t upto = over > 0 || v > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX
                      : over < 0 || v < 0            ? -1
                                                     : (Py_ssize_t)v;
    return core_publish(n, args[1], upto, slot);
}

/* mark_computed_many(pool, seqs, counts) -> list[int]: mark_computed(pool, seqs[i], counts[i])
 * for each i in turn (each its own call of the core, recorded as its own operation: oplog.c
 * R_mark_computed), the checks of a CUDA pool's publications queued as one at the end
 * (devchecks.c dev_batch_end); each sequence's count of blocks published. At the first that
 * raises, the call raises it: the sequences before it stay published (their checks queued),
 * the rest are not looked at. seqs and counts: lists or tuples of one length (else a TypeError
 * or a PoolError, before anything is published). */
static PyObject *R_mark_computed(Native *n, PyObject *const *args, Py_ssize_t nargs);
static PyObject *N_mark_computed_many(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !(PyList_Check(args[1]) || PyTuple_Check(args[1])) ||
        !(PyList_Check(args[2]) || PyTuple_Check(args[2]))) {
        PyErr_SetString(PyExc_TypeError,
                        "mark_computed_many(pool, seqs: list, num_tokens: list of ints)");
        return NULL;
    }
    Py_ssize_t k = PySequence_Fast_GET_SIZE(args[1]);
    if (PySequence_Fast_GET_SIZE(args[2]) != k) {
        pool_error("mark_computed_many: %zd sequences but %zd token counts", k,
                   PySequence_Fast_GET_SIZE(args[2]));
        return NULL;
    }
    /* (the items held, in tuples of their own: Python the core calls may change the lists) */
    PyObject *seq_list = PySequence_Tuple(args[1]), *count_list = PySequence_Tuple(args[2]);
    PyObject *out = seq_list && count_list ? PyList_New(k) : NULL;
    if (out == NULL) {
        Py_XDECREF(seq_list);
        Py_XDECREF(count_list);
        return NULL;
    }
    dev_batch_begin(n);
    Py_ssize_t i = 0;
    for (; i < k; i++) {
        PyObject *a[3] = {args[0], PyTuple_GET_ITEM(seq_list, i), PyTuple_GET_ITEM(count_list, i)};
        PyObject *r = R_mark_computed(n, a, 3);
        if (r == NULL) break;
        PyList_SET_ITEM(out, i, r);
    }
    /* what the sequences published checked, one launch (under the op mutex, let go after) */
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb);
    int rc = dev_batch_end(n);
    drop_mutex(n);
    if (et != NULL) {
        /* (the sequence's error is the call's; one of the checks' after it, unraisable) */
        if (rc != OK) PyErr_WriteUnraisable(args[0]);
        PyErr_Restore(et, ev, etb);
    }
    Py_DECREF(seq_list);
    Py_DECREF(count_list);
    if (et != NULL || rc != OK) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

/* Digests answered after their publication (a CUDA pool's, read by the core's own queue:
 * devchecks.c, devanswers.c) into the records of blocks b[0..k) still published in the
 * generation g[i] each was taken in and with no digest of it yet (word w[i]), under the
 * blocks' shard locks: how many were written; NULL with an exception set (the caller keeps
 * them for its next try). At most CHUNK blocks;
 * a block twice keeps its first digest. */
static PyObject *write_digest_words(Native *n, PyObject *pool, const int32_t *b,
                                    const uint32_t *g, const uint64_t *w, Py_ssize_t k) {
    GATE(n, pool);
    uint64_t locks = 0;
    for (Py_ssize_t i = 0; i < k; i++)
        /* its shard lock: a block published in a generation keeps its key */
        if (blk(n, b[i])[BF_INDEXED] == 1) locks |= block_shard_lock(n, b[i]);
    if (locks == 0) return PyLong_FromLong(0); /* none still published */
    PyObject *result = NULL;
    if (txn_begin(n, locks)) {
        result = unhandled(n);
        goto out;
    }
    long written = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, b[i]);
        uint32_t gen = U4(r + BF_GENERATION);
        uint64_t cur = U8(r + n->off_kv_digest);
        if (gen != g[i] || r[BF_INDEXED] != 1) continue;
        if (cur != 0 && (cur & GEN_MASK) == gen) continue; /* (a digest of this generation) */
        int saved = jsave_block(n, b[i]);
        if (saved != OK && !PyErr_Occurred() && n->jcount > 0) {
            /* the journal is full: what is written stands (each digest is a write of its
             * own), the rest in a transaction of its own */
            n->jfull = 0;
            txn_commit(n);
            if (txn_begin(n, locks)) {
                result = unhandled(n);
                goto out;
            }
            i--;
            continue;
        }
        if (saved != OK) {
            txn_abort(n);
            /* (an empty journal holds 96 KiB, a record 4 KiB at most) */
            core_bug("a block record larger than the journal");
            goto out;
        }
        U8(r + n->off_kv_digest) = w[i];
        seal(n, b[i]);
        written++;
    }
    txn_commit(n);
    n->ops_done++;
    result = PyLong_FromLong(written);
out:
    drop_mutex(n);
    return result;
}

/* verify_often(pool): the magic probe's periodic check asked for between operations (stats(),
 * a block table), on this core's clock: the gate runs it, and reports what it finds. */
static PyObject *N_verify_often(Native *n, PyObject *pool) {
    /* It may come from inside an operation's gate (Python the gate calls may ask again): what
     * that gate worked out for its operation stays as it was. */
    int probes = n->probes, between = n->verify_between;
    PyObject *was = n->pool;
    n->verify_between = 1; /* (a read waits for no pool lock: probes.c conservation) */
    int g = gate(n, pool);
    n->verify_between = between;
    n->probes = probes;
    n->pool = was;
    if (g != OK) return NULL;
    Py_RETURN_NONE;
}

/* Guard mode's scan of pool.verify() where the core maps the K/V (a CPU pool's: kvdata.c):
 * every block's guard slot, in every row, against the canary, read only (a release refills
 * a broken one: canaries_intact); a guard_violation finding, as the block's record is now,
 * for each block that does not hold it. OK, or ERROR with an exception set. */
static int verify_canaries(Native *n) {
    int64_t m = n->kv_slot_bytes / n->kv_esize;
    size_t guard = (size_t)(n->kv_spb - 1) * (size_t)n->kv_slot_bytes;
    for (int32_t b = 0; b < n->nb; b++) {
        int broken = 0;
        for (int64_t r = 0; r < n->kv_rows && !broken; r++)
            broken = !all_bits(n, kv_row(n, r, b) + guard, m, n->canary);
        if (!broken) continue;
        Seen s;
        seen_of(n, b, &s);
        if (finding_report(n, FK_GUARD_VIOLATION, &s, n->msg_canary) != OK) return ERROR;
    }
    return OK;
}

/* verify(pool) -> ([int], bool): pool.verify()'s check, at once (not on the VERIFY_EVERY_NS
 * interval) and whatever the probe word says of the magic probe: the header's checked bytes
 * against the copy taken at attach, and, with the leaks probe, conservation (probes.c
 * verify_now); in guard mode, where the core maps the K/V, every block's canary
 * (verify_canaries). What it finds it reports itself, into the ring (once per handle, as every
 * finding it counts): the ring positions written in this call (its gate's periodic check's
 * too), which KVPool._found holds too, as every call's, and whether it scanned the canaries
 * (not where the K/V is not this process's memory: a CUDA pool's). While the handle records,
 * the findings are a REPORT (a replay verifies there). */
static PyObject *N_verify(Native *n, PyObject *pool) {
    /* (as verify_often: what a gate this may come from worked out stays as it was) */
    int probes = n->probes;
    PyObject *was = n->pool;
    Py_ssize_t found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    uint64_t last = n->last_verify_ns;
    int rc = gate(n, pool), scanned = 0;
    /* (the gate's own check, where it was due just now, is this one) */
    if (rc == OK && n->last_verify_ns == last) rc = verify_now(n, verify_clock(n));
    if (rc == OK && (n->probes & (P_GUARD | P_GUARD_SAMPLED)) && n->kv != NULL &&
        n->kv_spb > 1) {
        scanned = 1;
        rc = verify_canaries(n);
    }
    n->probes = probes;
    n->pool = was;
    Py_ssize_t upto = n->found ? PyList_GET_SIZE(n->found) : 0;
    if (upto > found0) {
        char none[REQUEST_BYTES] = {0};
        oplog_found_report(n, found0, none);
    }
    if (rc != OK) return NULL;
    PyObject *at = n->found ? PyList_GetSlice(n->found, found0, upto) : PyList_New(0);
    return at ? Py_BuildValue("(NO)", at, scanned ? Py_True : Py_False) : NULL;
}

/* fork(pool, seq, request_id) -> Sequence: a new sequence sharing every block; any
 * request id (its str). */
static PyObject *fork_read(Native *n, PyObject *const *args, PyObject *rid);

static PyObject *N_fork(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "fork(pool, seq, request_id)");
        return NULL;
    }
    if (unusable(n)) return NULL; /* (before its arguments, as KVPool._check_process) */
    PyObject *rid = request_str(args[2]);
    if (rid == NULL) return NULL;
    PyObject *seq = fork_read(n, args, rid);
    Py_DECREF(rid);
    return seq;
}

static PyObject *fork_read(Native *n, PyObject *const *args, PyObject *rid) {
    GATE(n, args[0]);
    PyObject *src = args[1];
    int64_t src_slot = own_used(n, src, "fork");
    if (src_slot < 0) return NULL;
    seq_touch(n, src_slot);
    char request[REQUEST_BYTES];
    if (request_of(rid, request)) return NULL;
    int32_t site = site_now(n);
    if (site == SITE_ERROR) return NULL;
    PyObject *f[10];
    for (int i = 0; i < 10; i++) f[i] = NULL;
    int32_t ids_s[CHUNK], *ids = ids_s; /* (on the heap for a table of more) */
    PyObject *seq = NULL, *table = NULL, *tokens = NULL, *chain = NULL, *slot_o = NULL,
             *id_o = NULL;
    for (int i = 0; i < 10; i++)
        if ((f[i] = sfield(n, src, i)) == NULL) goto out;
    Py_ssize_t k, len = PyList_Check(f[F_BLOCK_TABLE]) ? PyList_GET_SIZE(f[F_BLOCK_TABLE]) : 0;
    if (len > CHUNK && len <= n->max_bps &&
        (ids = PyMem_Malloc(sizeof(int32_t) * (size_t)len)) == NULL) {
        ids = ids_s;
        PyErr_NoMemory();
        goto out;
    }
    uint64_t shards; /* the shards of its indexed blocks */
    if (!PyList_CheckExact(f[F_TOKENS]) || !PyList_CheckExact(f[F_CHAIN])) {
        seq_changed(PyList_CheckExact(f[F_TOKENS]) ? "chain" : "tokens");
        goto out;
    }
    if (table_of(n, f[F_BLOCK_TABLE], ids, ids == ids_s ? CHUNK : len, &k, &shards)) goto out;
    int64_t slot;
    uint64_t seq_id;
    Claim claim;
    int rc;
    n->want_locks = 0;
again:;
    uint64_t locks = shards | n->want_locks;
    claim_plan(n, &claim, &locks);
    if (txn_begin(n, locks)) {
        seq = unhandled(n);
        goto out;
    }
    if (claim_take(n, &claim)) goto abort;
    slot = claim.slot;
    seq_id = claim.seq_id;
    if (write_claim(n, slot, seq_id, request, wall_ns(), site)) goto abort;
    for (Py_ssize_t i = 0; i < k; i++)
        if (jsave_block(n, ids[i])) goto abort;
    for (Py_ssize_t i = 0; i < k; i++) {
        I4(blk(n, ids[i]) + BF_REFCOUNT) += 1;
        seal(n, ids[i]);
    }
    if (write_blocks(n, slot, 0, ids, k)) goto abort;
    U8(seqrec(n, slot) + SF_NUM_TOKENS) = (uint64_t)PyList_GET_SIZE(f[F_TOKENS]);
    txn_commit(n);
    count(n, C_FORKS, 1);
    ev_record(n, E_FORK, ids, k, request, PyLong_AsLongLong(f[F_SEQ_ID]));
    if (PyErr_Occurred()) goto out;
    if (claim_done(n, &claim)) goto out;
    /* The child Sequence: copies of the parent's lists, its cached and published counts. */
    table = PyList_GetSlice(f[F_BLOCK_TABLE], 0, k);
    tokens = PyList_GetSlice(f[F_TOKENS], 0, PyList_GET_SIZE(f[F_TOKENS]));
    chain = PyList_GetSlice(f[F_CHAIN], 0, PyList_GET_SIZE(f[F_CHAIN]));
    slot_o = PyLong_FromLongLong(slot);
    id_o = PyLong_FromUnsignedLongLong(seq_id);
    if (!table || !tokens || !chain || !slot_o || !id_o) goto out;
    PyObject *a[10] = {rid, tokens,    table,     slot_o, id_o,
                       f[F_POOL_UID], f[F_CACHED], s_running, chain, f[F_PUBLISHED]};
    seq = new_sequence(n, a, slot_o);
    if (seq) n->ops_done++;
    goto out;
abort:
    txn_abort(n);
    rc = rolled_back(n);
    if (rc == AGAIN) goto again;
    /* one transaction: a table the journal cannot hold is JournalFull */
    if (rc == JOURNAL_SHORT) rc = journal_full(n);
    seq = rc == UNHANDLED ? unhandled(n) : NULL;
out:
    drop_mutex(n); /* if waiting for a lock made the core take it */
    if (ids != ids_s) PyMem_Free(ids);
    for (int i = 0; i < 10; i++) Py_XDECREF(f[i]);
    Py_XDECREF(table);
    Py_XDECREF(tokens);
    Py_XDECREF(chain);
    Py_XDECREF(slot_o);
    Py_XDECREF(id_o);
    return seq;
}

/* -- before an operation that claims or releases a slot ---------------------------------------- */

/* The entry points that module.c binds for these operations: what comes before the operation
 * itself (recorded, where the handle records, by oplog.c's R_*), in the core's one call. */
static PyObject *R_end(Native *n, PyObject *const *args, Py_ssize_t nargs);
static PyObject *R_fork(Native *n, PyObject *const *args, Py_ssize_t nargs);
static PyObject *R_resume(Native *n, PyObject *const *args, Py_ssize_t nargs);

/* This process's slot reserve refilled (`claiming`) or trimmed where due (sequences.c
 * reserve_run), before an operation that claims or releases a slot, so that the operation
 * itself needs neither; not due: nothing (the common case, one test). OK or ERROR. */
static inline int reserve_before(Native *n, PyObject *const *args, Py_ssize_t nargs,
                                 int claiming) {
    if (nargs < 1 || !reserve_due(n, claiming)) return OK;
    if (unusable(n)) return ERROR;
    return reserve_run(n, args[0], claiming) < 0 ? ERROR : OK;
}

/* Sampled guard mode's draw for a sequence about to be claimed (allocate, resume), whatever
 * the call then does: the first, then one in guard_every (KVPool.guard_sample; 0 or 1: none,
 * guard mode guards every release). */
static inline int guard_draw(Native *n) {
    if (n->guard_every <= 1) return 0;
    return n->guard_tick++ % (uint64_t)n->guard_every == 0;
}

/* The sequence a draw picked, made: its slot in the guarded set (N_guarded reads it), whose
 * release guard mode guards, poisons and quarantines. OK or ERROR. */
static int guard_made(Native *n, PyObject *seq) {
    PyObject *slot = sfield(n, seq, F_SLOT);
    if (slot == NULL) return ERROR;
    int rc = PySet_Add(n->guarded, slot);
    Py_DECREF(slot);
    return rc ? ERROR : OK;
}

/* allocate(pool, tokens, request_id) -> Sequence (N_allocate). */
static PyObject *E_allocate(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    int guarded = guard_draw(n);
    if (reserve_before(n, args, nargs, 1)) return NULL;
    PyObject *seq = R_allocate(n, args, nargs);
    if (seq != NULL && guarded && guard_made(n, seq)) Py_CLEAR(seq);
    return seq;
}

/* end(pool, seq, final_state) -> True (N_end). */
static PyObject *E_end(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (reserve_before(n, args, nargs, 0)) return NULL;
    return R_end(n, args, nargs);
}

/* fork(pool, seq, request_id) -> Sequence (N_fork). */
static PyObject *E_fork(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (reserve_before(n, args, nargs, 1)) return NULL;
    return R_fork(n, args, nargs);
}

/* resume(pool, seq) -> cached tokens (preempt.c N_resume). */
static PyObject *E_resume(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    int guarded = guard_draw(n);
    if (reserve_before(n, args, nargs, 1)) return NULL;
    PyObject *cached = R_resume(n, args, nargs);
    if (cached != NULL && guarded && guard_made(n, args[1])) Py_CLEAR(cached);
    return cached;
}

/* guard_sample(every): sampled guard mode guards one allocation in `every` (KVPool.
 * guard_sample), drawn at each allocate and resume from here on. */
static PyObject *N_guard_sample(Native *n, PyObject *arg) {
    long long every = PyLong_AsLongLong(arg);
    if (every == -1 && PyErr_Occurred()) return NULL;
    n->guard_every = every;
    Py_RETURN_NONE;
}
