/* Slot provenance (docs/POOL.md "Slot provenance"; FORMAT.md section 14): for the sampled
 * sequences, the request, position and token that each of their slots was handed out to write,
 * kept in the segment beside the block records, and the checks that a slot a sequence reads
 * holds what its own tokens wrote, or what its prefix hit published. Part of _native.c.
 *
 * Written once, here, by the core's own operations: allocate and append record the slots they
 * hand out after their transaction commits (a record is not journaled: a rollback or a crash
 * before it leaves the older record, whose generation is not its block's, which no check
 * trusts); a copy-on-write copies the records of the slots it copies. A record counts while its
 * generation is its block's: a block handed out again (stamp: the generation moves on) holds no
 * provenance until its new holder's tokens are recorded, so an unsampled sequence's slots are
 * never checked against an earlier holder's records. Where the core reaches the pool's data (a
 * CPU pool), a publication also hashes each recorded slot's K/V into its record (kv_hash), once
 * the engine has stored it (mark_computed comes after the forward that wrote it). Checked at a
 * prefix hit (the hit's tokens and positions against the records of the blocks it maps, and
 * each slot's K/V against its hash: reported at the hit) and by `provenance_check` (a handle's
 * live sequences, each slot it reads against the block record's token there, its position and
 * its hash).
 *
 * Where the K/V is a CUDA pool's (the core does not map it), the hashes are taken and checked
 * by the core's device checks (devchecks.c, kernels/checks.py SLOTS: the same sum per slot,
 * on the GPU): a publication queues the hashing of its recorded slots before its commit, in
 * stream order after the forward that wrote them (the hashes land in the records when the
 * answer is applied, devanswers.c); a hit and the sweep queue the check of the hashed slots
 * they read, whose mismatch is reported at the next settle, naming the reader as here. */

/* The record of slot `off` of block b. */
static inline uint8_t *prov_rec(Native *n, int64_t b, int64_t off) {
    return n->seg + n->off_prov + n->prov_records +
           ((size_t)b * (size_t)n->bs + (size_t)off) * PROVENANCE;
}

/* Block b's generation whose slots hold records (0: none): the one word a check reads of a
 * block none of whose slots is recorded (the section's first array). */
static inline uint32_t *prov_recorded(Native *n, int64_t b) {
    return (uint32_t *)(n->seg + n->off_prov) + b;
}

/* Whether any slot of block b holds a record of its generation `gen`. */
static inline int prov_any(Native *n, int64_t b, uint32_t gen) {
    return __atomic_load_n(prov_recorded(n, b), __ATOMIC_ACQUIRE) == gen;
}

/* A slot's short K/V hash (never 0) from its raw sum: the digest's sum (kvdata.c) over the
 * slot's elements, every layer, K and V, one row after the other (a CPU pool's taken here, a
 * CUDA pool's by the check kernel's SLOTS mode). */
static inline uint32_t prov_hash_of(uint64_t sum) { return (uint32_t)(fmix64(sum) >> 32) | 1u; }

/* The short hash of slot `off` of block b's K/V; a CPU pool's (n->kv) only. */
static uint32_t prov_kv_hash(Native *n, int64_t b, int64_t off) {
    int64_t m = n->kv_slot_bytes / n->kv_esize;
    uint64_t sum = 0, jm = DIGEST_ADD;
    for (int64_t r = 0; r < n->kv_rows; r++)
        sum = digest_row(n, kv_row(n, r, b) + (size_t)off * (size_t)n->kv_slot_bytes, m, &jm, sum);
    return prov_hash_of(sum);
}

/* The short K/V hashes of slots [0, m) of block b into out[] (prov_kv_hash's values; a CPU
 * pool's): the sums the digest's pass of this operation kept (kvdata.c kv_sums_keep: a
 * publication stamps, a hit verifies, the same blocks' digests first), else, for a pool whose
 * slots slot_sums takes in one pass per row, from that pass (a publication and a prefix hit
 * hash every slot of their blocks: called per slot and per row, the call, the width's switch
 * and the chunk loop cost more than the slot's 8 elements); any other, slot by slot. */
static void prov_kv_hashes(Native *n, int64_t b, int64_t m, uint32_t *out) {
#if defined(__SSE2__)
    if (slot_sums_fast(n)) {
        uint64_t sum[4096];
        if (!kv_sums_take(n, (int32_t)b, m, sum)) slot_sums(n, b, m, sum, NULL);
        for (int64_t off = 0; off < m; off++) out[off] = prov_hash_of(sum[off]);
        return;
    }
#endif
    for (int64_t off = 0; off < m; off++) out[off] = prov_kv_hash(n, b, off);
}

static inline int prov_on_device(Native *n) { return n->kv == NULL && n->dev != NULL; }

/* A publication's blocks ids[0, k), after its commit: each recorded slot's K/V hashed into its
 * record (a CPU pool's; a CUDA pool's are hashed by prov_stamp_later's check). */
static void prov_published(Native *n, const int32_t *ids, int64_t k) {
    if (n->kv == NULL) return;
    /* (the records' lines asked for together: they were written when the slots were handed
     * out, seldom still in the cache) */
    for (int64_t i = 0, lines = 0; i < k; i++)
        for (size_t o = 0; o < (size_t)n->bs * PROVENANCE && lines < 256; o += 64, lines++)
            __builtin_prefetch(prov_rec(n, ids[i], 0) + o);
    /* and their K/V, which the hashes read (a load that misses was most of the hashes' time),
     * unless the digest probe's pass just took their sums (kv_sums_keep): then the hashes
     * read no K/V */
    if (n->n_kvs == 0) kv_prefetch(n, ids, k, (size_t)(n->bs * n->kv_slot_bytes));
    uint32_t h[4096]; /* (block_size <= 4096: N_init) */
    for (int64_t i = 0; i < k; i++) {
        uint32_t gen = U4(blk(n, ids[i]) + BF_GENERATION);
        if (!prov_any(n, ids[i], gen)) continue;
        prov_kv_hashes(n, ids[i], n->bs, h);
        for (int64_t off = 0; off < n->bs; off++) {
            uint8_t *p = prov_rec(n, ids[i], off);
            if (__atomic_load_n((uint32_t *)(p + PV_GENERATION), __ATOMIC_ACQUIRE) == gen)
                U4(p + PV_KV_HASH) = h[off];
        }
    }
    n->n_kvs = 0; /* (the digest pass's sums used: kvdata.c kv_sums_keep) */
}

/* A publication's blocks ids[0, k) of a pool whose K/V the core does not map, before its
 * commit: the K/V of the recorded slots of those that hold any, hashed by the device checks
 * (applied into the records with the answer, devanswers.c). OK, UNHANDLED or ERROR as
 * dev_check (the caller rolls its transaction back). */
static int prov_stamp_later(Native *n, const int32_t *ids, int64_t k) {
    if (n->probes & P_DIGEST) return OK; /* (stamp_digests' launch hashes them: DK_STAMP_PROV) */
    int32_t some[CHUNK];
    int64_t m = 0;
    for (int64_t i = 0; i < k; i++)
        if (prov_any(n, ids[i], U4(blk(n, ids[i]) + BF_GENERATION))) some[m++] = ids[i];
    return dev_publish_check(n, DK_PROV_STAMP, some, m);
}

static inline int prov_sampled(Native *n, uint64_t seq_id) {
    /* (every sequence, as under `kvscope run`: no division on a decode step's path) */
    if (n->prov_every == 1) return 1;
    return n->prov_every > 0 && seq_id % (uint64_t)n->prov_every == 0;
}

/* The request's 32 bytes as the record's short hash (FNV-1a, folded to 32 bits). A zero byte
 * only multiplies the hash by the prime, so the zeros that pad a short id end it as one
 * multiply by the prime's power (a decode step's append hashes its request's id, not 32
 * bytes one after the other). */
#define FNV_PRIME 1099511628211ull
static uint32_t prov_request_hash(const char *request) {
    int end = REQUEST_BYTES; /* past the last byte that is not zero */
    while (end >= 8) {
        uint64_t w;
        memcpy(&w, request + end - 8, 8);
        if (w != 0) break;
        end -= 8;
    }
    while (end > 0 && request[end - 1] == 0) end--;
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < end; i++) h = (h ^ (uint8_t)request[i]) * FNV_PRIME;
    uint64_t pow = 1, base = FNV_PRIME; /* FNV_PRIME ** (the zeros after `end`), mod 2 ** 64 */
    for (int e = REQUEST_BYTES - end; e; e >>= 1, base *= base)
        if (e & 1) pow *= base;
    h *= pow;
    return (uint32_t)(h ^ (h >> 32));
}

/* The request's short hash for sequence seq_id (a sequence's request never changes, and a
 * decode step's append writes for the same sequences step after step: kept by sequence id,
 * taken again only where the cache holds another's). */
static uint32_t prov_rh_slow(Native *n, uint64_t seq_id, const char *request) {
    uint32_t rh = prov_request_hash(request);
    if (n->prov_rh == NULL) n->prov_rh = PyMem_Calloc(PROV_RH_CACHE, sizeof(ProvHash));
    if (n->prov_rh != NULL) {
        ProvHash *c = &n->prov_rh[seq_id % PROV_RH_CACHE];
        c->seq_id_1 = seq_id + 1;
        c->hash = rh;
    }
    return rh;
}

static inline uint32_t prov_rh(Native *n, uint64_t seq_id, const char *request) {
    const ProvHash *c = n->prov_rh ? &n->prov_rh[seq_id % PROV_RH_CACHE] : NULL;
    if (__builtin_expect(c != NULL && c->seq_id_1 == seq_id + 1, 1)) return c->hash;
    return prov_rh_slow(n, seq_id, request);
}

/* Slot `off` of block b (generation gen) recorded as written by seq_id (request hash rh),
 * token tok at logical position pos. The generation is stored last: a reader racing the write
 * sees the record's old generation. */
static inline void prov_record(Native *n, int32_t b, uint32_t gen, int64_t off, uint64_t seq_id,
                               uint32_t rh, int64_t pos, int32_t tok) {
    uint8_t *p = prov_rec(n, b, off);
    U4(p + PV_GENERATION) = 0;
    U8(p + PV_SEQ_ID) = seq_id;
    I4(p + PV_POSITION) = (int32_t)pos;
    I4(p + PV_TOKEN) = tok;
    U4(p + PV_REQUEST_HASH) = rh;
    U4(p + PV_KV_HASH) = 0;
    __atomic_store_n((uint32_t *)(p + PV_GENERATION), gen, __ATOMIC_RELEASE);
}

/* Block b's `recorded` word, after its records: gen. Stored only where it is not gen already
 * (a decode step's append records the next slot of a block that holds records of its
 * generation: its line is not written again, which other processes reading the section would
 * have to fetch again). */
static inline void prov_mark(Native *n, int32_t b, uint32_t gen) {
    uint32_t *w = prov_recorded(n, b);
    if (__atomic_load_n(w, __ATOMIC_RELAXED) != gen) __atomic_store_n(w, gen, __ATOMIC_RELEASE);
}

static void prov_write(Native *n, uint64_t seq_id, const char *request, const int32_t *ids,
                       int64_t first, int64_t pos0, const int32_t *toks, int64_t k) {
    if (k <= 0) return;
    uint32_t rh = prov_rh(n, seq_id, request);
    /* (the block and slot stepped along: no division per slot) */
    int64_t bi = first / n->bs, off = first % n->bs;
    int32_t b = ids[bi];
    uint32_t gen = U4(blk(n, b) + BF_GENERATION);
    for (int64_t i = 0; i < k; i++, off++) {
        if (off == n->bs) {
            prov_mark(n, b, gen);
            off = 0;
            b = ids[++bi];
            gen = U4(blk(n, b) + BF_GENERATION);
        }
        prov_record(n, b, gen, off, seq_id, rh, pos0 + i, toks[i]);
    }
    prov_mark(n, b, gen);
}

/* A copy-on-write's copy: the records of slots [0, m) of src as dst's (dst's generation). */
static void prov_copy(Native *n, int32_t src, int32_t dst, int64_t m) {
    uint32_t sg = U4(blk(n, src) + BF_GENERATION), dg = U4(blk(n, dst) + BF_GENERATION);
    if (!prov_any(n, src, sg)) return;
    for (int64_t off = 0; off < m; off++) {
        uint8_t *s = prov_rec(n, src, off), *d = prov_rec(n, dst, off);
        U4(d + PV_GENERATION) = 0;
        if (__atomic_load_n((uint32_t *)(s + PV_GENERATION), __ATOMIC_ACQUIRE) != sg) continue;
        memcpy(d, s, PROVENANCE);
        U4(d + PV_GENERATION) = 0;
        U4(d + PV_KV_HASH) = 0; /* (the engine copies the K/V after the append) */
        __atomic_store_n((uint32_t *)(d + PV_GENERATION), dg, __ATOMIC_RELEASE);
        __atomic_store_n(prov_recorded(n, dst), dg, __ATOMIC_RELEASE);
    }
}

/* The request of a live sequence whose id is seq_id (its record's 32 bytes) into out, or
 * nothing (out[0] = 0): the writer a finding names. */
static void prov_writer(Native *n, uint64_t seq_id, char *out) {
    out[0] = 0;
    for (int64_t s = 0; s < n->max_seqs; s++) {
        const uint8_t *r = seqrec(n, s);
        if (r[SF_STATE] != S_EMPTY && U8(r + SF_SEQ_ID) == seq_id) {
            memcpy(out, r + SF_REQUEST, REQUEST_BYTES);
            return;
        }
    }
}

/* The words of a foreign_slot finding: slot `off` of block b, read by `reader` (32 bytes) as
 * position `pos` (token `tok`), whose record `p` says another position or token wrote it, or
 * (`now` != the record's hash) whose K/V changed since its publication; `where` the check. A
 * new reference, or NULL with an exception set. */
static PyObject *prov_message(Native *n, const char *where, int64_t b, int64_t off,
                              const char *reader, int64_t pos, int32_t tok, const uint8_t *p,
                              uint32_t now) {
    uint64_t writer = U8(p + PV_SEQ_ID);
    uint32_t h = U4(p + PV_KV_HASH);
    char wreq[REQUEST_BYTES + 1] = {0}, rreq[REQUEST_BYTES + 1] = {0};
    prov_writer(n, writer, wreq);
    memcpy(rreq, reader, REQUEST_BYTES);
    if (I4(p + PV_TOKEN) == tok && I4(p + PV_POSITION) == pos)
        return PyUnicode_FromFormat(
            "%s: slot %lld of block %lld, read by request '%s' as position %lld (token %d), "
            "was written since its publication: K/V hash %08x, recorded %08x (sequence "
            "%llu%s%s%s)",
            where, (long long)off, (long long)b, rreq, (long long)pos, (int)tok, (unsigned)now,
            (unsigned)h, (unsigned long long)writer, wreq[0] ? " (request '" : "",
            wreq[0] ? wreq : "", wreq[0] ? "')" : "");
    return PyUnicode_FromFormat(
        "%s: slot %lld of block %lld, read by request '%s' as position %lld (token %d), "
        "holds K/V written for position %d (token %d) by sequence %llu%s%s%s",
        where, (long long)off, (long long)b, rreq, (long long)pos, (int)tok,
        (int)I4(p + PV_POSITION), (int)I4(p + PV_TOKEN), (unsigned long long)writer,
        wreq[0] ? " (request '" : "", wreq[0] ? wreq : "", wreq[0] ? "')" : "");
}

/* Slots [0, m) of block b, read at logical positions pos0.. with tokens want[]: the first slot
 * whose record (one of its block's generation) says another position or token wrote it, or
 * (a CPU pool's) whose K/V no longer hashes as at its publication, is reported as foreign_slot
 * (about block b, naming `reader`, the request that reads it, and `where`); 1 when one was, 0
 * when none, ERROR with an exception set. (A CUDA pool's hashes: prov_check_later.) */
static int prov_check_block(Native *n, int32_t b, int64_t pos0, const int32_t *want, int64_t m,
                            const char *reader, const char *where) {
    uint32_t gen = U4(blk(n, b) + BF_GENERATION);
    if (!prov_any(n, b, gen)) return 0;
    /* (a CPU pool's: the K/V hashes of the block's slots taken together, prov_kv_hashes) */
    uint32_t kvh[4096];
    int hashed = 0;
    for (int64_t off = 0; off < m; off++) {
        const uint8_t *p = prov_rec(n, b, off);
        if (__atomic_load_n((const uint32_t *)(p + PV_GENERATION), __ATOMIC_ACQUIRE) != gen) continue;
        int32_t tok = I4(p + PV_TOKEN), pos = I4(p + PV_POSITION);
        uint32_t h = U4(p + PV_KV_HASH), now = h;
        if (h && n->kv) {
            if (!hashed) prov_kv_hashes(n, b, m, kvh);
            hashed = 1;
            now = kvh[off];
        }
        if (tok == want[off] && pos == pos0 + off && now == h) continue;
        Seen s;
        seen_of(n, b, &s);
        /* (the finding names the reading request, this process's: its pid, not the
         * publisher's the block record holds) */
        memcpy(s.request, reader, REQUEST_BYTES);
        s.owner_pid = n->pid;
        PyObject *msg = prov_message(n, where, b, off, reader, pos0 + off, want[off], p, now);
        if (msg == NULL) return ERROR;
        int rc = finding_report(n, FK_FOREIGN_SLOT, &s, msg);
        Py_DECREF(msg);
        return rc == OK ? 1 : ERROR;
    }
    return 0;
}

/* Whether block b holds a recorded slot of its generation whose K/V was hashed. */
static int prov_hashed(Native *n, int32_t b) {
    uint32_t gen = U4(blk(n, b) + BF_GENERATION);
    if (!prov_any(n, b, gen)) return 0;
    for (int64_t off = 0; off < n->bs; off++) {
        const uint8_t *p = prov_rec(n, b, off);
        if (__atomic_load_n((const uint32_t *)(p + PV_GENERATION), __ATOMIC_ACQUIRE) == gen &&
            U4(p + PV_KV_HASH) != 0)
            return 1;
    }
    return 0;
}

/* On a pool whose K/V the core does not map: the hashed slots of blocks ids[0, k), block i read
 * by the request at readers + i * stride (32 bytes; stride 0: one request reads them all),
 * checked against their K/V by the device checks, `where` 0 (a prefix hit) or 1 (the sweep); a
 * mismatch is reported when the answer is applied (devanswers.c). OK, UNHANDLED or ERROR as
 * dev_check. */
static int prov_check_later(Native *n, const int32_t *ids, const char *readers, int64_t stride,
                            int64_t k, int where) {
    int32_t some[256];
    char who[256 * REQUEST_BYTES];
    int64_t m = 0;
    for (int64_t i = 0; i <= k; i++) {
        if (m == 256 || (i == k && m)) {
            int rc = dev_check(n, DK_PROV_CHECK, some, m, who, where, NULL);
            if (rc != OK) return rc;
            m = 0;
        }
        if (i == k || !prov_hashed(n, ids[i])) continue;
        some[m] = ids[i];
        memcpy(who + m * REQUEST_BYTES, readers + i * stride, REQUEST_BYTES);
        m++;
    }
    return OK;
}

static int prov_hits_later(Native *n, const int32_t *table, int64_t hits, const char *request) {
    return prov_check_later(n, table, request, 0, hits, 0);
}

static int prov_check_hits(Native *n, const int32_t *table, int64_t hits, const int32_t *toks,
                           const char *request) {
    if (n->kv != NULL) kv_prefetch(n, table, hits, (size_t)(n->bs * n->kv_slot_bytes));
    int rc = OK;
    for (int64_t j = 0; j < hits && rc == OK; j++)
        if (prov_check_block(n, table[j], j * n->bs, toks + j * n->bs, n->bs, request,
                             "a prefix hit") == ERROR)
            rc = ERROR;
    n->n_kvs = 0; /* (the digest pass's sums used: kvdata.c kv_sums_keep) */
    return rc;
}

/* The foreign-slot fault (faults.py), at an append that recorded its token `tok` at position
 * `pos` for seq_id (in `slot`): the same write also lands in the slot at that offset of a
 * published block the sequence does not hold, one whose record says another token wrote it, as
 * a late store of this request's K/V under another's key does. Acts at the first opportunity
 * where such a block exists: the lowest-numbered one another live sequence holds, else the
 * lowest-numbered cached one. */
static void prov_foreign_fault(Native *n, int64_t slot, uint64_t seq_id, int64_t pos, int32_t tok) {
    if (!fault_opportunity(n, FT_FOREIGN_SLOT)) return;
    const uint8_t *s = seqrec(n, slot);
    const int32_t *tbl = (const int32_t *)(s + SF_TABLE);
    int64_t held = U4(s + SF_NUM_BLOCKS), off = pos % n->bs;
    /* (a block another live sequence holds first, whose reader is there to find it; then a
     * cached one, which a later prefix hit reads) */
    for (int32_t i = 0; i < 2 * n->nb; i++) {
        int32_t b = i % n->nb;
        const uint8_t *r = blk(n, b);
        if (r[BF_INDEXED] != 1 || r[BF_STATE] != (i < n->nb ? B_ALLOCATED : B_CACHED)) continue;
        const uint8_t *p = prov_rec(n, b, off);
        if (!prov_any(n, b, U4(r + BF_GENERATION)) ||
            U4(p + PV_GENERATION) != U4(r + BF_GENERATION) || I4(p + PV_TOKEN) == tok)
            continue;
        int mine = 0;
        for (int64_t j = 0; j < held && !mine; j++) mine = tbl[j] == b;
        if (mine) continue;
        prov_write(n, seq_id, (const char *)(s + SF_REQUEST), &b, off, pos, &tok, 1);
        fault_fired(n, FT_FOREIGN_SLOT);
        return;
    }
}

/* append's chunk, after its commit (or its decode step's write): the k tokens written from
 * relative position `first` of ids[] (logical position pos0 on), recorded where the sequence
 * in `slot` is sampled; a copy-on-write (cow_src >= 0) copies the records of the first
 * `first` slots to ids[0] first. */
static void prov_after_append(Native *n, int64_t slot, const int32_t *ids, int64_t first,
                              int64_t pos0, const int32_t *toks, int64_t k, int32_t cow_src) {
    const uint8_t *s = seqrec(n, slot);
    uint64_t seq_id = U8(s + SF_SEQ_ID);
    /* (the decode step's path laid out first, the rest out of its way: each cache line of
     * code an append runs through is one the interpreter's own loop can lose) */
    if (__builtin_expect(cow_src >= 0, 0)) prov_copy(n, cow_src, ids[0], first);
    if (!prov_sampled(n, seq_id)) return;
    if (__builtin_expect(k == 1 && first < n->bs, 1)) {
        /* (a decode step's one token, in the block that holds it: prov_write's work without
         * its call, division and loop: measured with callgrind over 6,400 such appends, every
         * probe on, 43 fewer instructions an append, about 50 left for slot provenance) */
        int32_t b = ids[0];
        uint32_t gen = U4(blk(n, b) + BF_GENERATION);
        prov_record(n, b, gen, first, seq_id, prov_rh(n, seq_id, (const char *)(s + SF_REQUEST)),
                    pos0, toks[0]);
        prov_mark(n, b, gen);
        /* (the line of the record a later step's append writes, asked for now: the records
         * were last written when the block was last handed out, seldom still in the cache,
         * and a store that misses stalls the append that makes it; by the next step's it has
         * arrived) */
        if (first + 64 / PROVENANCE < n->bs)
            __builtin_prefetch(prov_rec(n, b, first + 64 / PROVENANCE), 1, 3);
    } else {
        prov_write(n, seq_id, (const char *)(s + SF_REQUEST), ids, first, pos0, toks, k);
    }
    if (__builtin_expect(faults_armed(n), 0)) prov_foreign_fault(n, slot, seq_id, pos0 + k - 1, toks[k - 1]);
}

/* provenance(every): this handle records one sequence in `every` (0: none) and checks hits. */
static PyObject *N_provenance(Native *n, PyObject *arg) {
    int64_t every = PyLong_AsLongLong(arg);
    if (every == -1 && PyErr_Occurred()) return NULL;
    if (every < 0) {
        pool_error("provenance sample %lld: expected 0 (off) or N >= 1 (one sequence in N)",
                   (long long)every);
        return NULL;
    }
    n->prov_every = every;
    Py_RETURN_NONE;
}

/* provenance_check(pool, rows) -> int: the sweep. Each of `rows` (this handle's live
 * Sequences; None: all of them), each slot it reads, against the record there: a record of its
 * block's generation must say the token the block record holds at that slot, at the position
 * the sequence reads it as. The blocks with a foreign slot, each reported once
 * (foreign_slot); their count. A handle's own sequences change only in its own operations,
 * which the gate keeps out meanwhile; a block they hold keeps its generation while held. */
static PyObject *N_provenance_check(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "provenance_check(pool, rows)");
        return NULL;
    }
    GATE(n, args[0]);
    n->n_kvs = 0; /* (the sweep hashes the K/V as it is now, not as an operation's pass saw it) */
    PyObject *src = args[1] == Py_None ? PyDict_Values(n->seqs) : Py_NewRef(args[1]);
    if (src == NULL) return NULL;
    PyObject *rows = PySequence_Fast(src, "rows: expected a sequence of Sequences");
    Py_DECREF(src);
    if (rows == NULL) return NULL;
    int64_t bad = 0, later = 0, cap = 0;
    Py_ssize_t found0 = n->found ? PyList_GET_SIZE(n->found) : 0;
    /* (a CUDA pool's: the blocks whose hashed slots the device checks, and their readers) */
    int32_t *ids = NULL;
    char *readers = NULL;
    int device = prov_on_device(n);
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(rows); i++) {
        int64_t slot = own_slot(n, PySequence_Fast_GET_ITEM(rows, i));
        if (slot < 0) goto fail;
        const uint8_t *s = seqrec(n, slot);
        const int32_t *tbl = (const int32_t *)(s + SF_TABLE);
        int64_t ntok = (int64_t)U8(s + SF_NUM_TOKENS), held = U4(s + SF_NUM_BLOCKS);
        char req[REQUEST_BYTES];
        memcpy(req, s + SF_REQUEST, REQUEST_BYTES);
        for (int64_t j = 0; j < held && j * n->bs < ntok; j++) {
            int64_t m = ntok - j * n->bs < n->bs ? ntok - j * n->bs : n->bs;
            int32_t b = tbl[j];
            if (b < 0 || b >= n->nb) continue;
            int rc = prov_check_block(n, b, j * n->bs, (const int32_t *)(blk(n, b) + BF_TOKENS),
                                      m, req, "provenance sweep");
            if (rc == ERROR) goto fail;
            bad += rc;
            if (!device || rc) continue;
            if (later == cap) {
                cap = cap ? 2 * cap : 64;
                int32_t *ni = PyMem_Realloc(ids, (size_t)cap * sizeof *ids);
                if (ni != NULL) ids = ni;
                char *nr = ni ? PyMem_Realloc(readers, (size_t)cap * REQUEST_BYTES) : NULL;
                if (nr == NULL) {
                    PyErr_NoMemory();
                    goto fail;
                }
                readers = nr;
            }
            ids[later] = b;
            memcpy(readers + later * REQUEST_BYTES, req, REQUEST_BYTES);
            later++;
        }
    }
    if (later) {
        /* (the caller, pool.check_provenance, holds the handle's op mutex: dev_check's) */
        int mh = n->mutex_held;
        n->mutex_held = 1;
        int rc = prov_check_later(n, ids, readers, REQUEST_BYTES, later, 1);
        n->mutex_held = mh;
        if (rc != OK) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "provenance_check: the K/V check not queued");
            goto fail;
        }
    }
    PyMem_Free(ids);
    PyMem_Free(readers);
    Py_DECREF(rows);
    /* what it found, in the operation log (a replay sweeps there again) */
    if (bad && n->oplog) oplog_found_report(n, found0, "");
    return PyLong_FromLongLong(bad);
fail:
    PyMem_Free(ids);
    PyMem_Free(readers);
    Py_DECREF(rows);
    return NULL;
}
