/* Crash recovery: dead lock holders, undo journals of dead processes, reclaiming what a dead
 * process held, and detaching a client (close). Part of _native.c.
 *
 * Any number of processes may recover and reclaim at once (survivors calling reclaim_dead(),
 * `kvscope check --repair`, an attach that finds the client table full). The list of dead
 * clients is taken without locks, so it can be stale by the time a reclaimer acts on it:
 * another reclaimer may have reclaimed a record, and a new process attached into it. So every
 * step of a reclaim runs under every pool lock and first re-verifies that the record still
 * belongs to the same dead process (still_dead: state, pid, start time, attach generation, and
 * the process gone); a step that finds otherwise writes nothing, and the reclaim of that
 * client ends. */

/* -- client records ---------------------------------------------------------------------------- */

static inline uint8_t *crec(Native *n, int64_t c) {
    return n->seg + n->off_clients + (size_t)c * (size_t)CLIENT_SIZE;
}

/* The offset in a client record of a field this handle knows by its absolute offset in its
 * own record (c_jcount, c_local, ...). */
static inline size_t cfield(Native *n, size_t own_at) {
    return own_at - (n->off_clients + (size_t)n->client * (size_t)CLIENT_SIZE);
}

/* process.is_alive: the process of this pid and start time still runs (a zombie is dead). */
static int proc_alive(int32_t pid, uint64_t start) {
    if (pid <= 0) return 0;
    char path[40], buf[2048];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t k = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (k <= 0) return 0;
    buf[k] = 0;
    /* The command name may hold spaces and parentheses: the fields start after the last ')'. */
    char *p = strrchr(buf, ')');
    if (p == NULL || p[1] == 0 || p[2] == 0) return 0;
    p += 2;
    if (*p == 'Z') return 0;
    if (start == 0) return 1;
    for (int i = 0; i < 19; i++) { /* the start time: field 22, the 20th after the state */
        p = strchr(p, ' ');
        if (p == NULL) return 0;
        p++;
    }
    return strtoull(p, NULL, 10) == start;
}

/* A dead client as found (recovery.py find_dead): its record and the identity of the dead
 * process attached in it then. */
typedef struct {
    int64_t client;
    int32_t pid;
    uint64_t start, generation; /* generation: the record's attached_ns */
    /* 1: not a dead process's record, a closed one's sequences (recovery.c reclaim_orphans):
     * a step acts while the record holds no process of that pid */
    int orphans;
} DeadRec;

static int dead_now(Native *n, int64_t c) {
    uint8_t *r = crec(n, c);
    return r[CF_STATE] == CL_ATTACHED &&
           !proc_alive(I4(r + CF_PID), U8(r + CF_START));
}

/* The record still holds this same process, attached, and it is gone. */
static int still_dead(Native *n, const DeadRec *d) {
    uint8_t *r = crec(n, d->client);
    return r[CF_STATE] == CL_ATTACHED && I4(r + CF_PID) == d->pid &&
           U8(r + CF_START) == d->start && U8(r + CF_ATTACHED_NS) == d->generation &&
           !proc_alive(d->pid, d->start);
}

/* Record c is attached with process `pid` in it. */
static int holds_pid(Native *n, int64_t c, int32_t pid) {
    const uint8_t *r = crec(n, c);
    return r[CF_STATE] == CL_ATTACHED && I4(r + CF_PID) == pid;
}

/* Sequence slot s is live and no handle holds it: its owner's record is attached with no
 * process of its owner pid (the process closed its handle, or detached, without ending it;
 * a record reused since holds another process). One its own process attached again into the
 * same record is not told apart from that handle's own: it is left. */
static int orphaned(Native *n, int64_t s) {
    const uint8_t *r = seqrec(n, s);
    int32_t c = I4(r + SF_OWNER_CLIENT);
    return r[SF_STATE] != S_EMPTY && c >= 0 && c < n->max_clients &&
           !holds_pid(n, c, I4(r + SF_OWNER_PID));
}

/* What a reclaim step is for still holds, under every lock: the dead process is still in its
 * record, or (reclaiming orphans) no process of the sequences' owner pid is in it. */
static int still_reclaimable(Native *n, const DeadRec *d) {
    return d->orphans ? !holds_pid(n, d->client, d->pid) : still_dead(n, d);
}

static DeadRec dead_rec(Native *n, int64_t c) {
    uint8_t *r = crec(n, c);
    DeadRec d = {c, I4(r + CF_PID), U8(r + CF_START), U8(r + CF_ATTACHED_NS)};
    return d;
}

/* -- undo journals ------------------------------------------------------------------------------ */

/* Journal.problem: why client c's journal cannot be rolled back safely (a count past its
 * capacity, an entry outside the segment or over the sealed header, saved bytes past its
 * data), a new str; NULL when it can (or with an exception set). */
static PyObject *journal_problem(Native *n, int64_t c, int *error) {
    uint8_t *r = crec(n, c);
    uint32_t cnt = U4(r + cfield(n, n->c_jcount)), used = U4(r + cfield(n, n->c_jused));
    PyObject *why = NULL;
    *error = 0;
    if (cnt > JOURNAL_ENTRIES)
        why = PyUnicode_FromFormat("it claims %u entries, it holds at most %u", cnt,
                                   (unsigned)JOURNAL_ENTRIES);
    else if (used > JOURNAL_BYTES)
        why = PyUnicode_FromFormat("it claims %u saved bytes, it holds at most %u", used,
                                   (unsigned)JOURNAL_BYTES);
    else {
        uint64_t size = (uint64_t)n->buf.len;
        for (uint32_t i = 0; i < cnt && why == NULL; i++) {
            uint8_t *e = r + cfield(n, n->c_journal) + (size_t)i * JENTRY;
            uint64_t off = U8(e + JE_OFFSET), len = U4(e + JE_LENGTH), d = U4(e + JE_DATA_OFF);
            if (off > size || len > size - off) {
                /* (the end in Python's arithmetic: past 2**64 too) */
                PyObject *a = PyLong_FromUnsignedLongLong(off), *b = PyLong_FromUnsignedLongLong(len);
                PyObject *end = a && b ? PyNumber_Add(a, b) : NULL;
                if (end)
                    why = PyUnicode_FromFormat(
                        "entry %u restores bytes [%llu, %S) outside the %llu-byte segment", i,
                        (unsigned long long)off, end, (unsigned long long)size);
                Py_XDECREF(a);
                Py_XDECREF(b);
                Py_XDECREF(end);
                if (why == NULL) break;
            } else if (off < (uint64_t)n->hdr_len)
                why = PyUnicode_FromFormat("entry %u restores bytes at %llu, inside the sealed header",
                                           i, (unsigned long long)off);
            else if (d + len > used)
                why = PyUnicode_FromFormat(
                    "entry %u's saved bytes [%llu, %llu) run past the journal's %u bytes", i,
                    (unsigned long long)d, (unsigned long long)(d + len), used);
        }
    }
    if (why == NULL && PyErr_Occurred()) *error = 1;
    return why;
}

/* Journal.rollback of client c's journal: every saved range restored, newest first, unless
 * journal_problem rejects it (*why: the reason, a new str; its writes then stand, and a check
 * reports what they left); either way the journal is cleared. The entries restored, or -1
 * with an exception set. */
static int64_t journal_rollback(Native *n, int64_t c, PyObject **why) {
    int error;
    *why = journal_problem(n, c, &error);
    if (error) return -1;
    uint32_t cnt = *why ? 0 : U4(crec(n, c) + cfield(n, n->c_jcount));
    /* (this handle's own tables rolled back outside a transaction of its own: the leaks
     * probe's count of them is taken again, sequences.c own_note) */
    if (c == n->client) n->own_valid = 0;
    jundo(n, (ptrdiff_t)(c - n->client) * (ptrdiff_t)CLIENT_SIZE, cnt);
    return cnt;
}

/* -- dead lock holders -------------------------------------------------------------------------- */

/* Every lock, in order (the world stopped): a dead holder met is forgotten and written to
 * dead[i] (pid 0: none). The op mutex is taken first, holding no lock (a wait for one then
 * needs nothing more). OK, or ERROR with an exception set and nothing held: a dead holder met
 * is named in its record again, for the next taker to recover. The caller holds no lock. */
static int stop_world(Native *n, Holder *dead) {
    for (int i = 0; i < n->num_locks; i++) dead[i].pid = 0;
    if (hold_mutex(n) != OK) return ERROR;
    for (int i = 0; i < n->num_locks; i++) {
        if (lock_take_as(n, i, &dead[i]) == OK) continue;
        for (int j = i - 1; j >= 0; j--) {
            if (!dead[j].pid) {
                lock_drop(n, j);
                continue;
            }
            uint8_t *r = n->seg + n->off_locks + (size_t)j * LOCK_SIZE;
            I4(r + LF_HOLDER_PID) = dead[j].pid;
            I4(r + LF_HOLDER_CLIENT) = dead[j].client;
            pthread_mutex_unlock(lock_mutex(n, j));
            n->held &= ~lock_bit(j);
        }
        return ERROR;
    }
    return OK;
}

/* The name of pool lock i (layout.lock_names). */
static void lock_name(Native *n, int i, char *out, size_t cap) {
    if (i == n->lock_seqs)
        snprintf(out, cap, "seqs");
    else if (i >= n->lock_shard0 && i < n->lock_shard0 + n->num_shards)
        snprintf(out, cap, "index.%d", i - n->lock_shard0);
    else if (i == n->lock_free)
        snprintf(out, cap, "free");
    else if (i == n->lock_findings)
        snprintf(out, cap, "findings");
    else
        snprintf(out, cap, "sites");
}

/* With the world stopped, after stop_world met the dead holders `dead`: roll back the journal
 * of every dead client (those named as holders while their record still shows them, and every
 * attached record whose process is gone), this handle's own aside (unless its record is
 * borrowed: then the journal is its dead owner's), and write a `lock_dead_holder` finding per
 * lock a dead process held. `recovered`, when not NULL, gets {pid, entries, skipped} per
 * journal rolled back. OK or ERROR. */
static int recover_stopped(Native *n, const Holder *dead, PyObject *recovered) {
    int64_t me = n->borrowed ? -1 : n->client;
    uint8_t *roll = PyMem_Calloc((size_t)n->max_clients, 1);
    if (roll == NULL) {
        PyErr_NoMemory();
        return ERROR;
    }
    for (int i = 0; i < n->num_locks; i++) {
        int64_t c = dead[i].client;
        /* (only while the record still shows the dead holder: attached, its pid) */
        if (dead[i].pid && c >= 0 && c < n->max_clients && I4(crec(n, c) + CF_PID) == dead[i].pid &&
            crec(n, c)[CF_STATE] == CL_ATTACHED)
            roll[c] = 1;
    }
    for (int64_t c = 0; c < n->max_clients; c++)
        if (!roll[c] && dead_now(n, c)) roll[c] = 1;
    int rc = OK;
    for (int64_t c = 0; c < n->max_clients && rc == OK; c++) {
        if (!roll[c] || c == me || U4(crec(n, c) + cfield(n, n->c_jcount)) == 0) continue;
        PyObject *why;
        int64_t k = journal_rollback(n, c, &why);
        if (k < 0) {
            rc = ERROR;
            break;
        }
        if (recovered != NULL &&
            append_new(recovered, Py_BuildValue("{sisLsN}", "pid", (int)I4(crec(n, c) + CF_PID),
                                                "entries", (long long)k, "skipped",
                                                why ? why : Py_NewRef(Py_None))))
            rc = ERROR;
        else if (recovered == NULL)
            Py_XDECREF(why);
    }
    PyMem_Free(roll);
    for (int i = 0; i < n->num_locks && rc == OK; i++) {
        if (!dead[i].pid) continue;
        char name[32], text[160];
        lock_name(n, i, name, sizeof name);
        int len = snprintf(text, sizeof text,
                           "pid %d died holding pool lock '%s'; its unfinished operation was "
                           "rolled back",
                           (int)dead[i].pid, name);
        Seen s = {.block = -1, .owner_pid = dead[i].pid, .site = -1};
        rc = finding_write(n, FK_LOCK_DEAD_HOLDER, &s, text, len);
    }
    return rc;
}

/* Recover the locks dead processes held: stop the world, recover_stopped, let go. OK, or
 * ERROR with an exception set. */
static int recover_holders(Native *n, PyObject *recovered) {
    Holder dead[MAX_LOCKS];
    int rc = stop_world(n, dead);
    if (rc != OK) return rc;
    rc = recover_stopped(n, dead, recovered);
    release_all(n);
    return rc;
}

/* A journal this client left open, met by txn_begin: an operation that never finished (the
 * core rolls back every transaction it does not commit; bytes a crash left in the record) is
 * rolled back with the world stopped, newest first, or, where journal_problem rejects it,
 * cleared with its writes standing (a check reports what they left); the dead holders met on
 * the way are recovered as recover_holders does. OK, or ERROR with an exception set. */
static int recover_own_journal(Native *n) {
    Holder dead[MAX_LOCKS];
    int rc = stop_world(n, dead);
    if (rc != OK) return rc;
    client_seq_bump(n);
    rc = recover_stopped(n, dead, NULL);
    PyObject *why = NULL;
    if (rc == OK && journal_rollback(n, n->client, &why) < 0) rc = ERROR;
    Py_XDECREF(why);
    release_all(n);
    client_seq_bump(n);
    return rc;
}

/* -- reclaiming a dead client, step by step ------------------------------------------------------ */

/* A step found its record no longer the dead process's: it wrote nothing. */
#define GONE 3

/* A step: fn(n, d, arg) writes its answer into *arg (each step's own struct). */
typedef int (*StepFn)(Native *n, const DeadRec *d, void *arg);

/* One step of a reclaim: fn in a transaction of its own under every lock (a dead holder met
 * on the way is recovered first), once the record still holds the dead process `d`. OK,
 * GONE, UNHANDLED (a step outgrowing the journal), ERROR. */
static int reclaim_step(Native *n, const DeadRec *d, StepFn fn, void *arg) {
    Holder dead[MAX_LOCKS];
    client_seq_bump(n);
    int rc = stop_world(n, dead);
    if (rc != OK) {
        client_seq_bump(n);
        return rc;
    }
    int met = 0;
    for (int i = 0; i < n->num_locks; i++) met |= dead[i].pid != 0;
    if (met) rc = recover_stopped(n, dead, NULL);
    if (rc == OK && !still_reclaimable(n, d)) rc = GONE;
    if (rc == OK) {
        /* (a borrowed record's journal is its dead owner's until the first step) */
        n->jcount = U4(n->seg + n->c_jcount);
        n->jused = U4(n->seg + n->c_jused);
        rc = fn(n, d, arg);
        if (rc == OK)
            jcommit(n);
        else
            jrollback(n);
        n->own_n = 0; /* (a dead client's tables: sequences.c own_follows counts none) */
    }
    n->jcount = n->jused = 0;
    release_all(n);
    client_seq_bump(n);
    return rc;
}

/* Blocks a step drops or frees, a transaction's worth: each record is saved twice (its
 * drop, its reset into the ring), within the undo journal's bytes. */
static int64_t step_blocks(Native *n, int64_t most, int saves) {
    int64_t fit = ((int64_t)JOURNAL_BYTES - 16384) / (saves * n->rec);
    return fit < 1 ? 1 : fit < most ? fit : most;
}

/* Step: roll back the dead client's journal: the entries restored, and why it was skipped
 * (Journal.problem's words, a new str) or NULL. */
typedef struct {
    int64_t entries;
    PyObject *skipped;
} Rolled;

static int step_rollback(Native *n, const DeadRec *d, void *arg) {
    Rolled *out = arg;
    if (U4(crec(n, d->client) + cfield(n, n->c_jcount)) == 0) return OK;
    out->entries = journal_rollback(n, d->client, &out->skipped);
    return out->entries < 0 ? ERROR : OK;
}

/* Step: drop the last blocks of sequence `slot` (a transaction's worth), releasing the slot
 * after the last: the blocks freed (-1: the slot is no longer that process's), and whether
 * the slot is released (or was not its to release). */
typedef struct {
    int64_t slot, freed;
    int released;
} Tail;

static int step_drop_tail(Native *n, const DeadRec *d, void *arg) {
    Tail *out = arg;
    int64_t slot = out->slot;
    uint8_t *s = seqrec(n, slot);
    if (s[SF_STATE] == S_EMPTY || I4(s + SF_OWNER_CLIENT) != d->client ||
        I4(s + SF_OWNER_PID) != d->pid) {
        out->freed = -1;
        out->released = 1;
        return OK;
    }
    int64_t k = U4(s + SF_NUM_BLOCKS), chunk = step_blocks(n, CHUNK, 2);
    if (k > n->max_bps) k = n->max_bps;
    int64_t keep = k > chunk ? k - chunk : 0, m = 0, nz = 0;
    int32_t ids[CHUNK], zero[CHUNK];
    const int32_t *table = (const int32_t *)(s + SF_TABLE);
    for (int64_t i = keep; i < k; i++) /* (an id outside the pool is no block to drop) */
        if (table[i] >= 0 && table[i] < n->nb) ids[m++] = table[i];
    if (drop_refs(n, ids, m, wall_ns(), zero, &nz) || ring_push(n, zero, nz) ||
        write_blocks(n, slot, keep, NULL, 0))
        return UNHANDLED;
    if (keep == 0) { /* the slot back to the table: no reserve of ours holds it */
        if (jsave_head(n, slot)) return UNHANDLED;
        s[SF_RESERVED] = 0;
        s[SF_STATE] = S_EMPTY;
        U4(s + SF_NUM_BLOCKS) = 0;
    }
    out->freed = nz;
    out->released = keep == 0;
    return OK;
}

/* Step: return a transaction's worth (`most`) of the dead client's cached and stray private
 * blocks (LOCAL, or ALLOCATED and unpublished, owned by it) that no live sequence maps, lowest
 * ids first (`freed` of them); once fewer are left, its local cache is emptied. */
typedef struct {
    int64_t freed, most;
} Owned;

static int step_free_owned(Native *n, const DeadRec *d, void *arg) {
    Owned *out = arg;
    int64_t most = out->most = step_blocks(n, 2 * CHUNK, 1);
    uint8_t *r = crec(n, d->client);
    uint8_t *pick = PyMem_Calloc((size_t)n->nb, 2);
    int32_t *ids = PyMem_Malloc(sizeof(int32_t) * (size_t)most);
    if (pick == NULL || ids == NULL) {
        PyMem_Free(pick);
        PyMem_Free(ids);
        PyErr_NoMemory();
        return ERROR;
    }
    uint8_t *mapped = pick + n->nb;
    uint32_t lc = U4(r + CF_LOCAL_COUNT);
    const int32_t *loc = (const int32_t *)(r + cfield(n, n->c_local));
    for (uint32_t i = 0; i < lc && i < LOCAL_CACHE_MAX; i++)
        if (loc[i] >= 0 && loc[i] < n->nb) pick[loc[i]] = 1;
    for (int64_t b = 0; b < n->nb; b++) {
        uint8_t *br = blk(n, b);
        if (I4(br + BF_OWNER_CLIENT) == d->client &&
            (br[BF_STATE] == B_LOCAL || (br[BF_STATE] == B_ALLOCATED && br[BF_INDEXED] == 0)))
            pick[b] = 1;
    }
    /* (ids of dead owners that a live sequence still maps stay) */
    for (int64_t sl = 0; sl < n->max_seqs; sl++) {
        uint8_t *s = seqrec(n, sl);
        if (s[SF_STATE] == S_EMPTY) continue;
        int64_t k = U4(s + SF_NUM_BLOCKS);
        const int32_t *t = (const int32_t *)(s + SF_TABLE);
        for (int64_t i = 0; i < k && i < n->max_bps; i++)
            if (t[i] >= 0 && t[i] < n->nb) mapped[t[i]] = 1;
    }
    int64_t m = 0;
    for (int64_t b = 0; b < n->nb && m < most; b++)
        if (pick[b] && !mapped[b]) ids[m++] = (int32_t)b;
    PyMem_Free(pick);
    int rc = ring_push(n, ids, m);
    PyMem_Free(ids);
    if (rc) return UNHANDLED;
    if (m < most) {
        /* the record's head up to and with its local cache's count */
        if (jsave(n, (size_t)(r - n->seg), (uint32_t)cfield(n, n->c_local))) return UNHANDLED;
        U4(r + CF_LOCAL_COUNT) = 0;
    }
    out->freed = m;
    return OK;
}

/* Return up to CHUNK of client c's reserved sequence slots; once none is left, fold its
 * counters into the header and mark its record detached (*done 1). The caller holds the seqs
 * lock, which guards both. `dead`: its process died (its counter is evened: a process that
 * died inside an operation left it odd, and no snapshot may wait for a writer that will never
 * finish). OK or UNHANDLED. */
static int detach_chunk(Native *n, int64_t c, int dead, int64_t *done) {
    *done = 0;
    int64_t k = 0;
    for (int64_t s = 0; s < n->max_seqs; s++) {
        uint8_t *r = seqrec(n, s);
        if (r[SF_RESERVED] != 1 || I4(r + SF_OWNER_CLIENT) != c) continue;
        if (k == CHUNK) return OK; /* more: the caller calls again */
        if (jsave_head(n, s)) return UNHANDLED;
        r[SF_RESERVED] = 0;
        k++;
    }
    uint8_t *r = crec(n, c);
    for (int f = 0; f < NUM_COUNTERS; f++) {
        size_t at = HDR_COUNTERS + 8 * (size_t)f;
        if (jsave(n, at, 8)) return UNHANDLED;
        U8(n->seg + at) += U8(r + cfield(n, n->c_counters) + 8 * (size_t)f);
    }
    size_t rec_at = (size_t)(r - n->seg);
    if (jsave(n, rec_at + CF_STATE, 1)) return UNHANDLED;
    if (dead) {
        size_t seq_at = rec_at + cfield(n, n->c_seq);
        if (jsave(n, seq_at, 8)) return UNHANDLED;
        U8(n->seg + seq_at) += U8(n->seg + seq_at) % 2;
    }
    r[CF_STATE] = (uint8_t)CL_DETACHED;
    *done = 1;
    return OK;
}

static int step_detach(Native *n, const DeadRec *d, void *done) {
    return detach_chunk(n, d->client, 1, done);
}

/* Step: release a transaction's worth of the leases dead client d held (leases.c); *arg: how
 * many (fewer than all when the journal's room ended: the caller steps again). */
static int step_leases(Native *n, const DeadRec *d, void *arg) {
    int64_t *done = arg;
    return leases_step_reclaim(n, (int32_t)d->client, d->pid, done);
}

/* Reclaim dead client d: its journal rolled back, its sequences' blocks dropped and slots
 * released, its cached and stray blocks and reserved slots returned, its record detached,
 * each step its own transaction. What was done ({sequences, blocks, entries, skipped}), None
 * when another reclaimer took over the record, NULL with an exception set. */
static PyObject *reclaim_one(Native *n, const DeadRec *d) {
    int64_t seqs = 0, blocks = 0, done = 0;
    Rolled rolled = {0, NULL};
    int rc = reclaim_step(n, d, step_rollback, &rolled);
    /* its leases first, so that the blocks below go back free of them */
    for (int64_t leases = 1; rc == OK && leases > 0;) rc = reclaim_step(n, d, step_leases, &leases);
    /* the slots it holds (a hint, read without locks: each step checks its slot again) */
    int64_t *live = NULL, nlive = 0;
    if (rc == OK && (live = PyMem_Malloc(sizeof(int64_t) * (size_t)(n->max_seqs + 1))) == NULL) {
        PyErr_NoMemory();
        rc = ERROR;
    }
    for (int64_t s = 0; rc == OK && s < n->max_seqs; s++)
        if (seqrec(n, s)[SF_STATE] != S_EMPTY && I4(seqrec(n, s) + SF_OWNER_CLIENT) == d->client)
            live[nlive++] = s;
    /* the requests of the sequences it ends (each read before its step releases the slot) */
    PyObject *requests = rc == OK ? PyList_New(0) : NULL;
    if (rc == OK && requests == NULL) rc = ERROR;
    for (int64_t i = 0; rc == OK && i < nlive; i++) {
        char request[REQUEST_BYTES + 1];
        memcpy(request, seqrec(n, live[i]) + SF_REQUEST, REQUEST_BYTES);
        request[REQUEST_BYTES] = 0;
        Tail tail = {live[i], 0, 0};
        while (rc == OK && !tail.released) {
            rc = reclaim_step(n, d, step_drop_tail, &tail);
            if (rc == OK && tail.freed > 0) blocks += tail.freed;
        }
        if (rc == OK && tail.freed >= 0) {
            seqs++;
            PyObject *req = PyUnicode_DecodeUTF8(request, (Py_ssize_t)strlen(request), "replace");
            if (req == NULL || PyList_Append(requests, req) < 0) rc = ERROR;
            Py_XDECREF(req);
        }
    }
    PyMem_Free(live);
    /* (until a step returns fewer than it may) */
    for (Owned owned = {0, 0}; rc == OK && owned.freed == owned.most;) {
        rc = reclaim_step(n, d, step_free_owned, &owned);
        if (rc == OK) blocks += owned.freed;
    }
    while (rc == OK && !done) rc = reclaim_step(n, d, step_detach, &done);
    if (rc != OK) {
        Py_XDECREF(rolled.skipped);
        Py_XDECREF(requests);
        if (rc == GONE) Py_RETURN_NONE;
        if (rc == UNHANDLED && !PyErr_Occurred())
            PyErr_SetString(PoolErrorType ? PoolErrorType : PyExc_RuntimeError,
                            "reclaim: a step outgrew the undo journal");
        return NULL;
    }
    return Py_BuildValue("{sLsNsLsLsN}", "sequences", (long long)seqs, "requests", requests,
                         "blocks", (long long)blocks, "entries", (long long)rolled.entries,
                         "skipped", rolled.skipped ? rolled.skipped : Py_NewRef(Py_None));
}

/* -- entry points ------------------------------------------------------------------------------- */

/* The recovery entry points run whatever the handle's probes (no events, checks or hooks of
 * theirs), on a handle that is open. */
static int recovery_enter(Native *n) {
    if (n->seg == NULL) {
        PyErr_SetString(PoolErrorType ? PoolErrorType : PyExc_RuntimeError, "the pool is closed");
        return ERROR;
    }
    n->probes = 0;
    return OK;
}

/* The findings' answer of a call: NULL (and the mutex let go) on an exception. */
static PyObject *recovery_leave(Native *n, PyObject *result) {
    drop_mutex(n);
    return result;
}

static int lock_answer(int rc) {
    if (rc == UNHANDLED && !PyErr_Occurred())
        PyErr_SetString(PoolErrorType ? PoolErrorType : PyExc_RuntimeError,
                        "recovery: a step outgrew the undo journal");
    return rc;
}

/* reclaim_dead(said) -> (totals, done): return every dead client's blocks
 * (KVPool.reclaim_dead's totals {processes, sequences, blocks}); `done`: one entry per dead
 * process this call acted on: pid, sequences, blocks, journal entries rolled back (`skipped`:
 * why its journal could not be trusted and was not), and whether this call reclaimed it
 * (`detached`) or another reclaimer finished it. A process reclaimed with something held gets a
 * `leak_dead_owner` finding unless it is among `said` (pids whose own exit recorded what they
 * held: the same cause). */
static PyObject *N_reclaim_dead(Native *n, PyObject *said) {
    if (recovery_enter(n)) return NULL;
    Py_ssize_t found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    PyObject *rolled = PyDict_New(), *recovered = PyList_New(0), *done = PyList_New(0);
    long long tp = 0, ts = 0, tb = 0;
    PyObject *result = NULL;
    int64_t nd = 0;
    DeadRec *dead = PyMem_Malloc(sizeof(DeadRec) * (size_t)(n->max_clients + 1));
    if (!rolled || !recovered || !done || !dead) goto out;
    /* Stop the world once: dead holders' and every dead client's journals rolled back. */
    if (lock_answer(recover_holders(n, recovered)) != OK) goto out;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(recovered); i++) {
        PyObject *r = PyList_GET_ITEM(recovered, i);
        if (PyDict_SetItem(rolled, PyDict_GetItemString(r, "pid"), r)) goto out;
    }
    for (int64_t c = 0; c < n->max_clients; c++)
        if (c != n->client && dead_now(n, c)) dead[nd++] = dead_rec(n, c);
    for (int64_t i = 0; i < nd; i++) {
        PyObject *got = reclaim_one(n, &dead[i]);
        if (got == NULL) goto out;
        if (got == Py_None) {
            Py_DECREF(got);
            continue;
        }
        long long s = PyLong_AsLongLong(PyDict_GetItemString(got, "sequences"));
        long long b = PyLong_AsLongLong(PyDict_GetItemString(got, "blocks"));
        tp++, ts += s, tb += b;
        PyObject *pid = PyLong_FromLong(dead[i].pid);
        int is_said = pid ? PySequence_Contains(said, pid) : -1;
        PyObject *r = pid && is_said >= 0 ? PyDict_GetItemWithError(rolled, pid) : NULL;
        int bad = is_said < 0 || PyErr_Occurred();
        if (!bad && (b || s) && !is_said) {
            /* (the supervisor of a run says a dead worker once, from whichever it sees first) */
            /* the first two requests of its sequences, each cut to 24 bytes (the ring keeps
             * FD_MESSAGE_BYTES of the message) */
            PyObject *reqs = PyDict_GetItemString(got, "requests");
            Py_ssize_t nr = reqs ? PyList_GET_SIZE(reqs) : 0;
            char names[96] = "";
            for (Py_ssize_t j = 0; j < nr && j < 2; j++) {
                const char *u = PyUnicode_AsUTF8(PyList_GET_ITEM(reqs, j));
                size_t at = strlen(names);
                if (u) snprintf(names + at, sizeof names - at, "%s'%.24s'", j ? ", " : "", u);
            }
            if (nr > 2) {
                size_t at = strlen(names);
                snprintf(names + at, sizeof names - at, " and %zd more", nr - 2);
            }
            char text[256];
            int len = snprintf(text, sizeof text,
                               "pid %d died attached to the pool holding %lld sequence(s)%s%s%s; "
                               "pid %d reclaimed them (pool.reclaim_dead()): %lld block(s) "
                               "freed, shared ones lost a reference",
                               (int)dead[i].pid, s, nr ? " (request(s) " : "", names,
                               nr ? ")" : "", (int)n->pid, b);
            if (len >= FD_MESSAGE_BYTES) len = FD_MESSAGE_BYTES - 1;
            Seen none = {.block = -1, .owner_pid = dead[i].pid, .site = -1};
            PyErr_Clear(); /* (a name that would not encode is left out) */
            bad = lock_answer(lock_take_alone(n, n->lock_findings)) != OK;
            if (!bad) {
                bad = finding_write(n, FK_LEAK_DEAD_OWNER, &none, text, len) != OK;
                lock_drop(n, n->lock_findings);
            }
        }
        if (!bad && r != NULL) {
            /* its journal, rolled back when the world stopped, counts here */
            long long e = PyLong_AsLongLong(PyDict_GetItemString(got, "entries")) +
                          PyLong_AsLongLong(PyDict_GetItemString(r, "entries"));
            PyObject *sk = PyDict_GetItemString(got, "skipped"), *eo = PyLong_FromLongLong(e);
            bad = eo == NULL || PyDict_SetItemString(got, "entries", eo) < 0;
            Py_XDECREF(eo);
            if (!bad && sk == Py_None)
                bad = PyDict_SetItemString(got, "skipped", PyDict_GetItemString(r, "skipped"));
            if (!bad) bad = PyDict_DelItem(rolled, pid) < 0;
        }
        PyObject *entry = NULL;
        if (!bad) {
            entry = Py_BuildValue("{sO}", "pid", pid);
            bad = entry == NULL || PyDict_Update(entry, got) ||
                  PyDict_SetItemString(entry, "detached", Py_True) || PyList_Append(done, entry);
        }
        Py_XDECREF(entry);
        Py_XDECREF(pid);
        Py_DECREF(got);
        if (bad) goto out;
    }
    /* the dead processes whose journals another reclaimer's detach left to this call */
    PyObject *key, *r;
    Py_ssize_t pos = 0;
    while (PyDict_Next(rolled, &pos, &key, &r)) {
        PyObject *entry = Py_BuildValue("{sOsOsOsisisO}", "pid", key, "entries",
                                        PyDict_GetItemString(r, "entries"), "skipped",
                                        PyDict_GetItemString(r, "skipped"), "sequences", 0,
                                        "blocks", 0, "detached", Py_False);
        int bad = entry == NULL || PyList_Append(done, entry);
        Py_XDECREF(entry);
        if (bad) goto out;
    }
    result = Py_BuildValue("({sLsLsL}O)", "processes", tp, "sequences", ts, "blocks", tb, done);
    /* what it found (a dead holder's lock, a dead process's blocks), in the operation log */
    if (result && n->oplog) oplog_found_report(n, found0, "");
out:
    PyMem_Free(dead);
    Py_XDECREF(rolled);
    Py_XDECREF(recovered);
    Py_XDECREF(done);
    return recovery_leave(n, result);
}

/* reclaim_orphans() -> [{pid, client, request, blocks}]: end the live sequences no handle
 * holds (orphaned: a process closed its handle without ending them, which its close reported
 * as leak_finished), each dropped from its tail a transaction's worth a step under every lock
 * (step_drop_tail, its slot released after the last), once its record still holds no process
 * of its owner pid; one entry per sequence ended (`blocks`: those it returned to the pool, not
 * counting blocks others still map). Safe beside other reclaimers: a sequence another one ended
 * first is not listed. */
static PyObject *N_reclaim_orphans(Native *n, PyObject *unused) {
    if (recovery_enter(n)) return NULL;
    PyObject *out = PyList_New(0);
    if (out == NULL) return recovery_leave(n, NULL);
    int rc = OK;
    /* (a hint, read without locks: each step checks its slot and record again) */
    for (int64_t slot = 0; rc == OK && slot < n->max_seqs; slot++) {
        if (!orphaned(n, slot)) continue;
        const uint8_t *r = seqrec(n, slot);
        DeadRec d = {.client = I4(r + SF_OWNER_CLIENT), .pid = I4(r + SF_OWNER_PID), .orphans = 1};
        char request[REQUEST_BYTES + 1];
        memcpy(request, r + SF_REQUEST, REQUEST_BYTES);
        request[REQUEST_BYTES] = 0;
        Tail tail = {slot, 0, 0};
        int64_t blocks = 0;
        while (rc == OK && !tail.released) {
            rc = reclaim_step(n, &d, step_drop_tail, &tail);
            if (rc == OK && tail.freed > 0) blocks += tail.freed;
        }
        if (rc == GONE || (rc == OK && tail.freed < 0)) { /* (not an orphan by then) */
            rc = OK;
            continue;
        }
        if (rc != OK) break;
        PyObject *req = PyUnicode_DecodeUTF8(request, (Py_ssize_t)strlen(request), "replace");
        PyObject *e = req ? Py_BuildValue("{sisLsOsL}", "pid", (int)d.pid, "client",
                                          (long long)d.client, "request", req, "blocks",
                                          (long long)blocks)
                          : NULL;
        Py_XDECREF(req);
        if (e == NULL || PyList_Append(out, e)) rc = ERROR;
        Py_XDECREF(e);
    }
    if (rc != OK) {
        lock_answer(rc);
        Py_CLEAR(out);
    }
    return recovery_leave(n, out);
}

/* Read (client, pid, start, generation) into d. 0, or -1 with an exception set. */
static int dead_arg(Native *n, PyObject *const *args, Py_ssize_t nargs, int64_t client,
                    DeadRec *d) {
    int at = client < 0 ? 1 : 0;
    if (nargs != 3 + at) {
        PyErr_SetString(PyExc_TypeError, "expected (client,) pid, start, generation");
        return -1;
    }
    d->client = at ? PyLong_AsLongLong(args[0]) : client;
    d->pid = (int32_t)PyLong_AsLong(args[at]);
    d->start = PyLong_AsUnsignedLongLong(args[at + 1]);
    d->generation = PyLong_AsUnsignedLongLong(args[at + 2]);
    d->orphans = 0;
    if (PyErr_Occurred()) return -1;
    if (d->client < 0 || d->client >= n->max_clients) {
        PyErr_SetString(PyExc_ValueError, "no such client record");
        return -1;
    }
    return 0;
}

/* reclaim_client(client, pid, start, generation) -> dict | None: reclaim_one of the dead
 * process that record `client` held as found (recovery.DeadClient); None when another
 * reclaimer took the record over. */
static PyObject *N_reclaim_client(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    DeadRec d;
    if (recovery_enter(n) || dead_arg(n, args, nargs, -1, &d)) return NULL;
    return recovery_leave(n, reclaim_one(n, &d));
}

/* reclaim_for_attach(pid, start, generation) -> dict | None: reclaim the dead process that
 * this handle's own record still holds, for a process attaching to a full client table
 * (lifecycle.register_client): the handle borrows the record, its transactions journaled in it
 * and its counter left as its dead owner left it (the attach evens it), and a lock found held
 * by a dead process rolls that record's journal back with the others'. */
static PyObject *N_reclaim_for_attach(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    DeadRec d;
    if (recovery_enter(n) || dead_arg(n, args, nargs, n->client, &d)) return NULL;
    n->borrowed = 1;
    PyObject *got = reclaim_one(n, &d);
    n->borrowed = 0;
    return recovery_leave(n, got);
}

/* This handle's local cache, all of it, to the free ring in a transaction under the free
 * lock. OK or ERROR. */
static int flush_local(Native *n) {
    int rc = lock_answer(txn_begin(n, lock_bit(n->lock_free)));
    if (rc != OK) return ERROR;
    int32_t ids[LOCAL_CACHE_MAX];
    int64_t got;
    if (local_pop(n, LOCAL_CACHE_MAX, ids, &got) || ring_push(n, ids, got)) {
        txn_abort(n);
        lock_answer(UNHANDLED);
        return ERROR;
    }
    txn_commit(n);
    return OK;
}

/* The blocks of this process's local cache, in the cache's order, copied into `out` (room for
 * LOCAL_CACHE_MAX): what a flush returns, for its FLUSH or CLOSE record; how many. */
static int64_t local_copy(Native *n, int32_t *out) {
    int64_t k = local_count(n) < LOCAL_CACHE_MAX ? local_count(n) : LOCAL_CACHE_MAX;
    memcpy(out, local_arr(n), 4 * (size_t)k);
    return k;
}

/* flush_local(): flush_local (pool.flush_local; at a process's exit, kvscope/child.py, before
 * it looks for orphans). While the handle records, a FLUSH record of the blocks it returned. */
static PyObject *N_flush_local(Native *n, PyObject *unused) {
    if (recovery_enter(n)) return NULL;
    int32_t cache[LOCAL_CACHE_MAX];
    int64_t n_cache = n->oplog ? local_copy(n, cache) : 0;
    int rc = flush_local(n);
    if (n->oplog) oplog_returned(n, OP_FLUSH, cache, n_cache, 0, rc == OK);
    return recovery_leave(n, rc == OK ? Py_NewRef(Py_None) : NULL);
}

/* detach(pool): this handle's close: the sequences it still holds reported as leaks
 * (entry.c seqs_at_close, with the handle's probes), its own journal rolled back (an
 * operation interrupted without its rollback), its local cache flushed, its slot reserve
 * returned a CHUNK at a time and its counters folded into the header (detach_chunk, under the
 * seqs lock), its record marked detached. */
static PyObject *N_detach(Native *n, PyObject *pool) {
    if (seqs_at_close(n, pool) != OK) return NULL;
    if (recovery_enter(n)) return NULL;
    PyObject *why = NULL;
    if (U4(n->seg + n->c_jcount) && journal_rollback(n, n->client, &why) < 0)
        return recovery_leave(n, NULL);
    Py_XDECREF(why);
    /* the leases it still holds: leaks, released (leases.c) */
    int rc = lock_answer(leases_at_close(n));
    /* (what the close returns, for its CLOSE record: the local cache's blocks, the slots) */
    int32_t cache[LOCAL_CACHE_MAX];
    int64_t n_cache = n->oplog ? local_copy(n, cache) : 0, slots = n->res_n;
    if (rc == OK) rc = flush_local(n);
    if (rc == OK) n->res_n = 0; /* (its slots go back to the table below) */
    for (int64_t done = 0; rc == OK && !done;) {
        if ((rc = lock_answer(txn_begin(n, lock_bit(n->lock_seqs)))) != OK) break;
        if (detach_chunk(n, n->client, 0, &done)) {
            txn_abort(n);
            rc = lock_answer(UNHANDLED);
        } else
            txn_commit(n);
    }
    if (n->oplog) oplog_close_record(n, cache, n_cache, slots, rc == OK);
    return recovery_leave(n, rc == OK ? Py_NewRef(Py_None) : NULL);
}

/* mark_repaired(pids, kinds) -> [ring position]: mark the ring's findings of `kinds` about the
 * processes `pids` as repaired (after a repair returned what they held), under the findings
 * lock, journaled; the positions marked. */
static PyObject *N_mark_repaired(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "mark_repaired(pids, kinds: tuple)");
        return NULL;
    }
    if (recovery_enter(n)) return NULL;
    PyObject *pids = args[0], *kinds = args[1], *marked = PyList_New(0);
    int rc = marked ? lock_answer(txn_begin(n, lock_bit(n->lock_findings))) : ERROR;
    if (rc != OK) {
        Py_XDECREF(marked);
        return recovery_leave(n, NULL);
    }
    uint64_t head = U8(n->seg + HDR_FINDINGS_HEAD), cap = (uint64_t)FINDINGS_CAPACITY;
    for (uint64_t k = head > cap ? head - cap : 0; k < head && rc == OK; k++) {
        uint8_t *r = n->seg + n->off_findings + (size_t)(k % cap) * FINDING_SIZE;
        if (r[FD_REPAIRED]) continue;
        PyObject *pid = PyLong_FromLong(I4(r + FD_OWNER_PID));
        int in = pid ? PySequence_Contains(pids, pid) : -1;
        Py_XDECREF(pid);
        if (in < 0) rc = ERROR;
        if (in <= 0) continue;
        const char *kind = (const char *)r + FD_KIND;
        size_t kl = strnlen(kind, FD_KIND_BYTES);
        int known = 0;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(kinds) && !known; j++) {
            Py_ssize_t len;
            const char *want = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(kinds, j), &len);
            if (want == NULL) {
                rc = ERROR;
                break;
            }
            known = (size_t)len == kl && memcmp(want, kind, kl) == 0;
        }
        if (!known || rc != OK) continue;
        if (n->jcount + 1 > JOURNAL_ENTRIES) { /* (a journal's worth a transaction) */
            txn_commit(n);
            if ((rc = lock_answer(txn_begin(n, lock_bit(n->lock_findings)))) != OK) break;
        }
        if (jsave(n, (size_t)(r - n->seg) + FD_REPAIRED, 1))
            rc = lock_answer(UNHANDLED);
        else if (append_new(marked, PyLong_FromUnsignedLongLong(k)))
            rc = ERROR;
        else
            r[FD_REPAIRED] = 1;
    }
    if (rc == OK)
        txn_commit(n);
    else if (n->held)
        txn_abort(n);
    if (rc != OK) Py_CLEAR(marked);
    return recovery_leave(n, marked);
}

/* -- the lease section repaired (kvscope check --repair) ----------------------------------------- */

/* (leases.c, included after this file, has its own accessors; these read the same bytes) */
static inline uint8_t *rl_record(Native *n, int64_t i) {
    return n->seg + n->off_leases + n->lease_records + (size_t)i * (size_t)n->lease_rec;
}

/* Lease record l's holder is the attached process of the client record it names (the same pid
 * and start time): only then can the holder, its close or a reclaim of it end the lease. */
static int rl_holder_attached(Native *n, const uint8_t *l) {
    int32_t c = I4(l + LS_HOLDER_CLIENT);
    if (c < 0 || c >= n->max_clients) return 0;
    uint8_t *r = crec(n, c);
    return r[CF_STATE] == CL_ATTACHED && I4(r + CF_PID) == I4(l + LS_HOLDER_PID) &&
           U8(r + CF_START) == U8(l + LS_HOLDER_START);
}

/* What a repair of the lease section did. */
typedef struct {
    PyObject *ended; /* the ids of the leases ended (their holder gone without ending them) */
    int64_t counts;  /* block lease counts set to the held leases naming the block */
    int header;      /* bits: 1 active, 2 quarantined, 4 next_id, 8 capacity rewritten */
} LeaseFix;

/* One transaction of the repair (free lock held; the section's header journaled): the leases
 * whose holder is not attached ended, then each block's lease count set to the number of held
 * leases naming it, then the header's counts to the records', each write journaled, as many
 * as half the journal's entries; *more when some were left for the next. OK, UNHANDLED,
 * ERROR. */
static int repair_leases_txn(Native *n, LeaseFix *fix, int *more) {
    uint8_t *h = n->seg + n->off_leases;
    uint32_t *cnt = (uint32_t *)(h + LEASE_COUNTS);
    int64_t room = JOURNAL_ENTRIES / 2;
    *more = 0;
    for (int64_t i = 0; i < n->lease_cap; i++) {
        uint8_t *l = rl_record(n, i);
        if (l[LS_STATE] == L_EMPTY || rl_holder_attached(n, l)) continue;
        if (room-- <= 0) {
            *more = 1;
            return OK;
        }
        if (jsave(n, (size_t)(l - n->seg), 1)) return UNHANDLED;
        if (append_new(fix->ended, PyLong_FromUnsignedLongLong(U8(l + LS_LEASE_ID)))) return ERROR;
        l[LS_STATE] = L_EMPTY;
        U8(h + LH_RECLAIMED) += 1;
    }
    uint32_t *want = PyMem_Calloc((size_t)n->nb, sizeof(uint32_t));
    if (want == NULL) {
        PyErr_NoMemory();
        return ERROR;
    }
    uint32_t active = 0;
    uint64_t last = U8(h + LH_NEXT_ID);
    for (int64_t i = 0; i < n->lease_cap; i++) {
        uint8_t *l = rl_record(n, i);
        if (l[LS_STATE] == L_EMPTY) continue;
        active++;
        if (U8(l + LS_LEASE_ID) > last) last = U8(l + LS_LEASE_ID);
        int64_t k = U4(l + LS_NUM_BLOCKS);
        if (k > n->max_bps) k = n->max_bps;
        const int32_t *ids = (const int32_t *)(l + LS_BLOCKS);
        for (int64_t j = 0; j < k; j++)
            if (ids[j] >= 0 && ids[j] < n->nb) want[ids[j]]++;
    }
    int rc = OK;
    uint32_t quarantined = 0;
    for (int64_t b = 0; b < n->nb && rc == OK; b++) {
        if (cnt[b] != want[b]) {
            if (room-- <= 0) {
                *more = 1;
                break;
            }
            if (jsave(n, n->off_leases + LEASE_COUNTS + 4 * (size_t)b, 4)) {
                rc = UNHANDLED;
                break;
            }
            cnt[b] = want[b];
            fix->counts++;
        }
        quarantined += cnt[b] != 0 && blk(n, b)[BF_STATE] == B_QUARANTINED;
    }
    PyMem_Free(want);
    if (rc != OK || *more) return rc;
    if (U4(h + LH_ACTIVE) != active) fix->header |= 1;
    if (U4(h + LH_QUARANTINED) != quarantined) fix->header |= 2;
    if (U8(h + LH_NEXT_ID) != last) fix->header |= 4;
    if (U4(h + LH_CAPACITY) != (uint32_t)n->lease_cap) fix->header |= 8;
    U4(h + LH_CAPACITY) = (uint32_t)n->lease_cap;
    U4(h + LH_ACTIVE) = active;
    U4(h + LH_QUARANTINED) = quarantined;
    U8(h + LH_NEXT_ID) = last;
    return OK;
}

/* repair_leases() -> {ended, counts, header}: the lease section made to agree with itself
 * (`kvscope check --repair`, after the dead are reclaimed): the leases whose holder's client
 * record is detached or another process's, which nothing else would end, ended (`ended`: their
 * ids, each counted reclaimed); each block's lease count set to the held leases naming it
 * (`counts`: how many were not; a QUARANTINED block no lease holds is free again); the header's
 * leases held, quarantined leased blocks and last id set to the records', its capacity to the
 * table's (`header`: the fields that were not). Transactions under the free lock, journaled, a journal's worth each. */
static PyObject *N_repair_leases(Native *n, PyObject *unused) {
    if (recovery_enter(n)) return NULL;
    LeaseFix fix = {PyList_New(0), 0, 0};
    int rc = fix.ended ? OK : ERROR;
    for (int more = 1; rc == OK && more;) {
        if ((rc = lock_answer(txn_begin(n, lock_bit(n->lock_free)))) != OK) break;
        if (jsave(n, n->off_leases, LEASE_COUNTS)) rc = UNHANDLED;
        if (rc == OK) rc = repair_leases_txn(n, &fix, &more);
        if (rc == OK) {
            txn_commit(n);
        } else {
            txn_abort(n);
            lock_answer(rc);
        }
    }
    PyObject *result = NULL;
    if (rc == OK) {
        PyObject *fields = PyList_New(0);
        const char *names[] = {"active", "quarantined", "next_id", "capacity"};
        for (int f = 0; fields && f < 4; f++)
            if ((fix.header & (1 << f)) && append_new(fields, PyUnicode_FromString(names[f])))
                Py_CLEAR(fields);
        if (fields)
            result = Py_BuildValue("{sOsLsN}", "ended", fix.ended, "counts", (long long)fix.counts,
                                   "header", fields);
    }
    Py_XDECREF(fix.ended);
    return recovery_leave(n, result);
}
