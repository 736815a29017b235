/* kvscope.allocator._native: the pool's hot operations in C, on the same segment bytes.
 *
 * The Python allocator (seqops.py, append.py, release.py, blocks.py, ...) is the reference and
 * does everything; this module does the common case of allocate (with LRU eviction),
 * free/abort, a one-token append, mark_computed and fork, with the same writes, the same
 * journal, the same locks and the same checksums, so check(), recovery, dumps and the TUI
 * cannot tell which path wrote a record (tests/test_native.py compares the two byte for byte).
 *
 * Whatever is not the common case is left to Python: every entry point returns None, with
 * nothing changed, when it meets one (a slot reserve to refill, preemption, copy-on-write, a
 * lock whose record names a dead holder, a journal too small, a prompt longer than one
 * chunk...), and the Python method then runs its own path. Probes, armed faults and crash
 * points keep every call on the Python path (`gate`).
 *
 * Transactions follow docs/FORMAT.md: the client's seq goes odd, locks are taken in the one
 * order (ascending lock index), the old bytes of every shared write are saved in the client's
 * undo journal first (entry count stored last), commit stores 0 into the count, then the locks
 * are released and seq goes even. A process killed anywhere leaves a journal that recovery
 * rolls back, exactly as for the Python path.
 *
 * Threads: the C core runs with the GIL held, so no other thread of this process runs while it
 * does; a Python-path operation of another thread may be half done, though (it holds the
 * mapping's op mutex and counts itself in `busy`): then the call returns None and the Python
 * path waits for the mutex. The GIL is released only to wait for another process's fcntl
 * lock, and then the core holds the op mutex itself (taken without blocking, or it falls back).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define BLOCK_MAGIC 0x4B56424Bu
#define REQUEST_BYTES 32
#define MAX_LOCKS 64
#define CHUNK 128

enum { B_FREE = 0, B_ALLOCATED = 1, B_CACHED = 2, B_LOCAL = 3 };
enum { S_EMPTY = 0, S_RUNNING = 1 };
enum { OK = 0, FALLBACK = 1, ERROR = -1 };

/* Block record fields (allocator/layout.py block_dtype; the same offsets at every block size). */
#define BF_STATE 4
#define BF_INDEXED 5
#define BF_REFCOUNT 8
#define BF_GENERATION 12
#define BF_OWNER_PID 16
#define BF_OWNER_CLIENT 20
#define BF_PREFIX_HASH 24
#define BF_CHECKSUM 32
#define BF_OWNER_START 40
#define BF_REQUEST 48
#define BF_ALLOC_NS 80
#define BF_ACCESS_NS 88
#define BF_SITE 96
#define BF_NUM_TOKENS 100
#define BF_PARENT_HASH 104
#define BF_TOKENS 120
/* Sequence-table record fields (seq_dtype). */
#define SF_STATE 0
#define SF_RESERVED 1
#define SF_OWNER_PID 4
#define SF_OWNER_CLIENT 8
#define SF_NUM_BLOCKS 12
#define SF_OWNER_START 16
#define SF_SEQ_ID 24
#define SF_REQUEST 32
#define SF_NUM_TOKENS 64
#define SF_CREATED_NS 72
#define SF_TABLE 80
/* Lock record fields (LOCK_DTYPE, 96 bytes). */
#define LOCK_SIZE 96
#define LF_SEQ 16
#define LF_HOLDER_PID 24
#define LF_HOLDER_CLIENT 28
#define LF_HOLDER_START 32
#define LF_HOLDER_TID 40
#define LF_ACQUIRED 48
#define LF_ACQUIRES 56
#define LF_CONTENDED 64
#define LF_WAIT 72
#define LF_HOLD 80
#define LF_MAX_HOLD 88
/* Ring header (RING_HEADER_DTYPE) and index entries (INDEX_DTYPE). */
#define RING_HEAD 0
#define RING_TAIL 8
#define RING_COUNT 16
#define RING_ALLOCS 24
#define RING_IDS 32
#define INDEX_ENTRY 16
/* Journal entry {offset u8, length u4, data_off u4, op u8}. */
#define JENTRY 24
/* COUNTER_FIELDS order. */
enum { C_ALLOCS, C_FREES, C_COW, C_EVICTIONS, C_PREEMPTIONS, C_QUERIES, C_HITS, C_FORKS };

static const uint64_t KSUM[5] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
                                 0x27D4EB2F165667C5ull, 0xFF51AFD7ED558CCDull};
static const uint64_t CHAIN_P = 0x100000001B3ull;

static inline uint64_t wall_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t fmix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    return h ? h : 1;
}

/* prefix.family_key: `key` moved into the shard of the prompt's first key. */
static inline uint64_t family_key(uint64_t key, uint64_t first, uint64_t mask) {
    uint64_t k = (key & ~mask) | (first & mask);
    return k ? k : mask + 1;
}

#define U8(p) (*(uint64_t *)(p))
#define U4(p) (*(uint32_t *)(p))
#define I4(p) (*(int32_t *)(p))

typedef struct {
    PyObject_HEAD
    Py_buffer buf; /* the segment mapping, writable */
    uint8_t *seg;
    int fd;
    /* geometry */
    int64_t nb, bs, rec, max_seqs, seq_rec, max_bps, index_w, num_shards;
    size_t off_blocks, off_ring, off_index, off_seqs, off_locks, off_next_seq_id;
    /* this client's record: absolute offsets of its fields */
    size_t c_seq, c_local_count, c_local, c_jcount, c_jused, c_journal, c_jdata, c_counters;
    uint32_t j_entries, j_bytes;
    int client, lock_free, lock_shard0, num_locks;
    int32_t pid;
    uint64_t start;
    int64_t local_cap, local_max, slot_batch;
    PyObject *reserve; /* SeqTable.reserve: this process's reserved slots (a list, shared) */
    PyObject *ids;     /* SeqTable.ids: [next_id, end_id] (a list, shared) */
    PyObject *mutex;   /* KVPool._mutex: the mapping's op mutex (an RLock) */
    int64_t *busy;     /* the mapping's count of Python-path operations under that mutex */
    Py_buffer busy_buf;
    int64_t *hooks;    /* KVPool._hooks: probe hooks set on the handle (0: none) */
    Py_buffer hooks_buf;
    int mutex_held;    /* this call took the mutex to wait for an fcntl lock */
    PyObject *seq_type;     /* allocator.sequence.Sequence */
    PyObject *seq_fields;   /* its dataclass field names, in order (a tuple of 10) */
    Py_ssize_t seq_off[10]; /* their __slots__ offsets in an instance */
    PyObject *seqs;         /* KVPool._seqs: slot -> Sequence */
    PyObject *faults_armed; /* faults.ARMED */
    PyObject *crash_mod;    /* allocator.crash (its _target is read at every call) */
    int64_t uid;            /* KVPool._uid */
    PyObject *store;        /* KVPool.store: its remembered LRU candidates (eviction.py) */
    /* Done at commit: evictions to count, the LRU candidates' advance (eviction._lru_take). */
    int64_t pend_evicted;
    PyObject *pend_lru; /* the candidate list consumed from, or NULL */
    /* A scan's remembered candidates (eviction._lru_reset at commit), or pend_scan_n < 0. */
    int32_t *pend_scan_ids;
    uint64_t *pend_scan_ns;
    int64_t pend_scan_n, pend_scan_cached;
    PyObject *evict_mod; /* allocator.eviction (its LRU_KEEP is read at every scan) */
    Py_ssize_t pend_pos;
    int64_t pend_taken;
    int fork_gen;
    uint64_t *coefs;   /* prefix._COEFS[:bs] */
    /* the open transaction */
    uint32_t jcount, jused;
    uint64_t held; /* bit i: lock i */
    uint64_t acquired[MAX_LOCKS];
    int64_t crash_at; /* tests: SIGKILL at the n-th journal save (0: off) */
    uint64_t native_ops, fallbacks, native_evictions;
} Native;

static PyObject *s_acquire, *s_release, *s_target, *s_running, *s_finished, *s_aborted,
    *s_lru_ids, *s_lru_ns, *s_lru_pos, *s_lru_cached;

/* -- records --------------------------------------------------------------------------------- */

static inline uint8_t *blk(Native *n, int64_t b) { return n->seg + n->off_blocks + b * n->rec; }
static inline uint8_t *seqrec(Native *n, int64_t s) {
    return n->seg + n->off_seqs + s * n->seq_rec;
}
static inline uint8_t *idx_entry(Native *n, int64_t i) {
    return n->seg + n->off_index + i * INDEX_ENTRY;
}
static inline uint8_t *ringh(Native *n) { return n->seg + n->off_ring; }

/* The index shard (and lock) that owns a key. */
static inline int64_t shard_of(Native *n, uint64_t key) {
    return (int64_t)(key & (uint64_t)(n->num_shards - 1));
}

/* checksums.checksum_of_words over the record's 4 identity words. */
static inline uint64_t checksum(Native *n, int64_t b) {
    uint64_t *w = (uint64_t *)blk(n, b);
    uint64_t h = w[0] * KSUM[0] + w[1] * KSUM[1] + w[2] * KSUM[2] + w[3] * KSUM[3] +
                 (uint64_t)b * KSUM[4];
    h ^= h >> 29;
    h *= KSUM[0];
    return h ^ (h >> 32);
}

static inline void seal(Native *n, int64_t b) { U8(blk(n, b) + BF_CHECKSUM) = checksum(n, b); }

/* -- the journal ------------------------------------------------------------------------------ */

static int jsave(Native *n, size_t off, uint32_t len) {
    if (n->jcount + 1 > n->j_entries || n->jused + len > n->j_bytes) return FALLBACK;
    if (n->crash_at > 0 && --n->crash_at == 0) kill(getpid(), SIGKILL);
    uint8_t *e = n->seg + n->c_journal + (size_t)n->jcount * JENTRY;
    U8(e) = off;
    U4(e + 8) = len;
    U4(e + 12) = n->jused;
    U8(e + 16) = 0;
    memcpy(n->seg + n->c_jdata + n->jused, n->seg + off, len);
    n->jused += len;
    n->jcount += 1;
    U4(n->seg + n->c_jused) = n->jused;
    /* The count is written last: an entry exists only once its bytes are saved. */
    __atomic_store_n((uint32_t *)(n->seg + n->c_jcount), n->jcount, __ATOMIC_RELEASE);
    return OK;
}

static inline int jsave_block(Native *n, int64_t b) {
    return jsave(n, n->off_blocks + b * n->rec, (uint32_t)n->rec);
}

static void jrollback(Native *n) {
    for (int64_t i = (int64_t)n->jcount - 1; i >= 0; i--) {
        uint8_t *e = n->seg + n->c_journal + (size_t)i * JENTRY;
        memcpy(n->seg + U8(e), n->seg + n->c_jdata + U4(e + 12), U4(e + 8));
    }
    __atomic_store_n((uint32_t *)(n->seg + n->c_jcount), 0, __ATOMIC_RELEASE);
    U4(n->seg + n->c_jused) = 0;
    n->jcount = n->jused = 0;
}

static void jcommit(Native *n) {
    if (n->jcount || n->jused) {
        __atomic_store_n((uint32_t *)(n->seg + n->c_jcount), 0, __ATOMIC_RELEASE);
        U4(n->seg + n->c_jused) = 0;
    }
    n->jcount = n->jused = 0;
}

/* -- locks ------------------------------------------------------------------------------------ */

static int lock_fcntl(Native *n, int i, short type, int wait) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = type;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)(n->off_locks + (size_t)i * LOCK_SIZE);
    fl.l_len = 1;
    int r;
    if (!wait) return fcntl(n->fd, F_SETLK, &fl);
    Py_BEGIN_ALLOW_THREADS r = fcntl(n->fd, F_SETLKW, &fl);
    Py_END_ALLOW_THREADS return r;
}

/* Take lock i as LockTable.acquire does; FALLBACK (not taken) when its record names a dead
 * holder or the kernel refuses (EDEADLK): the Python path then recovers or reports. */
static int lock_take(Native *n, int i) {
    uint64_t t0 = mono_ns();
    int contended = 0;
    if (lock_fcntl(n, i, F_WRLCK, 0) != 0) {
        if (errno != EAGAIN && errno != EACCES) return FALLBACK;
        contended = 1;
        /* Waiting releases the GIL: hold the op mutex meanwhile, so that no other thread of
         * this process starts an operation on the mapping (fcntl locks do not exclude it). */
        if (!n->mutex_held) {
            PyObject *r = PyObject_CallMethodObjArgs(n->mutex, s_acquire, Py_False, NULL);
            int ok = r == Py_True;
            Py_XDECREF(r);
            if (!ok) {
                PyErr_Clear();
                return FALLBACK;
            }
            n->mutex_held = 1;
            *n->busy += 1;
        }
        if (lock_fcntl(n, i, F_WRLCK, 1) != 0) return FALLBACK;
    }
    uint8_t *r = n->seg + n->off_locks + (size_t)i * LOCK_SIZE;
    if (I4(r + LF_HOLDER_PID)) {
        lock_fcntl(n, i, F_UNLCK, 0);
        return FALLBACK;
    }
    uint64_t t1 = mono_ns();
    /* Holder first, then make the counter odd: a death in between leaves a named dead holder. */
    I4(r + LF_HOLDER_PID) = n->pid;
    I4(r + LF_HOLDER_CLIENT) = n->client;
    U8(r + LF_HOLDER_START) = n->start;
    U8(r + LF_HOLDER_TID) = (uint64_t)syscall(SYS_gettid);
    U8(r + LF_ACQUIRED) = t1;
    uint64_t seq = U8(r + LF_SEQ);
    U8(r + LF_SEQ) = seq + (seq % 2 == 0 ? 1 : 2);
    U8(r + LF_ACQUIRES) += 1;
    if (contended) {
        U8(r + LF_CONTENDED) += 1;
        U8(r + LF_WAIT) += t1 - t0;
    }
    n->held |= 1ull << i;
    return OK;
}

static void lock_drop(Native *n, int i) {
    uint8_t *r = n->seg + n->off_locks + (size_t)i * LOCK_SIZE;
    uint64_t held = mono_ns() - U8(r + LF_ACQUIRED);
    U8(r + LF_HOLD) += held;
    if (held > U8(r + LF_MAX_HOLD)) U8(r + LF_MAX_HOLD) = held;
    /* Counter even first, then clear the holder. */
    U8(r + LF_SEQ) += 1;
    I4(r + LF_HOLDER_PID) = 0;
    lock_fcntl(n, i, F_UNLCK, 0);
    n->held &= ~(1ull << i);
}

static void release_all(Native *n) {
    for (int i = n->num_locks - 1; i >= 0; i--)
        if (n->held & (1ull << i)) lock_drop(n, i);
}

static inline void client_seq_bump(Native *n) {
    uint64_t *p = (uint64_t *)(n->seg + n->c_seq);
    __atomic_store_n(p, *p + 1, __ATOMIC_RELEASE);
}

/* Begin: seq odd, then every lock of `mask` in ascending order. */
static int txn_begin(Native *n, uint64_t mask) {
    client_seq_bump(n);
    n->jcount = U4(n->seg + n->c_jcount);
    n->jused = U4(n->seg + n->c_jused);
    if (n->jcount || n->jused) {
        /* Never on top of an open journal (Python left one: let it deal with it). */
        client_seq_bump(n);
        return FALLBACK;
    }
    for (int i = 0; i < n->num_locks; i++) {
        if (!(mask & (1ull << i))) continue;
        if (lock_take(n, i) != OK) {
            release_all(n);
            client_seq_bump(n);
            return FALLBACK;
        }
    }
    return OK;
}

static inline void count(Native *n, int field, uint64_t k) {
    if (k) U8(n->seg + n->c_counters + 8 * (size_t)field) += k;
}

static PyObject *field(PyObject *obj, PyObject *name);

/* Set the store's remembered-candidate fields (eviction.py; NULL: leave that one). */
static void set_lru(Native *n, PyObject *ids, PyObject *ns, PyObject *pos, PyObject *cached) {
    PyObject *names[4] = {s_lru_ids, s_lru_ns, s_lru_pos, s_lru_cached};
    PyObject *values[4] = {ids, ns, pos, cached};
    for (int i = 0; i < 4; i++)
        if (values[i] && PyObject_SetAttr(n->store, names[i], values[i])) PyErr_Clear();
}

/* eviction._lru_take's `advance`, after commit: the consumed candidates are gone. */
static void lru_advance(Native *n) {
    PyObject *ids = field(n->store, s_lru_ids);
    PyObject *pos = field(n->store, s_lru_pos);
    PyObject *cached = field(n->store, s_lru_cached);
    if (ids && pos && cached && ids == n->pend_lru) {
        Py_ssize_t p = PyLong_AsSsize_t(pos);
        int64_t c = PyLong_AsLongLong(cached) - n->pend_taken;
        PyObject *np = PyLong_FromSsize_t(p > n->pend_pos ? p : n->pend_pos);
        PyObject *nc = PyLong_FromLongLong(c > 0 ? c : 0);
        if (np && nc) set_lru(n, NULL, NULL, np, nc);
        Py_XDECREF(np);
        Py_XDECREF(nc);
    }
    Py_XDECREF(ids);
    Py_XDECREF(pos);
    Py_XDECREF(cached);
    if (PyErr_Occurred()) PyErr_Clear();
}

/* eviction._lru_reset, after commit: a scan's later candidates become the remembered ones. */
static void lru_reset(Native *n) {
    int64_t m = n->pend_scan_n;
    PyObject *ids = PyList_New(m), *ns = PyList_New(m);
    PyObject *zero = PyLong_FromLong(0), *cached = PyLong_FromLongLong(n->pend_scan_cached);
    if (ids && ns && zero && cached) {
        for (int64_t i = 0; i < m; i++) {
            PyList_SET_ITEM(ids, i, PyLong_FromLong(n->pend_scan_ids[i]));
            PyList_SET_ITEM(ns, i, PyLong_FromUnsignedLongLong(n->pend_scan_ns[i]));
        }
        set_lru(n, ids, ns, zero, cached);
    }
    Py_XDECREF(ids);
    Py_XDECREF(ns);
    Py_XDECREF(zero);
    Py_XDECREF(cached);
    if (PyErr_Occurred()) PyErr_Clear();
}

static void drop_pending_scan(Native *n) {
    PyMem_Free(n->pend_scan_ids);
    PyMem_Free(n->pend_scan_ns);
    n->pend_scan_ids = NULL;
    n->pend_scan_ns = NULL;
    n->pend_scan_n = -1;
}

static void txn_commit(Native *n) {
    jcommit(n);
    release_all(n);
    client_seq_bump(n);
    count(n, C_EVICTIONS, (uint64_t)n->pend_evicted);
    n->native_evictions += (uint64_t)n->pend_evicted;
    n->pend_evicted = 0;
    if (n->pend_lru) {
        lru_advance(n);
        Py_CLEAR(n->pend_lru);
    }
    if (n->pend_scan_n >= 0) {
        lru_reset(n);
        drop_pending_scan(n);
    }
}

static void txn_abort(Native *n) {
    jrollback(n);
    release_all(n);
    client_seq_bump(n);
    n->pend_evicted = 0;
    Py_CLEAR(n->pend_lru);
    drop_pending_scan(n);
}

/* -- blocks ----------------------------------------------------------------------------------- */

static inline uint32_t local_count(Native *n) { return U4(n->seg + n->c_local_count); }
static inline int32_t *local_arr(Native *n) { return (int32_t *)(n->seg + n->c_local); }

/* BlockStore.local_pop: up to k ids from the end of the local cache, in array order. */
static int local_pop(Native *n, int64_t k, int32_t *out, int64_t *got) {
    uint32_t c = local_count(n);
    if (k > c) k = c;
    *got = k;
    if (k == 0) return OK;
    if (jsave(n, n->c_local_count, 4)) return FALLBACK;
    memcpy(out, local_arr(n) + (c - k), 4 * (size_t)k);
    U4(n->seg + n->c_local_count) = (uint32_t)(c - k);
    return OK;
}

/* RingOps.ring_pop (no quarantine: pools with one stay on the Python path). Free lock held. */
static int ring_pop(Native *n, int64_t k, int32_t *out, int64_t *got) {
    uint8_t *h = ringh(n);
    uint32_t cnt = U4(h + RING_COUNT);
    if (k > cnt) k = cnt;
    uint64_t head = U8(h + RING_HEAD);
    int32_t *ring = (int32_t *)(h + RING_IDS);
    for (int64_t i = 0; i < k; i++) out[i] = ring[(head + (uint64_t)i) % (uint64_t)n->nb];
    if (jsave(n, n->off_ring, RING_IDS)) return FALLBACK;
    U8(h + RING_HEAD) = head + (uint64_t)k;
    U4(h + RING_COUNT) = cnt - (uint32_t)k;
    U8(h + RING_ALLOCS) += (uint64_t)k;
    *got = k;
    return OK;
}

/* RingOps._push_raw + ring_push's record reset (state FREE). Free lock held. */
static int ring_push(Native *n, const int32_t *ids, int64_t k) {
    if (k == 0) return OK;
    for (int64_t i = 0; i < k; i++)
        if (jsave_block(n, ids[i])) return FALLBACK;
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        r[BF_STATE] = B_FREE;
        I4(r + BF_REFCOUNT) = 0;
        r[BF_INDEXED] = 0;
        I4(r + BF_OWNER_CLIENT) = -1;
        seal(n, ids[i]);
    }
    uint8_t *h = ringh(n);
    uint64_t tail = U8(h + RING_TAIL);
    if (jsave(n, n->off_ring, RING_IDS)) return FALLBACK;
    uint64_t first = tail % (uint64_t)n->nb;
    uint64_t n1 = (uint64_t)k < (uint64_t)n->nb - first ? (uint64_t)k : (uint64_t)n->nb - first;
    if (jsave(n, n->off_ring + RING_IDS + 4 * first, (uint32_t)(4 * n1))) return FALLBACK;
    if (n1 < (uint64_t)k && jsave(n, n->off_ring + RING_IDS, (uint32_t)(4 * ((uint64_t)k - n1))))
        return FALLBACK;
    int32_t *ring = (int32_t *)(h + RING_IDS);
    for (int64_t i = 0; i < k; i++) ring[(tail + (uint64_t)i) % (uint64_t)n->nb] = ids[i];
    U8(h + RING_TAIL) = tail + (uint64_t)k;
    U4(h + RING_COUNT) += (uint32_t)k;
    return OK;
}

/* BlockStore.local_push: park blocks as LOCAL; *rest = how many (from the end) did not fit. */
static int local_push(Native *n, const int32_t *ids, int64_t k, int64_t *fit_out) {
    uint32_t c = local_count(n);
    int64_t room = n->local_max - (int64_t)c;
    if (room < 0) room = 0;
    int64_t fit = k < room ? k : room;
    *fit_out = fit;
    if (fit == 0) return OK;
    for (int64_t i = 0; i < fit; i++)
        if (jsave_block(n, ids[i])) return FALLBACK;
    for (int64_t i = 0; i < fit; i++) {
        uint8_t *r = blk(n, ids[i]);
        r[BF_STATE] = B_LOCAL;
        I4(r + BF_REFCOUNT) = 0;
        r[BF_INDEXED] = 0;
        seal(n, ids[i]);
    }
    if (jsave(n, n->c_local_count, 4)) return FALLBACK;
    if (jsave(n, n->c_local + 4 * (size_t)c, (uint32_t)(4 * fit))) return FALLBACK;
    memcpy(local_arr(n) + c, ids, 4 * (size_t)fit);
    U4(n->seg + n->c_local_count) = c + (uint32_t)fit;
    return OK;
}

/* BlockStore.refill: a batch of FREE blocks from the ring into the local cache. */
static int refill(Native *n) {
    int64_t want = n->local_cap - (int64_t)local_count(n);
    if (want < 0) want = 0;
    int32_t ids[64];
    int64_t got;
    if (ring_pop(n, want, ids, &got)) return FALLBACK;
    for (int64_t i = 0; i < got; i++)
        if (jsave_block(n, ids[i])) return FALLBACK;
    for (int64_t i = 0; i < got; i++) {
        uint8_t *r = blk(n, ids[i]);
        I4(r + BF_OWNER_PID) = n->pid;
        I4(r + BF_OWNER_CLIENT) = n->client;
        U8(r + BF_OWNER_START) = n->start;
    }
    int64_t fit;
    return local_push(n, ids, got, &fit);
}

/* -- eviction (eviction.py) -------------------------------------------------------------------- */

#define EVICT_BATCH 32

/* PrefixIndex.remove: unindex `key` -> `block` with backward-shift deletion (shard lock). */
static int index_remove(Native *n, uint64_t key, int32_t block, int *removed) {
    int64_t base = shard_of(n, key) * n->index_w, w = n->index_w;
    int64_t i = (int64_t)((key >> 16) % (uint64_t)w), s;
    *removed = 0;
    for (s = 0; s < w; s++) {
        uint8_t *e = idx_entry(n, base + i);
        if (U8(e) == 0) return OK;
        if (U8(e) == key && I4(e + 8) == block) break;
        i = (i + 1) % w;
    }
    if (s == w) return OK;
    int64_t hole = i, j = (i + 1) % w;
    for (s = 0; s < w - 1; s++) {
        uint8_t *ej = idx_entry(n, base + j);
        uint64_t kj = U8(ej);
        if (kj == 0) break;
        int64_t home = (int64_t)((kj >> 16) % (uint64_t)w);
        /* Move entry j into the hole if its home is not in the cyclic range (hole, j]. */
        if (((j - home) % w + w) % w >= ((j - hole) % w + w) % w) {
            if (jsave(n, n->off_index + (size_t)(base + hole) * INDEX_ENTRY, INDEX_ENTRY))
                return FALLBACK;
            uint8_t *eh = idx_entry(n, base + hole);
            U8(eh) = kj;
            I4(eh + 8) = I4(ej + 8);
            hole = j;
        }
        j = (j + 1) % w;
    }
    if (jsave(n, n->off_index + (size_t)(base + hole) * INDEX_ENTRY, INDEX_ENTRY)) return FALLBACK;
    uint8_t *eh = idx_entry(n, base + hole);
    U8(eh) = 0;
    I4(eh + 8) = -1;
    *removed = 1;
    return OK;
}

/* eviction._lru_take: the next k (+ extra) remembered candidates still CACHED and untouched
 * since the scan; FALLBACK when fewer than k are left (Python scans the pool). */
static int lru_take(Native *n, int64_t k, int64_t extra, int32_t *cand, int64_t *ncand,
                    int dry) {
    PyObject *ids = field(n->store, s_lru_ids), *stamps = field(n->store, s_lru_ns);
    PyObject *pos_o = field(n->store, s_lru_pos), *cached_o = field(n->store, s_lru_cached);
    int rc = FALLBACK;
    if (!ids || !stamps || !pos_o || !cached_o || !PyList_CheckExact(ids) ||
        !PyList_CheckExact(stamps) || PyList_GET_SIZE(stamps) != PyList_GET_SIZE(ids))
        goto out;
    Py_ssize_t pos = PyLong_AsSsize_t(pos_o);
    int64_t cached = PyLong_AsLongLong(cached_o);
    if (PyErr_Occurred()) goto out;
    int64_t spare = cached - k > 0 ? (cached - k) / 4 : 0;
    int64_t want = k + (extra < spare ? extra : spare), got = 0;
    Py_ssize_t len = PyList_GET_SIZE(ids);
    while (pos < len && got < want) {
        long b = PyLong_AsLong(PyList_GET_ITEM(ids, pos));
        uint64_t st = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(stamps, pos));
        if (PyErr_Occurred()) goto out;
        if (b >= 0 && b < n->nb) {
            uint8_t *r = blk(n, b);
            if (r[BF_STATE] == B_CACHED && U8(r + BF_ACCESS_NS) == st) cand[got++] = (int32_t)b;
        }
        pos++;
    }
    if (got < k && dry) goto out;
    if (got < k) {
        /* eviction._lru_take: forget the exhausted candidates (at once, not at commit). */
        PyObject *e1 = PyList_New(0), *e2 = PyList_New(0), *z = PyLong_FromLong(0);
        if (e1 && e2 && z) set_lru(n, e1, e2, z, NULL);
        Py_XDECREF(e1);
        Py_XDECREF(e2);
        Py_XDECREF(z);
        goto out;
    }
    *ncand = got;
    rc = OK;
    if (dry) goto out;
    Py_XSETREF(n->pend_lru, Py_NewRef(ids));
    n->pend_pos = pos;
    n->pend_taken = got;
    rc = OK;
out:
    if (PyErr_Occurred()) PyErr_Clear();
    Py_XDECREF(ids);
    Py_XDECREF(stamps);
    Py_XDECREF(pos_o);
    Py_XDECREF(cached_o);
    return rc;
}

typedef struct {
    uint64_t ns;
    int32_t id;
} Aged;

static inline int aged_lt(const Aged *a, const Aged *b) {
    return a->ns < b->ns || (a->ns == b->ns && a->id < b->id);
}

static int aged_cmp(const void *a, const void *b) {
    return aged_lt(a, b) ? -1 : aged_lt(b, a) ? 1 : 0;
}

/* Put the `keep` smallest of a[0..m) (by access time, then id) first (quickselect). */
static void select_oldest(Aged *a, int64_t m, int64_t keep) {
    int64_t lo = 0, hi = m - 1;
    uint64_t seed = 0x9E3779B97F4A7C15ull;
    while (lo < hi) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        Aged pivot = a[lo + (int64_t)((seed >> 33) % (uint64_t)(hi - lo + 1))];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (aged_lt(&a[i], &pivot)) i++;
            while (aged_lt(&pivot, &a[j])) j--;
            if (i <= j) {
                Aged t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (keep - 1 <= j)
            hi = j;
        else if (keep - 1 >= i)
            lo = i;
        else
            return;
    }
}

/* eviction._lru_scan: the k (+ extra) least recently used CACHED blocks into cand, oldest
 * first; a large cache also remembers the next LRU_KEEP oldest (set at commit). */
static int lru_scan(Native *n, int64_t k, int64_t extra, int32_t *cand, int64_t *ncand,
                    int dry) {
    PyObject *keep_o = PyObject_GetAttrString(n->evict_mod, "LRU_KEEP");
    int64_t lru_keep = keep_o ? PyLong_AsLongLong(keep_o) : -1;
    Py_XDECREF(keep_o);
    if (lru_keep < 0 || PyErr_Occurred()) {
        PyErr_Clear();
        return FALLBACK;
    }
    int64_t m = 0;
    for (int64_t b = 0; b < n->nb; b++) m += blk(n, b)[BF_STATE] == B_CACHED;
    if (m == 0) return FALLBACK;
    Aged *a = PyMem_Malloc(sizeof(Aged) * (size_t)m);
    if (a == NULL) return FALLBACK;
    /* Without the locks (a dry run plans them) other processes change states meanwhile: never
     * past the count of the first pass. */
    int64_t i = 0;
    for (int64_t b = 0; b < n->nb && i < m; b++) {
        uint8_t *r = blk(n, b);
        if (r[BF_STATE] == B_CACHED) a[i].ns = U8(r + BF_ACCESS_NS), a[i++].id = (int32_t)b;
    }
    m = i;
    int64_t spare = m - k > 0 ? (m - k) / 4 : 0;
    k += extra < spare ? extra : spare;
    int64_t keep = m > 2 * lru_keep + k ? k + lru_keep : k;
    if (keep > m) keep = m;
    if (m > keep) select_oldest(a, m, keep);
    qsort(a, (size_t)keep, sizeof(Aged), aged_cmp);
    int64_t take_n = k < keep ? k : keep;
    for (int64_t j = 0; j < take_n; j++) cand[j] = a[j].id;
    *ncand = take_n;
    if (keep > k && !dry) {
        drop_pending_scan(n);
        int64_t later = keep - k;
        n->pend_scan_ids = PyMem_Malloc(sizeof(int32_t) * (size_t)later);
        n->pend_scan_ns = PyMem_Malloc(sizeof(uint64_t) * (size_t)later);
        if (!n->pend_scan_ids || !n->pend_scan_ns) {
            drop_pending_scan(n);
            PyMem_Free(a);
            return FALLBACK;
        }
        for (int64_t j = 0; j < later; j++) {
            n->pend_scan_ids[j] = a[k + j].id;
            n->pend_scan_ns[j] = a[k + j].ns;
        }
        n->pend_scan_n = later;
        n->pend_scan_cached = m - k;
    }
    PyMem_Free(a);
    return OK;
}

/* ReserveOps._take's eviction step: `k` blocks into out from the LRU cached ones; up to
 * EVICT_BATCH more go to the free ring (every shard lock and the free lock held). */
static int evict_into(Native *n, int64_t k, int32_t *out) {
    if (!(n->held & (1ull << n->lock_free))) return FALLBACK;
    int32_t cand[CHUNK + EVICT_BATCH];
    int64_t nc;
    if (k > CHUNK) return FALLBACK;
    if (lru_take(n, k, EVICT_BATCH, cand, &nc, 0) && lru_scan(n, k, EVICT_BATCH, cand, &nc, 0))
        return FALLBACK;
    if (nc < k) return FALLBACK; /* preemption or PoolExhausted: the Python path */
    /* Only the candidates' shards are locked (`take_locks` found them before the locks:
     * another process may have changed the pool since; then the Python path, every shard). */
    for (int64_t i = 0; i < nc; i++)
        if (!(n->held & (1ull << (n->lock_shard0 +
                                  shard_of(n, U8(blk(n, cand[i]) + BF_PREFIX_HASH))))))
            return FALLBACK;
    /* BlockStore.evict */
    for (int64_t i = 0; i < nc; i++)
        if (jsave_block(n, cand[i])) return FALLBACK;
    for (int64_t i = 0; i < nc; i++) {
        uint8_t *r = blk(n, cand[i]);
        int removed;
        if (index_remove(n, U8(r + BF_PREFIX_HASH), cand[i], &removed) || !removed)
            return FALLBACK;
    }
    for (int64_t i = 0; i < nc; i++) {
        uint8_t *r = blk(n, cand[i]);
        r[BF_INDEXED] = 0;
        I4(r + BF_REFCOUNT) = 0;
        r[BF_STATE] = B_LOCAL; /* in flight to the caller: stamped or pushed to the ring */
        I4(r + BF_OWNER_CLIENT) = n->client;
    }
    memcpy(out, cand, 4 * (size_t)k);
    if (ring_push(n, cand + k, nc - k)) return FALLBACK;
    n->pend_evicted += nc;
    return OK;
}

/* ReserveOps._take without preemption: the local cache, the ring, LRU eviction; FALLBACK when
 * they are short (Python preempts or raises PoolExhausted). The locks each step needs must
 * be held already (`take_locks` plans them). */
static int take(Native *n, int64_t k, int32_t *out) {
    int64_t got, more;
    if (local_pop(n, k, out, &got)) return FALLBACK;
    if (got < k) {
        if (!(n->held & (1ull << n->lock_free))) return FALLBACK;
        if (ring_pop(n, k - got, out + got, &more)) return FALLBACK;
        got += more;
        if (got == k) return refill(n);
        return evict_into(n, k - got, out + got);
    }
    return OK;
}

/* ReserveOps._take_locks: the locks `take(k)` will need, judged from the local cache and the
 * ring's count (a hint: if it was wrong, `take` falls back). */
static uint64_t take_locks(Native *n, int64_t k) {
    int64_t local = local_count(n);
    if (local >= k) return 0;
    uint64_t locks = 1ull << n->lock_free;
    int64_t short_ = k - local - (int64_t)U4(ringh(n) + RING_COUNT);
    if (short_ <= 0) return locks;
    /* Eviction: the shards of the blocks it will take, found now without the locks (the same
     * choice it makes under them when no other process changed the pool meanwhile). */
    int32_t cand[CHUNK + EVICT_BATCH];
    int64_t nc = 0;
    if (short_ <= CHUNK && (!lru_take(n, short_, EVICT_BATCH, cand, &nc, 1) ||
                            !lru_scan(n, short_, EVICT_BATCH, cand, &nc, 1))) {
        for (int64_t i = 0; i < nc; i++)
            locks |= 1ull << (n->lock_shard0 + shard_of(n, U8(blk(n, cand[i]) + BF_PREFIX_HASH)));
        return locks;
    }
    for (int64_t s = 0; s < n->num_shards; s++) locks |= 1ull << (n->lock_shard0 + s);
    return locks;
}

/* BlockStore.stamp: fresh ALLOCATED blocks with refcount 1, owned by this client. */
static int stamp(Native *n, const int32_t *ids, int64_t k, const char *request, int32_t site,
                 uint64_t now) {
    for (int64_t i = 0; i < k; i++)
        if (jsave_block(n, ids[i])) return FALLBACK;
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        U4(r) = BLOCK_MAGIC;
        r[BF_STATE] = B_ALLOCATED;
        r[BF_INDEXED] = 0;
        I4(r + BF_REFCOUNT) = 1;
        U4(r + BF_GENERATION) += 1;
        I4(r + BF_OWNER_PID) = n->pid;
        I4(r + BF_OWNER_CLIENT) = n->client;
        U8(r + BF_PREFIX_HASH) = 0;
        U8(r + BF_OWNER_START) = n->start;
        memcpy(r + BF_REQUEST, request, REQUEST_BYTES);
        U8(r + BF_ALLOC_NS) = now;
        U8(r + BF_ACCESS_NS) = now;
        I4(r + BF_SITE) = site;
        U4(r + BF_NUM_TOKENS) = 0;
        U8(r + BF_PARENT_HASH) = 0;
        seal(n, ids[i]);
    }
    return OK;
}

/* -- the prefix index ------------------------------------------------------------------------- */


/* PrefixIndex.lookup */
static int32_t index_lookup(Native *n, uint64_t key) {
    int64_t base = shard_of(n, key) * n->index_w, w = n->index_w;
    int64_t i = (int64_t)((key >> 16) % (uint64_t)w);
    for (int64_t s = 0; s < w; s++) {
        uint8_t *e = idx_entry(n, base + i);
        uint64_t k = U8(e);
        if (k == key) return I4(e + 8);
        if (k == 0) return -1;
        i = (i + 1) % w;
    }
    return -1;
}

/* PrefixIndex.insert: 1 inserted, 0 present or shard full, FALLBACK journal full. */
static int index_insert(Native *n, uint64_t key, int32_t block, int *inserted) {
    int64_t base = shard_of(n, key) * n->index_w, w = n->index_w;
    int64_t i = (int64_t)((key >> 16) % (uint64_t)w);
    *inserted = 0;
    for (int64_t s = 0; s < w; s++) {
        uint8_t *e = idx_entry(n, base + i);
        uint64_t k = U8(e);
        if (k == key) return OK;
        if (k == 0) {
            if (jsave(n, n->off_index + (size_t)(base + i) * INDEX_ENTRY, INDEX_ENTRY))
                return FALLBACK;
            I4(e + 8) = block;
            U8(e) = key;
            *inserted = 1;
            return OK;
        }
        i = (i + 1) % w;
    }
    return OK;
}

/* -- argument helpers ------------------------------------------------------------------------- */

/* obj.__dict__[name] as a new reference, else the generic lookup. */
static PyObject *field(PyObject *obj, PyObject *name) {
    PyObject *d = PyObject_GenericGetDict(obj, NULL);
    if (d != NULL) {
        PyObject *v = PyDict_GetItemWithError(d, name);
        Py_DECREF(d);
        if (v != NULL) return Py_NewRef(v);
        if (PyErr_Occurred()) return NULL;
    } else {
        PyErr_Clear();
    }
    return PyObject_GetAttr(obj, name);
}

/* Field i of a Sequence (F_* below; its type is checked by own_slot or made here): the
 * dataclass has __slots__, read and written at their offsets. */
enum { F_REQUEST_ID, F_TOKENS, F_BLOCK_TABLE, F_SLOT, F_SEQ_ID, F_POOL_UID, F_CACHED, F_STATE,
       F_CHAIN, F_PUBLISHED };

static PyObject *sfield(Native *n, PyObject *seq, int i) {
    PyObject *v = *(PyObject **)((char *)seq + n->seq_off[i]);
    if (v == NULL) PyErr_SetObject(PyExc_AttributeError, PyTuple_GET_ITEM(n->seq_fields, i));
    return Py_XNewRef(v);
}

static void sset(Native *n, PyObject *seq, int i, PyObject *v) {
    Py_XSETREF(*(PyObject **)((char *)seq + n->seq_off[i]), Py_NewRef(v));
}

/* Token ids of a list of ints into `out` (int32, as the records store them); FALLBACK on
 * anything else (Python raises its own error). */
static int tokens_of(PyObject *list, int32_t *out, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        if (!PyLong_CheckExact(o)) return FALLBACK;
#if PY_VERSION_HEX < 0x030C0000
        /* Up to 3.11 an int below 2**30 is one 30-bit digit with the sign in ob_size. */
        Py_ssize_t size = Py_SIZE(o);
        if (size >= -1 && size <= 1) {
            out[i] = (int32_t)(size * (long)((PyLongObject *)o)->ob_digit[0]);
            continue;
        }
#endif
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return FALLBACK;
        }
        if (v < INT32_MIN || v > INT32_MAX) return FALLBACK;
        out[i] = (int32_t)v;
    }
    return OK;
}

/* prefix.chain_one over one block of the stored tokens (as Python ints, masked to 64 bits). */
static inline uint64_t chain_next(Native *n, uint64_t prev, const int64_t *toks) {
    uint64_t c = 0;
    for (int64_t i = 0; i < n->bs; i++) c += (uint64_t)toks[i] * n->coefs[i];
    return prev * CHAIN_P + c;
}

/* OK when no Python-path operation of another thread is half done on this mapping. */
static int take_mutex(Native *n) { return *n->busy ? FALLBACK : OK; }

/* End of a call: give back the op mutex if waiting for a lock made it take it. */
static void drop_mutex(Native *n) {
    if (!n->mutex_held) return;
    n->mutex_held = 0;
    *n->busy -= 1;
    PyObject *r = PyObject_CallMethodNoArgs(n->mutex, s_release);
    if (r == NULL)
        PyErr_Clear();
    else
        Py_DECREF(r);
}

static PyObject *fallback(Native *n) {
    n->fallbacks++;
    Py_RETURN_NONE;
}

/* The reserve's next slot and id, or FALLBACK when it must be refilled (seqs lock: Python). */
static int peek_claim(Native *n, int64_t *slot, uint64_t *seq_id) {
    Py_ssize_t r = PyList_GET_SIZE(n->reserve);
    if (r == 0) return FALLBACK;
    uint64_t next = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(n->ids, 0));
    uint64_t end = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(n->ids, 1));
    if (PyErr_Occurred()) return ERROR;
    if (next >= end) return FALLBACK;
    *slot = PyLong_AsLongLong(PyList_GET_ITEM(n->reserve, r - 1));
    *seq_id = next;
    return OK;
}

/* After commit: the claimed slot and id leave the reserve. */
static int finish_claim(Native *n, uint64_t seq_id) {
    Py_ssize_t r = PyList_GET_SIZE(n->reserve);
    if (PyList_SetSlice(n->reserve, r - 1, r, NULL)) return ERROR;
    PyObject *v = PyLong_FromUnsignedLongLong(seq_id + 1);
    if (v == NULL) return ERROR;
    return PyList_SetItem(n->ids, 0, v);
}

/* SeqTable.claim's record writes (the slot is reserved by this client). */
static int write_claim(Native *n, int64_t slot, uint64_t seq_id, const char *request,
                       uint64_t now) {
    uint8_t *s = seqrec(n, slot);
    if (jsave(n, n->off_seqs + (size_t)slot * n->seq_rec, SF_TABLE)) return FALLBACK;
    I4(s + SF_OWNER_PID) = n->pid;
    I4(s + SF_OWNER_CLIENT) = n->client;
    U8(s + SF_OWNER_START) = n->start;
    memcpy(s + SF_REQUEST, request, REQUEST_BYTES);
    U8(s + SF_SEQ_ID) = seq_id;
    U8(s + SF_CREATED_NS) = now;
    U8(s + SF_NUM_TOKENS) = 0;
    U4(s + SF_NUM_BLOCKS) = 0;
    s[SF_STATE] = S_RUNNING;
    return OK;
}

/* SeqTable.write_blocks */
static int write_blocks(Native *n, int64_t slot, int64_t start, const int32_t *ids, int64_t k) {
    if (start + k > n->max_bps) return FALLBACK;
    uint8_t *s = seqrec(n, slot);
    if (jsave(n, n->off_seqs + (size_t)slot * n->seq_rec, SF_TABLE)) return FALLBACK;
    if (k) {
        size_t off = n->off_seqs + (size_t)slot * n->seq_rec + SF_TABLE + 4 * (size_t)start;
        if (jsave(n, off, (uint32_t)(4 * k))) return FALLBACK;
        memcpy(s + SF_TABLE + 4 * start, ids, 4 * (size_t)k);
    }
    U4(s + SF_NUM_BLOCKS) = (uint32_t)(start + k);
    return OK;
}

/* ReserveOps._fill: token ids at positions [first, first + k) of the table's blocks. */
static void fill(Native *n, const int32_t *table, int64_t first, const int32_t *toks, int64_t k) {
    int64_t pos = first, i = 0;
    while (i < k) {
        int64_t b = table[pos / n->bs], off = pos % n->bs;
        int64_t m = n->bs - off < k - i ? n->bs - off : k - i;
        memcpy(blk(n, b) + BF_TOKENS + 4 * off, toks + i, 4 * (size_t)m);
        U4(blk(n, b) + BF_NUM_TOKENS) = (uint32_t)(off + m);
        pos += m;
        i += m;
    }
}

/* sequence.request_bytes of a str: its UTF-8, truncated to 32 bytes, zero-padded. */
static int request_of(PyObject *rid, char *out) {
    Py_ssize_t len;
    const char *u = PyUnicode_AsUTF8AndSize(rid, &len);
    if (u == NULL) return ERROR;
    memset(out, 0, REQUEST_BYTES);
    memcpy(out, u, len < REQUEST_BYTES ? (size_t)len : REQUEST_BYTES);
    return OK;
}

/* -- allocate --------------------------------------------------------------------------------- */

/* allocate(tokens: list[int], request: bytes, site: int)
 *   -> (slot, seq_id, table: list[int], chain: list[int], hits) or None (the Python path). */
static PyObject *core_allocate(Native *n, PyObject *list, const char *request, int32_t site) {
    if (!PyList_CheckExact(list)) return fallback(n);
    Py_ssize_t ntok = PyList_GET_SIZE(list);
    int64_t bs = n->bs;
    int64_t nblocks = (ntok + bs - 1) / bs;
    if (ntok == 0 || nblocks > CHUNK || nblocks > n->max_bps) return fallback(n);
    int32_t table[CHUNK];
    /* nblocks <= CHUNK: the chain and keys fit on the stack; tokens do unless blocks are big. */
    uint64_t chain[CHUNK + 1], keys[CHUNK + 1];
    int32_t small[2048];
    int32_t *toks = ntok <= 2048 ? small : PyMem_Malloc(sizeof(int32_t) * (size_t)ntok);
    int64_t nfull = ntok / bs;
    PyObject *result = NULL;
    int mutex = 0;
    if (!toks) {
        PyErr_NoMemory();
        goto out;
    }
    if (tokens_of(list, toks, ntok)) {
        result = fallback(n);
        goto out;
    }
    /* Chain values and keys of the full blocks (prefix.chain_hashes / family_keys). */
    uint64_t mask = (uint64_t)(n->num_shards - 1);
    for (int64_t j = 0; j < nfull; j++) {
        uint64_t c = 0;
        for (int64_t i = 0; i < bs; i++) c += (uint64_t)(int64_t)toks[j * bs + i] * n->coefs[i];
        chain[j] = (j ? chain[j - 1] : 0) * CHAIN_P + c;
        keys[j] = fmix64(chain[j]);
    }
    if (mask)
        for (int64_t j = 0; j < nfull; j++) keys[j] = family_key(keys[j], keys[0], mask);
    int64_t max_hits = (ntok - 1) / bs;

    int rc = take_mutex(n);
    if (rc != OK) {
        result = rc == ERROR ? NULL : fallback(n);
        goto out;
    }
    mutex = 1;
    int64_t slot;
    uint64_t seq_id;
    rc = peek_claim(n, &slot, &seq_id);
    if (rc != OK) {
        result = rc == ERROR ? NULL : fallback(n);
        goto out;
    }
    uint64_t locks = 0;
    /* A prompt can only hit if its first block is indexed: a first look without the lock
     * spares the shard lock to prompts that cannot hit. (A key inserted meanwhile is a hit
     * missed, as if this allocation came first; a lookup never trusts a block without the
     * lock and the stored tokens.) */
    int may_hit = max_hits > 0 && index_lookup(n, keys[0]) >= 0;
    if (may_hit) locks |= 1ull << (n->lock_shard0 + shard_of(n, keys[0]));
    locks |= take_locks(n, nblocks);
    if (txn_begin(n, locks)) {
        result = fallback(n);
        goto out;
    }
    uint64_t now = wall_ns();
    if (write_claim(n, slot, seq_id, request, now)) goto abort;
    /* The longest verified prefix hit (seqops._match). */
    int64_t hits = 0;
    uint64_t parent = 0;
    for (int64_t j = 0; may_hit && j < max_hits; j++) {
        int32_t b = index_lookup(n, keys[j]);
        if (b < 0 || b >= n->nb) break;
        uint8_t *r = blk(n, b);
        if (r[BF_INDEXED] != 1 || U8(r + BF_PREFIX_HASH) != keys[j] ||
            U8(r + BF_PARENT_HASH) != parent ||
            memcmp(r + BF_TOKENS, toks + j * bs, 4 * (size_t)bs) != 0)
            break;
        table[hits++] = b;
        parent = keys[j];
    }
    for (int64_t j = 0; j < hits; j++)
        if (jsave_block(n, table[j])) goto abort;
    for (int64_t j = 0; j < hits; j++) {
        uint8_t *r = blk(n, table[j]);
        I4(r + BF_REFCOUNT) += 1;
        r[BF_STATE] = B_ALLOCATED;
        U8(r + BF_ACCESS_NS) = now;
        seal(n, table[j]);
    }
    int64_t k = nblocks - hits;
    if (take(n, k, table + hits)) goto abort;
    if (stamp(n, table + hits, k, request, site, now)) goto abort;
    if (write_blocks(n, slot, 0, table, nblocks)) goto abort;
    fill(n, table, hits * bs, toks + hits * bs, ntok - hits * bs);
    /* seqops._set_hashes: keys of the new full blocks (unindexed), then seal. */
    for (int64_t j = hits; j < nblocks; j++) {
        uint8_t *r = blk(n, table[j]);
        if (j < nfull) {
            U8(r + BF_PREFIX_HASH) = keys[j];
            U8(r + BF_PARENT_HASH) = j ? keys[j - 1] : 0;
        }
        seal(n, table[j]);
    }
    U8(seqrec(n, slot) + SF_NUM_TOKENS) = (uint64_t)ntok;
    txn_commit(n);
    count(n, C_ALLOCS, (uint64_t)k);
    count(n, C_QUERIES, (uint64_t)(max_hits > 0 ? max_hits : 0));
    count(n, C_HITS, (uint64_t)hits);
    if (finish_claim(n, seq_id)) goto out;
    PyObject *tab = PyList_New(nblocks), *ch = PyList_New(nfull);
    if (!tab || !ch) {
        Py_XDECREF(tab);
        Py_XDECREF(ch);
        goto out;
    }
    for (int64_t j = 0; j < nblocks; j++) PyList_SET_ITEM(tab, j, PyLong_FromLong(table[j]));
    for (int64_t j = 0; j < nfull; j++)
        PyList_SET_ITEM(ch, j, PyLong_FromUnsignedLongLong(chain[j]));
    n->native_ops++;
    result = PyTuple_New(5);
    if (result) {
        PyTuple_SET_ITEM(result, 0, PyLong_FromLongLong(slot));
        PyTuple_SET_ITEM(result, 1, PyLong_FromUnsignedLongLong(seq_id));
        PyTuple_SET_ITEM(result, 2, tab);
        PyTuple_SET_ITEM(result, 3, ch);
        PyTuple_SET_ITEM(result, 4, PyLong_FromLongLong(hits));
    } else {
        Py_DECREF(tab);
        Py_DECREF(ch);
    }
    goto out;
abort:
    txn_abort(n);
    result = fallback(n);
out:
    if (mutex) drop_mutex(n);
    if (toks != small) PyMem_Free(toks);
    return result;
}

/* -- free ------------------------------------------------------------------------------------- */

/* release(table: list[int], slot, final_state) -> True, or None (the Python path). */
static PyObject *core_release(Native *n, PyObject *list, int64_t slot, long final) {
    if (!PyList_CheckExact(list)) return fallback(n);
    Py_ssize_t k = PyList_GET_SIZE(list);
    if (k > CHUNK || slot < 0 || slot >= n->max_seqs) return fallback(n);
    int32_t ids[CHUNK], zero[CHUNK];
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        long v = PyLong_AsLong(o);
        if (v == -1 && PyErr_Occurred()) return NULL;
        if (v < 0 || v >= n->nb) return fallback(n);
        ids[i] = (int32_t)v;
    }
    int rc = take_mutex(n);
    if (rc != OK) return rc == ERROR ? NULL : fallback(n);
    PyObject *result = NULL;
    /* SeqTable.can_release_locally, else the seqs lock: Python. */
    uint8_t *s = seqrec(n, slot);
    if (PyList_GET_SIZE(n->reserve) >= 2 * n->slot_batch || s[SF_RESERVED] != 1 ||
        I4(s + SF_OWNER_CLIENT) != n->client) {
        result = fallback(n);
        goto out;
    }
    /* Locks: the shards of indexed blocks; free when the private ones overflow the cache. */
    uint64_t locks = 0;
    int64_t private_ = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        if (r[BF_INDEXED] == 1)
            locks |= 1ull << (n->lock_shard0 + shard_of(n, U8(r + BF_PREFIX_HASH)));
        else if (I4(r + BF_REFCOUNT) <= 1)
            private_++;
    }
    if ((int64_t)local_count(n) + private_ > n->local_max) locks |= 1ull << n->lock_free;
    if (txn_begin(n, locks)) {
        result = fallback(n);
        goto out;
    }
    uint64_t now = wall_ns();
    int64_t nz = 0;
    /* BlockStore.drop: blocks already free are left untouched (a double free). */
    for (Py_ssize_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        int32_t rcnt = I4(r + BF_REFCOUNT);
        if (r[BF_STATE] != B_ALLOCATED || rcnt <= 0) continue;
        if (jsave_block(n, ids[i])) goto abort;
        I4(r + BF_REFCOUNT) = rcnt - 1;
        U8(r + BF_ACCESS_NS) = now;
        if (rcnt == 1) {
            if (r[BF_INDEXED] == 1)
                r[BF_STATE] = B_CACHED;
            else
                zero[nz++] = ids[i];
        }
        seal(n, ids[i]);
    }
    /* BlockStore.give_back */
    int64_t fit;
    if (local_push(n, zero, nz, &fit)) goto abort;
    if (fit < nz) {
        if (!(n->held & (1ull << n->lock_free))) goto abort;
        if (ring_push(n, zero + fit, nz - fit)) goto abort;
    }
    if (write_blocks(n, slot, 0, NULL, 0)) goto abort;
    s[SF_STATE] = (uint8_t)final;
    /* SeqTable.release into the reserve. */
    if (jsave(n, n->off_seqs + (size_t)slot * n->seq_rec, SF_TABLE)) goto abort;
    s[SF_STATE] = S_EMPTY;
    U4(s + SF_NUM_BLOCKS) = 0;
    txn_commit(n);
    count(n, C_FREES, (uint64_t)k);
    PyObject *v = PyLong_FromLongLong(slot);
    if (v == NULL || PyList_Append(n->reserve, v)) {
        Py_XDECREF(v);
        goto out;
    }
    Py_DECREF(v);
    n->native_ops++;
    result = Py_NewRef(Py_True);
    goto out;
abort:
    txn_abort(n);
    result = fallback(n);
out:
    drop_mutex(n);
    return result;
}

/* -- append ----------------------------------------------------------------------------------- */

/* Keys of a sequence's chain values j and j-1 (seqops._key). */
static int seq_keys(Native *n, PyObject *chain, Py_ssize_t j, uint64_t *key, uint64_t *parent) {
    uint64_t mask = (uint64_t)(n->num_shards - 1);
    uint64_t first = fmix64(PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(chain, 0)));
    *key = fmix64(PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(chain, j)));
    *parent = j ? fmix64(PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(chain, j - 1))) : 0;
    if (PyErr_Occurred()) return ERROR;
    if (mask) {
        *key = family_key(*key, first, mask);
        if (j) *parent = family_key(*parent, first, mask);
    }
    return OK;
}

/* AppendOps._extend_chain: hash blocks that became full; record keys of unshared ones. */
static int extend_chain(Native *n, PyObject *tokens, PyObject *table, PyObject *chain) {
    Py_ssize_t full = PyList_GET_SIZE(tokens) / n->bs;
    int64_t *tk = PyMem_Malloc(sizeof(int64_t) * (size_t)n->bs);
    if (!tk) {
        PyErr_NoMemory();
        return ERROR;
    }
    while (PyList_GET_SIZE(chain) < full) {
        Py_ssize_t j = PyList_GET_SIZE(chain);
        uint64_t prev = j ? PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(chain, j - 1)) : 0;
        for (int64_t i = 0; i < n->bs; i++)
            tk[i] = (int64_t)PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(tokens, j * n->bs + i));
        if (PyErr_Occurred()) goto fail;
        PyObject *h = PyLong_FromUnsignedLongLong(chain_next(n, prev, tk));
        if (h == NULL || PyList_Append(chain, h)) {
            Py_XDECREF(h);
            goto fail;
        }
        Py_DECREF(h);
        long b = PyLong_AsLong(PyList_GET_ITEM(table, j));
        if (b == -1 && PyErr_Occurred()) goto fail;
        uint8_t *r = blk(n, b);
        if (r[BF_INDEXED] == 0 && I4(r + BF_REFCOUNT) == 1) {
            uint64_t key, parent;
            if (seq_keys(n, chain, j, &key, &parent)) goto fail;
            /* Key and checksum in one 16-byte store (append.py _set_keys: a kill leaves the
             * record sealed either way); the parent key is outside the checksum. */
            uint64_t w[2];
            uint64_t old = U8(r + BF_PREFIX_HASH);
            U8(r + BF_PREFIX_HASH) = key;
            w[0] = key;
            w[1] = checksum(n, b);
            U8(r + BF_PREFIX_HASH) = old;
#if defined(__SSE2__)
            _mm_storeu_si128((__m128i *)(r + BF_PREFIX_HASH), _mm_loadu_si128((__m128i *)w));
#else
            U8(r + BF_PREFIX_HASH) = w[0];
            U8(r + BF_CHECKSUM) = w[1];
#endif
            U8(r + BF_PARENT_HASH) = parent;
        }
    }
    PyMem_Free(tk);
    return OK;
fail:
    PyMem_Free(tk);
    return ERROR;
}

/* append1(seq, token: int) -> [] (no copies), or None (the Python path: copy-on-write, ...).
 * One token: into the last block when it has room, else into a new block (a transaction). */
static PyObject *core_append1(Native *n, PyObject *seq, PyObject *tok_in) {
    long tok = PyLong_AsLong(tok_in);
    if (tok == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return fallback(n);
    }
    if (tok < INT32_MIN || tok > INT32_MAX) return fallback(n);
    PyObject *tokens = sfield(n, seq, F_TOKENS);
    PyObject *table = sfield(n, seq, F_BLOCK_TABLE);
    PyObject *slot_o = sfield(n, seq, F_SLOT);
    PyObject *chain = sfield(n, seq, F_CHAIN);
    PyObject *result = NULL, *tok_o = NULL;
    int mutex = 0;
    if (!tokens || !table || !slot_o || !chain) goto out;
    if (!PyList_CheckExact(tokens) || !PyList_CheckExact(table) || !PyList_CheckExact(chain)) {
        result = fallback(n);
        goto out;
    }
    int64_t slot = PyLong_AsLongLong(slot_o);
    if (slot == -1 && PyErr_Occurred()) goto out;
    Py_ssize_t n_old = PyList_GET_SIZE(tokens), nb = PyList_GET_SIZE(table);
    int64_t bs = n->bs, off = n_old % bs;
    if (nb == 0 || slot < 0 || slot >= n->max_seqs || nb != (n_old + bs - 1) / bs) {
        result = fallback(n);
        goto out;
    }
    tok_o = PyLong_FromLong(tok);
    if (tok_o == NULL) goto out;
    if (off) {
        long last = PyLong_AsLong(PyList_GET_ITEM(table, nb - 1));
        if (last < 0 || last >= n->nb) {
            PyErr_Clear();
            result = fallback(n);
            goto out;
        }
        uint8_t *r = blk(n, last);
        if (I4(r + BF_REFCOUNT) > 1) { /* copy-on-write */
            result = fallback(n);
            goto out;
        }
        /* The decode step: unjournaled, as append.py's fast path (docs/FORMAT.md, crash rule 5). */
        I4(r + BF_TOKENS + 4 * off) = (int32_t)tok;
        U4(r + BF_NUM_TOKENS) = (uint32_t)(off + 1);
        if (PyList_Append(tokens, tok_o)) goto out;
        U8(seqrec(n, slot) + SF_NUM_TOKENS) = (uint64_t)(n_old + 1);
    } else {
        int rc = take_mutex(n);
        if (rc != OK) {
            result = rc == ERROR ? NULL : fallback(n);
            goto out;
        }
        mutex = 1;
        uint64_t locks = take_locks(n, 1);
        if (txn_begin(n, locks)) {
            result = fallback(n);
            goto out;
        }
        int32_t b;
        uint8_t *s = seqrec(n, slot);
        char request[REQUEST_BYTES];
        memcpy(request, s + SF_REQUEST, REQUEST_BYTES);
        int32_t site = -1;
        if (take(n, 1, &b) || stamp(n, &b, 1, request, site, wall_ns()) ||
            write_blocks(n, slot, nb, &b, 1)) {
            txn_abort(n);
            result = fallback(n);
            goto out;
        }
        I4(blk(n, b) + BF_TOKENS) = (int32_t)tok;
        U4(blk(n, b) + BF_NUM_TOKENS) = 1;
        U8(s + SF_NUM_TOKENS) = (uint64_t)(n_old + 1);
        txn_commit(n);
        count(n, C_ALLOCS, 1);
        PyObject *bo = PyLong_FromLong(b);
        if (bo == NULL || PyList_Append(table, bo)) {
            Py_XDECREF(bo);
            goto out;
        }
        Py_DECREF(bo);
        if (PyList_Append(tokens, tok_o)) goto out;
    }
    if ((n_old + 1) / bs > PyList_GET_SIZE(chain) && extend_chain(n, tokens, table, chain))
        goto out;
    n->native_ops++;
    result = PyList_New(0);
out:
    if (mutex) drop_mutex(n);
    Py_XDECREF(tok_o);
    Py_XDECREF(tokens);
    Py_XDECREF(table);
    Py_XDECREF(slot_o);
    Py_XDECREF(chain);
    return result;
}

/* -- mark_computed ---------------------------------------------------------------------------- */

/* publish(seq, num_tokens) -> blocks published, or None (the Python path). */
static PyObject *core_publish(Native *n, PyObject *seq, PyObject *upto_in) {
    Py_ssize_t upto_tokens = PyLong_AsSsize_t(upto_in);
    if (upto_tokens == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return fallback(n);
    }
    PyObject *tokens = sfield(n, seq, F_TOKENS);
    PyObject *table = sfield(n, seq, F_BLOCK_TABLE);
    PyObject *chain = sfield(n, seq, F_CHAIN);
    PyObject *pub_o = sfield(n, seq, F_PUBLISHED);
    PyObject *result = NULL;
    int mutex = 0;
    if (!tokens || !table || !chain || !pub_o) goto out;
    if (!PyList_CheckExact(tokens) || !PyList_CheckExact(table) || !PyList_CheckExact(chain)) {
        result = fallback(n);
        goto out;
    }
    Py_ssize_t pub = PyLong_AsSsize_t(pub_o);
    if (pub == -1 && PyErr_Occurred()) goto out;
    Py_ssize_t ntok = PyList_GET_SIZE(tokens);
    Py_ssize_t upto = (upto_tokens < ntok ? upto_tokens : ntok) / n->bs;
    if (upto <= pub) {
        result = PyLong_FromLong(0);
        goto out;
    }
    if (upto > PyList_GET_SIZE(chain) || upto > PyList_GET_SIZE(table) || pub < 0) {
        result = fallback(n);
        goto out;
    }
    uint64_t key0, unused;
    if (seq_keys(n, chain, pub, &key0, &unused)) goto out;
    int rc = take_mutex(n);
    if (rc != OK) {
        result = rc == ERROR ? NULL : fallback(n);
        goto out;
    }
    mutex = 1;
    /* Every key of a sequence lives in the shard of its first (prefix.family_keys). */
    if (txn_begin(n, 1ull << (n->lock_shard0 + shard_of(n, key0)))) {
        result = fallback(n);
        goto out;
    }
    long published = 0;
    for (Py_ssize_t j = pub; j < upto; j++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(table, j));
        if (b < 0 || b >= n->nb) {
            PyErr_Clear();
            goto abort;
        }
        uint8_t *r = blk(n, b);
        if (r[BF_INDEXED] || I4(r + BF_REFCOUNT) != 1) continue;
        uint64_t key, parent;
        if (seq_keys(n, chain, j, &key, &parent)) {
            PyErr_Clear();
            goto abort;
        }
        int inserted;
        if (index_insert(n, key, (int32_t)b, &inserted)) goto abort;
        if (!inserted) continue;
        /* BlockStore.publish */
        if (jsave_block(n, b)) goto abort;
        r[BF_INDEXED] = 1;
        U8(r + BF_PREFIX_HASH) = key;
        U8(r + BF_PARENT_HASH) = parent;
        seal(n, b);
        published++;
    }
    txn_commit(n);
    PyObject *u = PyLong_FromSsize_t(upto);
    if (u == NULL) goto out;
    sset(n, seq, F_PUBLISHED, u);
    Py_DECREF(u);
    n->native_ops++;
    result = PyLong_FromLong(published);
    goto out;
abort:
    txn_abort(n);
    result = fallback(n);
out:
    if (mutex) drop_mutex(n);
    Py_XDECREF(tokens);
    Py_XDECREF(table);
    Py_XDECREF(chain);
    Py_XDECREF(pub_o);
    return result;
}

/* -- entry points: the gate, the handle's checks, the Sequence ------------------------------- */

static int fork_gen = 0; /* bumped in a forked child: a handle made before the fork is not ours */
static void atfork_child(void) { fork_gen++; }

/* OK when this call may take the C path: the handle is open and this process's, no operation
 * of the Python path is half done, no fault or crash point is armed, no probe, call-site
 * recording or lock hook is installed (each is read at every call: they can come at any
 * time). FALLBACK otherwise, ERROR with an exception set. */
static int gate(Native *n, PyObject *pool) {
    if (n->seg == NULL || *n->busy || *n->hooks || n->fork_gen != fork_gen) return FALLBACK;
    if (PyDict_GET_SIZE(n->faults_armed)) return FALLBACK;
    PyObject *t = PyDict_GetItemWithError(PyModule_GetDict(n->crash_mod), s_target);
    if (t == NULL && PyErr_Occurred()) return ERROR;
    return t == Py_None ? OK : FALLBACK;
}

/* KVPool._own: a live Sequence of this handle; its slot, or -1 (the Python path decides). */
static int64_t own_slot(Native *n, PyObject *seq) {
    if (Py_TYPE(seq) != (PyTypeObject *)n->seq_type) return -1;
    PyObject *uid = sfield(n, seq, F_POOL_UID);
    PyObject *slot = sfield(n, seq, F_SLOT);
    int64_t out = -1;
    if (uid && slot && PyLong_CheckExact(uid) && PyLong_CheckExact(slot) &&
        PyLong_AsLongLong(uid) == n->uid)
        out = PyLong_AsLongLong(slot);
    Py_XDECREF(uid);
    Py_XDECREF(slot);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return out >= 0 && out < n->max_seqs ? out : -1;
}

#define GATE(n, pool)                                                                        \
    do {                                                                                     \
        int g_ = gate(n, pool);                                                              \
        if (g_ == ERROR) return NULL;                                                        \
        if (g_ != OK) return fallback(n);                                                    \
    } while (0)

/* allocate(pool, tokens, request_id) -> Sequence | None */
static PyObject *N_allocate(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_CheckExact(args[2]) || !PyList_CheckExact(args[1]))
        return fallback(n);
    GATE(n, args[0]);
    char request[REQUEST_BYTES];
    if (request_of(args[2], request)) {
        PyErr_Clear();
        return fallback(n);
    }
    PyObject *got = core_allocate(n, args[1], request, -1);
    if (got == NULL || got == Py_None) return got;
    /* (slot, seq_id, table, chain, hits) -> Sequence(request_id, tokens, block_table, slot,
     * seq_id, pool_uid, num_cached_tokens, state, chain, num_published) */
    PyObject *tokens = PyList_GetSlice(args[1], 0, PyList_GET_SIZE(args[1]));
    PyObject *uid = PyLong_FromLongLong(n->uid);
    PyObject *cached =
        PyLong_FromLongLong(PyLong_AsLongLong(PyTuple_GET_ITEM(got, 4)) * n->bs);
    PyObject *seq = NULL;
    if (tokens && uid && cached) {
        /* The dataclass's fields straight into a new instance's slots (its __init__ only
         * assigns them; tests/test_native.py compares the two). */
        PyObject *a[10] = {args[2],        tokens, PyTuple_GET_ITEM(got, 2), PyTuple_GET_ITEM(got, 0),
                           PyTuple_GET_ITEM(got, 1), uid, cached, s_running,
                           PyTuple_GET_ITEM(got, 3), PyTuple_GET_ITEM(got, 4)};
        PyTypeObject *tp = (PyTypeObject *)n->seq_type;
        seq = tp->tp_alloc(tp, 0);
        for (int i = 0; seq && i < 10; i++) sset(n, seq, i, a[i]);
    }
    Py_XDECREF(tokens);
    Py_XDECREF(uid);
    Py_XDECREF(cached);
    if (seq && PyDict_SetItem(n->seqs, PyTuple_GET_ITEM(got, 0), seq)) Py_CLEAR(seq);
    Py_DECREF(got);
    return seq;
}

/* end(pool, seq, final_state) -> True | None: free (FINISHED) or abort (ABORTED). */
static PyObject *N_end(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return fallback(n);
    GATE(n, args[0]);
    PyObject *seq = args[1];
    int64_t slot = own_slot(n, seq);
    long final = PyLong_AsLong(args[2]);
    if (slot < 0 || (final != 3 && final != 4)) {
        PyErr_Clear();
        return fallback(n);
    }
    PyObject *table = sfield(n, seq, F_BLOCK_TABLE);
    if (table == NULL) return NULL;
    PyObject *done = core_release(n, table, slot, final);
    Py_DECREF(table);
    if (done == NULL || done == Py_None) return done;
    Py_DECREF(done);
    /* The Python side of a release: the handle forgets the sequence. */
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
    if (bad) return NULL;
    Py_RETURN_TRUE;
}

/* append(pool, seq, tokens) -> [] | None: one token. */
static PyObject *N_append(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[2]) || PyList_GET_SIZE(args[2]) != 1)
        return fallback(n);
    GATE(n, args[0]);
    if (own_slot(n, args[1]) < 0) return fallback(n);
    return core_append1(n, args[1], PyList_GET_ITEM(args[2], 0));
}

/* mark_computed(pool, seq, num_tokens) -> int | None */
static PyObject *N_mark_computed(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return fallback(n);
    GATE(n, args[0]);
    if (own_slot(n, args[1]) < 0) return fallback(n);
    return core_publish(n, args[1], args[2]);
}

/* fork(pool, seq, request_id) -> Sequence | None: a new sequence sharing every block. */
static PyObject *N_fork(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyUnicode_CheckExact(args[2])) return fallback(n);
    GATE(n, args[0]);
    PyObject *src = args[1];
    if (own_slot(n, src) < 0) return fallback(n);
    char request[REQUEST_BYTES];
    if (request_of(args[2], request)) {
        PyErr_Clear();
        return fallback(n);
    }
    PyObject *f[10];
    for (int i = 0; i < 10; i++) f[i] = NULL;
    int32_t ids[CHUNK];
    PyObject *seq = NULL, *table = NULL, *tokens = NULL, *chain = NULL, *slot_o = NULL,
             *id_o = NULL;
    for (int i = 0; i < 10; i++)
        if ((f[i] = sfield(n, src, i)) == NULL) goto out;
    if (!PyList_CheckExact(f[F_BLOCK_TABLE]) || !PyList_CheckExact(f[F_TOKENS]) ||
        !PyList_CheckExact(f[F_CHAIN]) || PyList_GET_SIZE(f[F_BLOCK_TABLE]) > CHUNK) {
        seq = fallback(n);
        goto out;
    }
    Py_ssize_t k = PyList_GET_SIZE(f[F_BLOCK_TABLE]);
    uint64_t locks = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(f[F_BLOCK_TABLE], i));
        if (b < 0 || b >= n->nb) {
            PyErr_Clear();
            seq = fallback(n);
            goto out;
        }
        ids[i] = (int32_t)b;
        uint8_t *r = blk(n, b);
        if (r[BF_INDEXED] == 1)
            locks |= 1ull << (n->lock_shard0 + shard_of(n, U8(r + BF_PREFIX_HASH)));
    }
    int64_t slot;
    uint64_t seq_id;
    int rc = take_mutex(n);
    if (rc == OK) rc = peek_claim(n, &slot, &seq_id);
    if (rc != OK) {
        seq = rc == ERROR ? NULL : fallback(n);
        goto out;
    }
    if (txn_begin(n, locks)) {
        seq = fallback(n);
        goto out;
    }
    if (write_claim(n, slot, seq_id, request, wall_ns())) goto abort;
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
    if (finish_claim(n, seq_id)) goto out;
    /* seqops.fork's Sequence: copies of the parent's lists, its cached and published counts. */
    table = PyList_GetSlice(f[F_BLOCK_TABLE], 0, k);
    tokens = PyList_GetSlice(f[F_TOKENS], 0, PyList_GET_SIZE(f[F_TOKENS]));
    chain = PyList_GetSlice(f[F_CHAIN], 0, PyList_GET_SIZE(f[F_CHAIN]));
    slot_o = PyLong_FromLongLong(slot);
    id_o = PyLong_FromUnsignedLongLong(seq_id);
    if (!table || !tokens || !chain || !slot_o || !id_o) goto out;
    PyTypeObject *tp = (PyTypeObject *)n->seq_type;
    seq = tp->tp_alloc(tp, 0);
    if (seq == NULL) goto out;
    PyObject *a[10] = {args[2], tokens,    table,     slot_o, id_o,
                       f[F_POOL_UID], f[F_CACHED], s_running, chain, f[F_PUBLISHED]};
    for (int i = 0; i < 10; i++) sset(n, seq, i, a[i]);
    if (PyDict_SetItem(n->seqs, slot_o, seq)) Py_CLEAR(seq);
    n->native_ops++;
    goto out;
abort:
    txn_abort(n);
    seq = fallback(n);
out:
    for (int i = 0; i < 10; i++) Py_XDECREF(f[i]);
    Py_XDECREF(table);
    Py_XDECREF(tokens);
    Py_XDECREF(chain);
    Py_XDECREF(slot_o);
    Py_XDECREF(id_o);
    return seq;
}

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

/* Native(segment_buffer, fd, layout: dict, reserve: list, ids: list, mutex, busy, hooks,
 *        coefs) */
static int N_init(Native *n, PyObject *args, PyObject *kw) {
    PyObject *bufobj, *d, *reserve, *ids, *mutex, *busy, *hooks, *coefs;
    int fd;
    if (!PyArg_ParseTuple(args, "OiO!O!O!OOOO!", &bufobj, &fd, &PyDict_Type, &d, &PyList_Type,
                          &reserve, &PyList_Type, &ids, &mutex, &busy, &hooks, &PyList_Type,
                          &coefs))
        return -1;
    if (word_of(busy, &n->busy_buf, &n->busy)) return -1;
    if (word_of(hooks, &n->hooks_buf, &n->hooks)) return -1;
    if (PyObject_GetBuffer(bufobj, &n->buf, PyBUF_WRITABLE) < 0) return -1;
    n->seg = n->buf.buf;
    n->fd = fd;
    struct {
        const char *k;
        int64_t *v;
    } sizes[] = {{"num_blocks", &n->nb},
                 {"block_size", &n->bs},
                 {"record_size", &n->rec},
                 {"max_seqs", &n->max_seqs},
                 {"seq_record_size", &n->seq_rec},
                 {"max_blocks_per_seq", &n->max_bps},
                 {"index_width", &n->index_w},
                 {"num_shards", &n->num_shards},
                 {"local_cap", &n->local_cap},
                 {"local_max", &n->local_max},
                 {"slot_batch", &n->slot_batch}};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        if (get_size(d, sizes[i].k, sizes[i].v)) return -1;
    int64_t v[17];
    const char *offs[] = {"off_blocks", "off_ring",   "off_index",   "off_seqs",  "off_locks",
                          "off_next_seq_id", "c_seq", "c_local_count", "c_local", "c_jcount",
                          "c_jused", "c_journal", "c_jdata", "c_counters", "client",
                          "lock_free", "lock_shard0"};
    for (size_t i = 0; i < 17; i++)
        if (get_size(d, offs[i], &v[i])) return -1;
    n->off_blocks = v[0], n->off_ring = v[1], n->off_index = v[2], n->off_seqs = v[3];
    n->off_locks = v[4], n->off_next_seq_id = v[5], n->c_seq = v[6], n->c_local_count = v[7];
    n->c_local = v[8], n->c_jcount = v[9], n->c_jused = v[10], n->c_journal = v[11];
    n->c_jdata = v[12], n->c_counters = v[13];
    n->client = (int)v[14], n->lock_free = (int)v[15], n->lock_shard0 = (int)v[16];
    int64_t pid, start, je, jb, nl;
    if (get_size(d, "pid", &pid) || get_size(d, "start", &start) ||
        get_size(d, "journal_entries", &je) || get_size(d, "journal_bytes", &jb) ||
        get_size(d, "num_locks", &nl))
        return -1;
    n->pid = (int32_t)pid, n->start = (uint64_t)start;
    n->j_entries = (uint32_t)je, n->j_bytes = (uint32_t)jb, n->num_locks = (int)nl;
    if (n->num_locks > MAX_LOCKS || n->local_cap > 64 || n->bs > 4096 || n->bs < 1) {
        PyErr_SetString(PyExc_ValueError, "geometry outside the native core's limits");
        return -1;
    }
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
    Py_INCREF(reserve);
    Py_INCREF(ids);
    Py_INCREF(mutex);
    n->reserve = reserve, n->ids = ids, n->mutex = mutex;
    PyObject **objs[] = {&n->seq_type,  &n->seqs,  &n->faults_armed, &n->crash_mod,
                         &n->seq_fields, &n->store, &n->evict_mod};
    const char *names[] = {"seq_type",   "seqs",  "faults_armed",   "crash_module",
                           "seq_fields", "store", "eviction_module"};
    n->pend_scan_n = -1;
    for (int i = 0; i < 7; i++) {
        PyObject *o = PyDict_GetItemString(d, names[i]);
        if (o == NULL) {
            PyErr_Format(PyExc_KeyError, "native core needs %s", names[i]);
            return -1;
        }
        Py_INCREF(o);
        *objs[i] = o;
    }
    if (!PyTuple_Check(n->seq_fields) || PyTuple_GET_SIZE(n->seq_fields) != 10 ||
        !PyType_Check(n->seq_type)) {
        PyErr_SetString(PyExc_TypeError, "seq_type must be a class of 10 fields");
        return -1;
    }
    if (!PyDict_Check(n->seqs) || !PyDict_Check(n->faults_armed)) {
        PyErr_SetString(PyExc_TypeError, "seqs and faults_armed must be dicts");
        return -1;
    }
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
    int64_t uid;
    if (get_size(d, "uid", &uid)) return -1;
    n->uid = uid;
    n->fork_gen = fork_gen;
    return 0;
}

static void N_dealloc(Native *n) {
    if (n->seg) PyBuffer_Release(&n->buf);
    if (n->busy) PyBuffer_Release(&n->busy_buf);
    if (n->hooks) PyBuffer_Release(&n->hooks_buf);
    Py_XDECREF(n->reserve);
    Py_XDECREF(n->ids);
    Py_XDECREF(n->mutex);
    Py_XDECREF(n->seq_type);
    Py_XDECREF(n->seq_fields);
    Py_XDECREF(n->seqs);
    Py_XDECREF(n->faults_armed);
    Py_XDECREF(n->crash_mod);
    Py_XDECREF(n->store);
    Py_XDECREF(n->pend_lru);
    Py_XDECREF(n->evict_mod);
    drop_pending_scan(n);
    PyMem_Free(n->coefs);
    Py_TYPE(n)->tp_free((PyObject *)n);
}

/* close(): let go of the mapping (the pool is about to unmap it). */
static PyObject *N_close(Native *n, PyObject *unused) {
    if (n->seg) {
        PyBuffer_Release(&n->buf);
        n->seg = NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *N_stats(Native *n, PyObject *unused) {
    return Py_BuildValue("{sKsKsK}", "native_ops", (unsigned long long)n->native_ops,
                         "fallbacks", (unsigned long long)n->fallbacks, "evictions",
                         (unsigned long long)n->native_evictions);
}

static PyObject *N_set_crash_at(Native *n, PyObject *arg) {
    n->crash_at = PyLong_AsLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef N_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))N_allocate, METH_FASTCALL,
     "allocate(pool, tokens, request_id) -> Sequence | None (the Python path)"},
    {"end", (PyCFunction)(void (*)(void))N_end, METH_FASTCALL,
     "end(pool, seq, final_state) -> True | None: free or abort"},
    {"append", (PyCFunction)(void (*)(void))N_append, METH_FASTCALL,
     "append(pool, seq, tokens) -> [] | None: one token"},
    {"mark_computed", (PyCFunction)(void (*)(void))N_mark_computed, METH_FASTCALL,
     "mark_computed(pool, seq, num_tokens) -> int | None"},
    {"fork", (PyCFunction)(void (*)(void))N_fork, METH_FASTCALL,
     "fork(pool, seq, request_id) -> Sequence | None"},
    {"close", (PyCFunction)N_close, METH_NOARGS, "release the segment buffer"},
    {"stats", (PyCFunction)N_stats, METH_NOARGS, "operations done natively and fallbacks"},
    {"set_crash_at", (PyCFunction)N_set_crash_at, METH_O,
     "tests: SIGKILL this process at the n-th journal save (0: off)"},
    {NULL}};

static PyTypeObject NativeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvscope.allocator._native.Native",
    .tp_basicsize = sizeof(Native),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The pool's hot operations on one client's view of a segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)N_init,
    .tp_dealloc = (destructor)N_dealloc,
    .tp_methods = N_methods,
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_native",
                                    "The pool's hot operations in C (see allocator/native.py).",
                                    -1, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&NativeType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL) return NULL;
    s_acquire = PyUnicode_InternFromString("acquire");
    s_release = PyUnicode_InternFromString("release");
    s_target = PyUnicode_InternFromString("_target");
    s_running = PyUnicode_InternFromString("running");
    s_finished = PyUnicode_InternFromString("finished");
    s_aborted = PyUnicode_InternFromString("aborted");
    s_lru_ids = PyUnicode_InternFromString("_lru_ids");
    s_lru_ns = PyUnicode_InternFromString("_lru_ns");
    s_lru_pos = PyUnicode_InternFromString("_lru_pos");
    s_lru_cached = PyUnicode_InternFromString("_lru_cached");
    pthread_atfork(NULL, NULL, atfork_child);
    Py_INCREF(&NativeType);
    if (PyModule_AddObject(m, "Native", (PyObject *)&NativeType) < 0) return NULL;
    return m;
}
