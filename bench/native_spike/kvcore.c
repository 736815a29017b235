/* kvcore: feasibility spike of a native hot path for kvscope's block allocator.
 *
 * Operates on a MAP_SHARED buffer (an mmap of a /dev/shm file) laid out like docs/FORMAT.md's
 * block records (184 bytes at block size 16, same field offsets), free ring, sequence table,
 * lock records and client records with an undo journal {offset u8, length u4, data_off u4, op u8}
 * + 96 KiB of saved bytes. Every shared write of an operation is preceded by a journal save of
 * the old bytes; commit = journal count stored 0. Per-process local cache of free blocks; the
 * free ring and the seq-slot table are only touched under an fcntl byte lock on the segment file.
 *
 * NOT product code: block size fixed at 16, no prefix index / hits / publish, no probes, no
 * eviction / preemption / COW, no lock-escalation-by-restart, no dead-holder recovery.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BS 16
#define REQUEST_BYTES 32
#define BLOCK_MAGIC 0x4B56424Bu
#define LOCAL_CACHE_MAX 64
#define JOURNAL_ENTRIES 512
#define JOURNAL_BYTES (96 * 1024)
#define NUM_LOCKS 2
#define LOCK_SEQS 0
#define LOCK_FREE 1
#define SEQ_ID_BATCH 256
#define SLOT_BATCH 64
#define MAX_CLIENTS 2
#define MAX_PROMPT_BLOCKS 256

enum { FREE = 0, ALLOCATED = 1, CACHED = 2, LOCAL = 3 };
enum { S_EMPTY = 0, S_RUNNING = 1, S_FINISHED = 3 };

typedef struct {
    uint32_t magic;
    uint8_t state, indexed, poisoned, pad;
    int32_t refcount;
    uint32_t generation;
    int32_t owner_pid, owner_client;
    uint64_t prefix_hash;
    uint64_t checksum;
    uint64_t owner_start;
    char request[REQUEST_BYTES];
    uint64_t alloc_ns, access_ns;
    int32_t site;
    uint32_t num_tokens;
    uint64_t parent_hash;
    uint64_t freed_at;
    int32_t tokens[BS];
} BlockRec;
_Static_assert(sizeof(BlockRec) == 184, "block record is 184 bytes at block size 16");
_Static_assert(offsetof(BlockRec, tokens) == 120, "tokens at 120");
_Static_assert(offsetof(BlockRec, num_tokens) == 100, "num_tokens at 100");

typedef struct {
    uint64_t head, tail;
    uint32_t count, pad;
    uint64_t allocs;
} RingHdr;

typedef struct {
    uint8_t state, reserved, pad[2];
    int32_t owner_pid, owner_client;
    uint32_t num_blocks;
    uint64_t owner_start, seq_id;
    char request[REQUEST_BYTES];
    uint64_t num_tokens, created_ns;
    uint64_t chain; /* spike addition: chain value of the last full block (FORMAT.md keeps it in Python) */
    int32_t table[];
} SeqRec;
#define SEQ_HEAD 88
_Static_assert(sizeof(SeqRec) == SEQ_HEAD, "seq head");

typedef struct {
    char name[16];
    uint64_t seq;
    int32_t holder_pid, holder_client;
    uint64_t holder_start, holder_tid, acquired_ns, num_acquires, num_contended, wait_ns, hold_ns,
        max_hold_ns;
} LockRec;
_Static_assert(sizeof(LockRec) == 96, "lock record");

typedef struct {
    uint64_t offset;
    uint32_t length, data_off;
    uint64_t op;
} JEntry;

typedef struct {
    uint8_t state, pad[3];
    int32_t pid;
    uint64_t start, attached_ns, seq, op;
    uint32_t local_count, journal_count, journal_used, event_count;
    uint64_t event_head;
    int32_t local[LOCAL_CACHE_MAX];
    uint64_t counters[8]; /* num_allocs, num_frees, ... */
    JEntry journal[JOURNAL_ENTRIES];
    uint8_t journal_data[JOURNAL_BYTES];
} ClientRec;

typedef struct {
    uint64_t magic;
    uint64_t next_seq_id;
    uint64_t num_blocks, max_seqs, max_bps;
    uint64_t pad[3];
    RingHdr ring;
} SegHdr;

/* Segment layout: every section on a 64-byte boundary. */
typedef struct {
    size_t hdr, locks, blocks, ring, seqs, clients, end, seq_rec;
} Layout;

static size_t up64(size_t x) { return (x + 63) & ~(size_t)63; }

static Layout make_layout(size_t nb, size_t max_seqs, size_t max_bps) {
    Layout L;
    L.hdr = 0;
    L.locks = up64(sizeof(SegHdr));
    L.blocks = up64(L.locks + NUM_LOCKS * sizeof(LockRec));
    L.ring = up64(L.blocks + nb * sizeof(BlockRec));
    L.seq_rec = (SEQ_HEAD + 4 * max_bps + 7) & ~(size_t)7;
    L.seqs = up64(L.ring + 4 * nb);
    L.clients = up64(L.seqs + max_seqs * L.seq_rec);
    L.end = up64(L.clients + MAX_CLIENTS * sizeof(ClientRec));
    return L;
}

/* ---------------------------------------------------------------------------------------- */

static int g_forked = 0; /* set in a forked child: a Core made by the parent refuses to run */
static void atfork_child(void) { g_forked++; }

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static inline uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static const uint64_t K[5] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
                              0x27D4EB2F165667C5ull, 0xFF51AFD7ED558CCDull};
static const uint64_t CHAIN_P = 0x100000001B3ull;
static uint64_t CHAIN_C[BS];

static inline uint64_t fmix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    return h ? h : 1;
}

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int have_view;
    uint8_t *base;
    int fd;
    Layout L;
    int64_t nb, max_seqs, max_bps;
    int client, local_cap, full_checksum;
    int32_t pid;
    uint64_t start;
    int forked_at_init;
    SegHdr *hdr;
    LockRec *locks;
    BlockRec *blocks;
    int32_t *ring;
    ClientRec *cl;
    /* this process's (Python-private in kvscope) seq-slot reserve and seq-id range */
    int32_t reserve[2 * SLOT_BATCH];
    int nreserve;
    uint64_t next_id, end_id;
    int64_t hint;
    /* transaction */
    uint32_t jcount, jused;
    uint64_t op;
    uint64_t lock_t0[NUM_LOCKS];
    int held[NUM_LOCKS];
    int64_t crash_at; /* SIGKILL at the n-th journal save (crash-consistency test), 0: off */
    uint64_t n_lock_rt;
    /* reserve state before a refill in the current txn (restored on abort) */
    int refilled;
    int32_t saved_reserve[2 * SLOT_BATCH];
    int saved_nreserve;
    uint64_t saved_next_id, saved_end_id;
} Core;

static inline SeqRec *seqrec(Core *c, int64_t slot) {
    return (SeqRec *)(c->base + c->L.seqs + (size_t)slot * c->L.seq_rec);
}

static inline uint64_t seal_value(Core *c, const BlockRec *r, int64_t b) {
    const uint64_t *w = (const uint64_t *)r;
    if (!c->full_checksum) {
        /* kvscope's formula: identity words 0-3 and the block id */
        uint64_t h = w[0] * K[0] + w[1] * K[1] + w[2] * K[2] + w[3] * K[3] + (uint64_t)b * K[4];
        h ^= h >> 29;
        h *= K[0];
        return h ^ (h >> 32);
    }
    /* variant: every word of the record but the checksum itself (FNV-style, 8 bytes a step) */
    uint64_t h = 0xCBF29CE484222325ull ^ (uint64_t)b;
    for (int i = 0; i < 23; i++) {
        if (i == 4) continue;
        h = (h ^ w[i]) * 0x100000001B3ull;
    }
    return h ^ (h >> 32);
}
static inline void seal(Core *c, BlockRec *r, int64_t b) { r->checksum = seal_value(c, r, b); }

/* ---- journal --------------------------------------------------------------------------- */

static int jsave(Core *c, const void *p, uint32_t len) {
    uint32_t n = c->jcount, used = c->jused;
    if (n + 1 > JOURNAL_ENTRIES || used + len > JOURNAL_BYTES) {
        PyErr_SetString(PyExc_RuntimeError, "operation too large for the undo journal");
        return -1;
    }
    if (c->crash_at && --c->crash_at == 0) kill(getpid(), SIGKILL);
    ClientRec *cl = c->cl;
    uint64_t off = (uint64_t)((const uint8_t *)p - c->base);
    JEntry *e = &cl->journal[n];
    e->offset = off;
    e->length = len;
    e->data_off = used;
    e->op = c->op;
    memcpy(cl->journal_data + used, p, len);
    c->jused = used + len;
    c->jcount = n + 1;
    cl->journal_used = used + len;
    /* the count last: an entry exists only once its bytes are saved (x86: stores stay ordered) */
    __atomic_store_n(&cl->journal_count, n + 1, __ATOMIC_RELEASE);
    return 0;
}

static uint32_t journal_rollback(Core *c, ClientRec *cl) {
    uint32_t n = __atomic_load_n(&cl->journal_count, __ATOMIC_ACQUIRE);
    for (int64_t i = (int64_t)n - 1; i >= 0; i--) {
        JEntry *e = &cl->journal[i];
        memcpy(c->base + e->offset, cl->journal_data + e->data_off, e->length);
    }
    __atomic_store_n(&cl->journal_count, 0, __ATOMIC_RELEASE);
    cl->journal_used = 0;
    return n;
}

/* ---- locks: an fcntl write lock on the one byte of the lock record, plus the record ------ */

static int lock_acquire(Core *c, int i) {
    if (c->held[i]) return 0;
    LockRec *L = &c->locks[i];
    uint64_t t0 = mono_ns();
    struct flock fl = {0};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)((uint8_t *)L - c->base);
    fl.l_len = 1;
    if (fcntl(c->fd, F_SETLKW, &fl) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    uint64_t t1 = mono_ns();
    if (L->holder_pid != 0) {
        /* kvscope: a dead holder -> stop the world and roll back; not in the spike */
        struct flock un = fl;
        un.l_type = F_UNLCK;
        fcntl(c->fd, F_SETLK, &un);
        PyErr_Format(PyExc_RuntimeError, "lock %d names dead holder %d (recovery not in spike)", i,
                     L->holder_pid);
        return -1;
    }
    L->holder_pid = c->pid;
    L->holder_client = c->client;
    L->holder_start = c->start;
    L->holder_tid = (uint64_t)pthread_self();
    L->acquired_ns = t1;
    L->num_acquires++;
    L->wait_ns += t1 - t0;
    __atomic_store_n(&L->seq, L->seq + 1, __ATOMIC_RELEASE); /* odd */
    c->held[i] = 1;
    c->lock_t0[i] = t1;
    c->n_lock_rt++;
    return 0;
}

static void lock_release(Core *c, int i) {
    LockRec *L = &c->locks[i];
    uint64_t hold = mono_ns() - c->lock_t0[i];
    L->hold_ns += hold;
    if (hold > L->max_hold_ns) L->max_hold_ns = hold;
    __atomic_store_n(&L->seq, L->seq + 1, __ATOMIC_RELEASE); /* even, before the holder clears */
    L->holder_pid = 0;
    L->holder_client = -1;
    struct flock fl = {0};
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = (off_t)((uint8_t *)L - c->base);
    fl.l_len = 1;
    fcntl(c->fd, F_SETLK, &fl);
    c->held[i] = 0;
}

/* ---- transactions ----------------------------------------------------------------------- */

static inline void txn_begin(Core *c) {
    __atomic_store_n(&c->cl->seq, c->cl->seq + 1, __ATOMIC_RELEASE); /* odd: inside an op */
    c->op++;
    c->cl->op = c->op;
}
static inline void txn_end_locks(Core *c) {
    for (int i = NUM_LOCKS - 1; i >= 0; i--)
        if (c->held[i]) lock_release(c, i);
    __atomic_store_n(&c->cl->seq, c->cl->seq + 1, __ATOMIC_RELEASE);
}
static inline void txn_commit(Core *c) {
    if (c->jcount) {
        __atomic_store_n(&c->cl->journal_count, 0, __ATOMIC_RELEASE); /* the commit point */
        c->cl->journal_used = 0;
    }
    c->jcount = c->jused = 0;
    txn_end_locks(c);
}
static inline void txn_abort(Core *c) {
    journal_rollback(c, c->cl);
    c->jcount = c->jused = 0;
    txn_end_locks(c);
}

/* ---- free ring (free lock) -------------------------------------------------------------- */

static int ring_pop(Core *c, int64_t k, int32_t *out, int64_t *got) {
    RingHdr *h = &c->hdr->ring;
    if (k > h->count) k = h->count;
    *got = k;
    if (k == 0) return 0;
    if (jsave(c, h, sizeof(RingHdr))) return -1;
    uint64_t head = h->head;
    for (int64_t i = 0; i < k; i++) out[i] = c->ring[(head + i) % (uint64_t)c->nb];
    h->head = head + k;
    h->count -= (uint32_t)k;
    h->allocs += k;
    return 0;
}

/* records already journaled by the caller */
static int ring_push(Core *c, const int32_t *ids, int64_t k) {
    if (k == 0) return 0;
    RingHdr *h = &c->hdr->ring;
    for (int64_t i = 0; i < k; i++) {
        BlockRec *r = &c->blocks[ids[i]];
        r->state = FREE;
        r->refcount = 0;
        r->indexed = 0;
        r->owner_client = -1;
        seal(c, r, ids[i]);
    }
    if (jsave(c, h, sizeof(RingHdr))) return -1;
    uint64_t tail = h->tail, nb = (uint64_t)c->nb;
    uint64_t first = tail % nb;
    uint64_t n1 = (uint64_t)k < nb - first ? (uint64_t)k : nb - first;
    if (jsave(c, &c->ring[first], (uint32_t)(4 * n1))) return -1;
    if (n1 < (uint64_t)k && jsave(c, &c->ring[0], (uint32_t)(4 * (k - n1)))) return -1;
    for (int64_t i = 0; i < k; i++) c->ring[(tail + i) % nb] = ids[i];
    h->tail = tail + k;
    h->count += (uint32_t)k;
    return 0;
}

/* ---- local cache (owner only, no lock) --------------------------------------------------- */

/* park blocks (records already journaled) as LOCAL; returns how many fit */
static int64_t local_push(Core *c, const int32_t *ids, int64_t k) {
    ClientRec *cl = c->cl;
    uint32_t n = cl->local_count;
    int64_t room = 2 * c->local_cap - (int64_t)n;
    if (room < 0) room = 0;
    int64_t fit = k < room ? k : room;
    if (fit == 0) return 0;
    for (int64_t i = 0; i < fit; i++) {
        BlockRec *r = &c->blocks[ids[i]];
        r->state = LOCAL;
        r->refcount = 0;
        r->indexed = 0;
        seal(c, r, ids[i]);
    }
    if (jsave(c, &cl->local_count, 4) || jsave(c, &cl->local[n], (uint32_t)(4 * fit))) return -1;
    memcpy(&cl->local[n], ids, 4 * fit);
    cl->local_count = n + (uint32_t)fit;
    return fit;
}

/* n fresh blocks into out: local cache first, then the ring (free lock) + a refill to cap */
static int take(Core *c, int64_t n, int32_t *out) {
    ClientRec *cl = c->cl;
    uint32_t lc = cl->local_count;
    int64_t k = n < (int64_t)lc ? n : (int64_t)lc;
    if (k) {
        if (jsave(c, &cl->local_count, 4)) return -1;
        /* pop from the end, newest first */
        for (int64_t i = 0; i < k; i++) out[i] = cl->local[lc - 1 - i];
        cl->local_count = lc - (uint32_t)k;
    }
    int64_t shortv = n - k;
    if (shortv > 0) {
        if (lock_acquire(c, LOCK_FREE)) return -1;
        int64_t got;
        if (ring_pop(c, shortv, out + k, &got)) return -1;
        if (got < shortv) {
            PyErr_SetString(PyExc_MemoryError, "pool exhausted (eviction not in spike)");
            return -1;
        }
        /* refill the local cache to cap while the lock is held */
        int64_t want = c->local_cap - (int64_t)cl->local_count;
        if (want > 0) {
            int32_t tmp[LOCAL_CACHE_MAX];
            if (ring_pop(c, want, tmp, &got)) return -1;
            for (int64_t i = 0; i < got; i++) {
                BlockRec *r = &c->blocks[tmp[i]];
                if (jsave(c, r, sizeof(BlockRec))) return -1;
                r->owner_pid = c->pid;
                r->owner_client = c->client;
                r->owner_start = c->start;
            }
            if (local_push(c, tmp, got) < 0) return -1;
        }
    }
    return 0;
}

/* ---- sequence slots ---------------------------------------------------------------------- */

static int reserve_refill(Core *c) {
    if (lock_acquire(c, LOCK_SEQS)) return -1;
    c->refilled = 1;
    memcpy(c->saved_reserve, c->reserve, sizeof c->reserve);
    c->saved_nreserve = c->nreserve;
    c->saved_next_id = c->next_id;
    c->saved_end_id = c->end_id;
    if (c->nreserve == 0) {
        int found = 0;
        for (int64_t i = 0; i < c->max_seqs && found < SLOT_BATCH; i++) {
            int64_t s = (c->hint + i) % c->max_seqs;
            SeqRec *q = seqrec(c, s);
            if (q->state == S_EMPTY && !q->reserved) {
                if (jsave(c, q, SEQ_HEAD)) return -1;
                q->reserved = 1;
                q->owner_client = c->client;
                q->owner_pid = c->pid;
                q->owner_start = c->start;
                c->reserve[found++] = (int32_t)s;
            }
        }
        if (!found) {
            PyErr_SetString(PyExc_RuntimeError, "sequence table full");
            return -1;
        }
        c->hint = (c->reserve[found - 1] + 1) % c->max_seqs;
        /* popped from the end: lowest first */
        for (int i = 0; i < found / 2; i++) {
            int32_t t = c->reserve[i];
            c->reserve[i] = c->reserve[found - 1 - i];
            c->reserve[found - 1 - i] = t;
        }
        c->nreserve = found;
    }
    if (c->next_id >= c->end_id) {
        if (jsave(c, &c->hdr->next_seq_id, 8)) return -1;
        c->next_id = c->hdr->next_seq_id + 1;
        c->hdr->next_seq_id += SEQ_ID_BATCH;
        c->end_id = c->next_id + SEQ_ID_BATCH;
    }
    return 0;
}

/* ---- the operations ---------------------------------------------------------------------- */

static int check_ready(Core *c) {
    if (g_forked != c->forked_at_init) {
        PyErr_SetString(PyExc_RuntimeError, "pool handle used in a forked child; attach again");
        return -1;
    }
    return 0;
}

/* stamp block b as a fresh ALLOCATED block of `req` holding toks[0:nt) (record journaled) */
static inline void stamp(Core *c, int64_t b, const char *req, int site, uint64_t now,
                         const int32_t *toks, int nt, uint64_t key, uint64_t parent) {
    BlockRec *r = &c->blocks[b];
    r->magic = BLOCK_MAGIC;
    r->state = ALLOCATED;
    r->indexed = 0;
    r->refcount = 1;
    r->generation++;
    r->owner_pid = c->pid;
    r->owner_client = c->client;
    r->prefix_hash = key;
    r->owner_start = c->start;
    memcpy(r->request, req, REQUEST_BYTES);
    r->alloc_ns = r->access_ns = now;
    r->site = site;
    r->num_tokens = (uint32_t)nt;
    r->parent_hash = parent;
    memcpy(r->tokens, toks, 4 * nt);
    seal(c, r, b);
}

static inline uint64_t chain_step(uint64_t prev, const int32_t *t) {
    uint64_t s = 0;
    for (int k = 0; k < BS; k++) s += (uint64_t)(int64_t)t[k] * CHAIN_C[k];
    return prev * CHAIN_P + s;
}

/* allocate a sequence for a prompt: claim a slot, take+stamp blocks, write the table */
static int do_alloc(Core *c, const char *req, int site, const int32_t *toks, int64_t ntok,
                    int64_t *slot_out, uint64_t *sid_out, int32_t *ids) {
    int64_t n = (ntok + BS - 1) / BS;
    if (ntok <= 0 || n > c->max_bps || n > MAX_PROMPT_BLOCKS) {
        PyErr_SetString(PyExc_ValueError, "bad prompt length");
        return -1;
    }
    txn_begin(c);
    c->refilled = 0;
    if (c->nreserve == 0 || c->next_id >= c->end_id)
        if (reserve_refill(c)) goto fail;
    int64_t slot = c->reserve[--c->nreserve];
    uint64_t sid = c->next_id++;
    uint64_t now = now_ns();
    SeqRec *q = seqrec(c, slot);
    if (jsave(c, q, SEQ_HEAD)) goto fail_slot;
    if (take(c, n, ids)) goto fail_slot;
    uint64_t h = 0, key = 0, parent = 0;
    for (int64_t j = 0; j < n; j++) {
        int64_t b = ids[j];
        int nt = (int)(j == n - 1 ? ntok - j * BS : BS);
        if (nt == BS) {
            h = chain_step(h, toks + j * BS);
            parent = key;
            key = fmix64(h);
        }
        if (jsave(c, &c->blocks[b], sizeof(BlockRec))) goto fail_slot;
        stamp(c, b, req, site, now, toks + j * BS, nt, nt == BS ? key : 0, nt == BS ? parent : 0);
    }
    q->state = S_RUNNING;
    q->owner_pid = c->pid;
    q->owner_client = c->client;
    q->owner_start = c->start;
    memcpy(q->request, req, REQUEST_BYTES);
    q->seq_id = sid;
    q->created_ns = now;
    q->chain = h;
    if (jsave(c, q->table, (uint32_t)(4 * n))) goto fail_slot;
    memcpy(q->table, ids, 4 * n);
    q->num_blocks = (uint32_t)n;
    q->num_tokens = (uint64_t)ntok;
    txn_commit(c);
    c->cl->counters[0] += n;
    *slot_out = slot;
    *sid_out = sid;
    return 0;
fail_slot:
    c->reserve[c->nreserve++] = (int32_t)slot;
    c->next_id--;
fail:
    if (c->refilled) { /* the refill's segment writes are rolled back: so is the reserve */
        memcpy(c->reserve, c->saved_reserve, sizeof c->reserve);
        c->nreserve = c->saved_nreserve;
        c->next_id = c->saved_next_id;
        c->end_id = c->saved_end_id;
    }
    txn_abort(c);
    return -1;
}

static int do_free(Core *c, int64_t slot, const int32_t *ids, int64_t n) {
    if (slot < 0 || slot >= c->max_seqs) {
        PyErr_SetString(PyExc_ValueError, "bad slot");
        return -1;
    }
    SeqRec *q = seqrec(c, slot);
    if (q->state != S_RUNNING || q->owner_client != c->client) {
        PyErr_SetString(PyExc_ValueError, "sequence is not a live sequence of this process");
        return -1;
    }
    int32_t zero[MAX_PROMPT_BLOCKS * 2 + BS];
    if (n > (int64_t)(sizeof zero / 4)) {
        PyErr_SetString(PyExc_ValueError, "table too long for the spike (kvscope chunks by 128)");
        return -1;
    }
    /* locks known up front, in order: seqs (reserve overflow), then free (cache overflow) */
    int64_t priv = 0;
    for (int64_t i = 0; i < n; i++) {
        BlockRec *r = &c->blocks[ids[i]];
        priv += (r->indexed == 0 && r->refcount <= 1);
    }
    txn_begin(c);
    if (c->nreserve >= 2 * SLOT_BATCH && lock_acquire(c, LOCK_SEQS)) goto fail;
    if ((int64_t)c->cl->local_count + priv > 2 * c->local_cap && lock_acquire(c, LOCK_FREE))
        goto fail;
    uint64_t now = now_ns();
    int64_t nz = 0, already = 0;
    for (int64_t i = n - 1; i >= 0; i--) {
        int64_t b = ids[i];
        BlockRec *r = &c->blocks[b];
        int32_t rc = r->refcount;
        if (r->state != ALLOCATED || rc <= 0) {
            already++; /* double free: left untouched (kvscope reports a finding) */
            continue;
        }
        if (jsave(c, r, sizeof(BlockRec))) goto fail;
        r->refcount = rc - 1;
        r->access_ns = now;
        if (rc == 1) {
            if (r->indexed)
                r->state = CACHED;
            else
                zero[nz++] = (int32_t)b;
        }
        seal(c, r, b);
    }
    int64_t fit = local_push(c, zero, nz);
    if (fit < 0) goto fail;
    if (fit < nz) {
        if (!c->held[LOCK_FREE]) { /* kvscope: escalate by restart; never hit: counted above */
            PyErr_SetString(PyExc_RuntimeError, "free lock needed but not taken");
            goto fail;
        }
        if (ring_push(c, zero + fit, nz - fit)) goto fail;
    }
    if (jsave(c, q, SEQ_HEAD)) goto fail;
    q->state = S_EMPTY;
    q->num_blocks = 0;
    if (c->nreserve < 2 * SLOT_BATCH) {
        c->reserve[c->nreserve++] = (int32_t)slot;
    } else {
        q->reserved = 0;
    }
    txn_commit(c);
    c->cl->counters[1] += n;
    return (int)already;
fail:
    txn_abort(c);
    return -1;
}

/* append one token; returns the new length, -2 when copy-on-write would be needed */
static int64_t do_append1(Core *c, int64_t slot, int32_t *last_block, int64_t n_old, int32_t tok) {
    SeqRec *q = seqrec(c, slot);
    if ((uint64_t)n_old != q->num_tokens || q->state != S_RUNNING || q->owner_client != c->client) {
        PyErr_SetString(PyExc_ValueError, "stale sequence handle");
        return -1;
    }
    int64_t off = n_old % BS;
    if (off) {
        /* the decode step: owner-only, unjournaled (as kvscope's fast path) */
        int64_t b = *last_block;
        BlockRec *r = &c->blocks[b];
        if (r->refcount > 1) return -2;
        r->tokens[off] = tok;
        r->num_tokens = (uint32_t)(off + 1);
        q->num_tokens = (uint64_t)(n_old + 1);
        if (off + 1 == BS) {
            /* block full: record its prefix keys (not indexed) and re-seal */
            uint64_t prev = q->chain;
            uint64_t h = chain_step(prev, r->tokens);
            q->chain = h;
            if (!r->indexed && r->refcount == 1) {
                r->prefix_hash = fmix64(h);
                r->parent_hash = n_old + 1 > BS ? fmix64(prev) : 0;
                seal(c, r, b);
            }
        }
        return n_old + 1;
    }
    /* a new block: one journaled transaction */
    int64_t nbk = q->num_blocks;
    if (nbk >= c->max_bps) {
        PyErr_SetString(PyExc_ValueError, "sequence too long");
        return -1;
    }
    txn_begin(c);
    int32_t b;
    if (take(c, 1, &b)) goto fail;
    if (jsave(c, &c->blocks[b], sizeof(BlockRec))) goto fail;
    stamp(c, b, q->request, -1, now_ns(), &tok, 1, 0, 0);
    if (jsave(c, q, SEQ_HEAD) || jsave(c, &q->table[nbk], 4)) goto fail;
    q->table[nbk] = b;
    q->num_blocks = (uint32_t)(nbk + 1);
    q->num_tokens = (uint64_t)(n_old + 1);
    txn_commit(c);
    c->cl->counters[0] += 1;
    *last_block = b;
    return n_old + 1;
fail:
    txn_abort(c);
    return -1;
}

/* ---- Python glue --------------------------------------------------------------------------- */

static int get_request(PyObject *o, char out[REQUEST_BYTES]) {
    const char *s;
    Py_ssize_t n;
    if (PyUnicode_Check(o)) {
        s = PyUnicode_AsUTF8AndSize(o, &n);
        if (!s) return -1;
    } else if (PyBytes_Check(o)) {
        s = PyBytes_AS_STRING(o);
        n = PyBytes_GET_SIZE(o);
    } else {
        PyObject *str = PyObject_Str(o);
        if (!str) return -1;
        int r = get_request(str, out);
        Py_DECREF(str);
        return r;
    }
    if (n > REQUEST_BYTES) n = REQUEST_BYTES;
    memcpy(out, s, n);
    memset(out + n, 0, REQUEST_BYTES - n);
    return 0;
}

/* list/tuple of ints -> int32 array (validated before any shared write) */
static int64_t get_int32s(PyObject *o, int32_t *out, int64_t cap, const char *what, int64_t lo,
                          int64_t hi) {
    PyObject *fast = PySequence_Fast(o, what);
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > cap) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "%s: too many (%zd)", what, n);
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(items[i]);
        if ((v == -1 && PyErr_Occurred()) || v < lo || v >= hi) {
            Py_DECREF(fast);
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: %ld out of range", what, v);
            return -1;
        }
        out[i] = (int32_t)v;
    }
    Py_DECREF(fast);
    return n;
}

static PyObject *ids_to_list(const int32_t *ids, int64_t n) {
    PyObject *l = PyList_New(n);
    if (!l) return NULL;
    for (int64_t i = 0; i < n; i++) PyList_SET_ITEM(l, i, PyLong_FromLong(ids[i]));
    return l;
}

/* alloc(request, tokens, site) -> (slot, seq_id, [block ids]) */
static PyObject *Core_alloc(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "alloc(request, tokens, site)");
    if (check_ready(c)) return NULL;
    char req[REQUEST_BYTES];
    int32_t toks[MAX_PROMPT_BLOCKS * BS], ids[MAX_PROMPT_BLOCKS];
    if (get_request(args[0], req)) return NULL;
    int64_t nt = get_int32s(args[1], toks, MAX_PROMPT_BLOCKS * BS, "tokens", INT32_MIN,
                            (int64_t)INT32_MAX + 1);
    if (nt < 0) return NULL;
    long site = PyLong_AsLong(args[2]);
    if (site == -1 && PyErr_Occurred()) return NULL;
    int64_t slot;
    uint64_t sid;
    if (do_alloc(c, req, (int)site, toks, nt, &slot, &sid, ids)) return NULL;
    PyObject *l = ids_to_list(ids, (nt + BS - 1) / BS);
    if (!l) return NULL;
    PyObject *t = PyTuple_New(3);
    PyTuple_SET_ITEM(t, 0, PyLong_FromLongLong(slot));
    PyTuple_SET_ITEM(t, 1, PyLong_FromUnsignedLongLong(sid));
    PyTuple_SET_ITEM(t, 2, l);
    return t;
}

/* free(slot, table) -> number of double frees */
static PyObject *Core_free(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "free(slot, table)");
    if (check_ready(c)) return NULL;
    int32_t ids[MAX_PROMPT_BLOCKS * 2 + BS];
    long slot = PyLong_AsLong(args[0]);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    int64_t n = get_int32s(args[1], ids, sizeof ids / 4, "table", 0, c->nb);
    if (n < 0) return NULL;
    int r = do_free(c, slot, ids, n);
    if (r < 0) return NULL;
    return PyLong_FromLong(r);
}

/* append1(slot, table, n_old, token) -> new length (the table list gains a block when needed) */
static PyObject *Core_append1(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[1]))
        return PyErr_Format(PyExc_TypeError, "append1(slot, table: list, n_old, token)");
    if (check_ready(c)) return NULL;
    long slot = PyLong_AsLong(args[0]);
    long long n_old = PyLong_AsLongLong(args[2]);
    long tok = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= c->max_seqs || tok < INT32_MIN || tok > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "bad slot or token");
        return NULL;
    }
    PyObject *table = args[1];
    Py_ssize_t nb = PyList_GET_SIZE(table);
    int32_t last = -1;
    if (n_old % BS) {
        if (nb == 0) return PyErr_Format(PyExc_ValueError, "empty table");
        long v = PyLong_AsLong(PyList_GET_ITEM(table, nb - 1));
        if (v < 0 || v >= c->nb) return PyErr_Format(PyExc_ValueError, "bad block id");
        last = (int32_t)v;
    }
    int64_t r = do_append1(c, slot, &last, n_old, (int32_t)tok);
    if (r == -1) return NULL;
    if (r == -2) {
        PyErr_SetString(PyExc_NotImplementedError, "copy-on-write append not in spike");
        return NULL;
    }
    if (n_old % BS == 0) {
        PyObject *b = PyLong_FromLong(last);
        if (!b || PyList_Append(table, b)) {
            Py_XDECREF(b);
            return NULL;
        }
        Py_DECREF(b);
    }
    return PyLong_FromLongLong(r);
}

/* pure-C loops: the cost of the work without the CPython calls */
static PyObject *Core_bench_pairs(Core *c, PyObject *args) {
    long long n;
    int ntok;
    if (!PyArg_ParseTuple(args, "Li", &n, &ntok)) return NULL;
    int32_t toks[MAX_PROMPT_BLOCKS * BS], ids[MAX_PROMPT_BLOCKS];
    for (int i = 0; i < ntok; i++) toks[i] = 1000 + i;
    char req[REQUEST_BYTES] = "s";
    uint64_t t0 = mono_ns();
    for (long long i = 0; i < n; i++) {
        toks[0] = (int32_t)i;
        int64_t slot;
        uint64_t sid;
        if (do_alloc(c, req, -1, toks, ntok, &slot, &sid, ids)) return NULL;
        if (do_free(c, slot, ids, (ntok + BS - 1) / BS) < 0) return NULL;
    }
    return PyFloat_FromDouble((double)(mono_ns() - t0) / 1e9);
}

static PyObject *Core_bench_append(Core *c, PyObject *args) {
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
    int32_t ids[MAX_PROMPT_BLOCKS], one = 1;
    char req[REQUEST_BYTES] = "a";
    int64_t slot;
    uint64_t sid;
    uint64_t t0 = mono_ns();
    if (do_alloc(c, req, -1, &one, 1, &slot, &sid, ids)) return NULL;
    int64_t len = 1;
    int32_t last = ids[0];
    for (long long i = 0; i < n; i++) {
        if (len >= 1024) {
            SeqRec *q = seqrec(c, slot);
            if (do_free(c, slot, q->table, q->num_blocks) < 0) return NULL;
            if (do_alloc(c, req, -1, &one, 1, &slot, &sid, ids)) return NULL;
            len = 1;
            last = ids[0];
        }
        len = do_append1(c, slot, &last, len, (int32_t)i);
        if (len < 0) return NULL;
    }
    double dt = (double)(mono_ns() - t0) / 1e9;
    SeqRec *q = seqrec(c, slot);
    if (do_free(c, slot, q->table, q->num_blocks) < 0) return NULL;
    return PyFloat_FromDouble(dt);
}

static PyObject *Core_lock_roundtrips(Core *c, PyObject *args) {
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
    uint64_t t0 = mono_ns();
    for (long long i = 0; i < n; i++) {
        if (lock_acquire(c, LOCK_FREE)) return NULL;
        lock_release(c, LOCK_FREE);
    }
    return PyFloat_FromDouble((double)(mono_ns() - t0) / 1e9);
}

static PyObject *Core_rollback_client(Core *c, PyObject *args) {
    int i;
    if (!PyArg_ParseTuple(args, "i", &i)) return NULL;
    if (i < 0 || i >= MAX_CLIENTS) return PyErr_Format(PyExc_ValueError, "bad client");
    ClientRec *cl = (ClientRec *)(c->base + c->L.clients + (size_t)i * sizeof(ClientRec));
    return PyLong_FromUnsignedLong(journal_rollback(c, cl));
}

static PyObject *Core_set_crash(Core *c, PyObject *args) {
    long long n;
    if (!PyArg_ParseTuple(args, "L", &n)) return NULL;
    c->crash_at = n;
    Py_RETURN_NONE;
}

static PyObject *Core_stats(Core *c, PyObject *Py_UNUSED(ignored)) {
    return Py_BuildValue("{s:K,s:I,s:I,s:i,s:K,s:K}", "lock_roundtrips", c->n_lock_rt,
                         "local_count", c->cl->local_count, "ring_count", c->hdr->ring.count,
                         "reserve", c->nreserve, "num_allocs", c->cl->counters[0], "num_frees",
                         c->cl->counters[1]);
}

static PyObject *Core_init_segment(Core *c, PyObject *Py_UNUSED(ignored)) {
    /* creator: every block FREE in the ring, locks named, empty seq table */
    memset(c->base, 0, c->L.end);
    c->hdr->magic = 0x4B565343504F4531ull;
    c->hdr->num_blocks = c->nb;
    c->hdr->max_seqs = c->max_seqs;
    c->hdr->max_bps = c->max_bps;
    strcpy(c->locks[LOCK_SEQS].name, "seqs");
    strcpy(c->locks[LOCK_FREE].name, "free");
    for (int i = 0; i < NUM_LOCKS; i++) c->locks[i].holder_client = -1;
    for (int64_t b = 0; b < c->nb; b++) {
        BlockRec *r = &c->blocks[b];
        r->magic = BLOCK_MAGIC;
        r->state = FREE;
        r->owner_client = -1;
        seal(c, r, b);
        c->ring[b] = (int32_t)b;
    }
    c->hdr->ring.tail = c->nb;
    c->hdr->ring.count = (uint32_t)c->nb;
    Py_RETURN_NONE;
}

static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buf", "fd", "num_blocks", "max_seqs", "max_bps", "client",
                             "local_cap", "start", "full_checksum", NULL};
    PyObject *buf;
    long long nb, ms, mb, start;
    int fd, client, cap, full = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OiLLLiiL|p", kwlist, &buf, &fd, &nb, &ms, &mb,
                                     &client, &cap, &start, &full))
        return -1;
    if (cap < 0 || 2 * cap > LOCAL_CACHE_MAX || client < 0 || client >= MAX_CLIENTS || nb <= 0) {
        PyErr_SetString(PyExc_ValueError, "bad geometry");
        return -1;
    }
    if (c->have_view) {
        PyBuffer_Release(&c->view);
        c->have_view = 0;
    }
    if (PyObject_GetBuffer(buf, &c->view, PyBUF_WRITABLE)) return -1;
    c->have_view = 1;
    c->L = make_layout(nb, ms, mb);
    if ((size_t)c->view.len < c->L.end) {
        PyErr_SetString(PyExc_ValueError, "buffer smaller than the layout");
        return -1;
    }
    c->base = c->view.buf;
    c->fd = fd;
    c->nb = nb;
    c->max_seqs = ms;
    c->max_bps = mb;
    c->client = client;
    c->local_cap = cap;
    c->full_checksum = full;
    c->pid = getpid();
    c->start = start;
    c->forked_at_init = g_forked;
    c->hdr = (SegHdr *)(c->base + c->L.hdr);
    c->locks = (LockRec *)(c->base + c->L.locks);
    c->blocks = (BlockRec *)(c->base + c->L.blocks);
    c->ring = (int32_t *)(c->base + c->L.ring);
    c->cl = (ClientRec *)(c->base + c->L.clients + (size_t)client * sizeof(ClientRec));
    c->cl->pid = c->pid;
    c->cl->start = start;
    c->cl->state = 1;
    c->nreserve = 0;
    c->next_id = c->end_id = 0;
    return 0;
}

static void Core_dealloc(Core *c) {
    if (c->have_view) PyBuffer_Release(&c->view);
    Py_TYPE(c)->tp_free((PyObject *)c);
}


/* ---- variant: the Sequence handle as a C type, the API methods in C (no Python frames) ---- */

#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *request_id;
    PyObject *block_table;
    PyObject *state;
    PyObject *owner;
    long slot;
    long long seq_id, num_tokens;
} Seq;

static void Seq_dealloc(Seq *s) {
    Py_XDECREF(s->request_id);
    Py_XDECREF(s->block_table);
    Py_XDECREF(s->state);
    Py_XDECREF(s->owner);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMemberDef Seq_members[] = {
    {"request_id", T_OBJECT, offsetof(Seq, request_id), READONLY, NULL},
    {"block_table", T_OBJECT, offsetof(Seq, block_table), READONLY, NULL},
    {"state", T_OBJECT, offsetof(Seq, state), READONLY, NULL},
    {"slot", T_LONG, offsetof(Seq, slot), READONLY, NULL},
    {"seq_id", T_LONGLONG, offsetof(Seq, seq_id), READONLY, NULL},
    {"num_tokens", T_LONGLONG, offsetof(Seq, num_tokens), READONLY, NULL},
    {NULL}};

static PyTypeObject SeqType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcore.Sequence",
    .tp_basicsize = sizeof(Seq),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Seq_dealloc,
    .tp_members = Seq_members,
};

static PyObject *s_running, *s_finished;

/* allocate(request_id, tokens) -> Sequence */
static PyObject *Core_allocate(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "allocate(request_id, tokens)");
    if (check_ready(c)) return NULL;
    char req[REQUEST_BYTES];
    int32_t toks[MAX_PROMPT_BLOCKS * BS], ids[MAX_PROMPT_BLOCKS];
    if (get_request(args[0], req)) return NULL;
    int64_t nt = get_int32s(args[1], toks, MAX_PROMPT_BLOCKS * BS, "tokens", INT32_MIN,
                            (int64_t)INT32_MAX + 1);
    if (nt < 0) return NULL;
    Seq *s = PyObject_New(Seq, &SeqType);
    if (!s) return NULL;
    s->request_id = s->block_table = s->state = s->owner = NULL;
    int64_t slot;
    uint64_t sid;
    if (do_alloc(c, req, -1, toks, nt, &slot, &sid, ids)) {
        Py_DECREF(s);
        return NULL;
    }
    s->block_table = ids_to_list(ids, (nt + BS - 1) / BS);
    if (!s->block_table) {
        Py_DECREF(s);
        return NULL; /* (the spike leaks the sequence here) */
    }
    Py_INCREF(args[0]);
    s->request_id = args[0];
    Py_INCREF(s_running);
    s->state = s_running;
    Py_INCREF(c);
    s->owner = (PyObject *)c;
    s->slot = (long)slot;
    s->seq_id = (long long)sid;
    s->num_tokens = nt;
    return (PyObject *)s;
}

static int own(Core *c, PyObject *o) {
    if (Py_TYPE(o) != &SeqType || ((Seq *)o)->owner != (PyObject *)c || ((Seq *)o)->slot < 0) {
        PyErr_SetString(PyExc_ValueError, "not a live sequence of this pool");
        return -1;
    }
    return check_ready(c);
}

/* free(seq) */
static PyObject *Core_free_seq(Core *c, PyObject *o) {
    if (own(c, o)) return NULL;
    Seq *s = (Seq *)o;
    int32_t ids[MAX_PROMPT_BLOCKS * 2 + BS];
    int64_t n = get_int32s(s->block_table, ids, sizeof ids / 4, "table", 0, c->nb);
    if (n < 0) return NULL;
    if (do_free(c, s->slot, ids, n) < 0) return NULL;
    PyObject *empty = PyList_New(0);
    if (!empty) return NULL;
    Py_SETREF(s->block_table, empty);
    Py_INCREF(s_finished);
    Py_SETREF(s->state, s_finished);
    s->slot = -1;
    Py_RETURN_NONE;
}

/* append(seq, tokens) */
static PyObject *Core_append_seq(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) return PyErr_Format(PyExc_TypeError, "append(seq, tokens)");
    if (own(c, args[0])) return NULL;
    Seq *s = (Seq *)args[0];
    PyObject *fast = PySequence_Fast(args[1], "tokens");
    if (!fast) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *table = s->block_table;
    for (Py_ssize_t i = 0; i < k; i++) {
        long tok = PyLong_AsLong(items[i]);
        if ((tok == -1 && PyErr_Occurred()) || tok < INT32_MIN || tok > INT32_MAX) goto bad;
        int64_t n_old = s->num_tokens;
        int32_t last = -1;
        Py_ssize_t nb = PyList_GET_SIZE(table);
        if (n_old % BS) last = (int32_t)PyLong_AsLong(PyList_GET_ITEM(table, nb - 1));
        int64_t r = do_append1(c, s->slot, &last, n_old, (int32_t)tok);
        if (r == -1) goto bad;
        if (r == -2) {
            PyErr_SetString(PyExc_NotImplementedError, "copy-on-write append not in spike");
            goto bad;
        }
        if (n_old % BS == 0) {
            PyObject *b = PyLong_FromLong(last);
            if (!b || PyList_Append(table, b)) {
                Py_XDECREF(b);
                goto bad;
            }
            Py_DECREF(b);
        }
        s->num_tokens = r;
    }
    Py_DECREF(fast);
    Py_RETURN_NONE;
bad:
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad token");
    Py_DECREF(fast);
    return NULL;
}

static PyMethodDef Core_methods[] = {
    {"allocate", (PyCFunction)(void (*)(void))Core_allocate, METH_FASTCALL, "allocate(request_id, tokens) -> Sequence"},
    {"free_seq", (PyCFunction)Core_free_seq, METH_O, "free(seq)"},
    {"append_seq", (PyCFunction)(void (*)(void))Core_append_seq, METH_FASTCALL, "append(seq, tokens)"},
    {"alloc", (PyCFunction)(void (*)(void))Core_alloc, METH_FASTCALL, "alloc(request, tokens, site) -> (slot, seq_id, table)"},
    {"free", (PyCFunction)(void (*)(void))Core_free, METH_FASTCALL, "free(slot, table) -> double frees"},
    {"append1", (PyCFunction)(void (*)(void))Core_append1, METH_FASTCALL, "append1(slot, table, n_old, token) -> n"},
    {"bench_pairs", (PyCFunction)Core_bench_pairs, METH_VARARGS, "bench_pairs(n, ntok) -> seconds"},
    {"bench_append", (PyCFunction)Core_bench_append, METH_VARARGS, "bench_append(n) -> seconds"},
    {"lock_roundtrips", (PyCFunction)Core_lock_roundtrips, METH_VARARGS, "lock_roundtrips(n) -> seconds"},
    {"rollback_client", (PyCFunction)Core_rollback_client, METH_VARARGS, "roll back a client's journal"},
    {"set_crash", (PyCFunction)Core_set_crash, METH_VARARGS, "SIGKILL at the n-th journal save"},
    {"stats", (PyCFunction)Core_stats, METH_NOARGS, ""},
    {"init_segment", (PyCFunction)Core_init_segment, METH_NOARGS, ""},
    {NULL}};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
};

static PyObject *noop(PyObject *self, PyObject *Py_UNUSED(x)) { Py_RETURN_NONE; }
static PyObject *noop_fast(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_RETURN_NONE;
}

static PyObject *py_layout(PyObject *self, PyObject *args) {
    long long nb, ms, mb;
    if (!PyArg_ParseTuple(args, "LLL", &nb, &ms, &mb)) return NULL;
    Layout L = make_layout(nb, ms, mb);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}", "header", L.hdr, "locks",
                         L.locks, "blocks", L.blocks, "ring", L.ring, "seqs", L.seqs, "clients",
                         L.clients, "end", L.end, "seq_rec", L.seq_rec, "client_rec",
                         sizeof(ClientRec), "ring_header", offsetof(SegHdr, ring));
}

static PyObject *py_chain_coefs(PyObject *self, PyObject *Py_UNUSED(x)) {
    PyObject *l = PyList_New(BS);
    for (int i = 0; i < BS; i++) PyList_SET_ITEM(l, i, PyLong_FromUnsignedLongLong(CHAIN_C[i]));
    return l;
}

static PyMethodDef mod_methods[] = {
    {"noop", noop, METH_NOARGS, "no-op, no arguments"},
    {"noop3", (PyCFunction)(void (*)(void))noop_fast, METH_FASTCALL, "no-op, fastcall"},
    {"layout", py_layout, METH_VARARGS, "segment offsets"},
    {"chain_coefs", py_chain_coefs, METH_NOARGS, ""},
    {NULL}};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "kvcore", NULL, -1, mod_methods};

PyMODINIT_FUNC PyInit_kvcore(void) {
    uint64_t x = 0x4B5653ull;
    for (int i = 0; i < BS; i++) { /* splitmix64: fixed odd coefficients */
        uint64_t z = (x += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        CHAIN_C[i] = (z ^ (z >> 31)) | 1;
    }
    pthread_atfork(NULL, NULL, atfork_child);
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&SeqType) < 0) return NULL;
    s_running = PyUnicode_InternFromString("running");
    s_finished = PyUnicode_InternFromString("finished");
    PyObject *m = PyModule_Create(&mod);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    PyModule_AddObject(m, "Core", (PyObject *)&CoreType);
    Py_INCREF(&SeqType);
    PyModule_AddObject(m, "Sequence", (PyObject *)&SeqType);
    return m;
}
