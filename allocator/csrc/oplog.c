/* The operation log (docs/REPLAY.md): while a handle records (PoolConfig(record_ops=PATH),
 * KVSCOPE_RECORD_OPS=PATH: `kvscope run --record-ops`), every public operation of the core
 * appends one compact record to a chunk of the handle's, written with one write(2) on a
 * descriptor opened O_APPEND, so every process and handle recording into one file appends whole
 * chunks. The chunk's header is records.py's OPLOG_CHUNK_FIELDS (OC_* in layout.h), a record's
 * bytes are docs/REPLAY.md's (oplogread.c expands them to OPLOG_FIELDS); its `seq` is the segment's
 * global operation number (the header's op_seq, an atomic add by every recording process),
 * taken when the operation returns. Off (no log), an operation costs one test of `n->oplog`.
 * Part of _native.c. */

typedef PyObject *(*FastFn)(Native *, PyObject *const *, Py_ssize_t);

/* Records are composed into a chunk in `out` (an OPLOG_CHUNK header, then compact records:
 * docs/REPLAY.md) and the chunk written with one write(2) when it fills, when a record says
 * something happened (a status other than ok, a finding, a fault, a START, a report),
 * and when recording stops: the log on disk holds every record up to the last such one, and a
 * process killed loses at most the ordinary records since (a reader sees the gap). */
#define OPLOG_OUT (256 * 1024)
/* The file space reserved ahead of the log's end at a time (fallocate, FALLOC_FL_KEEP_SIZE: the
 * file's size is what was written, a reader never sees the reserve): a write into reserved
 * space costs the kernel about half what one that extends a file of delayed allocation does
 * (ext4). */
#define OPLOG_RESERVE (1024 * 1024)

/* A record's table: none, the whole table, or the first `keep` entries of the table the
 * sequence's last record gave it followed by the rest (an append's). */
enum { TM_NONE = 0, TM_NEW = 1, TM_OWN = 2 };
/* A compact record's second byte: the status (2 bits), then these. */
#define CR_FAULT 4
#define CR_TID 8
#define CR_PROBES 16
#define CR_REQUEST 32
#define CR_EXTRA 64 /* copies, preemptions, findings */
#define CR_ARGS 128 /* src_id, arg, result */
#define CR_TIME_SHIFT 20 /* record times count 2^20 ns from the chunk's */

/* Entry points and writers that no operation runs (N_oplog_copy, a device
 * check's answer's REPORT and the naming of its checks: below), in a text section of their
 * own, after the core's: emitted among the hot code they move it (recording's cost on
 * bench_serving_loop, whose operations never call them, measured about a point higher with
 * them placed there). */
#define OPLOG_RARE __attribute__((section(".text.oplog_rare"), noinline))

typedef struct Oplog {
    int fd;
    int32_t owner;  /* the process that opened it (a forked child's copy never writes) */
    uint8_t *out;   /* the chunk being composed: its header's room, then out_n - OPLOG_CHUNK
                       bytes of out_recs records */
    size_t out_n, cap_out;
    int64_t out_recs;
    uint64_t base_seq, prev_seq, base_time, now; /* the chunk's, the last record's */
    int32_t prev_tid;
    uint32_t prev_probes;
    int32_t *tok;   /* the open call's tokens, as the core read them (oplog_tokens) */
    int64_t ntok, cap_tok;
    int have_tok;
    int64_t slot;   /* the open append's sequence (its slot, -1: none) and its table's length */
    uint32_t nb0;   /* as the core began it (oplog_tokens) */
    int depth; /* calls in flight on this handle's thread (a call from inside one is refused) */
    uint64_t key;   /* redaction: tokens and request ids written as keyed hashes (0: off) */
    size_t off_seq; /* the header's op_seq */
    uint32_t tag;   /* the pool's tag, in every chunk */
    uint64_t lost;  /* records a failed write lost since the last one written */
    /* device checks that can find something were queued since the handle's last operation
     * record (devchecks.c dev_check: oplog_check_queued), n->checks_unnamed of them: the next
     * one names them (oplog_name_checks); a held append, where it added a block (a check of its
     * poison) */
    int unnamed;
    int64_t *pre;   /* the seq ids the call in flight preempted (oplog_preempted) */
    int64_t n_pre, cap_pre;
    uint64_t end, reserved; /* the log's end as this handle last wrote it, the space reserved to */
    int reserve;            /* the file system reserves space (fallocate) */
    struct Held *held;      /* plain appends not composed yet (oplog_compose_held), n_held of them */
    int n_held;
    Native *native;         /* the handle it records (a LOST record's number: oplog_room) */
    /* the release in flight (oplog_op), for the record of a process that dies in it
     * (oplog_dying): its record so far, the sequence's id and the table it releases */
    struct OpRec *open;
    int64_t open_id, open_nb;
    const int32_t *open_before;
    /* A bounded log (oplog_ring): past `limit` bytes after `base` (the file offset of the
     * pool's last checkpoint, or where the bound was set), `due` is set where a chunk is
     * written, and the handle's next operation (not a plain append) first calls `ckpt`
     * (allocator/checkpoint.py: a SNAPSHOT, then the file before the last one punched out). */
    uint64_t limit, base;
    int due;
    PyObject *ckpt;
} Oplog;

/* A plain append of one token held as it returned, composed into the chunk with the ones after
 * it (OPLOG_HELD at a time, and before any other record, any write of the chunk): the code
 * that composes a record runs in a loop that keeps it in the instruction cache, where a record
 * composed at its operation finds its code evicted by the program's own between two
 * operations. Its number and time are taken as the operation returns, as any record's. */
typedef struct Held {
    uint64_t seq, now;
    int64_t seq_id;
    int32_t token, block; /* block: the one it added after the table (where nb > keep) */
    uint32_t keep, nb;    /* the table's entries kept, its length after */
    int32_t tid;
    uint32_t probes;
} Held;
#define OPLOG_HELD 64

/* A chunk's check (and an expanded record's: allocator/oplog.py record_checks): fmix64 of the
 * sum of its 64-bit words, word i weighted by 2i + 1, with the check itself 0. Any one word
 * changed changes it. */
static uint64_t record_check(const uint8_t *r, size_t size) {
    /* (the weighted sum without a multiply: with s_i the sum of the words from i on,
     * sum w_i (2i + 1) = 2 sum s_i - s_0, modulo 2^64 as the products' sum is; two additions
     * a word, from the last) */
    const uint64_t *w = (const uint64_t *)r;
    uint64_t s = 0, t = 0;
    for (size_t i = size / 8; i-- > 0;) {
        s += w[i];
        t += s;
    }
    return fmix64(2 * t - s);
}

/* This thread's id (cached: gettid is a system call), fetched again in a forked child. */
/* (initial-exec: read at an offset from the thread pointer, not through __tls_get_addr) */
static __thread __attribute__((tls_model("initial-exec"))) int32_t tl_tid;
static __thread __attribute__((tls_model("initial-exec"))) int tl_gen = -1;
static __attribute__((noinline, cold)) void thread_id_fetch(void) {
    tl_tid = (int32_t)syscall(SYS_gettid);
    tl_gen = fork_gen;
}
static inline int32_t thread_id(void) {
    if (__builtin_expect(tl_gen != fork_gen, 0)) thread_id_fetch();
    return tl_tid;
}

/* The open call's tokens, as N_allocate / N_append read them, where they are more than one
 * (oplog_tokens). Where no memory is left for them, the record lists none. */
static __attribute__((noinline, cold)) void oplog_tokens_many(Oplog *L, const int32_t *v,
                                                              Py_ssize_t k) {
    L->have_tok = 1;
    L->ntok = 0;
    if (k > L->cap_tok) {
        int32_t *t = PyMem_Realloc(L->tok, sizeof(int32_t) * (size_t)k);
        if (t == NULL) return;
        L->tok = t;
        L->cap_tok = k;
    }
    memcpy(L->tok, v, sizeof(int32_t) * (size_t)k);
    L->ntok = k;
    L->have_tok = 1;
}

/* Inline in the core, a decode step's one token stored as it is: a call to a function of its
 * own and to memcpy cost the serving loop about 2% (their code out of the instruction cache at
 * every append). */
static inline void oplog_tokens(Native *n, const int32_t *v, Py_ssize_t k, int64_t slot) {
    Oplog *L = n->oplog;
    if (L->have_tok) return;
    L->slot = slot;
    L->nb0 = slot >= 0 ? U4(seqrec(n, slot) + SF_NUM_BLOCKS) : 0;
    if (__builtin_expect(k == 1, 1)) { /* (L->tok holds one at least: oplog_open) */
        L->tok[0] = v[0];
        L->ntok = 1;
        L->have_tok = 1;
    } else {
        oplog_tokens_many(L, v, k);
    }
}

/* Space reserved past the log's end for a chunk of `size` bytes about to be written, where
 * what this handle reserved last is used up (other processes' appends move the end too: it is
 * read again). A file system that cannot reserve is not asked again; a reserve that fails is
 * only a slower write. */
static void oplog_reserve(Oplog *L, size_t size) {
    if (!L->reserve || L->end + size <= L->reserved) return;
    struct stat st;
    if (fstat(L->fd, &st) != 0) return;
    L->end = (uint64_t)st.st_size;
    if (fallocate(L->fd, FALLOC_FL_KEEP_SIZE, st.st_size, OPLOG_RESERVE) == 0)
        L->reserved = L->end + OPLOG_RESERVE;
    else if (errno == EOPNOTSUPP || errno == ENOSYS)
        L->reserve = 0;
}

/* A bounded log: whether the file (every process's appends) passed its bound since the last
 * checkpoint; the next operation takes one (oplog_due). */
static __attribute__((noinline, cold)) void oplog_ring_check(Oplog *L) {
    struct stat st;
    if (fstat(L->fd, &st) == 0 && (uint64_t)st.st_size >= L->base + L->limit) L->due = 1;
}

/* Write the chunk composed so far (by the process that opened the log only). */
static __attribute__((noinline)) void oplog_flush(Oplog *L) {
    if (L->out_recs == 0) return;
    size_t size = (L->out_n + 7) & ~(size_t)7;
    memset(L->out + L->out_n, 0, size - L->out_n);
    uint8_t *c = L->out;
    U4(c + OC_MAGIC) = OPLOG_CHUNK_MAGIC;
    U4(c + OC_SIZE) = (uint32_t)size;
    U8(c + OC_CHECK) = 0;
    U8(c + OC_SEQ) = L->base_seq;
    U8(c + OC_TIME_NS) = L->base_time;
    I4(c + OC_PID) = L->owner;
    U4(c + OC_POOL) = L->tag;
    U4(c + OC_N_RECORDS) = (uint32_t)L->out_recs;
    U4(c + OC_FLAGS) = L->key ? OPLOG_REDACTED : 0;
    if (L->owner == (int32_t)getpid()) {
        U8(c + OC_CHECK) = record_check(c, size);
        oplog_reserve(L, size);
        size_t done = 0;
        while (done < size) {
            ssize_t w = write(L->fd, c + done, size - done);
            if (w < 0 && errno == EINTR) continue;
            if (w <= 0) break;
            done += (size_t)w;
        }
        L->end += done;
        if (done < size) L->lost += (uint64_t)L->out_recs;
        if (__builtin_expect(L->limit != 0, 0)) oplog_ring_check(L);
    }
    L->out_n = OPLOG_CHUNK;
    L->out_recs = 0;
}

/* A preemption of the open call: the Sequence's id, kept for the call's record. */
static void oplog_preempted(Native *n, PyObject *seq) {
    Oplog *L = n->oplog;
    PyObject *id = sfield(n, seq, F_SEQ_ID);
    int64_t v = id ? PyLong_AsLongLong(id) : -1;
    Py_XDECREF(id);
    if (PyErr_Occurred()) PyErr_Clear();
    if (L->n_pre == L->cap_pre) {
        int64_t cap = L->cap_pre ? 2 * L->cap_pre : 16;
        int64_t *p = PyMem_Realloc(L->pre, sizeof(int64_t) * (size_t)cap);
        if (p == NULL) return; /* (the record lists fewer; replay compares what it lists) */
        L->pre = p;
        L->cap_pre = cap;
    }
    L->pre[L->n_pre++] = v;
}

static __attribute__((noinline, cold)) int32_t redacted_token(uint64_t key, int32_t t) {
    return (int32_t)(fmix64(key ^ (uint64_t)(uint32_t)t) & 0x7FFFFFFF);
}
static inline int32_t oplog_token(Oplog *L, int32_t t) {
    return __builtin_expect(L->key != 0, 0) ? redacted_token(L->key, t) : t;
}

/* LEB128 varints; signed values zigzag-encoded first. */
static inline uint8_t *put_u(uint8_t *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    *p++ = (uint8_t)v;
    return p;
}
static inline uint64_t zz(int64_t v) { return ((uint64_t)v << 1) ^ (uint64_t)(v >> 63); }
static inline uint8_t *put_s(uint8_t *p, int64_t v) { return put_u(p, zz(v)); }

/* What one record holds. */
typedef struct OpRec {
    int op, status, flags;
    int64_t seq_id, src_id, arg, result;
    char request[REQUEST_BYTES];
    int req_live; /* the request is the live sequence's own (a reader has it already) */
    const void *text; /* START: the JSON text, n_text bytes */
    int64_t n_text;
    int tmode;             /* TM_*: how the table is written */
    const int32_t *blocks; /* the block ids (a sequence record's table, or a copy) */
    int64_t n_blocks;
    int64_t keep; /* TM_OWN: the entries kept of the sequence's table before */
    PyObject *copies;  /* a list of (src, dst), or NULL */
    Py_ssize_t found0; /* KVPool._found's length when the call began (-1: `found_at` only) */
    int64_t found_at;  /* a REPORT's ring position */
    int scratch;       /* the call's tokens and preemptions go in (an operation's record) */
} OpRec;

/* A request id's 32 bytes as the log keeps them (redacted: 'h' and 16 hex digits). */
static void oplog_request(Oplog *L, const char *in, char *out) {
    memcpy(out, in, REQUEST_BYTES);
    if (!L->key || out[0] == 0) return;
    uint64_t h = L->key;
    for (int i = 0; i < REQUEST_BYTES && in[i]; i++) h = fmix64(h ^ (uint8_t)in[i]);
    memset(out, 0, REQUEST_BYTES);
    snprintf(out, REQUEST_BYTES, "h%016llx", (unsigned long long)h);
}

/* Room for a record of at most `bound` bytes after what the chunk holds (the chunk written
 * first where it would not fit); NULL where no memory is left for it. */
static inline uint8_t *room_raw(Oplog *L, size_t bound) {
    if (__builtin_expect(L->out_n + bound + 8 > L->cap_out, 0)) oplog_flush(L);
    if (__builtin_expect(OPLOG_CHUNK + bound + 8 > L->cap_out, 0)) {
        if (OPLOG_CHUNK + bound + 8 > UINT32_MAX) return NULL;
        uint8_t *o = PyMem_Realloc(L->out, OPLOG_CHUNK + bound + 8);
        if (o == NULL) return NULL;
        L->out = o;
        L->cap_out = OPLOG_CHUNK + bound + 8;
    }
    return L->out + L->out_n;
}

/* The rare parts of a record's head, out of the hot path's way: the clock (read every 64
 * records: a record's time is its chunk's to 2^20 ns, and within the 63 records before it),
 * a chunk's first record, a thread id or probe word that changed. */
static __attribute__((noinline, cold)) void oplog_clock(Oplog *L, uint64_t seq) {
    L->now = clock_ns(CLOCK_REALTIME_COARSE);
    if (L->out_recs == 0) {
        L->base_seq = L->prev_seq = seq;
        L->base_time = L->now;
        L->prev_tid = L->owner;
        L->prev_probes = 0;
    }
}
static __attribute__((noinline, cold)) void oplog_tick(Oplog *L) {
    L->now = clock_ns(CLOCK_REALTIME_COARSE);
}
static __attribute__((noinline, cold)) uint8_t *oplog_changed(Oplog *L, uint8_t *p, int bits,
                                                              int32_t tid, uint32_t probes) {
    if (bits & CR_TID) p = put_u(p, (uint32_t)tid);
    if (bits & CR_PROBES) p = put_u(p, probes);
    L->prev_tid = tid;
    L->prev_probes = probes;
    return p;
}

/* put_u for the held appends' loop and a record's tokens and table, where a loop's exit (at
 * one, two or three bytes as a token, sequence id or block falls) is a branch the predictor
 * misses: a value below 2^35 (nearly every one) spread into its bytes and written with one
 * 8-byte store,
 * its length and continuation bits looked up by its bit length. The bytes past the varint are
 * overwritten by what follows it, or lie past the chunk's end (room_raw keeps 8 bytes past
 * every record's bound). */
static const uint8_t varint_len[36] = {1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3,
                                       3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5};
static const uint64_t varint_cont[6] = {0, 0, 0x80, 0x8080, 0x808080, 0x80808080};
static inline uint8_t *put_v(uint8_t *p, uint64_t v) {
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (__builtin_expect(v < (1ull << 35), 1)) {
        uint64_t x = (v & 0x7f) | (v << 1 & 0x7f00) | (v << 2 & 0x7f0000) |
                     (v << 3 & 0x7f000000) | (v << 4 & 0x7f00000000ull);
        unsigned len = varint_len[64 - __builtin_clzll(v | 1)];
        x |= varint_cont[len];
        memcpy(p, &x, 8);
        return p + len;
    }
#endif
    return put_u(p, v);
}
/* put_u of a value that is almost always below 128 there (a number's or the clock's step, a
 * table's length): one byte, the branch predicted. */
static inline uint8_t *put_small(uint8_t *p, uint64_t v) {
    if (__builtin_expect(v < 0x80, 1)) {
        *p = (uint8_t)v;
        return p + 1;
    }
    return put_u(p, v);
}

/* The held plain appends composed into the chunk, in their order (docs/REPLAY.md's record:
 * op, status, number, time, thread and probe word where they changed, the sequence's id, the
 * token, the table's entries kept and the block added), room for all of them made first (the
 * chunk written before them where they would not fit). Where that write fails, they are
 * counted lost with its records (the next record written is a LOST). */
#define HELD_BYTES 64 /* (a held append's record at its longest, and a varint's 8-byte store) */
static void oplog_compose_held(Oplog *L) {
    int k = L->n_held;
    L->n_held = 0;
    uint8_t *p = L->lost ? NULL : room_raw(L, HELD_BYTES * (size_t)k);
    if (p == NULL || L->lost) {
        L->lost += (uint64_t)k;
        return;
    }
    uint8_t *p0 = p;
    if (L->out_recs == 0) {
        L->base_seq = L->prev_seq = L->held[0].seq;
        L->base_time = L->held[0].now;
        L->prev_tid = L->owner;
        L->prev_probes = 0;
    }
    /* (in locals: the loop's byte stores may alias any field of L's, which would be read
     * again after each) */
    const Held *h = L->held, *end = L->held + k;
    uint64_t prev_seq = L->prev_seq, base_time = L->base_time, key = L->key;
    int32_t prev_tid = L->prev_tid;
    uint32_t prev_probes = L->prev_probes;
    for (; h < end; h++) {
        int bits = OS_OK | (h->tid != prev_tid ? CR_TID : 0) |
                   (h->probes != prev_probes ? CR_PROBES : 0);
        *p++ = OP_APPEND;
        *p++ = (uint8_t)bits;
        p = put_small(p, h->seq - prev_seq);
        p = put_small(p, h->now > base_time ? (h->now - base_time) >> CR_TIME_SHIFT : 0);
        if (__builtin_expect(bits & (CR_TID | CR_PROBES), 0)) {
            p = oplog_changed(L, p, bits, h->tid, h->probes);
            prev_tid = h->tid;
            prev_probes = h->probes;
        }
        p = put_v(p, zz(h->seq_id));
        prev_seq = h->seq;
        *p++ = 1; /* (one token) */
        p = put_v(p, zz(__builtin_expect(key != 0, 0) ? redacted_token(key, h->token) : h->token));
        *p++ = TM_OWN;
        p = put_small(p, h->keep);
        *p++ = (uint8_t)(h->nb - h->keep);
        if (h->nb > h->keep) p = put_v(p, zz(h->block));
    }
    L->prev_seq = prev_seq;
    L->out_n += (size_t)(p - p0);
    L->out_recs += k;
}

/* Write every record of the handle's now (its held appends composed first). */
static void oplog_flush_all(Oplog *L) {
    if (L->n_held) oplog_compose_held(L);
    oplog_flush(L);
}

static void oplog_name_checks(Native *n, uint64_t seq);
/* An operation's record numbered `seq`: the device checks queued since the last one are its
 * (oplog_name_checks). Called after the head by the writers of records (oplog_write,
 * oplog_lease, append_plain; not oplog_head, which every record's writer inlines: there it cost
 * recording about a point on bench_serving_loop) and by a held append where it added a block
 * (a check of that block's poison). Records that are no operation (a REPORT, STORE, COPY,
 * CLOSE, LOST) name none. */
static OPLOG_RARE void oplog_name_op(Native *n, int op, uint64_t seq) {
    if ((op >= OP_ALLOCATE && op <= OP_EVICT) || (op >= OP_LEASE && op <= OP_EXPIRE_LEASES))
        oplog_name_checks(n, seq);
}

/* A record's first bytes: op, status and flags, its number, time, thread and probe word
 * where they changed, and the sequence's id. (Every record runs it: kept to a few cache lines
 * of code, which a Python program's interpreter evicts between two operations.) */
static inline __attribute__((hot)) uint8_t *oplog_head(Native *n, Oplog *L, uint8_t *p, int op,
                                                       int bits, int64_t seq_id) {
    uint64_t seq = __atomic_add_fetch((uint64_t *)(n->seg + L->off_seq), 1, __ATOMIC_SEQ_CST);
    if (__builtin_expect((L->out_recs & 63) == 0, 0)) oplog_clock(L, seq);
    int32_t tid = thread_id(); /* (not cached by pthread_self: an ended thread's is reused) */
    uint32_t probes = (uint32_t)*n->probe_bits;
    if (tid != L->prev_tid) bits |= CR_TID;
    if (probes != L->prev_probes) bits |= CR_PROBES;
    *p++ = (uint8_t)op;
    *p++ = (uint8_t)bits;
    p = put_u(p, seq - L->prev_seq);
    p = put_u(p, L->now > L->base_time ? (L->now - L->base_time) >> CR_TIME_SHIFT : 0);
    if (__builtin_expect(bits & (CR_TID | CR_PROBES), 0)) p = oplog_changed(L, p, bits, tid, probes);
    p = put_s(p, seq_id);
    L->prev_seq = seq;
    return p;
}

/* A LOST record at p, in a chunk with room for it: how many records failed writes lost since
 * the last one written (docs/REPLAY.md). */
static __attribute__((noinline, cold)) uint8_t *oplog_lost(Oplog *L, uint8_t *p) {
    uint8_t *q = oplog_head(L->native, L, p, OP_LOST, CR_ARGS, -1);
    q = put_s(q, -1);
    q = put_s(q, (int64_t)L->lost);
    q = put_s(q, 0);
    *q++ = 0; /* (no tokens) */
    *q++ = TM_NONE;
    L->lost = 0;
    L->out_n += (size_t)(q - p);
    L->out_recs++;
    return q;
}

/* Room for a record of at most `bound` bytes after what the chunk holds, the held appends
 * composed before it; where a write failed since the last record, a LOST record first (the
 * next record written after a failed write is a LOST). NULL where no memory is left. */
static inline uint8_t *oplog_room(Oplog *L, size_t bound) {
    if (L->n_held) oplog_compose_held(L);
    uint8_t *p = room_raw(L, bound + 64);
    if (__builtin_expect(L->lost != 0, 0) && p != NULL && L->native->seg != NULL)
        p = oplog_lost(L, p);
    return p;
}

/* A record's request id (redacted where the log is): a length byte and its bytes. */
static uint8_t *put_request(Oplog *L, uint8_t *p, const char *request) {
    char req[REQUEST_BYTES];
    oplog_request(L, request, req);
    size_t k = strnlen(req, REQUEST_BYTES);
    *p++ = (uint8_t)k;
    memcpy(p, req, k);
    return p + k;
}

/* Compose one record into the chunk. Errors are never raised: a record that cannot be
 * written is counted lost, and the next one written is preceded by a LOST record saying how
 * many (its number taken too: readers see where). */
static void oplog_write(Native *n, OpRec *o) {
    Oplog *L = n->oplog;
    if (n->seg == NULL) return;
    Py_ssize_t nc = o->copies ? PyList_GET_SIZE(o->copies) : 0;
    Py_ssize_t nf = 0;
    if (o->found0 >= 0 && n->found) nf = PyList_GET_SIZE(n->found) - o->found0;
    if (o->found0 < 0) nf = 1;
    if (nf < 0) nf = 0;
    if (nf > 255) nf = 255;
    int64_t nt = o->scratch && L->have_tok ? L->ntok : 0;
    int64_t npre = o->scratch ? L->n_pre : 0;
    size_t bound = 128 + REQUEST_BYTES + (o->op == OP_START ? (size_t)o->n_text : 5 * (size_t)nt) +
                   5 * (size_t)o->n_blocks + 10 * (size_t)nc + 10 * (size_t)npre +
                   (16 + OPLOG_FOUND) * (size_t)nf;
    uint8_t *p0 = oplog_room(L, bound);
    if (p0 == NULL) {
        L->lost++;
        return;
    }
    uint32_t fired = n->oplog_fired;
    n->oplog_fired = 0;
    int bits = (o->status & 3) | (o->flags & OPLOG_FAULT || fired ? CR_FAULT : 0);
    if (!o->req_live && o->request[0]) bits |= CR_REQUEST;
    if (nc || npre || nf) bits |= CR_EXTRA;
    if (o->src_id != -1 || o->arg || o->result) bits |= CR_ARGS;
    uint8_t *p = oplog_head(n, L, p0, o->op, bits, o->seq_id);
    if (__builtin_expect(L->unnamed, 0)) oplog_name_op(n, o->op, L->prev_seq);
    if (bits & CR_FAULT) p = put_u(p, fired);
    if (bits & CR_ARGS) {
        p = put_s(p, o->src_id);
        p = put_s(p, o->arg);
        p = put_s(p, o->result);
    }
    if (bits & CR_REQUEST) p = put_request(L, p, o->request);
    if (o->op == OP_START) {
        p = put_u(p, (uint64_t)o->n_text);
        memcpy(p, o->text, (size_t)o->n_text);
        p += o->n_text;
    } else {
        p = put_u(p, (uint64_t)nt);
        for (int64_t i = 0; i < nt; i++) p = put_v(p, zz(oplog_token(L, L->tok[i])));
    }
    int tmode = o->tmode;
    *p++ = (uint8_t)tmode;
    if (tmode != TM_NONE) {
        int64_t keep = tmode == TM_OWN ? o->keep : 0;
        if (tmode == TM_OWN) p = put_u(p, (uint64_t)keep);
        p = put_u(p, (uint64_t)(o->n_blocks - keep));
        for (int64_t i = keep; i < o->n_blocks; i++) p = put_v(p, zz(o->blocks[i]));
    }
    if (bits & CR_EXTRA) {
        p = put_u(p, (uint64_t)nc);
        for (Py_ssize_t i = 0; i < nc; i++) {
            PyObject *pair = PyList_GET_ITEM(o->copies, i);
            int ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2;
            p = put_s(p, ok ? PyLong_AsLong(PyTuple_GET_ITEM(pair, 0)) : -1);
            p = put_s(p, ok ? PyLong_AsLong(PyTuple_GET_ITEM(pair, 1)) : -1);
        }
        p = put_u(p, (uint64_t)npre);
        for (int64_t i = 0; i < npre; i++) p = put_s(p, L->pre[i]);
        p = put_u(p, (uint64_t)nf);
        for (Py_ssize_t i = 0; i < nf; i++) {
            uint64_t pos = o->found0 < 0 ? (uint64_t)o->found_at
                                         : PyLong_AsUnsignedLongLong(
                                               PyList_GET_ITEM(n->found, o->found0 + i));
            const uint8_t *f =
                n->seg + n->off_findings + (size_t)(pos % FINDINGS_CAPACITY) * FINDING_SIZE;
            p = put_s(p, I4(f + FD_BLOCK));
            size_t kl = FD_KIND_BYTES < OPLOG_FOUND - OF_KIND ? FD_KIND_BYTES
                                                                  : OPLOG_FOUND - OF_KIND;
            kl = strnlen((const char *)f + FD_KIND, kl);
            *p++ = (uint8_t)kl;
            memcpy(p, f + FD_KIND, kl);
            p += kl;
        }
    }
    if (PyErr_Occurred()) PyErr_Clear(); /* (an int that did not fit: written as -1) */
    L->out_n += (size_t)(p - p0);
    L->out_recs++;
    /* something happened: on disk now */
    if (o->status != OS_OK || nf || (bits & CR_FAULT) || o->op == OP_START || o->op == OP_REPORT)
        oplog_flush(L);
}

/* The live slot a Sequence names (its slot field, in the table's range), else -1. */
static __attribute__((hot)) int64_t slot_of(Native *n, PyObject *seq) {
    if (seq == NULL || (!Py_IS_TYPE(seq, (PyTypeObject *)n->seq_type) &&
                        !PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)))
        return -1;
    PyObject *v = *(PyObject **)((char *)seq + n->seq_off[F_SLOT]);
    int64_t s = v && PyLong_CheckExact(v) ? PyLong_AsLongLong(v) : -1;
    if (s == -1 && PyErr_Occurred()) PyErr_Clear();
    return s >= 0 && s < n->max_seqs ? s : -1;
}

/* A Sequence's integer field (-1: none). */
static int64_t seq_int(Native *n, PyObject *seq, int field) {
    if (seq == NULL || !PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) return -1;
    PyObject *v = *(PyObject **)((char *)seq + n->seq_off[field]);
    int64_t x = v && PyLong_Check(v) ? PyLong_AsLongLong(v) : -1;
    if (x == -1 && PyErr_Occurred()) PyErr_Clear();
    return x;
}

/* A slot's table and seq id, from its record in the segment. */
static void slot_table(Native *n, int64_t slot, OpRec *o) {
    const uint8_t *s = seqrec(n, slot);
    uint32_t k = U4(s + SF_NUM_BLOCKS);
    o->blocks = (const int32_t *)(s + SF_TABLE);
    o->n_blocks = k <= (uint64_t)n->max_bps ? k : 0;
}

/* The request id of an argument, as the segment keeps it (its str's first 32 bytes). */
static void oplog_rid(PyObject *rid, char *out) {
    memset(out, 0, REQUEST_BYTES);
    PyObject *s = rid ? request_str(rid) : NULL;
    if (s == NULL || request_of(s, out)) PyErr_Clear();
    Py_XDECREF(s);
}

/* A bounded log past its bound: the checkpoint (allocator/checkpoint.py, through the callable
 * oplog_ring was given), before an operation of the handle's and outside any (depth 0): every
 * record of the handle's before it is composed, none is in flight. What it raises is reported
 * as unraisable, never the operation's. */
static __attribute__((noinline, cold)) void oplog_due(Native *n) {
    Oplog *L = n->oplog;
    L->due = 0;
    PyObject *f = L->ckpt;
    if (f == NULL || L->owner != (int32_t)getpid()) return; /* (a forked child's copy: not) */
    Py_INCREF(f);
    PyObject *r = PyObject_CallNoArgs(f);
    if (r == NULL) PyErr_WriteUnraisable(f);
    Py_XDECREF(r);
    Py_DECREF(f);
}

/* One public operation run and recorded: `fn` called as it is, its record written after. */
static PyObject *oplog_op(Native *n, int op, FastFn fn, PyObject *const *args, Py_ssize_t nargs) {
    Oplog *L = n->oplog;
    if (__builtin_expect(L->due, 0) && L->depth == 0) {
        oplog_due(n);
        if ((L = n->oplog) == NULL) return fn(n, args, nargs); /* (the checkpoint stopped it) */
    }
    /* (the call's tokens and preemptions are set after its gate, so by this call only: another
     * thread's operation on the handle waits there; both are cleared once its record is
     * written) */
    OpRec o;
    o.op = op;
    o.scratch = L->depth == 0;
    if (o.scratch) { /* (the hook's next tokens are this call's: oplog_tokens) */
        L->have_tok = 0;
        L->slot = -1;
    }
    o.status = OS_OK;
    o.flags = 0;
    o.seq_id = o.src_id = -1;
    o.arg = o.result = 0;
    o.req_live = 0;
    o.tmode = TM_NONE;
    o.n_blocks = o.keep = 0;
    o.blocks = NULL;
    o.copies = NULL;
    o.found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    Py_ssize_t armed0 = n->faults_armed ? PyDict_GET_SIZE(n->faults_armed) : 0;
    PyObject *seq = nargs >= 2 && op != OP_ALLOCATE && op != OP_EVICT ? args[1] : NULL;
    int64_t slot = slot_of(n, seq);
    /* free, abort: the table the release drops; append: the table before (its record holds
     * what changed) */
    int32_t before_s[64], *before = before_s;
    int64_t n_before = -1;
    if (slot >= 0) {
        memcpy(o.request, seqrec(n, slot) + SF_REQUEST, REQUEST_BYTES);
        o.req_live = 1;
        if (op == OP_APPEND) n_before = U4(seqrec(n, slot) + SF_NUM_BLOCKS);
        if (op == OP_FREE || op == OP_ABORT) {
            OpRec t;
            slot_table(n, slot, &t);
            if (t.n_blocks > 64) before = PyMem_Malloc(4 * (size_t)t.n_blocks);
            if (before == NULL) before = before_s;
            else {
                memcpy(before, t.blocks, 4 * (size_t)t.n_blocks);
                n_before = t.n_blocks;
            }
        }
    } else {
        memset(o.request, 0, REQUEST_BYTES);
        if (seq && PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) {
            PyObject *rid = *(PyObject **)((char *)seq + n->seq_off[F_REQUEST_ID]);
            if (rid) oplog_rid(rid, o.request);
        }
    }
    int64_t id_before = slot >= 0 ? (int64_t)U8(seqrec(n, slot) + SF_SEQ_ID) : seq_int(n, seq, F_SEQ_ID);

    struct OpRec *open0 = L->open;
    if (op == OP_FREE || op == OP_ABORT) {
        L->open = &o;
        L->open_id = id_before;
        L->open_before = before;
        L->open_nb = n_before;
    }
    L->depth++;
    PyObject *res = fn(n, args, nargs);
    L->depth--;
    /* (a release whose process was to die in it has its record: oplog_dying) */
    int written = (op == OP_FREE || op == OP_ABORT) && L->open != &o;
    L->open = open0;

    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    if (res == NULL) PyErr_Fetch(&et, &ev, &etb);
    if (res == NULL) {
        o.status = op_status(et);
    }
    if (n->faults_armed && PyDict_GET_SIZE(n->faults_armed) < armed0) o.flags |= OPLOG_FAULT;
    int64_t after = -1;
    switch (op) {
    case OP_ALLOCATE:
        if (nargs == 3) oplog_rid(args[2], o.request);
        o.req_live = 0;
        if (res) {
            after = slot_of(n, res);
            o.result = seq_int(n, res, F_CACHED);
        }
        break;
    case OP_APPEND:
        o.seq_id = id_before;
        after = slot_of(n, seq);
        if (res && PyList_Check(res)) o.copies = res;
        break;
    case OP_FORK:
        o.src_id = id_before;
        if (res) after = slot_of(n, res);
        if (nargs == 3) oplog_rid(args[2], o.request);
        o.req_live = 0;
        break;
    case OP_MARK_COMPUTED: {
        o.seq_id = id_before;
        int over = 0;
        o.arg = nargs == 3 && PyLong_Check(args[2]) ? PyLong_AsLongLongAndOverflow(args[2], &over)
                                                    : 0;
        if (over) o.arg = over > 0 ? INT64_MAX : INT64_MIN;
        if (res && PyLong_Check(res)) o.result = PyLong_AsLongLong(res);
        break;
    }
    case OP_FREE:
    case OP_ABORT:
        o.seq_id = id_before;
        if (res && n_before >= 0) {
            o.tmode = TM_NEW;
            o.blocks = before;
            o.n_blocks = n_before;
        }
        break;
    case OP_SET_STATE:
        o.seq_id = id_before;
        if (nargs == 3 && PyUnicode_Check(args[2]))
            o.arg = PyUnicode_CompareWithASCIIString(args[2], "running") == 0   ? 1
                    : PyUnicode_CompareWithASCIIString(args[2], "waiting") == 0 ? 2
                                                                                : 0;
        break;
    case OP_RESUME:
        o.src_id = id_before;
        o.seq_id = seq_int(n, seq, F_SEQ_ID);
        after = slot_of(n, seq);
        if (res && PyLong_Check(res)) o.result = PyLong_AsLongLong(res);
        break;
    case OP_EVICT:
        o.arg = nargs == 2 && PyLong_Check(args[1]) ? PyLong_AsLongLong(args[1]) : 0;
        if (res && PyLong_Check(res)) o.result = PyLong_AsLongLong(res);
        break;
    }
    if (after >= 0) {
        slot_table(n, after, &o);
        o.tmode = TM_NEW;
        if (op == OP_APPEND && n_before >= 0) {
            /* an append adds blocks after the table and replaces its last one where it copies
             * on write (or preempts the sequence itself: an empty table) */
            o.tmode = TM_OWN;
            o.keep = n_before - (o.copies && PyList_GET_SIZE(o.copies) ? 1 : 0);
            if (o.keep > o.n_blocks) o.keep = o.n_blocks;
            if (o.keep < 0) o.keep = 0;
        }
        if (op == OP_ALLOCATE || op == OP_FORK) o.seq_id = (int64_t)U8(seqrec(n, after) + SF_SEQ_ID);
    }
    if (PyErr_Occurred()) PyErr_Clear();
    if (!written) oplog_write(n, &o);
    if (before != before_s) PyMem_Free(before);
    if (res == NULL) PyErr_Restore(et, ev, etb);
    if (o.scratch) {
        L->n_pre = 0;
        L->have_tok = 0;
    }
    return res;
}

/* The recorded entry points (module.c's table): each the operation itself while no log is
 * open (one test), else run through oplog_op. */
#define RECORDED(name, op, fn)                                                                 \
    static PyObject *name(Native *n, PyObject *const *args, Py_ssize_t nargs) {                \
        if (n->oplog == NULL) return fn(n, args, nargs);                                       \
        return oplog_op(n, op, fn, args, nargs);                                               \
    }
RECORDED(R_allocate, OP_ALLOCATE, N_allocate)

/* An append that was not a plain one (an error, copies on write, preemptions, findings, a
 * fault, records lost before it): its general record, of the sequence in `rec`'s slot, whose
 * table had nb0 entries as the call began; with `rec` NULL (a sequence that is no live one),
 * of the sequence's own fields, as oplog_op records it. Out of the hot path's way. */
static __attribute__((noinline, cold)) PyObject *append_general(Native *n, PyObject *const *args,
                                                                PyObject *res,
                                                                const uint8_t *rec, uint32_t nb0,
                                                                Py_ssize_t found0,
                                                                Py_ssize_t armed0) {
    Oplog *L = n->oplog;
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = OP_APPEND;
    o.scratch = 1;
    o.src_id = -1;
    o.found0 = found0;
    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    if (res == NULL) {
        PyErr_Fetch(&et, &ev, &etb);
        o.status = op_status(et);
    }
    if (rec) {
        o.seq_id = (int64_t)U8(rec + SF_SEQ_ID);
        o.req_live = 1;
        memcpy(o.request, rec + SF_REQUEST, REQUEST_BYTES);
    } else {
        PyObject *seq = args[1];
        o.seq_id = seq_int(n, seq, F_SEQ_ID);
        if (PyObject_TypeCheck(seq, (PyTypeObject *)n->seq_type)) {
            PyObject *rid = *(PyObject **)((char *)seq + n->seq_off[F_REQUEST_ID]);
            if (rid) oplog_rid(rid, o.request);
        }
    }
    if (n->faults_armed && PyDict_GET_SIZE(n->faults_armed) < armed0) o.flags |= OPLOG_FAULT;
    if (res && PyList_Check(res)) o.copies = res;
    int64_t after = rec ? slot_of(n, args[1]) : -1;
    if (after >= 0 && n->seg) {
        slot_table(n, after, &o);
        o.tmode = TM_OWN;
        o.keep = (int64_t)nb0 - (o.copies && PyList_GET_SIZE(o.copies) ? 1 : 0);
        if (o.keep > o.n_blocks) o.keep = o.n_blocks;
        if (o.keep < 0) o.keep = 0;
    }
    if (PyErr_Occurred()) PyErr_Clear();
    oplog_write(n, &o);
    if (res == NULL) PyErr_Restore(et, ev, etb);
    L->n_pre = 0;
    L->have_tok = 0;
    return res;
}

/* An append the core did not run on a live sequence of this handle (refused, or stopped before
 * its check): recorded as the sequence its slot field names (a copy of a live one: that one),
 * else as the Sequence's own fields. Nothing changed its table. */
static __attribute__((noinline, cold)) PyObject *append_refused(Native *n, PyObject *const *args,
                                                                PyObject *res, Py_ssize_t found0,
                                                                Py_ssize_t armed0) {
    PyObject *et, *ev, *etb;
    PyErr_Fetch(&et, &ev, &etb); /* (slot_of may set and clear one of its own) */
    int64_t slot = slot_of(n, args[1]);
    PyErr_Restore(et, ev, etb);
    const uint8_t *rec = slot >= 0 ? seqrec(n, slot) : NULL;
    return append_general(n, args, res, rec, rec ? U4(rec + SF_NUM_BLOCKS) : 0, found0, armed0);
}

/* A plain append of more than one token, or one that added more than one block: composed now
 * (its tokens, the table's entries kept and the blocks after them). */
static __attribute__((noinline)) void append_plain(Native *n, Oplog *L, const uint8_t *rec,
                                                   uint32_t keep, uint32_t nb1) {
    uint8_t *p0 = oplog_room(L, 64 + 5 * (size_t)L->ntok + 5 * (size_t)(nb1 - keep));
    if (p0 == NULL) {
        L->lost++;
        return;
    }
    uint8_t *p = oplog_head(n, L, p0, OP_APPEND, OS_OK, (int64_t)U8(rec + SF_SEQ_ID));
    if (__builtin_expect(L->unnamed, 0)) oplog_name_op(n, OP_APPEND, L->prev_seq);
    p = put_u(p, (uint64_t)L->ntok);
    for (int64_t i = 0; i < L->ntok; i++) p = put_v(p, zz(oplog_token(L, L->tok[i])));
    *p++ = TM_OWN;
    p = put_u(p, keep);
    p = put_u(p, nb1 - keep);
    const int32_t *table = (const int32_t *)(rec + SF_TABLE);
    for (uint32_t i = keep; i < nb1; i++) p = put_v(p, zz(table[i]));
    L->out_n += (size_t)(p - p0);
    L->out_recs++;
}

/* append, recorded: the core's hot path (a decode step appends to every running sequence).
 * The core hands the call's tokens, sequence and table length to the log as it reads them
 * (oplog_tokens), so nothing is looked up before the call; a plain append's record is taken
 * straight from the sequence's record in the segment after it. Kept to a few cache lines of
 * code: a Python program's interpreter evicts them between two operations. */
static PyObject *R_append(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    Oplog *L = n->oplog;
    if (L == NULL) return N_append(n, args, nargs);
    if (L->depth != 0 || nargs != 3 || n->seg == NULL)
        return oplog_op(n, OP_APPEND, N_append, args, nargs);
    Py_ssize_t found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    Py_ssize_t armed0 = n->faults_armed ? PyDict_GET_SIZE(n->faults_armed) : 0;
    L->slot = -1;
    L->have_tok = 0; /* (the hook's next tokens are this call's: oplog_tokens) */
    L->depth++;
    PyObject *res = N_append(n, args, nargs);
    L->depth--;
    int64_t slot = L->slot;
    if (__builtin_expect(slot < 0, 0)) return append_refused(n, args, res, found0, armed0);
    const uint8_t *rec = seqrec(n, slot);
    uint32_t nb0 = L->nb0, nb1 = U4(rec + SF_NUM_BLOCKS);
    if (__builtin_expect(
            res == NULL || !PyList_CheckExact(res) || PyList_GET_SIZE(res) || L->n_pre ||
                !L->have_tok || (n->found ? PyList_GET_SIZE(n->found) : 0) != found0 ||
                (n->faults_armed ? PyDict_GET_SIZE(n->faults_armed) : 0) != armed0 ||
                nb1 > (uint64_t)n->max_bps || L->lost || n->oplog_fired || n->seg == NULL,
            0))
        return append_general(n, args, res, rec, nb0, found0, armed0);
    /* a plain append: its tokens, and the blocks it added after the table */
    uint32_t keep = nb0 < nb1 ? nb0 : nb1;
    if (__builtin_expect(L->ntok == 1 && nb1 - keep <= 1, 1)) {
        /* (a decode step's: held, composed with the ones after it) */
        Held *h = &L->held[L->n_held];
        h->seq = __atomic_add_fetch((uint64_t *)(n->seg + L->off_seq), 1, __ATOMIC_SEQ_CST);
        if (__builtin_expect(((L->out_recs + L->n_held) & 63) == 0, 0)) oplog_tick(L);
        h->now = L->now;
        h->tid = thread_id();
        h->probes = (uint32_t)*n->probe_bits;
        h->seq_id = (int64_t)U8(rec + SF_SEQ_ID);
        h->token = L->tok[0];
        h->keep = keep;
        h->nb = nb1;
        h->block = 0;
        if (nb1 > keep) {
            h->block = ((const int32_t *)(rec + SF_TABLE))[keep];
            /* (a block handed out: a check of its poison, queued in this append, is its) */
            if (__builtin_expect(L->unnamed, 0)) oplog_name_op(n, OP_APPEND, h->seq);
        }
        if (++L->n_held == OPLOG_HELD) oplog_compose_held(L);
    } else {
        append_plain(n, L, rec, keep, nb1);
    }
    L->have_tok = 0;
    return res;
}
RECORDED(R_fork, OP_FORK, N_fork)
RECORDED(R_mark_computed, OP_MARK_COMPUTED, N_mark_computed)
RECORDED(R_set_state, OP_SET_STATE, N_set_state)
RECORDED(R_resume, OP_RESUME, N_resume)
RECORDED(R_evict, OP_EVICT, N_evict)

static PyObject *R_end(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (n->oplog == NULL) return N_end(n, args, nargs);
    long final = nargs == 3 ? PyLong_AsLong(args[2]) : 0;
    if (final == -1 && PyErr_Occurred()) PyErr_Clear();
    return oplog_op(n, final == 4 ? OP_ABORT : OP_FREE, N_end, args, nargs);
}

/* kill-holding-lock (faults.c kill_fault): the release in flight dies once it has taken its
 * locks (SIGKILL, at its crash point). Its record is written there, just before the kill (its
 * number taken with the locks held: an operation of another process numbered after it that
 * wanted them met a dead holder): status error, the fault fired, the sequence's id and the
 * table it was releasing; then the chunk, so the log holds every record of the process up to
 * its death (the fault is kvscope's own: where it kills is known). A crash point armed
 * otherwise (crash.py: tests) writes nothing. A replay runs that process in a child of its
 * own, which dies there too (docs/REPLAY.md). */
static void oplog_dying(Native *n) {
    Oplog *L = n->oplog;
    if (L == NULL || L->open == NULL || n->seg == NULL ||
        !(n->oplog_fired & (1u << FT_KILL_HOLDING_LOCK)))
        return;
    OpRec *o = L->open;
    L->open = NULL;
    o->status = OS_ERROR;
    o->seq_id = L->open_id;
    if (L->open_nb >= 0) {
        o->tmode = TM_NEW;
        o->blocks = L->open_before;
        o->n_blocks = L->open_nb;
    }
    oplog_write(n, o); /* (written at once: its status is not ok) */
    if (PyErr_Occurred()) PyErr_Clear();
}

/* report(...): a finding reported between operations, recorded as a REPORT. */
static PyObject *R_report(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *res = N_report(n, args, nargs);
    if (n->oplog == NULL || res == NULL) return res;
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = OP_REPORT;
    o.seq_id = o.src_id = -1;
    o.found0 = -1;
    o.found_at = (int64_t)PyLong_AsUnsignedLongLong(res);
    o.tmode = TM_NONE;
    if (nargs == 7) oplog_rid(args[5], o.request);
    oplog_write(n, &o);
    if (PyErr_Occurred()) PyErr_Clear();
    return res;
}

/* The block-table audit of a host table (audit.c N_audit_table) that found something: a
 * REPORT of its findings that holds its input (docs/REPLAY.md): `src_id` the table's rows R,
 * `arg` its width W, `result` the padding, and in place of tokens each audited row's sequence
 * id, then the tokens it reads (lengths, or its sequence's), then the table's R x W entries
 * row by row. `rows` is a PySequence_Fast of `live` Sequences, own ones (the audit checked). */
static void oplog_audit(Native *n, Py_ssize_t found0, PyObject *rows, int64_t live,
                        const Py_buffer *t, int64_t R, int64_t W, const Py_buffer *l,
                        PyObject *lens_fast, int64_t sentinel) {
    Oplog *L = n->oplog;
    if (L == NULL || n->seg == NULL || L->depth) return;
    int64_t k = 2 * live + R * W;
    int32_t *v = PyMem_Malloc(sizeof(int32_t) * (size_t)(k ? k : 1));
    if (v == NULL) {
        L->lost++;
        return;
    }
    for (int64_t r = 0; r < live; r++) {
        PyObject *seq = PySequence_Fast_GET_ITEM(rows, r);
        int64_t slot = slot_of(n, seq), tokens;
        v[r] = (int32_t)seq_int(n, seq, F_SEQ_ID);
        if (l != NULL) tokens = int_at(l, r);
        else if (lens_fast != NULL)
            tokens = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(lens_fast, r));
        else
            tokens = slot >= 0 ? I4(seqrec(n, slot) + SF_NUM_TOKENS) : -1;
        v[live + r] = (int32_t)tokens;
    }
    for (int64_t i = 0; i < R * W; i++) v[2 * live + i] = (int32_t)int_at(t, i);
    if (PyErr_Occurred()) PyErr_Clear();
    oplog_tokens_many(n->oplog, v, (Py_ssize_t)k); /* (the report's own: whatever the hook held) */
    PyMem_Free(v);
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = OP_REPORT;
    o.seq_id = -1;
    o.src_id = R;
    o.arg = W;
    o.result = sentinel;
    o.found0 = found0;
    o.scratch = 1;
    o.tmode = TM_NONE;
    oplog_write(n, &o);
    L->have_tok = 0;
    L->n_pre = 0;
    if (PyErr_Occurred()) PyErr_Clear();
}

/* -- lease operations (leases.c: KVPool.lease, lease_release, expire_leases) ---------------- */

/* One finding of the findings ring (its position) as a record lists it: its block, then a
 * length byte and its kind's bytes. */
static uint8_t *put_found(Native *n, uint8_t *p, uint64_t pos) {
    const uint8_t *f = n->seg + n->off_findings + (size_t)(pos % FINDINGS_CAPACITY) * FINDING_SIZE;
    p = put_s(p, I4(f + FD_BLOCK));
    size_t kl = FD_KIND_BYTES < OPLOG_FOUND - OF_KIND ? FD_KIND_BYTES : OPLOG_FOUND - OF_KIND;
    kl = strnlen((const char *)f + FD_KIND, kl);
    *p++ = (uint8_t)kl;
    memcpy(p, f + FD_KIND, kl);
    return p + kl;
}

/* A lease operation's record (LeaseRec, filled by leases.c): the head and arguments as any
 * record's, then in place of tokens its lease part (docs/REPLAY.md: mode, holder, the lease's
 * record and id, timeout, deadline, the generations of its blocks), the blocks, and the
 * preemptions and findings of the call. */
static void oplog_lease(Native *n, const LeaseRec *o) {
    Oplog *L = n->oplog;
    if (L == NULL || n->seg == NULL) return;
    Py_ssize_t nf = n->found ? PyList_GET_SIZE(n->found) - o->found0 : 0;
    if (nf < 0) nf = 0;
    if (nf > 255) nf = 255;
    int64_t npre = L->depth == 0 ? L->n_pre : 0;
    /* (every varint at its longest: the head and arguments, two strings, the lease part's) */
    size_t bound = 256 + 2 * REQUEST_BYTES + 5 * (size_t)o->n_gens + 5 * (size_t)o->n_blocks +
                   10 * (size_t)npre + (16 + OPLOG_FOUND) * (size_t)nf;
    uint8_t *p0 = oplog_room(L, bound);
    if (p0 == NULL) {
        L->lost++;
        L->n_pre = 0;
        return;
    }
    uint32_t fired = n->oplog_fired;
    n->oplog_fired = 0;
    int bits = (o->status & 3) | (o->fault || fired ? CR_FAULT : 0);
    if (o->request[0]) bits |= CR_REQUEST;
    if (npre || nf) bits |= CR_EXTRA;
    if (o->arg || o->result) bits |= CR_ARGS;
    uint8_t *p = oplog_head(n, L, p0, o->op, bits, o->seq_id);
    if (__builtin_expect(L->unnamed, 0)) oplog_name_op(n, o->op, L->prev_seq);
    if (bits & CR_FAULT) p = put_u(p, fired);
    if (bits & CR_ARGS) {
        p = put_s(p, -1);
        p = put_s(p, o->arg);
        p = put_s(p, o->result);
    }
    if (bits & CR_REQUEST) p = put_request(L, p, o->request);
    *p++ = (uint8_t)o->mode;
    size_t hk = strnlen(o->holder, REQUEST_BYTES);
    *p++ = (uint8_t)hk;
    memcpy(p, o->holder, hk);
    p += hk;
    p = put_s(p, o->record);
    p = put_u(p, o->lease_id);
    p = put_u(p, o->timeout_ns);
    p = put_u(p, o->deadline_ns);
    p = put_u(p, (uint64_t)o->n_gens);
    for (int64_t i = 0; i < o->n_gens; i++) p = put_s(p, (int64_t)o->gens[i]);
    *p++ = (uint8_t)(o->blocks ? TM_NEW : TM_NONE);
    if (o->blocks) {
        p = put_u(p, (uint64_t)o->n_blocks);
        for (int64_t i = 0; i < o->n_blocks; i++) p = put_s(p, o->blocks[i]);
    }
    if (bits & CR_EXTRA) {
        p = put_u(p, 0); /* (no copies) */
        p = put_u(p, (uint64_t)npre);
        for (int64_t i = 0; i < npre; i++) p = put_s(p, L->pre[i]);
        p = put_u(p, (uint64_t)nf);
        for (Py_ssize_t i = 0; i < nf; i++) {
            PyObject *pos = PyList_GET_ITEM(n->found, o->found0 + i);
            p = put_found(n, p, PyLong_AsUnsignedLongLong(pos));
        }
    }
    if (PyErr_Occurred()) PyErr_Clear();
    L->out_n += (size_t)(p - p0);
    L->out_recs++;
    L->n_pre = 0;
    if (o->status != OS_OK || nf || (bits & CR_FAULT)) oplog_flush(L);
}

/* The findings the core wrote since `found0` in a call that is no recorded operation, recorded
 * as a REPORT about `request` ("": none): a handle's close (leases.c leases_at_close: a lease
 * still held is a lease_leak), `reclaim_dead` (recovery.c: lock_dead_holder, leak_dead_owner),
 * the provenance sweep (provenance.c: foreign_slot). A replay runs that call again where the
 * REPORT is (docs/REPLAY.md). */
static OPLOG_RARE void oplog_report_of(Native *n, Py_ssize_t found0, const char *request,
                                       int64_t src_id, int64_t arg) {
    if (n->oplog == NULL || n->seg == NULL || n->found == NULL ||
        PyList_GET_SIZE(n->found) <= found0)
        return;
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = OP_REPORT;
    o.seq_id = -1;
    o.src_id = src_id;
    o.arg = arg;
    o.found0 = found0;
    o.tmode = TM_NONE;
    memcpy(o.request, request, REQUEST_BYTES);
    oplog_write(n, &o);
    if (PyErr_Occurred()) PyErr_Clear();
}
static OPLOG_RARE void oplog_found_report(Native *n, Py_ssize_t found0, const char *request) {
    oplog_report_of(n, found0, request, -1, 0);
}

/* The findings the core wrote since `found0` from a device check's answer, applied at a
 * settle after the operation that queued the check (devanswers.c dev_apply: a CUDA pool's
 * checks), recorded as a REPORT about `request` that names that operation: `src_id` its
 * number (`op`; -1 where none is known: the provenance sweep's checks, one queued while the
 * handle did not record), `arg` -1 (OPLOG_ANSWER: a device check's answer). A replay's CPU
 * pool finds it in that operation, and compares it there (docs/REPLAY.md). */
static OPLOG_RARE void oplog_answer_report(Native *n, Py_ssize_t found0, const char *request,
                                           uint64_t op) {
    int64_t src = op == 0 || op == OP_UNNAMED || op > INT64_MAX ? -1 : (int64_t)op;
    oplog_report_of(n, found0, request, src, OPLOG_ANSWER);
}

/* A device check that can find something queued while the handle records (devchecks.c
 * dev_check, which counts it in n->checks_unnamed): the handle's next operation record names
 * it. */
static OPLOG_RARE void oplog_check_queued(Native *n) {
    if (n->oplog != NULL) n->oplog->unnamed = 1;
}

/* The device checks queued since the handle's last operation record that can find something
 * (n->checks_unnamed of them: devchecks.c dev_check), and the findings read from any the queue
 * took early, named as the operation's whose record is numbered `seq` (0: none, as recording
 * stops). They are the newest in the queue (and in the findings read), so the walk starts
 * there and stops once every one is named. */
static OPLOG_RARE void oplog_name_checks(Native *n, uint64_t seq) {
    DevChecks *d = n->dev;
    int64_t left = n->checks_unnamed;
    n->checks_unnamed = 0;
    if (n->oplog != NULL) n->oplog->unnamed = 0;
    if (d == NULL) return;
    for (int64_t i = d->q_count - 1; i >= 0 && left > 0; i--) {
        DevEntry *e = dev_at(d, i);
        if (e->op != OP_UNNAMED) continue;
        e->op = seq;
        left--;
    }
    for (int64_t i = d->n_found - 1; i >= 0 && left > 0; i--) {
        if (d->found[i].op != OP_UNNAMED) continue;
        d->found[i].op = seq;
        left--;
    }
}

/* What a CLOSE or a FLUSH (recovery.c N_flush_local: pool.flush_local) returned to the pool:
 * `ids` the k blocks of the local cache (the cache's order) as the record's table, `slots` in
 * `result` (a close's slot reserve; 0 for a flush); status error where it failed. */
static void oplog_returned(Native *n, int op, const int32_t *ids, int64_t k, int64_t slots,
                           int ok) {
    if (n->oplog == NULL || n->seg == NULL) return;
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = (uint8_t)op;
    o.status = ok ? OS_OK : OS_ERROR;
    o.seq_id = o.src_id = -1;
    o.result = slots;
    o.found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    o.tmode = TM_NEW;
    o.blocks = ids;
    o.n_blocks = k;
    oplog_write(n, &o);
    if (PyErr_Occurred()) PyErr_Clear();
}

/* A recording handle's close (recovery.c N_detach), a CLOSE record after the REPORTs of the
 * lease_leaks it found (docs/REPLAY.md): the close is no operation of the pool's API, but it
 * changes what another process's next allocate gets (it returns the handle's local cache to
 * the free ring, its slot reserve to the table), so a replay closes that process's handle there
 * and compares. `ids` the k blocks of its local cache it returned (the cache's order) as the
 * record's table, `slots` its reserve's slots in `result` (oplog_returned); status error where
 * the detach failed. Written at once (the recording ends with it). */
static __attribute__((noinline, cold)) void oplog_close_record(Native *n, const int32_t *ids,
                                                               int64_t k, int64_t slots, int ok) {
    oplog_returned(n, OP_CLOSE, ids, k, slots, ok);
    if (n->oplog) oplog_flush_all(n->oplog);
}

/* -- a store check's input (probes/stores.py Writers.check) ----------------------------------- */

/* oplog_store(spans, slots, what, ref) -> int: while the handle records, a STORE record of one
 * store check's input (docs/REPLAY.md): `spans` int64 triples (the writer's seq id, start, end)
 * in slot order, `slots` the int64 slot mapping it checked (empty: none), `what` 1 the writers'
 * blocks checked, 2 the slots, 3 both, `ref` a slots-only record's store (the number the record
 * that checked its blocks got; -1: none). Returns the record's number (0: not recording, or the
 * record lost). The spans in place of tokens (a count, then seq id (s), start, length), the
 * slots as their differences (s), no table. */
static PyObject *N_oplog_store(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "oplog_store(spans, slots, what, ref)");
        return NULL;
    }
    Oplog *L = n->oplog;
    if (L == NULL || n->seg == NULL) return PyLong_FromLong(0);
    int64_t what = PyLong_AsLongLong(args[2]), ref = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer sp, sl;
    if (PyObject_GetBuffer(args[0], &sp, PyBUF_SIMPLE) != OK) return NULL;
    if (PyObject_GetBuffer(args[1], &sl, PyBUF_SIMPLE) != OK) {
        PyBuffer_Release(&sp);
        return NULL;
    }
    PyObject *res = NULL;
    if (sp.len % 24 || sl.len % 8) {
        PyErr_SetString(PyExc_ValueError, "oplog_store: spans are int64 triples, slots int64");
        goto done;
    }
    const int64_t *spans = sp.buf, *slots = sl.buf;
    size_t n_spans = (size_t)sp.len / 24, n_slots = (size_t)sl.len / 8;
    /* (every varint at its longest) */
    uint8_t *p0 = oplog_room(L, 128 + 30 * n_spans + 10 * n_slots);
    if (p0 == NULL) {
        L->lost++;
        res = PyLong_FromLong(0);
        goto done;
    }
    int bits = OS_OK | CR_ARGS;
    uint8_t *p = oplog_head(n, L, p0, OP_STORE, bits, n_spans ? spans[0] : -1);
    uint64_t seq = L->prev_seq; /* (the number oplog_head took) */
    p = put_s(p, ref);
    p = put_s(p, what);
    p = put_s(p, 0);
    p = put_u(p, (uint64_t)n_spans);
    for (size_t i = 0; i < n_spans; i++) {
        int64_t start = spans[3 * i + 1], end = spans[3 * i + 2];
        p = put_s(p, spans[3 * i]);
        p = put_s(p, start);
        p = put_s(p, end - start);
    }
    p = put_u(p, (uint64_t)n_slots);
    int64_t prev = 0;
    for (size_t i = 0; i < n_slots; i++) {
        p = put_s(p, (int64_t)((uint64_t)slots[i] - (uint64_t)prev));
        prev = slots[i];
    }
    *p++ = TM_NONE;
    L->out_n += (size_t)(p - p0);
    L->out_recs++;
    res = PyLong_FromUnsignedLongLong(seq);
done:
    PyBuffer_Release(&sp);
    PyBuffer_Release(&sl);
    return res;
}

/* -- a program's block copies (KVPool.copied: kvscope.kernels.copy_blocks(..., pool=)) --------- */

/* oplog_copy(pairs) -> int: while the handle records, a COPY record of the blocks the program
 * copied (docs/REPLAY.md): `pairs` int64 (src, dst) pairs, each block copied whole, every
 * layer, K and V (the copy-on-write pairs `append` returned, where the program copies them).
 * The log holds the pool's work and where stores wrote, not the program's K/V: with its copies
 * too, a replay's K/V holds what the program's would have where each slot was written, so a
 * copy the program skipped leaves the replay's slots as unwritten as the recording's (guard
 * mode's kv_never_written at the free). Returns the record's number (0: not recording, or the
 * record lost). The pairs in the record's copies (bit 64: a count, then src (s) and dst (s)
 * each; no preemption, no finding), seq_id -1, no tokens, no table. */
static OPLOG_RARE PyObject *N_oplog_copy(Native *n, PyObject *arg) {
    Oplog *L = n->oplog;
    if (L == NULL || n->seg == NULL) return PyLong_FromLong(0);
    Py_buffer pb;
    if (PyObject_GetBuffer(arg, &pb, PyBUF_SIMPLE) != OK) return NULL;
    PyObject *res = NULL;
    if (pb.len % 16) {
        PyErr_SetString(PyExc_ValueError, "oplog_copy: pairs are int64 (src, dst) pairs");
        goto done;
    }
    const int64_t *pairs = pb.buf;
    size_t n_pairs = (size_t)pb.len / 16;
    /* (every varint at its longest) */
    uint8_t *p0 = oplog_room(L, 64 + 20 * n_pairs);
    if (p0 == NULL) {
        L->lost++;
        res = PyLong_FromLong(0);
        goto done;
    }
    uint8_t *p = oplog_head(n, L, p0, OP_COPY, OS_OK | CR_EXTRA, -1);
    uint64_t seq = L->prev_seq; /* (the number oplog_head took) */
    *p++ = 0;        /* (no tokens) */
    *p++ = TM_NONE;
    p = put_u(p, (uint64_t)n_pairs);
    for (size_t i = 0; i < 2 * n_pairs; i++) p = put_s(p, pairs[i]);
    *p++ = 0; /* (no preemption) */
    *p++ = 0; /* (no finding) */
    L->out_n += (size_t)(p - p0);
    L->out_recs++;
    res = PyLong_FromUnsignedLongLong(seq);
done:
    PyBuffer_Release(&pb);
    return res;
}

static void oplog_free(Native *n) {
    Oplog *L = n->oplog;
    if (L == NULL) return;
    n->oplog = NULL;
    /* (checks no record named: they belong to no recorded operation) */
    if (n->checks_unnamed) oplog_name_checks(n, 0);
    n->checks_unnamed = 0;
    oplog_flush_all(L);
    if (L->fd >= 0) close(L->fd);
    PyMem_Free(L->held);
    PyMem_Free(L->pre);
    PyMem_Free(L->out);
    PyMem_Free(L->tok);
    Py_XDECREF(L->ckpt);
    PyMem_Free(L);
}

/* oplog_open(path, key, start_text, off_op_seq, tag): start recording into the file at `path`
 * (created 0600 if missing, appended to), with a START record holding start_text (the
 * handle's geometry, probes and armed faults as JSON: allocator/oplog.py); `key` non-zero
 * redacts; `tag` is the pool's, in every record. A log already open is closed first. */
static PyObject *N_oplog_open(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "oplog_open(path, key, start_text, off_op_seq, tag)");
        return NULL;
    }
    if (unusable(n)) return NULL;
    PyObject *path = PyUnicode_EncodeFSDefault(args[0]);
    if (path == NULL) return NULL;
    uint64_t key = PyLong_AsUnsignedLongLongMask(args[1]);
    Py_ssize_t tl;
    const char *text = PyUnicode_AsUTF8AndSize(args[2], &tl);
    int64_t off = PyLong_AsLongLong(args[3]);
    uint32_t tag = (uint32_t)PyLong_AsUnsignedLongMask(args[4]);
    if (text == NULL || PyErr_Occurred()) {
        Py_DECREF(path);
        return NULL;
    }
    if (off < 0 || (off & 7) || (size_t)off + 8 > (size_t)n->buf.len) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_ValueError, "op_seq outside the header");
        return NULL;
    }
    int fd = open(PyBytes_AS_STRING(path), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, args[0]);
        Py_DECREF(path);
        return NULL;
    }
    Py_DECREF(path);
    oplog_free(n);
    Oplog *L = PyMem_Calloc(1, sizeof(Oplog));
    uint8_t *out = L ? PyMem_Malloc(OPLOG_OUT) : NULL;
    Held *held = out ? PyMem_Malloc(sizeof(Held) * OPLOG_HELD) : NULL;
    int32_t *tok = held ? PyMem_Malloc(sizeof(int32_t) * 64) : NULL; /* (oplog_tokens: one) */
    if (L) {
        L->out_n = OPLOG_CHUNK;
        L->cap_out = OPLOG_OUT;
    }
    if (tok == NULL) {
        PyMem_Free(held);
        PyMem_Free(out);
        PyMem_Free(L);
        close(fd);
        return PyErr_NoMemory();
    }
    L->held = held;
    L->tok = tok;
    L->cap_tok = 64;
    L->slot = -1;
    L->fd = fd;
    L->native = n;
    L->reserve = 1;
    L->owner = (int32_t)getpid();
    L->out = out;
    L->key = key;
    L->off_seq = (size_t)off;
    L->tag = tag;
    n->oplog = L;
    OpRec o;
    memset(&o, 0, sizeof o);
    o.op = OP_START;
    o.seq_id = o.src_id = -1;
    n->oplog_fired = 0; /* (faults fired before: not this log's) */
    o.text = text;
    o.n_text = tl;
    o.found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    oplog_write(n, &o);
    if (L->lost) {
        oplog_free(n);
        return PyErr_Format(PyExc_OSError, "cannot write the operation log %R", args[0]);
    }
    Py_RETURN_NONE;
}

static PyObject *N_oplog_close(Native *n, PyObject *unused) {
    oplog_free(n);
    Py_RETURN_NONE;
}

/* oplog_flush(): write the records composed so far (tests, and a program about to exit). */
static PyObject *N_oplog_flush(Native *n, PyObject *unused) {
    if (n->oplog) oplog_flush_all(n->oplog);
    Py_RETURN_NONE;
}

/* -- snapshots and the bounded log (allocator/checkpoint.py) ---------------------------------- */

/* oplog_snapshot(state, expect) -> (seq, offset) | None: a SNAPSHOT record holding `state` (the
 * pool's metadata as allocator/checkpoint.py copied it, the header's op_seq `expect` then),
 * numbered expect + 1 where op_seq is `expect` still: a compare-and-swap, so that no recording
 * process took a number between the copy and this record (every operation numbered up to
 * `expect` is in the copy, and none after it; an operation whose number comes later is
 * replayed after it). None, with nothing of it written, where one was taken (the caller copies
 * again). The handle's records before it are written first, it is written at once, in a chunk
 * of its own; `offset` is that chunk's in the file (-1 where the write failed). */
static PyObject *N_oplog_snapshot(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "oplog_snapshot(state, expect)");
        return NULL;
    }
    Oplog *L = n->oplog;
    if (L == NULL || n->seg == NULL || L->owner != (int32_t)getpid()) {
        PyErr_SetString(PyExc_ValueError, "oplog_snapshot: this handle does not record");
        return NULL;
    }
    uint64_t expect = PyLong_AsUnsignedLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(args[0], &b, PyBUF_SIMPLE) != OK) return NULL;
    PyObject *res = NULL;
    oplog_flush_all(L);
    uint8_t *p0 = oplog_room(L, 64 + (size_t)b.len);
    if (p0 == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t want = expect;
    if (!__atomic_compare_exchange_n((uint64_t *)(n->seg + L->off_seq), &want, expect + 1, 0,
                                     __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
        res = Py_NewRef(Py_None);
        goto done;
    }
    uint64_t seq = expect + 1;
    if ((L->out_recs & 63) == 0) oplog_clock(L, seq);
    else oplog_tick(L);
    int32_t tid = thread_id();
    uint32_t probes = (uint32_t)*n->probe_bits;
    int bits = OS_OK | (tid != L->prev_tid ? CR_TID : 0) | (probes != L->prev_probes ? CR_PROBES : 0);
    uint8_t *p = p0;
    *p++ = OP_SNAPSHOT;
    *p++ = (uint8_t)bits;
    p = put_u(p, seq - L->prev_seq);
    p = put_u(p, L->now > L->base_time ? (L->now - L->base_time) >> CR_TIME_SHIFT : 0);
    if (bits & (CR_TID | CR_PROBES)) p = oplog_changed(L, p, bits, tid, probes);
    p = put_s(p, -1);
    L->prev_seq = seq;
    p = put_u(p, (uint64_t)b.len);
    memcpy(p, b.buf, (size_t)b.len);
    p += b.len;
    *p++ = TM_NONE;
    L->out_n += (size_t)(p - p0);
    L->out_recs++;
    uint64_t size = (L->out_n + 7) & ~(size_t)7;
    uint64_t lost = L->lost;
    oplog_flush(L);
    off_t at = L->lost == lost ? lseek(L->fd, 0, SEEK_CUR) : -1;
    res = Py_BuildValue("(KL)", (unsigned long long)seq,
                        (long long)(at >= (off_t)size ? at - (off_t)size : -1));
done:
    PyBuffer_Release(&b);
    return res;
}

/* oplog_ring(limit, checkpoint, base): bound the log (docs/REPLAY.md "A bounded log"): where the
 * file passes `limit` bytes after `base` (the offset of the pool's last checkpoint in it, or
 * its size as the bound is set), the handle's next operation calls `checkpoint()` first, which
 * writes a SNAPSHOT (oplog_snapshot) and sets the new base (again, oplog_ring). limit 0: no
 * bound. */
static PyObject *N_oplog_ring(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "oplog_ring(limit, checkpoint, base)");
        return NULL;
    }
    Oplog *L = n->oplog;
    if (L == NULL) {
        PyErr_SetString(PyExc_ValueError, "oplog_ring: this handle does not record");
        return NULL;
    }
    uint64_t limit = PyLong_AsUnsignedLongLong(args[0]);
    uint64_t base = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return NULL;
    PyObject *f = args[1] == Py_None ? NULL : args[1];
    if (f && !PyCallable_Check(f)) {
        PyErr_SetString(PyExc_TypeError, "oplog_ring: checkpoint is not callable");
        return NULL;
    }
    Py_XINCREF(f);
    Py_XSETREF(L->ckpt, f);
    L->limit = limit;
    L->base = base;
    L->due = 0;
    Py_RETURN_NONE;
}

/* oplog_punch(end): free the log file's bytes before `end` (fallocate PUNCH_HOLE, KEEP_SIZE:
 * the file's size and every offset stay, so every process's O_APPEND descriptor stays valid;
 * the range reads as zeros, and a reader skips it). False where the file system cannot. */
static PyObject *N_oplog_punch(Native *n, PyObject *arg) {
    Oplog *L = n->oplog;
    long long end = PyLong_AsLongLong(arg);
    if (end == -1 && PyErr_Occurred()) return NULL;
    if (L == NULL || end <= 0) Py_RETURN_FALSE;
    if (fallocate(L->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, (off_t)end) != 0)
        Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}
