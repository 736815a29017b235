/* The Native type: its construction from the pool's layout, its methods, the module.
 * Part of _native.c. */

/* -- the type --------------------------------------------------------------------------------- */

static int get_size(PyObject *d, const char *key, int64_t *out) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "native layout needs %s", key);
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    return PyErr_Occurred() ? -1 : 0;
}

/* An 8-byte word shared with Python (an array('q')). */
static int word_of(PyObject *obj, Py_buffer *view, int64_t **out) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) return -1;
    if (view->len < 8) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "expected an 8-byte writable buffer");
        return -1;
    }
    *out = view->buf;
    return 0;
}

/* Native(segment_buffer, fd, layout: dict): the layout dict (native.py core_for) names what
 * depends on the pool (its geometry, its sections' offsets, this handle's client, pid and name,
 * the KV data) and the Python objects the core shares; the records' field offsets and sizes are
 * layout.h's. */
static int N_init(Native *n, PyObject *args, PyObject *kw) {
    PyObject *bufobj, *d;
    int fd;
    if (!PyArg_ParseTuple(args, "OiO!", &bufobj, &fd, &PyDict_Type, &d)) return -1;
    /* Integers, each read as int64 and stored at its field's width. */
    enum { I64, SIZE, INT, I32, U32, U64 };
    struct {
        const char *key;
        void *dst;
        int kind;
    } ints[] = {
        {"num_blocks", &n->nb, I64},          {"block_size", &n->bs, I64},
        {"record_size", &n->rec, I64},        {"max_seqs", &n->max_seqs, I64},
        {"seq_record_size", &n->seq_rec, I64}, {"max_blocks_per_seq", &n->max_bps, I64},
        {"index_width", &n->index_w, I64},    {"num_shards", &n->num_shards, I64},
        {"local_cap", &n->local_cap, I64},    {"local_max", &n->local_max, I64},
        {"slot_batch", &n->slot_batch, I64},  {"uid", &n->uid, I64},
        {"quarantine", &n->quarantine, I64},
        {"off_blocks", &n->off_blocks, SIZE}, {"off_ring", &n->off_ring, SIZE},
        {"off_index", &n->off_index, SIZE},   {"off_seqs", &n->off_seqs, SIZE},
        {"off_locks", &n->off_locks, SIZE},   {"off_lru", &n->off_lru, SIZE},
        {"client", &n->client, INT},
        {"lock_free", &n->lock_free, INT},    {"lock_shard0", &n->lock_shard0, INT},
        {"lock_seqs", &n->lock_seqs, INT},
        {"num_locks", &n->num_locks, INT},    {"pid", &n->pid, I32},
        {"start", &n->start, U64},
        {"off_events", &n->off_ev, SIZE},
        {"event_capacity", &n->ev_cap, U64},
        {"max_clients", &n->max_clients, I64},
        {"kv_rows", &n->kv_rows, I64},        {"kv_row_stride", &n->kv_row_stride, I64},
        {"kv_block_stride", &n->kv_block_stride, I64},
        {"kv_slot_bytes", &n->kv_slot_bytes, I64}, {"kv_spb", &n->kv_spb, I64},
        {"kv_esize", &n->kv_esize, I64},      {"canary", &n->canary, U64},
        {"nan_bits", &n->nan_bits, U64},      {"poison_ok", &n->poison_ok, I64},
        {"off_kv_digest", &n->off_kv_digest, I64},
        {"off_clients", &n->off_clients, SIZE},
        {"off_leases", &n->off_leases, SIZE}, {"lease_records", &n->lease_records, SIZE},
        {"lease_record_size", &n->lease_rec, I64},
        {"off_provenance", &n->off_prov, SIZE}, {"provenance_records", &n->prov_records, SIZE},
        {"lease_capacity", &n->lease_cap, I64},
    };
    int64_t kv_ptr;
    if (get_size(d, "kv_ptr", &kv_ptr)) return -1;
    n->kv = (uint8_t *)(uintptr_t)kv_ptr;
    for (size_t i = 0; i < sizeof ints / sizeof *ints; i++) {
        int64_t v;
        if (get_size(d, ints[i].key, &v)) return -1;
        switch (ints[i].kind) {
        case I64: *(int64_t *)ints[i].dst = v; break;
        case SIZE: *(size_t *)ints[i].dst = (size_t)v; break;
        case INT: *(int *)ints[i].dst = (int)v; break;
        case I32: *(int32_t *)ints[i].dst = (int32_t)v; break;
        case U32: *(uint32_t *)ints[i].dst = (uint32_t)v; break;
        case U64: *(uint64_t *)ints[i].dst = (uint64_t)v; break;
        }
    }
    /* The records' fixed offsets and sizes are layout.h's (records.py); this client's record
     * and its event ring are where the pool's sections put them. */
    size_t cbase = n->off_clients + (size_t)n->client * CLIENT_SIZE;
    n->c_seq = cbase + CF_SEQ;
    n->c_local_count = cbase + CF_LOCAL_COUNT;
    n->c_local = cbase + CF_LOCAL;
    n->c_jcount = cbase + CF_JOURNAL_COUNT;
    n->c_jused = cbase + CF_JOURNAL_USED;
    n->c_journal = cbase + CF_JOURNAL;
    n->c_jdata = cbase + CF_JOURNAL_DATA;
    n->c_counters = cbase + CF_COUNTERS;
    n->c_wait = cbase + CF_OP;
    n->c_event_head = cbase + CF_EVENT_HEAD;
    n->off_ev += (size_t)n->client * n->ev_cap * EV_SIZE;
    n->hdr_len = HDR_CHECKSUM + 8; /* the header's bytes up to and with its checksum */
    if (n->num_locks > MAX_LOCKS || n->local_cap > LOCAL_CACHE_MAX || n->bs > 4096 || n->bs < 1) {
        PyErr_SetString(PyExc_ValueError, "geometry outside the native core's limits");
        return -1;
    }
    if (n->kv_esize != 1 && n->kv_esize != 2 && n->kv_esize != 4 && n->kv_esize != 8) {
        PyErr_SetString(PyExc_ValueError, "KV elements of 1, 2, 4 or 8 bytes");
        return -1;
    }
    /* Python objects the core shares with the handle (new references). */
    PyObject **objs[] = {&n->mutex,     &n->seq_type,
                         &n->seq_fields, &n->faults_armed, &n->fault_fired,
                         &n->kv_dirs,   &n->write_past,
                         &n->kv_obj, &n->msg_unwritten, &n->name};
    const char *names[] = {"mutex",        "seq_type",
                           "seq_fields", "faults_armed", "fault_fired",
                           "kvscope_dirs", "write_past",
                           "kv_tensor", "unwritten_message", "name"};
    for (size_t i = 0; i < sizeof objs / sizeof *objs; i++) {
        PyObject *o = PyDict_GetItemString(d, names[i]);
        if (o == NULL) {
            PyErr_Format(PyExc_KeyError, "native core needs %s", names[i]);
            return -1;
        }
        *objs[i] = Py_NewRef(o);
    }
    /* the slot reserve (sequences.c): at most twice a batch */
    if (n->slot_batch < 0 || n->slot_batch > CHUNK ||
        (n->res = PyMem_Malloc(sizeof(int32_t) * (size_t)(2 * n->slot_batch + 1))) == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    if (!PyTuple_Check(n->seq_fields) || PyTuple_GET_SIZE(n->seq_fields) != 10 ||
        !PyType_Check(n->seq_type)) {
        PyErr_SetString(PyExc_TypeError, "seq_type must be a class of 10 fields");
        return -1;
    }
    /* the handle's live sequences and guarded slots: the core's own (sequences.c) */
    Py_XSETREF(n->seqs, PyDict_New());
    Py_XSETREF(n->guarded, PySet_New(NULL));
    Py_XSETREF(n->ended_used, PySet_New(NULL));
    if (n->seqs == NULL || n->guarded == NULL || n->ended_used == NULL) return -1;
    if (faults_init(n, d)) return -1;
    PyObject *coefs = PyDict_GetItemString(d, "coefs");
    if (!coefs || !PyList_Check(coefs)) {
        PyErr_SetString(PyExc_KeyError, "native core needs coefs (a list)");
        return -1;
    }
    PyObject *overdue = PyDict_GetItemString(d, "overdue");
    if (!overdue) {
        PyErr_SetString(PyExc_KeyError, "native core needs overdue");
        return -1;
    }
    if (word_of(overdue, &n->overdue_buf, &n->overdue)) return -1;
    PyObject *pbits = PyDict_GetItemString(d, "probe_bits");
    if (!pbits || !PyTuple_Check(n->kv_dirs)) {
        PyErr_SetString(PyExc_KeyError, "native core needs probe_bits and kvscope_dirs (a tuple)");
        return -1;
    }
    if (word_of(pbits, &n->probe_bits_buf, &n->probe_bits)) return -1;
    PyObject *classes = PyDict_GetItemString(d, "lock_classes");
    if (!classes || !PyTuple_Check(classes) || PyTuple_GET_SIZE(classes) != n->num_locks) {
        PyErr_SetString(PyExc_KeyError, "native core needs lock_classes (a tuple)");
        return -1;
    }
    for (int i = 0; i < n->num_locks; i++) {
        PyObject *ci = PyTuple_GET_ITEM(classes, i);
        if (ci == Py_None) continue;
        n->traced |= lock_bit(i);
        for (int j = 0; j < n->num_locks; j++) {
            PyObject *cj = PyTuple_GET_ITEM(classes, j);
            int eq = cj != Py_None ? PyObject_RichCompareBool(ci, cj, Py_EQ) : 0;
            if (eq < 0) return -1;
            if (eq) n->same_class[i] |= lock_bit(j);
        }
    }
    if (PyObject_GetBuffer(bufobj, &n->buf, PyBUF_WRITABLE) < 0) return -1;
    n->seg = n->buf.buf;
    n->fd = fd;
    if (PyList_GET_SIZE(coefs) < n->bs) {
        PyErr_SetString(PyExc_ValueError, "need one chain coefficient per token of a block");
        return -1;
    }
    n->coefs = PyMem_Malloc(sizeof(uint64_t) * (size_t)n->bs);
    if (!n->coefs) {
        PyErr_NoMemory();
        return -1;
    }
    for (int64_t i = 0; i < n->bs; i++)
        n->coefs[i] = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(coefs, i));
    if (PyErr_Occurred()) return -1;
    n->pend_scan_n = -1;
    PyObject *tdict = ((PyTypeObject *)n->seq_type)->tp_dict;
    for (int i = 0; i < 10; i++) {
        PyObject *desc = PyDict_GetItemWithError(tdict, PyTuple_GET_ITEM(n->seq_fields, i));
        if (desc == NULL || !Py_IS_TYPE(desc, &PyMemberDescr_Type) ||
            ((PyMemberDescrObject *)desc)->d_member->type != T_OBJECT_EX) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "Sequence must be a dataclass with __slots__");
            return -1;
        }
        n->seq_off[i] = ((PyMemberDescrObject *)desc)->d_member->offset;
    }
    n->fork_gen = fork_gen;
    return probes_init(n, d);
}

static void N_dealloc(Native *n) {
    oplog_free(n);
    if (n->seg) PyBuffer_Release(&n->buf);
    if (n->overdue) PyBuffer_Release(&n->overdue_buf);
    if (n->crash) PyBuffer_Release(&n->crash_buf);
    if (n->probe_bits) PyBuffer_Release(&n->probe_bits_buf);
    site_cache_clear(n);
    Py_XDECREF(n->kv_dirs);
    Py_XDECREF(n->fault_fired);
    Py_XDECREF(n->write_past);
    Py_XDECREF(n->guarded);
    Py_XDECREF(n->ended_used);
    Py_XDECREF(n->name);
    Py_XDECREF(n->kv_obj);
    dev_free(n->dev);
    PyMem_Free(n->checked);
    PyMem_Free(n->refs);
    PyMem_Free(n->refs_stamp);
    PyMem_Free(n->reported);
    PyMem_Free(n->leak);
    findings_drop(n);
    PyMem_Free(n->pend);
    Py_XDECREF(n->found);
    Py_XDECREF(n->msg_canary);
    Py_XDECREF(n->msg_poison);
    Py_XDECREF(n->msg_modified);
    Py_XDECREF(n->msg_blank);
    Py_XDECREF(n->msg_unwritten);
    PyMem_Free(n->maybe_live);
    PyMem_Free(n->hdr_copy);
    PyMem_Free(n->in_maybe);
    PyMem_Free(n->seen_seq);
    PyMem_Free(n->maybe_foreign);
    PyMem_Free(n->own_refs);
    PyMem_Free(n->own_log);
    PyMem_Free(n->kvs_sums);
    PyMem_Free(n->kvs_ids);
    PyMem_Free(n->kvs_gen);
    PyMem_Free(n->prov_rh);
    PyMem_Free(n->pre_slots);
    PyMem_Free(n->res);
    Py_XDECREF(n->mutex);
    Py_XDECREF(n->seq_type);
    Py_XDECREF(n->seq_fields);
    Py_XDECREF(n->seqs);
    Py_XDECREF(n->faults_armed);
    PyMem_Free(n->poison_ids);
    PyMem_Free(n->evicted_ids);
    lru_drop_pending(n);
    PyMem_Free(n->scan_buf);
    PyMem_Free(n->coefs);
    Py_TYPE(n)->tp_free((PyObject *)n);
}

/* close(): let go of the mapping (the pool is about to unmap it). */
static PyObject *N_close(Native *n, PyObject *unused) {
    oplog_free(n);
    if (n->seg) {
        PyBuffer_Release(&n->buf);
        n->seg = NULL;
    }
    n->kv = NULL;
    Py_CLEAR(n->kv_obj);
    dev_free(n->dev);
    n->dev = NULL;
    n->checks_unnamed = 0;
    Py_RETURN_NONE;
}

/* stats(): this handle's core's counts (see the method table). */
static PyObject *N_stats(Native *n, PyObject *unused) {
    return Py_BuildValue("{sKsKsKsO}", "native_ops", (unsigned long long)n->ops_done,
                         "unhandled", (unsigned long long)n->unhandled, "evictions",
                         (unsigned long long)n->evicted, "kv_direct",
                         n->kv ? Py_True : Py_False);
}

static PyObject *N_set_crash_at(Native *n, PyObject *arg) {
    n->crash_at = PyLong_AsLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef N_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))E_allocate, METH_FASTCALL,
     "allocate(pool, tokens, request_id) -> Sequence"},
    {"end", (PyCFunction)(void (*)(void))E_end, METH_FASTCALL,
     "end(pool, seq, final_state) -> True: free or abort"},
    {"append", (PyCFunction)(void (*)(void))R_append, METH_FASTCALL,
     "append(pool, seq, tokens) -> copies: the copy-on-write (src, dst) pairs"},
    {"mark_computed", (PyCFunction)(void (*)(void))R_mark_computed, METH_FASTCALL,
     "mark_computed(pool, seq, num_tokens) -> int: the blocks published"},
    {"fork", (PyCFunction)(void (*)(void))E_fork, METH_FASTCALL,
     "fork(pool, seq, request_id) -> Sequence"},
    {"verify_often", (PyCFunction)N_verify_often, METH_O,
     "verify_often(pool): the magic probe's periodic check, on the core's clock"},
    {"verify", (PyCFunction)N_verify, METH_O,
     "verify(pool) -> ([int], bool): pool.verify()'s check at once (the header; with the "
     "leaks probe conservation; in guard mode, where the core maps the K/V, every canary): the "
     "ring positions of the findings written, and whether it scanned the canaries"},
    {"first_report", (PyCFunction)(void (*)(void))N_first_report, METH_FASTCALL,
     "first_report(kind, block) -> bool | None: whether a finding the core counts is new "
     "(once per block); None for a kind it does not count"},
    {"report", (PyCFunction)(void (*)(void))R_report, METH_FASTCALL,
     "report(kind, severity, block, owner_pid, site, request, message) -> int: a finding "
     "written into the segment's findings ring (its position)"},
    {"live", (PyCFunction)N_live, METH_NOARGS,
     "live() -> {slot: Sequence}: the handle's live sequences (a copy)"},
    {"guard_sample", (PyCFunction)N_guard_sample, METH_O,
     "guard_sample(every): one allocation in `every` guarded, drawn at allocate and resume"},
    {"guarded", (PyCFunction)N_guarded, METH_O,
     "guarded(slot) -> bool: whether sampled guard mode guards that slot's release"},
    {"audit_table", (PyCFunction)(void (*)(void))N_audit_table, METH_FASTCALL,
     "audit_table(pool, table, rows, lengths, sentinel, expect) -> int: the block-table audit"},
    {"learn_edge", (PyCFunction)(void (*)(void))N_learn_edge, METH_FASTCALL,
     "learn_edge(src: str, dst: str, site: str) -> bool: lockdep's order edge added to the "
     "segment's graph (a cycle it closes reported); False when the graph is full"},
    {"held_here", (PyCFunction)N_held_here, METH_NOARGS,
     "held_here() -> int: the pool locks this thread holds (bit i: lock i), by their records"},
    {"close", (PyCFunction)N_close, METH_NOARGS, "release the segment buffer"},
    {"unwritten", (PyCFunction)(void (*)(void))N_unwritten, METH_FASTCALL,
     "unwritten(table, num_tokens, request): guard mode's check of a finished request"},
    {"digests", (PyCFunction)N_digests, METH_O,
     "digests(ids) -> list[int]: kernels/digest.py block_digests, computed here (CPU data)"},
    {"mark_computed_many", (PyCFunction)(void (*)(void))N_mark_computed_many, METH_FASTCALL,
     "mark_computed_many(pool, seqs, num_tokens) -> list[int]: mark_computed of each in turn, "
     "their checks queued as one"},
    {"stats", (PyCFunction)N_stats, METH_NOARGS,
     "stats() -> {native_ops: operations this handle's core completed, unhandled: cases it "
     "did not handle (each a RuntimeError), evictions: blocks its transactions evicted, "
     "kv_direct: whether it maps the K/V itself (a CPU pool)}"},
    {"device_checks", (PyCFunction)N_device_checks, METH_O,
     "device_checks(config | None): the core launches a CUDA pool's checks itself"},
    {"device_take", (PyCFunction)(void (*)(void))N_device_take, METH_FASTCALL,
     "device_take(pool, wait, most) -> int: the checks' answers that are in, applied (digests "
     "into the records, findings into the ring); how many wait still"},
    {"device_queue", (PyCFunction)(void (*)(void))N_device_queue, METH_FASTCALL,
     "device_queue(kind, ids, when): a check queued as the core's operations queue theirs "
     "(tests, benchmarks)"},
    {"device_test", (PyCFunction)(void (*)(void))N_device_test, METH_FASTCALL,
     "device_test(mode, block) -> int: one check launched here and waited for"},
    {"device_stats", (PyCFunction)N_device_stats, METH_NOARGS,
     "the core's own checks: waiting, unapplied, launched, events (recorded), broken (a "
     "CUresult) | None"},
    {"provenance", (PyCFunction)N_provenance, METH_O,
     "provenance(every): record one sequence's slots in `every` (0: none) and check hits"},
    {"provenance_check", (PyCFunction)(void (*)(void))N_provenance_check, METH_FASTCALL,
     "provenance_check(pool, rows) -> int: the blocks with a foreign slot (rows None: all)"},
    {"lease", (PyCFunction)(void (*)(void))N_lease, METH_FASTCALL,
     "lease(pool, target, mode, holder, timeout_ns[, deadline_ns]) -> (record, id): "
     "KVPool.lease"},
    {"lease_release", (PyCFunction)(void (*)(void))N_lease_release, METH_FASTCALL,
     "lease_release(pool, record, id) -> bool: a lease's transfer completed"},
    {"lease_expire", (PyCFunction)(void (*)(void))N_lease_expire, METH_FASTCALL,
     "lease_expire(pool, now_ns) -> int: leases past their deadline reported as leaks"},
    {"set_state", (PyCFunction)(void (*)(void))R_set_state, METH_FASTCALL,
     "set_state(pool, seq, state) -> True: mark a sequence running or waiting"},
    {"resume", (PyCFunction)(void (*)(void))E_resume, METH_FASTCALL,
     "resume(pool, seq) -> cached tokens: re-allocate a preempted sequence"},
    {"reclaim_dead", (PyCFunction)N_reclaim_dead, METH_O,
     "reclaim_dead(said_pids) -> (totals, done): every dead client's blocks returned"},
    {"reclaim_orphans", (PyCFunction)N_reclaim_orphans, METH_NOARGS,
     "reclaim_orphans() -> [{pid, client, request, blocks}]: live sequences no handle holds, ended"},
    {"reclaim_client", (PyCFunction)(void (*)(void))N_reclaim_client, METH_FASTCALL,
     "reclaim_client(client, pid, start, generation) -> dict | None: one dead client"},
    {"reclaim_for_attach", (PyCFunction)(void (*)(void))N_reclaim_for_attach, METH_FASTCALL,
     "reclaim_for_attach(pid, start, generation) -> dict | None: this handle's borrowed record"},
    {"flush_local", (PyCFunction)N_flush_local, METH_NOARGS,
     "flush_local(): this process's local cache to the free ring"},
    {"detach", (PyCFunction)N_detach, METH_O,
     "detach(pool): close's work (live sequences reported as leaks, local cache, slot reserve, "
     "counters, record detached)"},
    {"mark_repaired", (PyCFunction)(void (*)(void))N_mark_repaired, METH_FASTCALL,
     "mark_repaired(pids, kinds) -> [ring position]: findings a repair answered"},
    {"repair_leases", (PyCFunction)N_repair_leases, METH_NOARGS,
     "repair_leases() -> {ended, counts, header}: the lease section made to agree with itself"},
    {"evict", (PyCFunction)(void (*)(void))R_evict, METH_FASTCALL,
     "evict(pool, num_blocks) -> int: LRU cached blocks to the free ring"},
    {"adopt", (PyCFunction)N_adopt, METH_O,
     "adopt(seq): a restored segment's live sequence (its slot's) registered as this handle's"},
    {"adopt_reserve", (PyCFunction)(void (*)(void))N_adopt_reserve, METH_FASTCALL,
     "adopt_reserve(slots, next_id, end_id): a snapshot's slot reserve taken as this handle's"},
    {"reserve_state", (PyCFunction)N_reserve_state, METH_NOARGS,
     "reserve_state() -> (slots, next_id, end_id): this process's slot reserve (tests)"},
    {"oplog_open", (PyCFunction)(void (*)(void))N_oplog_open, METH_FASTCALL,
     "oplog_open(path, key, start_text, off_op_seq, tag): record every operation into the log "
     "file at path (docs/REPLAY.md)"},
    {"oplog_close", (PyCFunction)N_oplog_close, METH_NOARGS, "stop recording operations"},
    {"oplog_flush", (PyCFunction)N_oplog_flush, METH_NOARGS,
     "write the operation log's records composed so far"},
    {"oplog_snapshot", (PyCFunction)(void (*)(void))N_oplog_snapshot, METH_FASTCALL,
     "oplog_snapshot(state, expect) -> (seq, offset) | None: the pool's metadata as a SNAPSHOT "
     "record numbered expect + 1, where no number was taken since"},
    {"oplog_ring", (PyCFunction)(void (*)(void))N_oplog_ring, METH_FASTCALL,
     "oplog_ring(limit, checkpoint, base): bound the log, checkpoint() called past the limit"},
    {"oplog_punch", (PyCFunction)N_oplog_punch, METH_O,
     "oplog_punch(end) -> bool: the log file's bytes before end freed (a hole)"},
    {"oplog_store", (PyCFunction)(void (*)(void))N_oplog_store, METH_FASTCALL,
     "oplog_store(spans, slots, what, ref) -> int: a store check's input as a STORE record "
     "(docs/REPLAY.md; 0: not recording)"},
    {"oplog_copy", (PyCFunction)N_oplog_copy, METH_O,
     "oplog_copy(pairs) -> int: the blocks the program copied (int64 (src, dst) pairs) as a COPY "
     "record (docs/REPLAY.md; 0: not recording)"},
    {"store_check", (PyCFunction)(void (*)(void))N_store_check, METH_FASTCALL,
     "store_check(spans, slots, tables, site, what) -> int: a store check (probes/stores.py), "
     "its findings written into the ring (their count)"},
    {"set_crash_at", (PyCFunction)N_set_crash_at, METH_O,
     "tests: SIGKILL this process at the n-th journal save (0: off)"},
    {NULL}};

static PyTypeObject NativeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvscope.allocator._native.Native",
    .tp_basicsize = sizeof(Native),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The pool's operations on one client's view of a segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)N_init,
    .tp_dealloc = (destructor)N_dealloc,
    .tp_methods = N_methods,
};

/* fmix64(h) -> int: core.h's finalizer of h mod 2^64 (tests/test_hash_finalizer.py). */
static PyObject *M_fmix64(PyObject *mod, PyObject *arg) {
    uint64_t h = PyLong_AsUnsignedLongLongMask(arg);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(fmix64(h));
}

/* register_errors(PoolError, PoolExhausted, JournalFull, HandleInherited): the exception
 * classes the core raises (allocator/errors.py), handed over once by native.py. */
static PyObject *M_register_errors(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    int ok = nargs == 4 && PyType_Check(args[0]) &&
             PyType_IsSubtype((PyTypeObject *)args[0], (PyTypeObject *)PyExc_Exception);
    for (Py_ssize_t i = 1; ok && i < nargs; i++)
        ok = PyType_Check(args[i]) &&
             PyType_IsSubtype((PyTypeObject *)args[i], (PyTypeObject *)args[0]);
    if (!ok) {
        PyErr_SetString(PyExc_TypeError,
                        "register_errors(PoolError, PoolExhausted, JournalFull, HandleInherited): "
                        "exception classes, the others subclasses of the first");
        return NULL;
    }
    Py_XSETREF(PoolErrorType, Py_NewRef(args[0]));
    Py_XSETREF(PoolExhaustedType, Py_NewRef(args[1]));
    Py_XSETREF(JournalFullType, Py_NewRef(args[2]));
    Py_XSETREF(HandleInheritedType, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

/* A traced user lock's class and graph (M_traced_lock_*): the class as the graph stores it
 * (its first 16 bytes of UTF-8, NUL-padded), the graph a pool handle's uid or 0. */
static int traced_lock_args(PyObject *const *args, Py_ssize_t nargs, char cls[16],
                            int64_t *graph) {
    if (nargs != 2 || !PyUnicode_Check(args[0]) || !PyLong_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "(cls: str, graph: int)");
        return ERROR;
    }
    Py_ssize_t len;
    const char *text = PyUnicode_AsUTF8AndSize(args[0], &len);
    if (text == NULL) return ERROR;
    memset(cls, 0, 16);
    memcpy(cls, text, (size_t)(len < 16 ? len : 16));
    *graph = PyLong_AsLongLong(args[1]);
    return PyErr_Occurred() ? ERROR : OK;
}

/* traced_lock_taken(cls, graph): this thread holds a traced user lock now (probes.c
 * user_held_push): the core's transactions order their locks after it. */
static PyObject *M_traced_lock_taken(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    char cls[16];
    int64_t graph;
    if (traced_lock_args(args, nargs, cls, &graph) != OK) return NULL;
    user_held_push(cls, graph);
    Py_RETURN_NONE;
}

/* traced_lock_released(cls, graph): this thread let go of one (probes.c user_held_pop). */
static PyObject *M_traced_lock_released(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    char cls[16];
    int64_t graph;
    if (traced_lock_args(args, nargs, cls, &graph) != OK) return NULL;
    user_held_pop(cls, graph);
    Py_RETURN_NONE;
}

/* traced_locks_held() -> [(cls, graph)]: this thread's traced user locks, oldest first, as the
 * core keeps them (the ones past its limit left out). */
static PyObject *M_traced_locks_held(PyObject *mod, PyObject *unused) {
    PyObject *out = PyList_New(user_kept);
    for (int k = 0; out != NULL && k < user_kept; k++) {
        PyObject *t = Py_BuildValue("(s#L)", user_held[k].cls,
                                    (Py_ssize_t)strnlen(user_held[k].cls, 16),
                                    (long long)user_held[k].graph);
        if (t == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, k, t);
    }
    return out;
}

static PyMethodDef module_methods[] = {
    {"fmix64", (PyCFunction)M_fmix64, METH_O, "fmix64(h) -> int: the core's hash finalizer"},
    {"oplog_expand", (PyCFunction)M_oplog_expand, METH_O,
     "oplog_expand(data) -> (records, chunks, offsets, lists, heads): an operation log's "
     "records in OPLOG_FIELDS' layout, in pool and number order, each one's chunk offset and "
     "offset, its tokens and table as lists, and the fixed parts one after another"},
    {"register_errors", (PyCFunction)(void (*)(void))M_register_errors, METH_FASTCALL,
     "register_errors(PoolError, PoolExhausted, JournalFull, HandleInherited): the exception "
     "classes the core raises"},
    {"init_lock_mutexes", (PyCFunction)(void (*)(void))M_init_lock_mutexes, METH_FASTCALL,
     "init_lock_mutexes(records, count): a fresh segment's lock mutexes made (header.py)"},
    {"traced_lock_taken", (PyCFunction)(void (*)(void))M_traced_lock_taken, METH_FASTCALL,
     "traced_lock_taken(cls, graph): this thread took a traced user lock (lockdep.TracedLock)"},
    {"traced_lock_released", (PyCFunction)(void (*)(void))M_traced_lock_released, METH_FASTCALL,
     "traced_lock_released(cls, graph): this thread let go of one"},
    {"traced_locks_held", (PyCFunction)M_traced_locks_held, METH_NOARGS,
     "traced_locks_held() -> [(cls, graph)]: this thread's traced user locks, as the core sees"},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_native",
                                    "The pool's operations in C, its only writer (see allocator/native.py).",
                                    -1, module_methods};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&NativeType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL) return NULL;
    s_acquire = PyUnicode_InternFromString("acquire");
    s_release = PyUnicode_InternFromString("release");
    s_running = PyUnicode_InternFromString("running");
    s_finished = PyUnicode_InternFromString("finished");
    s_aborted = PyUnicode_InternFromString("aborted");
    s_waiting = PyUnicode_InternFromString("waiting");
    s_preempted = PyUnicode_InternFromString("preempted");
    pthread_atfork(NULL, NULL, atfork_child);
    Py_INCREF(&NativeType);
    if (PyModule_AddObject(m, "Native", (PyObject *)&NativeType) < 0) return NULL;
    if (PyModule_AddObject(m, "LAYOUT", layout_dict()) < 0) return NULL;
    return m;
}
