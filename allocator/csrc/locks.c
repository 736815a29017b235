/* Pool locks and transactions. Part of _native.c. */

/* -- locks ------------------------------------------------------------------------------------ */

/* Lock i's mutex: the process-shared robust pthread mutex at the start of its record (made by
 * init_lock_mutexes below, which header.py calls for a fresh segment). */
_Static_assert(sizeof(pthread_mutex_t) <= LOCK_MUTEX_BYTES, "the lock record's mutex bytes");
static inline pthread_mutex_t *lock_mutex(Native *n, int i) {
    return (pthread_mutex_t *)(n->seg + n->off_locks + (size_t)i * LOCK_SIZE + LF_MUTEX);
}

/* init_lock_mutexes(records, count): make the mutex at the start of each of the first `count`
 * lock records of `records` (a writable buffer: a fresh segment's lock section, header.py) a
 * free process-shared, robust, error-checking mutex: one a holder's death never leaves stuck
 * (the next taker gets EOWNERDEAD, mutex_taken), and a thread that takes one it holds, or lets
 * go of one it does not, gets an error instead of a deadlock or a broken lock. */
static PyObject *M_init_lock_mutexes(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer buf;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "init_lock_mutexes(records, count)");
        return NULL;
    }
    Py_ssize_t count = PyLong_AsSsize_t(args[1]);
    if (count == -1 && PyErr_Occurred()) return NULL;
    if (PyObject_GetBuffer(args[0], &buf, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int rc = 0;
    const char *what = NULL;
    if (count < 0 || count * LOCK_SIZE > buf.len) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_ValueError, "init_lock_mutexes: fewer lock records than count");
        return NULL;
    }
    pthread_mutexattr_t attr;
    if ((rc = pthread_mutexattr_init(&attr)) != 0) what = "pthread_mutexattr_init";
    else {
        if ((rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK)) != 0)
            what = "pthread_mutexattr_settype";
        else if ((rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED)) != 0)
            what = "pthread_mutexattr_setpshared";
        else if ((rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST)) != 0)
            what = "pthread_mutexattr_setrobust";
        for (Py_ssize_t i = 0; what == NULL && i < count; i++) {
            pthread_mutex_t *m = (pthread_mutex_t *)((uint8_t *)buf.buf + i * LOCK_SIZE + LF_MUTEX);
            if ((rc = pthread_mutex_init(m, &attr)) != 0) what = "pthread_mutex_init";
        }
        pthread_mutexattr_destroy(&attr);
    }
    PyBuffer_Release(&buf);
    if (what != NULL) {
        PyObject *e = Py_BuildValue("(is)", rc, what);
        if (e != NULL) PyErr_SetObject(PyExc_OSError, e);
        Py_XDECREF(e);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* A pthread_mutex_*lock answer: 0 taken (a dead holder's mutex made consistent: the record
 * still names it), EBUSY, or another error. */
static inline int mutex_taken(pthread_mutex_t *m, int rc) {
    if (rc == EOWNERDEAD) return pthread_mutex_consistent(m);
    return rc;
}

/* hold_mutex's answer when another thread holds the op mutex and this call holds pool locks:
 * waiting for it there could close a cycle (that thread may be waiting for one of them), so
 * the caller lets go of its locks and asks again holding none (txn_begin). */
#define MUTEX_LATER 4

/* Hold the handle's op mutex while the core lets go of the GIL: to wait for a lock, or for
 * Python to run inside a transaction (devchecks.c's kernel launch): no other thread starts an
 * operation on this handle meanwhile (the gate waits: wait_others). The mutex is the
 * mapping's: a thread of this process holds it without the core where it runs the core's
 * other work under it (evict, close, the K/V checks' settle, otel's span of an operation);
 * holding no pool lock, the core waits for it (the GIL let go: RLock.acquire). OK,
 * MUTEX_LATER (another thread holds it, and this call holds pool locks), ERROR. */
static int hold_mutex(Native *n) {
    if (n->mutex_held) return OK;
    PyObject *r = PyObject_CallMethodObjArgs(n->mutex, s_acquire, Py_False, NULL);
    if (r == NULL) return ERROR;
    int got = r == Py_True;
    Py_DECREF(r);
    if (!got) {
        if (n->held) return MUTEX_LATER;
        /* (the operation is in flight meanwhile: another thread's gate waits for it) */
        n->mutex_wanted = 1;
        n->op_thread = PyThread_get_thread_ident();
        r = PyObject_CallMethodNoArgs(n->mutex, s_acquire);
        n->mutex_wanted = 0;
        if (r == NULL) return ERROR;
        Py_DECREF(r);
    }
    n->mutex_held = 1;
    n->op_thread = PyThread_get_thread_ident();
    return OK;
}

/* Whether this thread holds the op mutex: 1, 0, or -1 with an exception set. */
static int mutex_mine(Native *n) {
    PyObject *r = PyObject_CallMethod(n->mutex, "_is_owned", NULL);
    if (r == NULL) return -1;
    int mine = r == Py_True;
    Py_DECREF(r);
    return mine;
}

static int wait_others(Native *n, int *mine, int *waited) {
    *mine = 0;
    if (waited) *waited = 0;
    while (n->mutex_held || n->held || n->mutex_wanted) {
        if (n->mutex_held) {
            if ((*mine = mutex_mine(n)) != 0) return *mine < 0 ? ERROR : OK;
            PyObject *r = PyObject_CallMethodNoArgs(n->mutex, s_acquire);
            if (r == NULL) return ERROR;
            Py_DECREF(r);
            if ((r = PyObject_CallMethodNoArgs(n->mutex, s_release)) == NULL) return ERROR;
            Py_DECREF(r);
        } else if (n->held && n->op_thread == PyThread_get_thread_ident()) {
            *mine = 1;
            return OK;
        } else {
            int first = n->held ? 0 : mutex_mine(n);
            if (first != 0) return first < 0 ? ERROR : OK;
            Py_BEGIN_ALLOW_THREADS
            struct timespec ts = {0, 50000};
            nanosleep(&ts, NULL);
            Py_END_ALLOW_THREADS
        }
        if (waited) *waited = 1;
    }
    return OK;
}

/* lock_take's answer when lock i's record names a holder that died holding it (the mutex is
 * let go again): the caller recovers (recovery.c recover_holders) and takes it again. */
#define HOLDER_DEAD 2

/* A dead holder lock_take_as met and cleared: its pid and client record (pid 0: none). */
typedef struct {
    int32_t pid, client;
} Holder;

static void lock_name(Native *n, int i, char *out, size_t cap);

/* A pthread_mutex_*lock of lock i that failed with rc (not EBUSY): OSError with that errno,
 * naming the lock. ERROR. */
static int lock_failed(Native *n, int i, int rc) {
    char name[32];
    lock_name(n, i, name, sizeof name);
    PyObject *args = Py_BuildValue(
        "(iN)", rc, PyUnicode_FromFormat("pool lock '%s' could not be taken: %s", name, strerror(rc)));
    if (args != NULL) PyErr_SetObject(PyExc_OSError, args);
    Py_XDECREF(args);
    return ERROR;
}

/* lock_get's answer when lock i is busy and the caller asked not to wait (nothing taken). */
#define LOCK_BUSY 5

/* How many times a taker looks again at a busy mutex before it waits for it. The
 * core's critical sections are a few microseconds long: a holder running on another core lets
 * go within the spin, and the sleep and the wake-up (two system calls and a context switch each
 * side) are spared; a holder that is not running (preempted) costs the spin, a few
 * microseconds, and the taker yields its core (LOCK_YIELDS) before it sleeps. */
#define LOCK_SPIN 256

/* How many times a taker whose spin ran out gives its core away (sched_yield) and looks again
 * before it sleeps on the mutex. With more processes than cores (bench_pool --procs: 4 on 2) a
 * holder still holding after the spin is mostly one the scheduler paused, often on this very
 * core behind the taker: a yield lets it run and let go without the futex sleep, the
 * unlocker's wake-up system call and the two context switches (about 20 us of CPU a sleep,
 * measured there), and the taker stays runnable instead of losing its turn: 4 processes sleep
 * 3.5-7 times less often (docs/POOL.md, "Several processes on a few cores"). A holder not back
 * after the yields (one paused behind other work) is slept on as before. */
#define LOCK_YIELDS 2

static inline void cpu_relax(void) {
#if defined(__SSE2__)
    _mm_pause();
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

/* pthread_mutex_trylock(m) when glibc's lock word (which names the owner) says it is free, else
 * EBUSY without touching it: a look that keeps the line shared while the holder works. */
static inline int mutex_try_free(pthread_mutex_t *m) {
    if (__atomic_load_n(&m->__data.__lock, __ATOMIC_RELAXED) != 0) return EBUSY;
    return pthread_mutex_trylock(m);
}

/* Spin while mutex m looks held, trying it whenever it looks free: pthread_mutex_trylock's
 * answer, EBUSY when it stayed held. */
static int mutex_spin(pthread_mutex_t *m) {
    int rc;
    for (int k = 0; k < LOCK_SPIN; k++) {
        cpu_relax();
        if ((rc = mutex_try_free(m)) != EBUSY) return rc;
    }
    return EBUSY;
}

/* Wait for mutex m (the GIL let go): when `yield` (the taker holds no other pool lock: a yield
 * holding one would keep it from every process that wants it meanwhile), yield the core a few
 * times first (LOCK_YIELDS), trying it whenever it looks free; then sleep on it.
 * pthread_mutex_lock's answer. */
static int mutex_wait_for(pthread_mutex_t *m, int yield) {
    int rc;
    for (int k = 0; yield && k < LOCK_YIELDS; k++) {
        sched_yield();
        if ((rc = mutex_try_free(m)) != EBUSY) return rc;
    }
    return pthread_mutex_lock(m);
}

/* Take lock i (a busy one after a spin, mutex_spin, then a wait: mutex_wait_for); HOLDER_DEAD (not
 * taken) when its record names a dead holder and `dead` is NULL, else the holder is written to
 * *dead and forgotten (the caller stops the world to recover: recovery.c); MUTEX_LATER (not
 * taken) when it must wait and another thread holds the op mutex while this call holds other
 * locks (hold_mutex); ERROR (OSError) when the wait fails. The core takes locks in the
 * documented order only, so its waits cannot close a cycle (but the lock-inversion fault's,
 * which is meant to); it publishes them (waits.py) for a reader of a stuck pool. With `wait` 0 a lock
 * still busy after the spin is not waited for: LOCK_BUSY, nothing taken (not counted: the wait
 * for it that follows is). */
static int lock_get(Native *n, int i, Holder *dead, int wait) {
    uint64_t t0 = 0;
    int contended = 0;
    pthread_mutex_t *m = lock_mutex(n, i);
    int rc = mutex_taken(m, pthread_mutex_trylock(m));
    if (rc == EBUSY) {
        /* (the wait is timed from the first busy look: a free lock, most takes, costs no clock
         * read before it) */
        t0 = mono_ns();
        contended = 1;
        rc = mutex_taken(m, mutex_spin(m));
    }
    if (rc != 0) {
        if (rc != EBUSY) return lock_failed(n, i, rc);
        if (!wait) return LOCK_BUSY;
        /* Waiting releases the GIL: hold the op mutex meanwhile, so that no other thread of
         * this process starts an operation on the handle. */
        if ((rc = hold_mutex(n)) != OK) return rc;
        U8(n->seg + n->c_wait) = (uint64_t)(i + 1) | ((uint64_t)(i + 1) << 32);
        if (n->keep_gil) /* (the gil-wait fault: the GIL kept through the wait) */
            rc = mutex_taken(m, pthread_mutex_lock(m));
        else {
            int yield = n->held == 0;
            Py_BEGIN_ALLOW_THREADS rc = mutex_taken(m, mutex_wait_for(m, yield));
            Py_END_ALLOW_THREADS
        }
        U8(n->seg + n->c_wait) = 0;
        if (rc != 0) return lock_failed(n, i, rc);
    }
    uint8_t *r = n->seg + n->off_locks + (size_t)i * LOCK_SIZE;
    /* A live holder clears the record before it unlocks, and the kernel unlocks at exit: a
     * holder named in a record whose mutex we now hold is dead. */
    if (I4(r + LF_HOLDER_PID)) {
        if (dead == NULL) {
            pthread_mutex_unlock(m);
            return HOLDER_DEAD;
        }
        dead->pid = I4(r + LF_HOLDER_PID);
        dead->client = I4(r + LF_HOLDER_CLIENT);
        I4(r + LF_HOLDER_PID) = 0;
        if (U8(r + LF_SEQ) % 2) U8(r + LF_SEQ) += 1;
    }
    uint64_t t1 = mono_ns();
    /* Holder first, then make the counter odd: a death in between leaves a named dead holder. */
    I4(r + LF_HOLDER_PID) = n->pid;
    I4(r + LF_HOLDER_CLIENT) = n->client;
    U8(r + LF_HOLDER_START) = n->start;
    /* the thread id glibc keeps in the mutex it holds (what gettid(2) would say) */
    U8(r + LF_HOLDER_TID) = (uint64_t)(uint32_t)m->__data.__owner;
    U8(r + LF_ACQUIRED) = t1;
    uint64_t seq = U8(r + LF_SEQ);
    U8(r + LF_SEQ) = seq + (seq % 2 == 0 ? 1 : 2);
    U8(r + LF_ACQUIRES) += 1;
    if (contended) {
        U8(r + LF_CONTENDED) += 1;
        U8(r + LF_WAIT) += t1 - t0;
    }
    n->held |= lock_bit(i);
    n->op_thread = PyThread_get_thread_ident();
    return OK;
}

static inline int lock_take_as(Native *n, int i, Holder *dead) { return lock_get(n, i, dead, 1); }

static inline int lock_take(Native *n, int i) { return lock_take_as(n, i, NULL); }

static int recover_holders(Native *n, PyObject *recovered);

/* Take lock i while holding no other (waiting for it, and for the op mutex): a dead holder is
 * recovered and the take retried. OK, or ERROR with an exception set. */
static int lock_take_alone(Native *n, int i) {
    int rc;
    while ((rc = lock_take(n, i)) == HOLDER_DEAD)
        if ((rc = recover_holders(n, NULL)) != OK) return rc;
    return rc;
}

static void lock_drop(Native *n, int i) {
    uint8_t *r = n->seg + n->off_locks + (size_t)i * LOCK_SIZE;
    uint64_t held = mono_ns() - U8(r + LF_ACQUIRED);
    U8(r + LF_HOLD) += held;
    if (held > U8(r + LF_MAX_HOLD)) U8(r + LF_MAX_HOLD) = held;
    /* Counter even first, then clear the holder. */
    U8(r + LF_SEQ) += 1;
    I4(r + LF_HOLDER_PID) = 0;
    pthread_mutex_unlock(lock_mutex(n, i));
    n->held &= ~lock_bit(i);
}

static void release_all(Native *n) {
    for (int i = n->num_locks - 1; i >= 0; i--)
        if (holds(n, i)) lock_drop(n, i);
}

static inline void client_seq_bump(Native *n) {
    /* (a record borrowed to reclaim its dead owner: recovery.c reclaim_for_attach) */
    if (n->borrowed) return;
    uint64_t *p = (uint64_t *)(n->seg + n->c_seq), old = *p;
    __atomic_store_n(p, old + 1, __ATOMIC_RELEASE);
    /* the leaks probe's live-slot cache follows this core's own transactions (anything
     * else that moved it still shows as a difference: a rescan) */
    if (n->maybe_valid && n->seen_seq[n->client] == old) n->seen_seq[n->client] = old + 1;
}

static int recover_own_journal(Native *n);
static int gil_wait_report(Native *n, int i);

static int txn_begin(Native *n, uint64_t mask) {
    n->n_pre = 0;
    n->exhausted_need = 0;
    /* (an operation that failed after its commit left findings: they stand, as it does) */
    n->pend_hold = 0;
    if (n->n_pend) findings_flush(n);
    int invert = faults_armed(n) && lock_inversion(n, mask);
    int gil = faults_armed(n) && !invert ? gil_wait(n, mask) : -1;
    int rc = OK;
    if (n->probes & P_LOCKDEP) rc = invert ? lockdep_inverted_ok(n, mask) : lockdep_ok(n, mask);
    if (rc == OK && gil >= 0 && (n->probes & P_LOCKDEP)) rc = gil_wait_report(n, gil);
    /* The K/V checks of a pool whose data this process does not map are queued under the op
     * mutex (devchecks.c dev_check, inside the transaction): it is taken first, holding no
     * pool lock. */
    if (rc == OK && n->dev != NULL) rc = hold_mutex(n);
    if (rc == OK && (U4(n->seg + n->c_jcount) || U4(n->seg + n->c_jused))) {
        rc = recover_own_journal(n);
    }
    if (rc != OK) {
        n->dry_valid = 0;
        return rc;
    }
    client_seq_bump(n);
    if (++n->txn_stamp == 0) n->txn_stamp = 1; /* records the magic probe checked: none */
    n->jcount = n->jused = 0;
    n->own_n = 0;
    n->n_kvs = 0;
    n->n_poison = n->n_evicted = 0; /* (commit_poison's lists: this transaction's) */
    for (int k = 0; k < n->num_locks; k++) {
        int i = invert ? n->num_locks - 1 - k : k;
        if (!(mask & lock_bit(i)) || holds(n, i)) continue;
        /* Holding others, a busy lock is not waited for (its wait would keep them from every
         * process that wants them meanwhile): let go of them, wait for it alone, and take the
         * rest again the same way, keeping it (a lock is waited for only while none is held:
         * no wait closes a cycle, whatever the order the rest are taken in). The lock-inversion
         * fault waits holding them, as it is meant to. */
        n->keep_gil = i == gil;
        rc = lock_get(n, i, NULL, !invert && n->held ? 0 : 1);
        n->keep_gil = 0;
        if (rc == OK) continue;
        release_all(n);
        client_seq_bump(n);
        /* A lock a dead process held: recover (every lock, in order); the op mutex another
         * thread holds: wait for it, holding none. Then begin again. */
        if (rc == HOLDER_DEAD) rc = recover_holders(n, NULL);
        else if (rc == MUTEX_LATER)
            rc = hold_mutex(n);
        else if (rc == LOCK_BUSY) {
            n->keep_gil = i == gil;
            rc = lock_take(n, i);
            n->keep_gil = 0;
            if (rc == HOLDER_DEAD) rc = recover_holders(n, NULL);
        }
        if (rc != OK) {
            n->dry_valid = 0;
            return ERROR;
        }
        client_seq_bump(n);
        k = -1;
    }
    if (invert) fault_fired(n, FT_LOCK_INVERSION);
    if (gil >= 0) fault_fired(n, FT_GIL_WAIT);
    if (mask) crash_point(n, CP_AFTER_LOCKS);
    return OK;
}

static void txn_commit(Native *n) {
    n->dry_valid = 0;
    crash_point(n, CP_BEFORE_COMMIT);
    jcommit(n);
    n->own_n = 0; /* (its changes to the leaks probe's counts stand: sequences.c own_note) */
    lru_commit(n); /* (under the free lock, still held) */
    release_all(n);
    client_seq_bump(n);
    count(n, C_EVICTIONS, (uint64_t)n->pend_evicted);
    n->evicted += (uint64_t)n->pend_evicted;
    n->pend_evicted = 0;
    findings_flush(n);
}

static void txn_abort(Native *n) {
    n->dry_valid = 0;
    jrollback(n);
    if (n->own_valid) own_rollback(n);
    n->own_n = 0;
    /* (counted and recorded before the locks go: the record is the free lock holder's) */
    if (n->exhausted_need > 0 && !PyErr_Occurred()) exhausted_note(n, n->exhausted_need);
    release_all(n);
    client_seq_bump(n);
    n->pend_evicted = 0;
    lru_drop_pending(n);
    n->n_pre = 0;
    findings_drop(n);
    if (n->exhausted_need > 0 && !PyErr_Occurred()) raise_exhausted(n, n->exhausted_need);
    n->exhausted_need = 0;
}
