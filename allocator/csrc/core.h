/* The C core's shared part: constants, record offsets, the Native object, record helpers. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <math.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Offsets, sizes, states and constants of the segment: generated from allocator/records.py
 * by setup.py (the one definition; native.py checks the built values at import). */
#include "layout.h"
/* The held-lock mask is one 64-bit word. */
#define MAX_LOCKS 64

enum { OK = 0, UNHANDLED = 1, ERROR = -1 };
/* What an operation's step answers after its transaction rolled back (eviction.c rolled_back),
 * besides ERROR and UNHANDLED (a case the core does not handle: a bug, unhandled()): run it again
 * as it is (AGAIN), or in smaller transactions (JOURNAL_SHORT: the journal could not hold it). */
enum { AGAIN = 3, JOURNAL_SHORT = 4 };

/* The light probes the core runs itself (probes.c): bits of the handle's probe word
 * (KVPool._probe_bits, probing.PoolProbes.native_bits). */
#define P_EVENTS 1
#define P_SITES 2      /* ownership, one frame: sites cached by (code object, instruction) */
#define P_LEAKS 4
#define P_MAGIC 8
#define P_SITES_EACH 16 /* ownership with stacks: each frame cached, the stack interned */
#define P_LOCKDEP 32    /* lockdep instruments the handle's locks, and nothing else does */
#define P_GUARD_SAMPLED 64 /* sampled guard mode: the releases of the sequences it guards */
#define P_GUARD 128    /* guard mode in full: every release guarded (kvdata.c) */
#define P_DIGEST 256   /* digests of published blocks (kvdata.c) */
/* User lock classes whose edges into the pool's classes a handle remembers (probes.c). */
#define USER_KNOWN_MAX 32
/* Bits from here up: the frames per site with stacks (sites.stack_depth; P_SITES_EACH) */
#define P_SITE_DEPTH_SHIFT 16
/* sites.MAX_STACK_DEPTH */
#define MAX_STACK_DEPTH 16
/* Event ops (events.py EventOp). */
enum { E_ALLOCATE = 1, E_FREE = 2, E_FORK = 3, E_COW = 4, E_EVICT = 5, E_PREFIX_HIT = 6, E_PREFIX_MISS = 7,
       E_GUARD_VIOLATION = 8, E_FINDING = 9, E_ABORT = 10, E_PREEMPT = 11, E_PUBLISH = 13,
       E_LEASE = 14, E_LEASE_END = 15, E_EXHAUSTED = 16 };
/* probing.VERIFY_EVERY_S */
#define VERIFY_EVERY_NS 10000000ull
/* Entries of the core's site cache (a power of two). */
#define SITE_CACHE 256

static const uint64_t KSUM[5] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull,
                                 0x27D4EB2F165667C5ull, 0xFF51AFD7ED558CCDull};
static const uint64_t CHAIN_P = 0x100000001B3ull;

static inline uint64_t clock_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t wall_ns(void) { return clock_ns(CLOCK_REALTIME); }

static inline uint64_t mono_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

/* The coarse monotonic clock (the kernel's tick: a few ms; a seventh of mono_ns's cost on a TSC
 * machine, 3 ns against 20) for the magic probe's check cadence, read at every operation. */
static inline uint64_t mono_coarse_ns(void) { return clock_ns(CLOCK_MONOTONIC_COARSE); }

/* How much less than the time passed a difference of two coarse readings can be: its
 * resolution (or UINT64_MAX when the coarse clock is not usable for a 10 ms cadence). */
static inline uint64_t coarse_slack_ns(void) {
    struct timespec r;
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &r) != 0) return UINT64_MAX;
    uint64_t res = (uint64_t)r.tv_sec * 1000000000ull + (uint64_t)r.tv_nsec;
    return res < VERIFY_EVERY_NS / 2 ? res : UINT64_MAX;
}

/* MurmurHash3's 64-bit finalizer, never 0 (0 is "none": an empty index slot, no digest): the
 * prefix index's keys and the block digests (allocator/prefix.py fmix64; kernels/digest.py's
 * Triton fmix64; equal bit for bit, tests/test_hash_finalizer.py). */
static inline uint64_t fmix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 33;
    return h ? h : 1;
}

/* `key` moved into the shard of the prompt's first key. */
static inline uint64_t family_key(uint64_t key, uint64_t first, uint64_t mask) {
    uint64_t k = (key & ~mask) | (first & mask);
    return k ? k : mask + 1;
}

#define U8(p) (*(uint64_t *)(p))
#define U2(p) (*(uint16_t *)(p))
#define U4(p) (*(uint32_t *)(p))
#define I4(p) (*(int32_t *)(p))

/* A cached block by age: its access time and id (eviction's order). */
typedef struct {
    uint64_t ns;
    int32_t id;
} Aged;

/* The finding kinds the core reports itself (probes.c FK_NAMES: findings.FindingKind). */
enum {
    FK_LEAK_FINISHED,
    FK_FREE_LIST_CORRUPT,
    FK_HEADER_CORRUPT,
    FK_REFCOUNT_MISMATCH,
    FK_USE_AFTER_FREE,
    FK_GUARD_VIOLATION,
    FK_PUBLISHED_BLOCK_MODIFIED,
    FK_LOCK_DEAD_HOLDER, /* recovery.c */
    FK_LEAK_DEAD_OWNER,
    FK_KV_NEVER_WRITTEN,
    FK_DOUBLE_FREE,
    FK_BLOCK_HEADER_CORRUPT,
    FK_LOCK_ORDER_CYCLE,
    FK_BLOCK_TABLE_MISMATCH, /* audit.c */
    FK_WAIT_HOLDS_GIL,       /* locks.c: a wait of the core's that keeps the GIL */
    FK_TRANSFER_AFTER_FREE, /* leases.c */
    FK_LEASE_LEAK,
    FK_FOREIGN_SLOT, /* provenance.c */
    FK_UNMAPPED_WRITE, /* stores.c */
    FK_COUNT
};

/* A request hash slot provenance took (provenance.c prov_write), by sequence id. */
#define PROV_RH_CACHE 256
/* The most blocks whose slot sums one operation keeps (kvdata.c kv_sums_keep). */
#define KVS_KEEP 256
typedef struct {
    uint64_t seq_id_1;
    uint32_t hash;
} ProvHash;

/* A block as a finding saw it: what the findings ring records of it (and a leak's refcount). */
typedef struct {
    int32_t block, owner_pid, site, refcount;
    char request[REQUEST_BYTES];
} Seen;

#define SEEN_LATER_BUT_REQUEST 2

/* A finding seen inside a transaction, reported when it commits (probes.c finding_later). */
typedef struct {
    int fk;
    Seen seen;
    PyObject *message;
    int event;      /* an event recorded first, whether or not the finding is new (0: none) */
    int seen_later; /* the block's record is read when it is reported, not when it was seen
                     * (SEEN_LATER_BUT_REQUEST: its request kept, the one the finding is about) */
    int64_t pre;    /* the sequences the transaction had preempted when it was seen */
    uint64_t op;    /* a device check's answer: the operation the check belongs to (OP_UNNAMED,
                     * 0: none known), for its REPORT (devanswers.c dev_apply) */
} Pending;
/* A device check queued while the handle records, whose operation's record is not written yet:
 * the handle's next operation record names it (oplog.c oplog_name_checks). */
#define OP_UNNAMED UINT64_MAX

typedef struct {
    PyObject_HEAD
    Py_buffer buf; /* the segment mapping, writable */
    uint8_t *seg;
    int fd;
    /* geometry */
    int64_t nb, bs, rec, max_seqs, seq_rec, max_bps, index_w, num_shards;
    size_t off_blocks, off_ring, off_index, off_seqs, off_locks;
    /* this client's record: absolute offsets of its fields */
    size_t c_seq, c_local_count, c_local, c_jcount, c_jused, c_journal, c_jdata, c_counters;
    size_t c_wait; /* where this process publishes the locks it waits for (waits.py) */
    int client, lock_free, lock_shard0, lock_seqs, num_locks;
    int32_t pid;
    uint64_t start;
    int64_t local_cap, local_max, slot_batch;
    int64_t quarantine; /* the pool's quarantine count (guard mode): 0 for none */
    /* This process's slot reserve (sequences.c): EMPTY slots the table marks reserved by this
     * client (res[0..res_n), claimed from the end; room for 2 x slot_batch), its range of
     * sequence ids [id_next, id_end), where a refill looks for slots first (res_hint). */
    int32_t *res;
    int64_t res_n, res_hint;
    uint64_t id_next, id_end;
    PyObject *mutex;   /* KVPool._mutex: the mapping's op mutex (an RLock) */
    int64_t *overdue; /* set where more check answers wait than kept (KVPool._overdue) */
    Py_buffer overdue_buf;
    int mutex_held;    /* this call took the mutex to wait for a pool lock (locks.c hold_mutex) */
    int mutex_wanted;  /* this call waits for the mutex, another thread holding it */
    /* the thread of the operation in flight: the last to take a pool lock or the op mutex (read
     * while `held` or `mutex_held` says one is: locks.c wait_others) */
    unsigned long op_thread;
    PyObject *seq_type;     /* allocator.sequence.Sequence */
    PyObject *seq_fields;   /* its dataclass field names, in order (a tuple of 10) */
    Py_ssize_t seq_off[10]; /* their __slots__ offsets in an instance */
    PyObject *seqs;         /* the handle's live sequences: slot -> Sequence (the core's own) */
    PyObject *faults_armed; /* faults.ARMED: fault -> opportunities left (faults.c) */
    PyObject *fault_fired;  /* faults.fired */
    PyObject *write_past;   /* faults.write_past: oob-write's write into the KV data */
    int64_t *crash;         /* crash.ARMED: [armed point + 1, hits left] (faults.c) */
    Py_buffer crash_buf;
    int64_t uid;            /* KVPool._uid */
    PyObject *name;         /* KVPool.name (a str: the handle's errors name the pool) */
    /* the (finding kind, request) of each refused call on an ended sequence reported
     * (entry.c ended_use: a double_free or use_after_free about no block, once per request) */
    PyObject *ended_used;
    size_t off_lru; /* the segment's LRU list (eviction.c), shared by every process */
    /* Done at commit, under the free lock: evictions to count; how far this transaction's
     * takes advanced the LRU list (pend_takes of them, pend_taken candidates); a scan's
     * candidates for the list, or pend_scan_n < 0; the scans done. */
    int64_t pend_evicted;
    int64_t pend_take_pos, pend_taken, pend_takes, pend_scans;
    int32_t *pend_scan_ids;
    uint64_t *pend_scan_ns;
    int64_t pend_scan_n, pend_scan_cached;
    /* Scratch for scans (num_blocks entries), and what the last dry scan found there. */
    Aged *scan_buf;
    int dry_valid;
    int64_t dry_k, dry_extra, dry_m, dry_keep, dry_added;
    /* An eviction that stopped short of its candidates (the journal's room): the LRU list is
     * forgotten at commit (the next eviction scans). */
    int pend_forget;
    /* The open operation's take: the blocks its eviction is to hand it, and whether a journal
     * save was refused (jsave): both together, after its rollback, are evicted ahead in
     * transactions of their own and the operation runs again (eviction.c rolled_back). */
    int64_t evicting;
    int jfull;
    /* The save the journal refused last (its entries and bytes with it: journal_full's words). */
    uint32_t jfull_entries, jfull_bytes;
    /* Locks the open operation found it needs and did not hold (need_locks): it rolls back and
     * runs again with them too (`want_locks`, kept until the operation ends; `escalate`: this
     * rollback's reason). */
    uint64_t want_locks;
    int escalate;
    /* A K/V check of the open transaction needed the handle's op mutex while another thread
     * held it: after the rollback the core waits for it, holds it, and runs the operation again
     * (eviction.c rolled_back). */
    int need_mutex;
    /* Guard mode's poison the open transaction lays at its commit (kvdata.c commit_poison;
     * emptied by txn_begin): the blocks a preemption inside it freed (quarantined), and the
     * blocks it evicted, whoever holds them at the commit. */
    int32_t *poison_ids;
    int64_t n_poison, cap_poison;
    int32_t *evicted_ids;
    int64_t n_evicted, cap_evicted;
    int fork_gen;
    uint64_t *coefs;   /* prefix.COEFS[:bs] */
    /* the open transaction */
    uint32_t jcount, jused;
    uint64_t held; /* bit i: lock i */
    int64_t crash_at; /* tests: SIGKILL at the n-th journal save (0: off) */
    /* stats(): operations completed, cases not handled (each a RuntimeError), blocks evicted */
    uint64_t ops_done, unhandled, evicted;
    /* A waiting sequence (its slot + 1, else 0) whose preemption would outgrow the open
     * operation's journal: the operation rolls back, preempts it ahead in transactions of its
     * own and runs again (preempt.c preempt_ahead). */
    int64_t ahead;
    /* probes (probes.c) */
    int64_t *probe_bits; /* KVPool._probe_bits: P_* of the handle's probe (read at every call) */
    Py_buffer probe_bits_buf;
    int probes;          /* this call's P_* */
    int abandoning;      /* an operation aborting the sequence it could not finish (abandon) */
    size_t off_ev, c_event_head; /* this client's event ring and its head */
    uint64_t ev_cap;
    PyObject *kv_dirs;   /* sites._KVSCOPE_DIRS */
    PyObject *site_code[SITE_CACHE];
    int site_lasti[SITE_CACHE];
    int32_t site_id[SITE_CACHE];
    PyObject *out_code[SITE_CACHE];
    uint8_t out_flag[SITE_CACHE];
    int site_used, out_used;
    uint32_t *checked;   /* magic: block -> the transaction that checked its record */
    uint32_t txn_stamp;
    int32_t *refs;       /* leaks: scratch counts per block, valid where refs_stamp is */
    uint32_t *refs_stamp; /* ... refs_epoch (probes.c leak_scratch) */
    uint32_t refs_epoch;
    uint64_t last_verify_ns;
    int verify_between; /* the check runs between operations (entry.c N_verify_often): no waits */
    uint64_t coarse_slack; /* verify_often's clock: 0 not yet asked (coarse_slack_ns) */
    uint64_t op_ns;        /* the coarse monotonic clock as this operation's gate read it */
    /* lockdep (probes.c lockdep_ok) */
    uint64_t traced;              /* locks lockdep traces (not sites, findings) */
    uint64_t same_class[MAX_LOCKS]; /* locks of lock i's class (the index shards are one) */
    uint64_t known_into[MAX_LOCKS]; /* bit i of [j]: the order edge class(i) -> class(j) is known */
    int lockdep_was_on;
    int keep_gil;        /* the gil-wait fault: this lock_take waits holding the GIL (faults.c) */
    /* the edges traced user class -> pool lock class known (probes.c lockdep_user_into): bit
     * j of uk_into[k] for class uk_cls[k] */
    char uk_cls[USER_KNOWN_MAX][16];
    uint64_t uk_into[USER_KNOWN_MAX];
    int uk_used;
    /* the lock-order graph (FORMAT.md section 10: probes.c probes_init), under lock_findings */
    size_t off_lockgraph; /* (its records' fields: layout.h's LG_) */
    int lock_findings;
    char lock_cls[MAX_LOCKS][16]; /* each lock's class as the graph stores it (S16) */
    /* the findings ring (FORMAT.md section 11: probes.c probes_init), under lock_findings */
    size_t off_findings; /* (its records' fields: layout.h's FD_) */
    uint8_t fk_severity[FK_COUNT]; /* each kind's severity byte (1 error, 2 warning) */
    /* the site table (FORMAT.md: probes.c probes_init), under lock_sites */
    size_t off_sites; /* (its records' fields: layout.h's SR_) */
    int lock_sites;
    uint8_t *reported; /* [FK_COUNT][nb + 1]: reported once per (kind, block; nb: none) */
    PyObject *found;   /* KVPool._found: ring positions of findings written in this call */
    Seen *leak;        /* the blocks a release leaked (leaked_blocks), CHUNK at most */
    Pending *pend;     /* findings of the open transaction, reported at its commit */
    int64_t n_pend;
    int pend_hold;     /* the operation reports them itself, among its events (findings_hold) */
    int64_t n_leak;
    PyObject *pool; /* the call's pool (borrowed, for the duration of one call) */
    /* leaks: the slots that may hold a live sequence (a superset, kept while no client but
     * this core ran a transaction since the last full scan: every client's seq as seen) */
    int32_t *maybe_live;
    uint8_t *in_maybe;
    int64_t n_maybe;
    uint64_t *seen_seq;
    int maybe_valid;
    int64_t max_clients;
    /* every client's record: the clients section (their fields: layout.h's CF_) */
    size_t off_clients;
    /* recovery.c: this handle's record is a dead process's, being reclaimed for an attach (its
     * counter is not bumped: reclaim_for_attach) */
    int borrowed;
    /* preempt.c: the slots this transaction preempted (their Sequences change at commit), and
     * the blocks a take still needed when nothing was left (PoolExhausted after the rollback;
     * 0: none) */
    int64_t *pre_slots;
    int64_t n_pre, cap_pre;
    int64_t exhausted_need;
    char exhausted_request[REQUEST_BYTES]; /* whose take it was (its `exhausted` event) */
    PyObject *guarded;   /* slots of the sequences sampled guard mode guards (the core's own) */
    uint8_t *hdr_copy;   /* magic: the header's checked bytes as the handle attached */
    PyObject *msg_canary, *msg_poison; /* integrity.CANARY_MESSAGE, POISON_MESSAGE */
    PyObject *msg_modified, *msg_blank; /* integrity.MODIFIED_MESSAGE, BLANK_MODIFIED_MESSAGE */
    PyObject *msg_unwritten; /* integrity.UNWRITTEN_MESSAGE */
    uint64_t blank_zero, blank_nan; /* high halves of a never-written block's digests (0: not yet) */
    int blank_known;
    int64_t hdr_len;
    /* The KV data (kvdata.c): its bytes when this process maps them (a CPU pool), else NULL
     * (its checks are queued: devchecks.c); [layers, 2, blocks, slots, heads, dim]. */
    uint8_t *kv;
    PyObject *kv_obj;    /* the tensor (keeps the mapping alive), or None */
    int64_t kv_rows;     /* layers x 2 */
    int64_t kv_row_stride, kv_block_stride, kv_slot_bytes, kv_spb, kv_esize; /* bytes; slots */
    uint64_t canary;     /* kernels/guard.py CANARY_BITS of the element size */
    uint64_t nan_bits;   /* kernels/checks.py poison_bits */
    int64_t poison_ok;   /* integrity.can_poison: a floating-point cache */
    int64_t off_kv_digest; /* the block record's kv_digest (its last field) */
    struct DevChecks *dev; /* the checks the core launches itself (devchecks.c), or NULL */
    uint32_t oplog_fired; /* faults fired since the last record (bit i: FAULT_NAMES[i]) */
    struct Oplog *oplog;   /* the operation log this handle records into (oplog.c), or NULL */
    /* device checks (and findings read from them) that can find something, queued while the
     * handle records and not yet named by an operation's record (oplog_name_checks) */
    int64_t checks_unnamed;
    /* leases.c: the section, where its records start in it, a record's size, the next record
     * to look at */
    size_t off_leases, lease_records;
    int64_t lease_rec, lease_hint, lease_cap;
    /* provenance.c: the section; one sequence in this many has its slots' provenance recorded
     * by this handle (0: none, and no check) */
    size_t off_prov, prov_records; /* (the records from prov_records on, after the generations) */
    int64_t prov_every;
    /* kvdata.c kv_sums_keep: the slot sums the digest's pass took in this operation, for slot
     * provenance's hashes of the same blocks (n_kvs of kvs_cap; emptied at each txn_begin and
     * after use) */
    int32_t *kvs_ids;
    uint32_t *kvs_gen;
    uint64_t *kvs_sums;
    int64_t n_kvs, kvs_cap;
    /* provenance.c prov_write: request hashes by sequence id (seq_id_1: the id + 1; 0 none) */
    ProvHash *prov_rh; /* (PROV_RH_CACHE of them, allocated at the first write) */
    /* leaks: the slots of maybe_live another client owned at its last scan (a claim of this
     * core's own is never one: unmapped reads this handle's own tables from own_refs) */
    int32_t *maybe_foreign;
    int64_t n_foreign;
    /* leaks: how many entries of this handle's live tables name each block (while own_valid;
     * sequences.c own_note keeps them where the core changes a table of its own), and the
     * changes of the open transaction (own_log: block + 1, negated for an entry removed),
     * undone if it rolls back; counted afresh (own_refs_ready) inside the transaction
     * own_built, a rollback of that one drops them instead */
    int32_t *own_refs;
    int32_t *own_log;
    int64_t own_n, own_cap;
    int own_valid;
    uint32_t own_built;
    /* sampled guard mode (KVPool.guard_sample): one allocation in guard_every guarded, drawn
     * by the core at each allocate and resume (entry.c before_claim); guard_tick counts them */
    int64_t guard_every;
    uint64_t guard_tick;
} Native;

static PyObject *s_acquire, *s_release, *s_running, *s_finished, *s_aborted,
    *s_waiting, *s_preempted;

/* -- records --------------------------------------------------------------------------------- */

static inline uint8_t *blk(Native *n, int64_t b) { return n->seg + n->off_blocks + b * n->rec; }
static inline uint8_t *seqrec(Native *n, int64_t s) {
    return n->seg + n->off_seqs + s * n->seq_rec;
}
/* The program served sequence `slot` in this operation (an allocate or fork made it; an append,
 * mark_computed, set_state, resume or lease named it): its record's `active_ns`, the gate's
 * clock (FORMAT.md section 5, the sequence table; the whole-pool check's idle_request, read by
 * allocator/idle.py). Not journaled: a rollback leaves the time of a call that ran. */
static inline void seq_touch(Native *n, int64_t slot) { U8(seqrec(n, slot) + SF_ACTIVE_NS) = n->op_ns; }
static inline uint8_t *idx_entry(Native *n, int64_t i) {
    return n->seg + n->off_index + i * INDEX_ENTRY;
}
static inline uint8_t *ringh(Native *n) { return n->seg + n->off_ring; }

/* The index shard (and lock) that owns a key. */
static inline int64_t shard_of(Native *n, uint64_t key) {
    return (int64_t)(key & (uint64_t)(n->num_shards - 1));
}

/* The record's checksum over its 4 identity words (the readers': checksums.py block_checksums). */
static inline uint64_t checksum(Native *n, int64_t b) {
    uint64_t *w = (uint64_t *)blk(n, b);
    uint64_t h = w[0] * KSUM[0] + w[1] * KSUM[1] + w[2] * KSUM[2] + w[3] * KSUM[3] +
                 (uint64_t)b * KSUM[4];
    h ^= h >> 29;
    h *= KSUM[0];
    return h ^ (h >> 32);
}

static inline void seal(Native *n, int64_t b) { U8(blk(n, b) + BF_CHECKSUM) = checksum(n, b); }

/* Lock bits (the `held` word and lock sets): lock i; the index shard lock of a key; that of
 * block b's prefix key (meaningful while it is indexed). */
static inline uint64_t lock_bit(int i) { return 1ull << i; }
static inline int holds(Native *n, int i) { return (n->held & lock_bit(i)) != 0; }
/* A step that needs the locks of `mask`: OK when the open transaction holds them;
 * else UNHANDLED, and the operation, rolled back, runs again with them too (eviction.c
 * rolled_back). */
static inline int need_locks(Native *n, uint64_t mask) {
    if ((n->held & mask) == mask) return OK;
    n->want_locks |= mask;
    n->escalate = 1;
    return UNHANDLED;
}
static inline uint64_t shard_lock(Native *n, uint64_t key) {
    return lock_bit(n->lock_shard0 + (int)shard_of(n, key));
}
static inline uint64_t block_shard_lock(Native *n, int64_t b) {
    return shard_lock(n, U8(blk(n, b) + BF_PREFIX_HASH));
}

static inline void count(Native *n, int field, uint64_t k) {
    if (k) U8(n->seg + n->c_counters + 8 * (size_t)field) += k;
}

/* Defined in a later part (the parts are one translation unit: see _native.c). */
/* A case the core does not handle: a bug, raised as a RuntimeError naming where
 * (sequences.c unhandled_at, below). */
#define unhandled(n) unhandled_at((n), __FILE__, __LINE__)
static int evict_into(Native *n, int64_t k, int64_t extra, int64_t mine, int32_t *out,
                      int64_t *got, int64_t later);
static int mutex_wait(Native *n);
static int py_caller_unusable(Native *n);
static int ungated(Native *n, PyObject *pool);
static int preempt_one(Native *n, int64_t exclude, int64_t short_by, int *found);
static int preempt_ahead(Native *n);
static int lru_take(Native *n, int64_t k, int64_t extra, int32_t *cand, int64_t *ncand,
                    int dry);
static int lru_scan(Native *n, int64_t k, int64_t extra, int32_t *cand, int64_t *ncand,
                    int dry);
static void lru_commit(Native *n);
static void lru_drop_pending(Native *n);
static int record_sealed(Native *n, int64_t b);
static int finding_report(Native *n, int fk, const Seen *s, PyObject *message);
static int fork_gen; /* entry.c: bumped in a forked child */
static int unusable(Native *n);
static PyObject *request_text(const char *b);
static void findings_flush(Native *n);
static void findings_drop(Native *n);
static int lockdep_ok(Native *n, uint64_t mask);
static inline int prov_any(Native *n, int64_t b, uint32_t gen);
static int dev_check(Native *n, int kind, const int32_t *ids, int64_t k, const char *when,
                     int64_t extra, PyObject *tag);
/* devchecks.c: a publication's check, queued now or at its batch's end (mark_computed_many) */
static int dev_publish_check(Native *n, int kind, const int32_t *ids, int64_t k);
static int64_t dev_batch_mark(Native *n);
static void dev_batch_undo(Native *n, int64_t mark);
static void dev_batch_begin(Native *n);
static int dev_batch_end(Native *n);
/* devchecks.c: what a check is for (DK_NAME) */
enum {
    DK_STAMP = 0,
    DK_VERIFY = 1,
    DK_POISON = 2,
    DK_CANARY = 3,
    DK_FILL = 4,
    DK_UNWRITTEN = 5,
    DK_PROV_STAMP = 6, /* slot provenance: the K/V hashes of published blocks' recorded slots */
    DK_PROV_CHECK = 7, /* slot provenance: recorded slots' K/V against their hashes */
    DK_STAMP_PROV = 8, /* DK_STAMP and DK_PROV_STAMP of the same blocks, one launch */
    DK_HIT_CHECK = 9,  /* a prefix hit's DK_VERIFY and DK_PROV_CHECK of its blocks, one launch */
    DK_RELEASE = 10,   /* a guarded release's DK_CANARY and DK_FILL of the blocks it frees, one
                        * launch */
    N_DK = 11
};
static void maybe_live_add(Native *n, int64_t slot);
static void own_rollback(Native *n);
static void raise_exhausted(Native *n, int64_t needed);
static void exhausted_note(Native *n, int64_t needed);
static void oplog_preempted(Native *n, PyObject *seq); /* oplog.c */
static void oplog_found_report(Native *n, Py_ssize_t found0, const char *request);
static void oplog_answer_report(Native *n, Py_ssize_t found0, const char *request, uint64_t op);
static void oplog_check_queued(Native *n);
static void oplog_dying(Native *n);
static void oplog_close_record(Native *n, const int32_t *ids, int64_t k, int64_t slots, int ok);
static void oplog_returned(Native *n, int op, const int32_t *ids, int64_t k, int64_t slots,
                           int ok);
static void oplog_audit(Native *n, Py_ssize_t found0, PyObject *rows, int64_t live,
                        const Py_buffer *t, int64_t R, int64_t W, const Py_buffer *l,
                        PyObject *lens_fast, int64_t sentinel);
/* leases.c: any lease held in the pool; block b leased (the section's per-block count). */
static inline int leases_any(Native *n) {
    return __atomic_load_n((uint32_t *)(n->seg + n->off_leases + LH_ACTIVE), __ATOMIC_ACQUIRE) != 0;
}
static inline int leased(Native *n, int32_t b) {
    return b >= 0 && b < n->nb && ((uint32_t *)(n->seg + n->off_leases + LEASE_COUNTS))[b] != 0;
}
static void prov_published(Native *n, const int32_t *ids, int64_t k);
/* (a CUDA pool's K/V hashes, queued before the commit: provenance.c) */
static int prov_stamp_later(Native *n, const int32_t *ids, int64_t k);
static void prov_after_append(Native *n, int64_t slot, const int32_t *ids, int64_t first,
                              int64_t pos0, const int32_t *toks, int64_t k, int32_t cow_src);
static int leases_pass_over(Native *n, int32_t *out, int64_t *k);
static int leases_at_close(Native *n);
/* (the sequences a handle holds as it closes: entry.c) */
static int seqs_at_close(Native *n, PyObject *pool);
static int leases_step_reclaim(Native *n, int32_t client, int32_t pid, int64_t *done);
/* The exception classes the core raises (allocator/errors.py), handed to it once by
 * native.py through register_errors(); NULL until then. */
static PyObject *PoolErrorType, *PoolExhaustedType, *JournalFullType, *HandleInheritedType;

/* An operation's status as the operation log records it (OpStatus), from the exception it
 * raised (et: its type; NULL: none was set): exhausted, refused (another PoolError), else an
 * error. */
static inline int op_status(PyObject *et) {
    return et == NULL ? OS_ERROR
           : PoolExhaustedType && PyErr_GivenExceptionMatches(et, PoolExhaustedType) ? OS_EXHAUSTED
           : PoolErrorType && PyErr_GivenExceptionMatches(et, PoolErrorType)         ? OS_REFUSED
                                                                                     : OS_ERROR;
}

/* The core's internal interface for allocate: every function allocate.c and entry.c's allocate
 * path (E_allocate, N_allocate and what they call) use that another part defines, with its
 * contract here and only implementation notes at its definition; grouped by the part that
 * defines it, in _native.c's order. OK, ERROR, UNHANDLED, AGAIN and JOURNAL_SHORT are as
 * above; "journaled": the write's old bytes are saved in the open transaction's undo journal
 * first (rolled back with it). */

/* -- faults.c: the crash points and the injectable faults -------------------------------------- */

/* SIGKILL at the armed point's n-th hit. crash.ARMED is [the armed point's place + 1 (0: none),
 * hits left], counted down here. Where the kill-holding-lock fault armed it, a recording
 * handle writes the release's record first (oplog.c oplog_dying). */
static inline void crash_point(Native *n, int point);

/* Any fault armed (faults.ARMED not empty): the one test an operation makes when none is. */
static inline int faults_armed(Native *n);

/* A fault's opportunity, counted on faults.ARMED itself: 1 at the armed fault's n-th
 * opportunity and at every later one until it has fired, 0 otherwise. */
static int fault_opportunity(Native *n, int f);

/* faults.fired: the core has injected fault f; faults.py disarms it and announces it (its
 * stderr line, FIRED, the ON_FIRE hooks: `kvscope run` records it). A hook's error is reported
 * as unraisable: the operation it follows is done. */
static void fault_fired(Native *n, int f);

/* The faults that strike when a request ends, decided before its
 * transaction: `leak` keeps one block only this request holds (*skip: its place in ids, else
 * -1), `use-after-free` frees the blocks but leaves the table live and mapped (*stale). Each
 * waits for a request it can act on. Announced once the release has committed. */
static void end_faults(Native *n, const int32_t *ids, int64_t k, int64_t *skip, int *stale);

/* `kill-holding-lock`: a release that takes locks dies (SIGKILL)
 * right after taking them (crash_point: a recording handle writes the release's record there,
 * once its locks are taken, then dies). */
static void kill_fault(Native *n, uint64_t locks);

/* `double-free`, announced after its release committed: the block it released a second time
 * (nothing in the segment changes: the block is already free), and,
 * under a probe, its double_free finding, written by the core (probes.c finding_report) with
 * the block's record as the release left it (`rec`, its bytes) and the ending request. */
static void double_free_fired(Native *n, int32_t b, PyObject *rec, const char *request);

/* `refcount-skew`, inside an allocation's transaction after its new blocks
 * ids[0..k) were stamped: the first one's reference taken twice (its record journaled by the
 * stamp). 1 when it acted (announced once the allocation committed). */
static int refcount_skew(Native *n, const int32_t *ids, int64_t k);


/* -- journal.c: the undo journal --------------------------------------------------------------- */

/* Block b's record saved in the undo journal, before the caller writes it (magic: a record
 * something outside the allocator wrote is reported first: probes.c record_sealed). OK;
 * UNHANDLED when the journal has no room (n->jfull set: the operation rolls back and
 * eviction.c rolled_back decides); ERROR with an exception set. */
static inline int jsave_block(Native *n, int64_t b);

/* A sequence slot's fixed fields saved in the undo journal before the caller writes them (its
 * table is saved by range). OK; UNHANDLED when the journal has no room (n->jfull set). */
static inline int jsave_head(Native *n, int64_t slot);

/* JournalFull (a PoolError), for an operation whose smallest transaction the journal cannot
 * hold (the words of the save it refused last): ERROR. */
static int journal_full(Native *n);

/* What cannot happen, by the core's own construction (the comment at the call says why): the
 * operation, rolled back, raises RuntimeError. ERROR. */
static int core_bug(const char *what);

/* The most blocks (at most CHUNK) one transaction may change when each costs `recs` saved
 * records, `bytes` more saved bytes and `entries` journal entries, besides TXN_SLACK: releases
 * are sized by it, so their journal never overflows (rule 3 of the journal). */
static int64_t blocks_fit(Native *n, int64_t recs, int64_t bytes, int64_t entries);


/* -- locks.c: pool locks and transactions ------------------------------------------------------ */

/* Another thread's operation on this handle in flight with the GIL let go (waiting for a pool
 * lock under the op mutex, or inside a transaction, in Python it called, or for the op mutex):
 * wait for it to end (for the op mutex, or with the GIL let go a moment at a time). One that
 * waits for the op mutex holds no pool lock: where this thread holds the mutex, that one waits
 * for this one, and this call goes first. *mine: the operation in flight is this thread's own
 * (Python it called is calling the pool): nothing is waited for. *waited (unless NULL): this
 * call let go of the GIL (anything may have happened to the handle meanwhile). OK, or ERROR
 * with an exception set. */
static int wait_others(Native *n, int *mine, int *waited);

/* Begin: seq odd, then every lock of `mask` in ascending order (in descending order at the
 * lock-inversion fault's opportunity, announced once they are taken). Lockdep's edges are
 * learned first (probes.c lockdep_ok: the findings lock waited for, a dead holder of it
 * recovered), and a journal this client left open is rolled back (recovery.c
 * recover_own_journal); a lock whose record names a dead holder is recovered (every lock, in
 * order) and the locks taken again; a wait for which another thread holds the op mutex lets
 * go of what is taken, waits for the mutex, and takes them again. OK, or ERROR with an
 * exception set (a failed wait: OSError). */
static int txn_begin(Native *n, uint64_t mask);

/* Commit the open transaction: its journal emptied (its writes stand), the LRU list's
 * pending changes applied (under the free lock, still held), every lock let go and seq even,
 * its evictions counted, the findings seen inside it reported (findings_flush; not where the
 * operation holds them: probes.c findings_hold). */
static void txn_commit(Native *n);

/* Roll back and let go: the journal undone, the locks released, seq even, what the transaction
 * had pending (LRU changes, preemptions, findings) dropped; a take that found nothing left
 * raises PoolExhausted now, with the pool as it was (preempt.c). The caller then asks
 * eviction.c rolled_back what to do. */
static void txn_abort(Native *n);


/* -- blocks.c: the blocks: the local cache, the free ring, stamps, the take -------------------- */

/* The local cache's count (this client's own record: no lock). */
static inline uint32_t local_count(Native *n);

/* ids[0..k) to the free ring's tail, their records reset to FREE (each journaled, then the
 * ring's header and slots). The free lock held. OK; UNHANDLED when the journal has no room. */
static inline int ring_push(Native *n, const int32_t *ids, int64_t k);

/* Park blocks as LOCAL in this client's local cache (no lock: the cache is the client's own):
 * the first *fit_out of ids[0..k) that fit under local_max, records and cache journaled. OK;
 * UNHANDLED when the journal has no room. The caller pushes the rest to the ring. */
static int local_push(Native *n, const int32_t *ids, int64_t k, int64_t *fit_out);

/* The take: k blocks into out from the local cache, the ring, LRU eviction (a batch more
 * to the ring), then this handle's oldest waiting sequences, preempted one at a time (not
 * `exclude`, the slot being grown: preempt.c), each followed by the cache, the ring and
 * eviction again. When they are all short, UNHANDLED with `exhausted_need` (and `request`,
 * whose take it was) set: the transaction's rollback records its `exhausted` event and raises
 * PoolExhausted (preempt.c); when the eviction outgrows the
 * journal, UNHANDLED with `jfull` set: the operation's rollback evicts ahead (rolled_back). The
 * locks each step needs are planned by `take_locks`; one not held (the pool changed since the
 * plan) leaves UNHANDLED: the operation runs again with it (need_locks). */
static int take(Native *n, int64_t k, int32_t *out, int64_t exclude, const char *request);

/* The locks `take(k)` will need (a lock mask for txn_begin), judged before the transaction,
 * without a lock, from the local cache and the ring's count (a hint: where it was wrong, the
 * operation runs again with more, need_locks): the free lock where the cache falls short, and
 * the shards of the blocks eviction would take (found by a dry scan; every shard where that
 * is not known). */
static uint64_t take_locks(Native *n, int64_t k);

/* Fresh ALLOCATED blocks ids[0..k) with refcount 1, owned by this client, for `request` at
 * `site`: each record journaled, rewritten, its generation bumped and sealed (the blocks are
 * the transaction's own: taken by `take`, no lock needed). OK; UNHANDLED when the journal has
 * no room. */
static int stamp(Native *n, const int32_t *ids, int64_t k, const char *request, int32_t site,
                 uint64_t now);

/* One reference less on each of ids[0..k) still ALLOCATED with a positive
 * refcount (a block already free is left untouched: a double free), its last use `now`; the
 * blocks left with no reference and not indexed into zero[*nz] (an indexed one stays CACHED).
 * Each record changed is journaled and resealed. OK; UNHANDLED when the journal has no room. */
static int drop_refs(Native *n, const int32_t *ids, int64_t k, uint64_t now, int32_t *zero,
                     int64_t *nz);


/* -- prefix.c: the prefix index and chain hashes ----------------------------------------------- */

/* PrefixIndex.lookup: the block indexed under `key`, or -1. Reads only; under the key's shard
 * lock for an answer to trust (allocate also looks once without it, and verifies under it). */
static int32_t index_lookup(Native *n, uint64_t key);

/* The chain value of one block of tokens after `prev` (prefix.py; a pure function). */
static inline uint64_t chain_next(Native *n, uint64_t prev, const int32_t *toks);


/* -- eviction.c: LRU eviction and what follows a rollback -------------------------------------- */

/* After an operation's transaction rolled back (txn_abort), what the core does next: ERROR
 * with the exception set (a full pool's PoolExhausted among them); else, by what stopped it:
 * - a waiting sequence whose preemption would have outgrown its journal is preempted ahead, in
 *   transactions of its own (preempt_ahead);
 * - the op mutex a K/V check needed (another thread's) is waited for, no pool lock held, and
 *   held until the operation ends (mutex_wait);
 * - locks a step needed and the transaction did not hold are taken too next time (need_locks);
 * - the blocks its eviction was to hand it when the journal ran out are evicted to the free
 *   ring ahead, in transactions of their own (evict_to_ring), where running it again takes them;
 * and AGAIN: run it again. JOURNAL_SHORT when the journal could not hold it and nothing could
 * be evicted ahead (the caller runs it in smaller transactions, or raises journal_full);
 * UNHANDLED when a transaction ahead could not begin (txn_begin). */
static int rolled_back(Native *n);


/* -- sequences.c: sequences: fields, the slot reserve, claims, table writes -------------------- */

/* A sequence slot being claimed: from this process's reserve, or, on a pool
 * too small for reserves or when its reserve is empty (the table had no slot for it), the
 * lowest empty slot of the table under the seqs lock (`direct`). */
typedef struct {
    int64_t slot;
    uint64_t seq_id;
    int direct;
} Claim;

/* Field i (F_*) of a Sequence, read at its __slots__ offset: a new reference; NULL with
 * AttributeError where it is unset. */
static PyObject *sfield(Native *n, PyObject *seq, int i);

/* Field i (F_*) of a Sequence set to v (a new reference of it kept, the old one dropped). */
static void sset(Native *n, PyObject *seq, int i, PyObject *v);

/* PoolError for a Sequence whose `what` (a list the pool keeps in it) is not as the pool left
 * it: something outside the pool changed it. ERROR. */
static int seq_changed(const char *what);

/* A block table (a list of at most cap block ids) into ids; the lock bits of the index
 * shards of its indexed blocks into *shards. ERROR (seq_changed) on anything else. */
static int table_of(Native *n, PyObject *list, int32_t *ids, Py_ssize_t cap, Py_ssize_t *k,
                    uint64_t *shards);

/* End of a call: give back the op mutex if waiting for a lock (or the K/V checks) made it take
 * it. An exception already raised is kept across the call to release(): a call
 * made with one pending fails, and clearing that failure would lose it. */
static void drop_mutex(Native *n);

/* A case the core does not handle (a bug): RuntimeError naming the place (unhandled(n) in
 * core.h). An error already set (txn_begin's ERROR: a failed wait, an error while recovering)
 * stands instead. */
static PyObject *unhandled_at(Native *n, const char *where, int line);

/* Whether a slot released (after `taking` more are claimed from the
 * reserve) goes back to the reserve, not to the table. */
static inline int reserve_keeps(Native *n, int64_t slot, int64_t taking);

/* Whether the next claim (`claiming`) would find the reserve empty or out of ids, or the next
 * release would find it full. */
static inline int reserve_due(Native *n, int claiming);

/* The reserve refilled (claiming) or trimmed (not) where due (reserve_due; the handle usable:
 * entry.c unusable), before an operation that claims or releases a slot, in the core's call
 * of it (entry.c reserve_before): in a transaction of its own under the seqs lock (waited for,
 * a dead holder recovered: txn_begin) and the handle's op mutex (waited for: another thread's
 * operation first). 1 done; 0, with nothing done, where this thread is inside an operation of
 * the handle already (in Python the core called: its locks and journal are that operation's)
 * or the refill would outgrow the journal: the claim then takes the table's own way, under the
 * seqs lock; -1 with an exception set. */
static int reserve_run(Native *n, PyObject *pool, int claiming);

/* Before the transaction (no lock): the reserve's next slot and id into *c; for a direct claim
 * (no reserve, or it is empty), the seqs lock added to the transaction's (*locks). */
static void claim_plan(Native *n, Claim *c, uint64_t *locks);

/* Inside the transaction, a direct claim (the seqs lock held): the lowest EMPTY slot no
 * process reserves, and the header's next sequence id (journaled); a claim from the reserve
 * has nothing to do here. OK; ERROR (a PoolError) when the table is full; UNHANDLED when the
 * journal is. */
static int claim_take(Native *n, Claim *c);

/* After commit: a claim from the reserve takes its slot and id out of it (n->res, the
 * process's own: no lock, nothing journaled). OK. */
static int claim_done(Native *n, const Claim *c);

/* A claim's record writes: the slot's head (journaled) names this client, `request`, `site`
 * and `seq_id`, RUNNING with no blocks (the slot is reserved by this client, or taken under
 * the seqs lock: claim_take). OK; UNHANDLED when the journal has no room. */
static int write_claim(Native *n, int64_t slot, uint64_t seq_id, const char *request,
                       uint64_t now, int32_t site);

/* Table entries [start, start + k) of `slot` written and its block count set to start + k
 * (head and entries journaled; the slot is this operation's own, no lock). OK; ERROR (a
 * PoolError) past max_blocks_per_seq; UNHANDLED when the journal has no room. */
static int write_blocks(Native *n, int64_t slot, int64_t start, const int32_t *ids, int64_t k);

/* Token ids at positions [first, first + k) of the table's blocks, and each block's token
 * count. Not journaled: the caller saved the records first (stamp, jsave_block). */
static void fill(Native *n, const int32_t *table, int64_t first, const int32_t *toks, int64_t k);

/* A request id's 32 bytes: its str's UTF-8, truncated to 32 bytes, zero-padded. OK, or ERROR
 * with an exception set (no UTF-8). */
static int request_of(PyObject *rid, char *out);


/* -- tokens.c: the caller's tokens and request id ---------------------------------------------- */

/* A caller's tokens as the core read them (tokens_read): up to TOKENS_SMALL in place. */
#define TOKENS_SMALL 512

typedef struct {
    int32_t *v; /* the tokens: `small` or a PyMem block */
    Py_ssize_t n;
    /* Where the caller asked for it and every token is an int: a list of them of the core's
     * own (new reference), or the caller's tuple; else NULL. */
    PyObject *items;
    int32_t small[TOKENS_SMALL];
} Tokens;

/* What a read of tokens holds let go (its PyMem block, its kept items): after every
 * tokens_read, whatever it returned. */
static void tokens_done(Tokens *t);

/* Raise PoolError(message): ERROR. */
static int pool_error(const char *fmt, ...);

/* The caller's tokens into t (t->v, t->n; with `want_items`, t->items where the Sequence may
 * keep them): OK, or ERROR with PoolError (a 2-D or non-integer array, a token outside int32)
 * or the TypeError of an item that is not an integer. tokens_done(t) after, either way. */
static int tokens_read(PyObject *obj, Tokens *t, int want_items);

/* The tokens as a list of ints (what a Sequence keeps; a new reference, at most once per
 * read): the kept items, else ints made from the values. */
static PyObject *tokens_list(const Tokens *t);

/* The request id as the Sequence keeps it (a new reference): a str as it is, anything else
 * its str(). */
static PyObject *request_str(PyObject *rid);


/* -- probes.c: the light probes: events, sites, findings, leaks -------------------------------- */

/* One event per block (one with block -1 when there are none), into this client's event ring
 * (its own: no lock, not journaled; after the commit). Only with the events probe. */
static void ev_record(Native *n, int op, const int32_t *ids, int64_t k, const char *request,
                      int64_t arg);

/* The site id of the operation being run: from the first frame outside kvscope's folders, its
 * text composed and interned by the core (sites.py's text: a frame at depth 1, a stack at
 * KVSCOPE_STACK_DEPTH > 1, the depth in the probe word), each frame's id cached by its code
 * object and instruction, into the probe's site table (the core is its only writer). -1 when
 * sites are off (or every frame is kvscope's); SITE_ERROR (-2) with an
 * exception set. Called before the operation takes its locks (site_intern waits for the sites
 * lock). */
static int32_t site_now(Native *n);

/* Block b as a finding sees it now (the record's owner, allocation site and request). */
static void seen_of(Native *n, int32_t b, Seen *s);

/* A finding seen inside the open transaction (message: a new reference, taken over),
 * reported when it commits (findings_flush: a write after free found in a block being handed
 * out, reported whether or not the operation goes on to hand it out) and dropped if it rolls
 * back (the operation is then done again, or refused, and finds it again). OK, or ERROR with
 * an exception set. */
static int finding_later(Native *n, int fk, const Seen *s, PyObject *message);

/* Report the first `upto` findings waiting (after a commit, its locks let go), and keep the
 * others. A failure to report: an exception written as unraisable (the operation stands). */
static void findings_first(Native *n, int64_t upto);

/* The open operation reports its transaction's findings itself, in order among its events
 * (findings_before, findings_first), not at its commit (findings_flush); in force until they
 * are all reported (or the next txn_begin). */
static void findings_hold(Native *n);

/* Report, of the first `upto` findings waiting, those seen before the transaction's
 * preemption number `pre` (the events of a preemption come after what was found before
 * it). */
static void findings_before(Native *n, int64_t upto, int64_t pre);

/* The magic probe's periodic check, run by verify_often once it is due (`now`, on its clock):
 * the header's checked bytes compared with the copy taken when the handle attached
 * (probes_init), and, with the leaks probe, conservation. OK, or ERROR with an exception set. */
static int verify_now(Native *n, uint64_t now);

/* The magic probe's periodic check: the header (and, with the leaks probe, conservation) at
 * most every VERIFY_EVERY_NS, on one clock for the handle (the gate's, and N_verify_often's
 * between operations). Every operation's gate reads the coarse clock (n->op_ns, which
 * seq_touch stores too), with its resolution taken off the interval, so that the check still
 * runs once VERIFY_EVERY_NS have passed (and at worst a resolution sooner). Inline in the gate, the check itself out of line: nearly
 * every operation only reads the clock, and a call of its own on every operation's path cost
 * more instructions than the test, and cache lines of code that the interpreter's loop then
 * lost (callgrind's model of the serving loop under `kvscope run`). OK, or ERROR with an
 * exception set. */
static inline int verify_often(Native *n) {
    uint64_t slack = n->coarse_slack;
    if (__builtin_expect(slack == 0, 0)) slack = n->coarse_slack = coarse_slack_ns();
    int coarse = slack != UINT64_MAX;
    uint64_t now = coarse ? n->op_ns : mono_ns();
    if (__builtin_expect(now - n->last_verify_ns < VERIFY_EVERY_NS - (coarse ? slack : 0), 1))
        return OK;
    return verify_now(n, now);
}

/* The clock verify_often reads (the coarse one where its resolution is fine enough): the
 * check pool.verify() asks for at once (entry.c N_verify) runs on it too, so that the
 * interval after it is counted on one clock. */
static inline uint64_t verify_clock(Native *n) {
    if (n->coarse_slack == 0) n->coarse_slack = coarse_slack_ns();
    return n->coarse_slack != UINT64_MAX ? mono_coarse_ns() : mono_ns();
}

/* before_release: each unindexed ALLOCATED block of the table has as many references as
 * this handle's sequences map it; a refcount_mismatch finding for each that has not, as the
 * record is now (the request id `rid` named in its message), and the release goes on. OK, or
 * ERROR with an exception set. */
static int refcounts_match(Native *n, const int32_t *ids, int64_t k, PyObject *rid);

/* No live sequence (of any process) maps a block about to be given to `request`. A block one
 * does map is a use_after_free finding, naming the sequence (its request and pid: the first
 * that maps it, by slot) and the block's allocation site, reported when the operation commits
 * (stale_findings). OK, or ERROR with an exception set. */
static int unmapped(Native *n, const int32_t *ids, int64_t k, const char *request);

/* held_after_release, inside the release's transaction after its drops: the blocks of the
 * table this process still holds that no other sequence of this handle maps (leaked), as they
 * are now, into n->leak (read inside the release: once it commits, a block it freed is
 * anyone's and would look held by its next owner). Their number, or -1 with an exception set. */
static int64_t leaked_blocks(Native *n, const int32_t *ids, int64_t k, int64_t slot);


/* -- kvdata.c: guard mode and the digest probe on the KV data ---------------------------------- */

/* Freed blocks' guard slots still hold the canary; one that does not
 * gets it back, and a guard_violation finding, reported when the release commits with the
 * block's record as it is then (and a GUARD_VIOLATION event first). OK, UNHANDLED (a CUDA
 * pool's queue: another thread holds the op mutex), ERROR. */
static int canaries_intact(Native *n, const int32_t *ids, int64_t k);

/* NaN into the token slots of freed blocks, just before the release commits
 * (under its locks: once they are released the blocks are anyone's). OK, UNHANDLED, ERROR. */
static int poison_blocks(Native *n, const int32_t *ids, int64_t k);

/* Guard mode's poison laid at the commit of the open transaction (txn_begin empties its
 * lists): `poison_later` the blocks a guarded preemption freed, poisoned at the commit but
 * those the same transaction hands out again; `evicted_poison_later` the blocks an eviction
 * took out of the cache, poisoned at the commit whoever holds them then (the new holder's
 * slots hold no earlier request's K/V, as a freed block's do not). OK, or ERROR with an
 * exception set. */
static int poison_later(Native *n, const int32_t *ids, int64_t k);
static int evicted_poison_later(Native *n, const int32_t *ids, int64_t k);

/* Just before the commit of a transaction: the poison its preemptions and evictions left to
 * lay (poison_later, evicted_poison_later). OK, UNHANDLED (a CUDA pool's queue not to be had
 * now: dev_check), ERROR. */
static int commit_poison(Native *n);

/* Whether guard mode poisons what this handle frees (in full or sampled) in this cache. */
static inline int guard_poisons(Native *n) {
    return (n->probes & (P_GUARD | P_GUARD_SAMPLED)) && n->poison_ok;
}

/* Guarded freed blocks go to the ring's tail QUARANTINED (never the local cache), marked
 * poisoned where the cache can be (records journaled by the push); the free lock is held. OK;
 * UNHANDLED when the journal has no room. */
static int ring_push_quarantined(Native *n, const int32_t *ids, int64_t k);

/* Guard mode, blocks about to be taken: a poisoned one must still
 * hold its poison; one that does not (a write after free) is a use_after_free finding, with
 * its record as it is now, reported when the operation commits (a CUDA pool's: at the settle
 * that reads the answer, with the record as the operation saw it). OK, UNHANDLED (a CUDA pool's
 * queue not to be had now), ERROR. */
static int poison_intact(Native *n, const int32_t *ids, int64_t k);

/* Blocks just stamped are no longer poisoned (guard mode; not journaled: the stamp saved the
 * records). */
static void unpoison(Native *n, const int32_t *ids, int64_t k);

/* The published blocks among ids (indexed, with a digest of their
 * generation) still match it; `when` names the moment in a finding ("a prefix hit"). One that
 * does not is a published_block_modified finding, with its record as it is now, reported when
 * the operation commits (which goes on); a CUDA pool's at the
 * settle that reads the answer, with the record as the operation saw it. OK, UNHANDLED, ERROR. */
static int digests_intact(Native *n, const int32_t *ids, int64_t k, const char *when);

/* digests_intact, the slots' sums of blocks with provenance records kept with `keep` (a
 * prefix hit's: slot provenance checks the same slots next, digests). */
static int digests_intact_keep(Native *n, const int32_t *ids, int64_t k, const char *when,
                              int keep);


/* -- append.c: appends ------------------------------------------------------------------------- */

/* Tokens appended to seq (in `slot`) -> the copy-on-write (src, dst) copies, in chunks of
 * CHUNK blocks' worth, each a transaction of its own (half as many where the journal cannot
 * hold one, down to a token). Where the pool changed since a chunk's plan, a preemption or an
 * eviction outgrew the journal, or a K/V check waits for the op mutex, the chunk runs again
 * (rolled_back). An error after some chunks leaves them appended (docs/POOL.md: a long append
 * that fails keeps its first chunks); NULL then, with the exception set. */
static PyObject *core_append(Native *n, PyObject *pool, PyObject *seq, int64_t slot,
                             const int32_t *toks, int64_t k);


/* -- preempt.c: preemption --------------------------------------------------------------------- */

/* After the commit: the sequences preempted[from..to) of this transaction, in order: their
 * events (PREEMPT, then FREE, of their tables), counters, and Sequences (no blocks, state
 * "preempted", nothing published). OK, or ERROR with an exception set. */
static int preempted(Native *n, int64_t from, int64_t to);


/* -- leases.c: leases -------------------------------------------------------------------------- */

/* give_back_freed's first step (free lock not yet required): the leased blocks of the freed
 * zero[0..*nz) are taken out of it and pushed to the free ring's tail QUARANTINED (the free
 * lock: need_locks), where ring_pop passes over them while they stay leased; the rest stay in
 * zero (order kept) for the caller to give back. OK or UNHANDLED. */
static int leases_divert(Native *n, int32_t *zero, int64_t *nz);


/* -- provenance.c: slot provenance ------------------------------------------------------------- */

/* Whether this pool's K/V hashes go through the core's device checks: its K/V is not mapped
 * here (a CUDA pool), and the checks are configured (guard mode or the digest probe). */
static inline int prov_on_device(Native *n);

/* Whether the sequence `seq_id` is sampled (its slots recorded): one in prov_every. */
static inline int prov_sampled(Native *n, uint64_t seq_id);

/* Record k slots from relative position `first` of the blocks ids[] (the table from the block
 * that holds it) as written by seq_id, tokens toks, logical positions from `pos0`. */
static void prov_write(Native *n, uint64_t seq_id, const char *request, const int32_t *ids,
                       int64_t first, int64_t pos0, const int32_t *toks, int64_t k);

/* allocate's hit, before its commit, on a pool whose K/V the core does not map: the hit's
 * blocks table[0, hits), read by `request`, queued for their K/V check (prov_check_later). */
static int prov_hits_later(Native *n, const int32_t *table, int64_t hits, const char *request);

/* allocate's hit, after its commit: the hit's blocks table[0, hits) against the prompt's
 * tokens and positions (a hit whose block holds other tokens than the hit's is reported at the
 * hit). OK, or ERROR with an exception set. */
static int prov_check_hits(Native *n, const int32_t *table, int64_t hits, const int32_t *toks,
                           const char *request);


/* -- devchecks.c: the device checks of a CUDA pool's K/V --------------------------------------- */

/* allocate's hit, before its commit, on a pool whose K/V the core does not map, with the
 * digest probe and slot provenance both on: the hit's blocks table[0, hits), read by `request`
 * (32 bytes), checked in one launch (DK_HIT_CHECK: the kernel's DIGEST_SLOTS mode, a block's
 * digest and its slots' sums) where the two checks would take two (kvdata.c digests_intact's
 * DK_VERIFY of the blocks published with a digest of their generation, `when` naming the
 * moment; provenance.c prov_hits_later's DK_PROV_CHECK of the blocks with hashed slots). A
 * block is in it where either check would take it; the answer applies each check only where
 * it would have (devanswers.c hit_check_read, from the record kept). OK, UNHANDLED, ERROR as
 * dev_check. */
static int dev_hit_check(Native *n, const int32_t *table, int64_t hits, const char *when,
                         const char *request);

/* Whether a guarded release's blocks have their canaries checked with their fill, one launch
 * (DK_RELEASE, just before the release commits: dev_release_check) rather than each on its own
 * (kvdata.c canaries_intact, then poison_blocks): a pool whose K/V the core does not map, and
 * that poisons freed blocks. */
static inline int dev_release_later(Native *n);

/* A guarded release's blocks ids[0, k) (dev_release_later), just before its commit: their
 * guard slots checked for the canary, then their token slots filled with the poison, one
 * launch (the kernel's CANARY_POISON mode); a broken canary is a guard_violation finding when
 * the answer is applied, as DK_CANARY's (devanswers.c). OK, UNHANDLED, ERROR as dev_check. */
static int dev_release_check(Native *n, const int32_t *ids, int64_t k);


/* -- oplog.c: the operation log ---------------------------------------------------------------- */

/* allocate as module.c binds it (entry.c E_allocate calls it): entry.c N_allocate, whose
 * operation record, where the handle records (n->oplog), oplog_op writes around it (RECORDED
 * defines it). What N_allocate returns. */
static PyObject *R_allocate(Native *n, PyObject *const *args, Py_ssize_t nargs);

/* The open call's tokens as the core read them, and the sequence an append appends to (its
 * live slot, else -1: allocate's, or one the core refused) with its table's length then, kept
 * for the call's operation record (the handle's own: no lock, nothing in the segment): the
 * hook of N_allocate and N_append, after the gate and the sequence's check, where the handle
 * records (n->oplog). The first call to reach it after the recorded entry point cleared have_tok (R_append,
 * oplog_op) is that entry point's: a pool operation called from Python that call ran comes
 * later, and leaves the open call's alone. */
static inline void oplog_tokens(Native *n, const int32_t *v, Py_ssize_t k, int64_t slot);
