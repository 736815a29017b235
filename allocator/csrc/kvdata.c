/* Guard mode and the digest probe on the KV data (integrity.py, kernels/guard.py and
 * kernels/digest.py define what is checked): the canary of a freed block's guard slot, the NaN
 * poison of its token slots, the poison checked before a block is reused, a request's unwritten
 * slots at its finish, and the digest of a published block.
 *
 * Where the data is this process's memory (a CPU pool: the shared data file, mapped) the core
 * reads and writes its bytes itself, and a problem found is a finding the operation reports
 * when it commits (finding_later). Where it is not (a CUDA pool), each of these is one check of
 * every block of the operation at once, queued in the core's own checks (`kv_later`,
 * devchecks.c: one launch of the check kernel), whose answers the core reads and applies at
 * the next settle (devanswers.c): digests into the records, findings into the findings ring.
 * Nothing here calls into Python. Part of _native.c. */

/* kernels/digest.py DIGEST_MUL, DIGEST_ADD */
#define DIGEST_MUL 0x5851F42D4C957F2Dull
#define DIGEST_ADD 0x14057B7EF767814Full
/* integrity.GENERATION_MASK: the low half of a kv_digest word is the generation */
#define GEN_MASK 0xFFFFFFFFull

/* Whether block record r holds a digest of its generation, published (the blocks a digest check
 * verifies: digests_intact, a prefix hit's one launch devchecks.c dev_hit_check and its answer). */
static inline int digest_current(Native *n, const uint8_t *r) {
    uint64_t w = U8(r + n->off_kv_digest);
    return r[BF_INDEXED] == 1 && w != 0 && (w & GEN_MASK) == U4(r + BF_GENERATION);
}

/* Row r (layer * 2 + K/V) of block b: its first byte. [layers, 2, blocks, slots, heads, dim] */
static inline uint8_t *kv_row(Native *n, int64_t r, int64_t b) {
    return n->kv + (size_t)r * n->kv_row_stride + (size_t)b * n->kv_block_stride;
}

/* Whether the `len` bytes at p are `pattern` (8 bytes, an element's bits repeated: byte o of a
 * row is byte o % 8 of it) over and over: guard mode's checks of its poison and canaries. 64
 * bytes at a time with SSE2 (their differences or-ed together, one test per 64), then 8, then
 * one by one. Measured with callgrind on the serving loop (bench_serving_loop, 600 steps, every
 * probe on, the core's entry points only): the 8-bytes-at-a-time compare and an element-by-
 * element fill took about 135 instructions per pool operation; these, about 35. */
static int bytes_are(const uint8_t *p, size_t len, uint64_t pattern) {
    size_t o = 0;
#if defined(__SSE2__)
    const __m128i pat = _mm_set1_epi64x((long long)pattern), zero = _mm_setzero_si128();
    for (; o + 64 <= len; o += 64) {
        __m128i d = _mm_or_si128(
            _mm_or_si128(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(p + o)), pat),
                         _mm_xor_si128(_mm_loadu_si128((const __m128i *)(p + o + 16)), pat)),
            _mm_or_si128(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(p + o + 32)), pat),
                         _mm_xor_si128(_mm_loadu_si128((const __m128i *)(p + o + 48)), pat)));
        if (_mm_movemask_epi8(_mm_cmpeq_epi8(d, zero)) != 0xFFFF) return 0;
    }
#endif
    for (; o + 8 <= len; o += 8) {
        uint64_t word;
        memcpy(&word, p + o, 8);
        if (word != pattern) return 0;
    }
    for (; o < len; o++)
        if (p[o] != (uint8_t)(pattern >> (8 * (o % 8)))) return 0;
    return 1;
}

/* `pattern` (as bytes_are's) over the `len` bytes at p. */
static void bytes_fill(uint8_t *p, size_t len, uint64_t pattern) {
    size_t o = 0;
#if defined(__SSE2__)
    const __m128i pat = _mm_set1_epi64x((long long)pattern);
    for (; o + 16 <= len; o += 16) _mm_storeu_si128((__m128i *)(p + o), pat);
#endif
    for (; o + 8 <= len; o += 8) memcpy(p + o, &pattern, 8);
    for (; o < len; o++) p[o] = (uint8_t)(pattern >> (8 * (o % 8)));
}

/* The loops over a row's elements, one per element width (the width is the cache's dtype's:
 * chosen once per row, so the compiler can vectorize each). An element is read as
 * kernels/digest.py int_view reads it: the bits as the integer of its width (1 byte unsigned,
 * wider ones sign-extended). */
#define KV_LOOPS(W, T, U)                                                                        \
    /* sum of element e * coef(j + e), coef(j) = (j * MUL + ADD) | 1; *jm: j * MUL + ADD */     \
    __attribute__((unused)) static uint64_t digest_row##W(const uint8_t *p_, int64_t m,          \
                                                         uint64_t *jm_, uint64_t sum) {        \
        const T *p = (const T *)p_;                                                             \
        uint64_t jm = *jm_;                                                                     \
        for (int64_t e = 0; e < m; e++, jm += DIGEST_MUL) sum += (uint64_t)(int64_t)p[e] * (jm | 1); \
        *jm_ = jm;                                                                              \
        return sum;                                                                             \
    }                                                                                           \
    /* 1 when every element's bits are v (bytes_are: v repeated) */                            \
    static int all_bits##W(const uint8_t *p, int64_t m, uint64_t v) {                          \
        return bytes_are(p, (size_t)m * W, (uint64_t)(U)v * (UINT64_MAX / (uint64_t)(U)~(U)0)); \
    }                                                                                           \
    static void fill_bits##W(uint8_t *p, int64_t m, uint64_t v) {                              \
        bytes_fill(p, (size_t)m * W, (uint64_t)(U)v * (UINT64_MAX / (uint64_t)(U)~(U)0));       \
    }                                                                                           \
    /* how many elements' bits are not v */                                                    \
    static int64_t count_not##W(const uint8_t *p_, int64_t m, uint64_t v) {                    \
        const U *p = (const U *)p_;                                                             \
        U want = (U)v;                                                                          \
        int64_t c = 0;                                                                          \
        for (int64_t e = 0; e < m; e++) c += p[e] != want;                                      \
        return c;                                                                               \
    }
KV_LOOPS(1, uint8_t, uint8_t)
KV_LOOPS(2, int16_t, uint16_t)
KV_LOOPS(4, int32_t, uint32_t)
KV_LOOPS(8, int64_t, uint64_t)

/* digest_row2 with the sums rearranged: MUL is odd, so the parity of jm + e * MUL is that of
 * jm + e, and x | 1 is x + 1 where x is even; over a row of m elements p[e] from *jm, mod 2^64,
 *     sum of p[e] * ((jm + e * MUL) | 1) = jm * S + MUL * (sum of e * p[e]) + (sum of the p[e]
 *     where jm + e is even),
 * S the sum of the p[e]. In chunks of DIGEST_CHUNK elements, whose sums of 16-bit elements fit
 * in 32 bits (SSE2's multiply-adds of 8 elements at a time, the chunk's last few one by one),
 * added into the 64-bit sums with the chunk's first index. The same value as
 * digest_row2, bit for bit (tests/test_core_guard.py: the core's digests against kernels/digest.py
 * on rows of 1 to 432 elements). */
#define DIGEST_CHUNK 128
static uint64_t digest_row2_sums(const uint8_t *p_, int64_t m, uint64_t *jm_, uint64_t sum) {
    const int16_t *p = (const int16_t *)p_;
    uint64_t jm = *jm_, s1 = 0, se = 0, so = 0; /* sum of e * p[e]; of the even e's, odd e's */
    for (int64_t c0 = 0; c0 < m; c0 += DIGEST_CHUNK) {
        int64_t len = m - c0 < DIGEST_CHUNK ? m - c0 : DIGEST_CHUNK, i = 0;
#ifdef __SSE2__
        /* the chunk's groups of 8; per lane at most 16 * 2 * 127 * 32768 in a1: below 2^31 */
        const __m128i even = _mm_set_epi16(0, 1, 0, 1, 0, 1, 0, 1);
        const __m128i odd = _mm_set_epi16(1, 0, 1, 0, 1, 0, 1, 0);
        __m128i a1 = _mm_setzero_si128(), ae = a1, ao = a1;
        __m128i idx = _mm_set_epi16(7, 6, 5, 4, 3, 2, 1, 0), step = _mm_set1_epi16(8);
        for (; i + 8 <= len; i += 8) {
            __m128i q = _mm_loadu_si128((const __m128i *)(p + c0 + i));
            a1 = _mm_add_epi32(a1, _mm_madd_epi16(q, idx));
            ae = _mm_add_epi32(ae, _mm_madd_epi16(q, even));
            ao = _mm_add_epi32(ao, _mm_madd_epi16(q, odd));
            idx = _mm_add_epi16(idx, step);
        }
        if (i) {
            int32_t v1[4], ve[4], vo[4];
            _mm_storeu_si128((__m128i *)v1, a1);
            _mm_storeu_si128((__m128i *)ve, ae);
            _mm_storeu_si128((__m128i *)vo, ao);
            int64_t t1 = (int64_t)v1[0] + v1[1] + v1[2] + v1[3];
            int64_t te = (int64_t)ve[0] + ve[1] + ve[2] + ve[3];
            int64_t to = (int64_t)vo[0] + vo[1] + vo[2] + vo[3];
            /* (c0 is even: the chunk's even elements are the row's) */
            s1 += (uint64_t)c0 * (uint64_t)(te + to) + (uint64_t)t1;
            se += (uint64_t)te;
            so += (uint64_t)to;
        }
#endif
        for (; i < len; i++) {
            int64_t c = c0 + i;
            uint64_t v = (uint64_t)(int64_t)p[c];
            if (c & 1)
                so += v;
            else
                se += v;
            s1 += (uint64_t)c * v;
        }
    }
    *jm_ = jm + (uint64_t)m * DIGEST_MUL;
    return sum + jm * (se + so) + DIGEST_MUL * s1 + ((jm & 1) ? so : se);
}

static uint64_t digest_row(Native *n, const uint8_t *p, int64_t m, uint64_t *jm, uint64_t sum) {
    switch (n->kv_esize) {
    case 1: return digest_row1(p, m, jm, sum);
    case 2: return digest_row2_sums(p, m, jm, sum);
    case 4: return digest_row4(p, m, jm, sum);
    default: return digest_row8(p, m, jm, sum);
    }
}

static int all_bits(Native *n, const uint8_t *p, int64_t m, uint64_t v) {
    switch (n->kv_esize) {
    case 1: return all_bits1(p, m, v);
    case 2: return all_bits2(p, m, v);
    case 4: return all_bits4(p, m, v);
    default: return all_bits8(p, m, v);
    }
}

static int64_t count_not(Native *n, const uint8_t *p, int64_t m, uint64_t v) {
    switch (n->kv_esize) {
    case 1: return count_not1(p, m, v);
    case 2: return count_not2(p, m, v);
    case 4: return count_not4(p, m, v);
    default: return count_not8(p, m, v);
    }
}

static void fill_bits(Native *n, uint8_t *p, int64_t m, uint64_t v) {
    switch (n->kv_esize) {
    case 1: fill_bits1(p, m, v); break;
    case 2: fill_bits2(p, m, v); break;
    case 4: fill_bits4(p, m, v); break;
    default: fill_bits8(p, m, v); break;
    }
}

static int dev_found_add(Native *n, int fk, int32_t b, const uint8_t *rec, PyObject *message);
static void dev_found_about(Native *n, const char request[REQUEST_BYTES]);

/* -- data the core cannot reach (a CUDA pool) ------------------------------------------------ */

/* The work of kind `kind` (DK_*, core.h) on blocks ids[0..k) of a pool whose data this process
 * does not map: queued in the core's own checks (devchecks.c), answered and applied at the
 * next settle. OK, UNHANDLED (another thread holds the op mutex: dev_check), ERROR. */
static int kv_later(Native *n, int kind, const int32_t *ids, int64_t k, const char *when) {
    return dev_check(n, kind, ids, k, when, 0, NULL);
}

/* The cache lines of the first `bytes` of the rows of blocks ids[0..k) asked for ahead (at most
 * PREFETCH_LINES of them): the blocks a check reads are seldom in the cache (guard mode's
 * quarantine hands out the block freed longest ago), and lines asked for together arrive
 * together. Every line the bytes touch, from the one the row starts in (a guarded pool's
 * block is not a whole number of lines); the pointer stepped a line at a time (the loop was
 * most of the instructions of a publication's probes' own, past the sums). */
#define PREFETCH_LINES 256
static void kv_prefetch(Native *n, const int32_t *ids, int64_t k, size_t bytes) {
    int64_t left = PREFETCH_LINES;
    for (int64_t i = 0; i < k; i++)
        for (int64_t r = 0; r < n->kv_rows; r++) {
            const uint8_t *row = kv_row(n, r, ids[i]);
            const uint8_t *p = (const uint8_t *)((uintptr_t)row & ~(uintptr_t)63);
            for (const uint8_t *end = row + bytes; p < end; p += 64) {
                __builtin_prefetch(p);
                if (--left == 0) return;
            }
        }
}

/* -- guard mode -------------------------------------------------------------------------------- */

/* The release of the sequence in `slot` is guarded: guard mode in full, or the sequences
 * sampled guard mode guards (KVPool._guards). 1, 0, or -1 with an exception set. */
static int guard_release(Native *n, int64_t slot) {
    if (n->probes & P_GUARD) return 1;
    if (!(n->probes & P_GUARD_SAMPLED) || PySet_GET_SIZE(n->guarded) == 0) return 0;
    PyObject *key = PyLong_FromLongLong(slot);
    if (key == NULL) return -1;
    int in = PySet_Contains(n->guarded, key);
    Py_DECREF(key);
    return in;
}

static int canaries_intact(Native *n, const int32_t *ids, int64_t k) {
    if (k == 0) return OK;
    if (n->kv == NULL) return kv_later(n, DK_CANARY, ids, k, NULL);
    int64_t m = n->kv_slot_bytes / n->kv_esize;
    size_t guard = (size_t)(n->kv_spb - 1) * (size_t)n->kv_slot_bytes;
    for (int64_t i = 0; i < k; i++) {
        int broken = 0;
        for (int64_t r = 0; r < n->kv_rows; r++)
            broken |= !all_bits(n, kv_row(n, r, ids[i]) + guard, m, n->canary);
        if (!broken) continue;
        for (int64_t r = 0; r < n->kv_rows; r++)
            fill_bits(n, kv_row(n, r, ids[i]) + guard, m, n->canary);
        Seen s = {.block = ids[i]};
        if (finding_later(n, FK_GUARD_VIOLATION, &s, Py_NewRef(n->msg_canary))) return ERROR;
        n->pend[n->n_pend - 1].event = E_GUARD_VIOLATION;
        n->pend[n->n_pend - 1].seen_later = 1;
    }
    return OK;
}

static int poison_blocks(Native *n, const int32_t *ids, int64_t k) {
    if (k == 0 || !n->poison_ok) return OK;
    if (n->kv == NULL) return kv_later(n, DK_FILL, ids, k, NULL);
    int64_t m = n->bs * n->kv_slot_bytes / n->kv_esize;
    for (int64_t i = 0; i < k; i++)
        for (int64_t r = 0; r < n->kv_rows; r++) fill_bits(n, kv_row(n, r, ids[i]), m, n->nan_bits);
    return OK;
}

/* ids appended to one of the open transaction's lists (grown as needed). OK, or ERROR with an
 * exception set. */
static int ids_append(int32_t **list, int64_t *len, int64_t *cap, const int32_t *ids, int64_t k) {
    if (*len + k > *cap) {
        int64_t c = *cap ? *cap : CHUNK;
        while (c < *len + k) c *= 2;
        int32_t *p = PyMem_Realloc(*list, sizeof(int32_t) * (size_t)c);
        if (p == NULL) {
            PyErr_NoMemory();
            return ERROR;
        }
        *list = p;
        *cap = c;
    }
    memcpy(*list + *len, ids, sizeof(int32_t) * (size_t)k);
    *len += k;
    return OK;
}

static int poison_later(Native *n, const int32_t *ids, int64_t k) {
    if (k == 0 || !n->poison_ok) return OK;
    return ids_append(&n->poison_ids, &n->n_poison, &n->cap_poison, ids, k);
}

static int evicted_poison_later(Native *n, const int32_t *ids, int64_t k) {
    if (k == 0 || !guard_poisons(n)) return OK;
    return ids_append(&n->evicted_ids, &n->n_evicted, &n->cap_evicted, ids, k);
}

static int commit_poison(Native *n) {
    int64_t k = 0;
    for (int64_t i = 0; i < n->n_poison; i++)
        if (blk(n, n->poison_ids[i])[BF_STATE] != B_ALLOCATED) n->poison_ids[k++] = n->poison_ids[i];
    n->n_poison = k;
    /* (one list, so that a CUDA pool's fill is queued whole or not at all) */
    if (n->n_evicted &&
        ids_append(&n->poison_ids, &n->n_poison, &n->cap_poison, n->evicted_ids, n->n_evicted))
        return ERROR;
    n->n_evicted = 0;
    int rc = poison_blocks(n, n->poison_ids, n->n_poison);
    if (rc == OK) n->n_poison = 0;
    return rc;
}

static int ring_push_quarantined(Native *n, const int32_t *ids, int64_t k) {
    if (k == 0) return OK;
    if (ring_push_state(n, ids, k, B_QUARANTINED)) return UNHANDLED;
    if (!n->poison_ok) return OK;
    /* (the records were saved by the push) */
    for (int64_t i = 0; i < k; i++) {
        blk(n, ids[i])[BF_POISONED] = 1;
        seal(n, ids[i]);
    }
    return OK;
}

/* integrity.poison_message: a write after free into a block whose record `r` (as the check saw
 * it) still names who freed it (freed_by) and when (its last access, local time to the
 * millisecond as datetime prints a float timestamp), and `count` elements of its poison
 * overwritten (integrity.POISON_MESSAGE, formatted). */
static PyObject *poison_message(Native *n, const uint8_t *r, int64_t count) {
    double ip, frac = modf((double)U8(r + BF_ACCESS_NS) / 1e9, &ip);
    long us = lrint(frac * 1e6);
    if (us >= 1000000) {
        us -= 1000000;
        ip += 1.0;
    }
    time_t sec = (time_t)ip;
    struct tm tm;
    char when[64];
    localtime_r(&sec, &tm);
    size_t w = strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    snprintf(when + w, sizeof when - w, ".%03ld", us / 1000);
    PyObject *request = request_text((const char *)r + BF_REQUEST);
    PyObject *fmt = PyObject_GetAttrString(n->msg_poison, "format"), *args = PyTuple_New(0);
    PyObject *kw = request ? Py_BuildValue("{s:i,s:O,s:s,s:L}", "pid", freed_by(r),
                                           "request", request, "when", when, "slots",
                                           (long long)count)
                           : NULL;
    PyObject *msg = fmt && args && kw ? PyObject_Call(fmt, args, kw) : NULL;
    Py_XDECREF(request);
    Py_XDECREF(fmt);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    return msg;
}

/* Block b was quarantined by a guarded preemption of the open transaction, or evicted by it:
 * its poison lands at the commit (commit_poison), so it holds none yet. */
static int quarantined_now(Native *n, int32_t b) {
    for (int64_t i = 0; i < n->n_poison; i++)
        if (n->poison_ids[i] == b) return 1;
    for (int64_t i = 0; i < n->n_evicted; i++)
        if (n->evicted_ids[i] == b) return 1;
    return 0;
}

static int poison_intact(Native *n, const int32_t *ids, int64_t k) {
    if (!guard_poisons(n)) return OK;
    int32_t mine[CHUNK];
    int64_t nm = 0;
    for (int64_t i = 0; i < k; i++)
        if (blk(n, ids[i])[BF_POISONED] == 1 && !quarantined_now(n, ids[i])) {
            /* (a take gives out at most CHUNK blocks at once) */
            if (nm == CHUNK) return core_bug("more than CHUNK blocks handed out at once");
            mine[nm++] = ids[i];
        }
    if (nm == 0) return OK;
    if (n->kv == NULL) return kv_later(n, DK_POISON, mine, nm, NULL);
    int64_t m = n->bs * n->kv_slot_bytes / n->kv_esize;
    /* (the quarantine hands out the block freed longest ago: its lines asked for together) */
    kv_prefetch(n, mine, nm, (size_t)(n->bs * n->kv_slot_bytes));
    for (int64_t i = 0; i < nm; i++) {
        /* intact: every element the poison, compared 8 bytes at a time; the elements that are
         * not are counted (for the finding's words) only where one is not */
        int intact = 1;
        for (int64_t r = 0; r < n->kv_rows && intact; r++)
            intact = all_bits(n, kv_row(n, r, mine[i]), m, n->nan_bits);
        if (intact) continue;
        int64_t count = 0;
        for (int64_t r = 0; r < n->kv_rows; r++)
            count += count_not(n, kv_row(n, r, mine[i]), m, n->nan_bits);
        if (count == 0) continue;
        Seen s;
        seen_of(n, mine[i], &s);
        s.owner_pid = freed_by(blk(n, mine[i]));
        if (finding_later(n, FK_USE_AFTER_FREE, &s, poison_message(n, blk(n, mine[i]), count)))
            return ERROR;
    }
    return OK;
}

static void unpoison(Native *n, const int32_t *ids, int64_t k) {
    if (!guard_poisons(n)) return;
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        if (r[BF_POISONED] == 1) {
            r[BF_POISONED] = 0;
            seal(n, ids[i]);
        }
    }
}

/* -- digests ----------------------------------------------------------------------------------- */

/* Whether a block's sums can be taken slot by slot in one pass (slot_sums): 16-bit elements, a
 * slot a multiple of 8 of them and at most DIGEST_CHUNK (one chunk of digest_row2_sums: its
 * 32-bit lane sums cannot overflow), at most 4096 slots. */
static inline int slot_sums_fast(Native *n) {
#if defined(__SSE2__)
    int64_t em = n->kv_slot_bytes / n->kv_esize;
    return n->kv_esize == 2 && em % 8 == 0 && em <= DIGEST_CHUNK && n->bs <= 4096;
#else
    (void)n;
    return 0;
#endif
}

#if defined(__SSE2__)
/* The 4 lanes of each of a, b, c, d added: their four sums, in that order. */
static inline __m128i hsum4(__m128i a, __m128i b, __m128i c, __m128i d) {
    __m128i ab = _mm_add_epi32(_mm_unpacklo_epi32(a, b), _mm_unpackhi_epi32(a, b));
    __m128i cd = _mm_add_epi32(_mm_unpacklo_epi32(c, d), _mm_unpackhi_epi32(c, d));
    return _mm_add_epi32(_mm_unpacklo_epi64(ab, cd), _mm_unpackhi_epi64(ab, cd));
}

/* One slot's three sums (slot_sums: S, T, P), each in four 32-bit lanes. */
typedef struct {
    __m128i t, s, p;
} SlotLanes;

/* The lanes of the `em` 16-bit elements at p (em a multiple of 8, at most DIGEST_CHUNK). */
static inline __attribute__((always_inline)) SlotLanes slot_lanes(const int16_t *p, int64_t em,
                                                                  __m128i par) {
    const __m128i ones = _mm_set1_epi16(1), step = _mm_set1_epi16(8);
    __m128i idx = _mm_set_epi16(7, 6, 5, 4, 3, 2, 1, 0);
    SlotLanes l = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
    for (int64_t i = 0; i < em; i += 8) {
        __m128i q = _mm_loadu_si128((const __m128i *)(p + i));
        l.t = _mm_add_epi32(l.t, _mm_madd_epi16(q, idx));
        l.s = _mm_add_epi32(l.s, _mm_madd_epi16(q, ones));
        l.p = _mm_add_epi32(l.p, _mm_madd_epi16(q, par));
        idx = _mm_add_epi16(idx, step);
    }
    return l;
}

/* One row's slots [0, m) of `em` elements each (slot_sums), from `row`: each slot's sum
 * (coefficients from jm) added into sum[], and into *acc each slot's S times `place` plus the
 * slot's index. Four slots at a time, their lanes added together at once (hsum4). */
static inline __attribute__((always_inline)) void row_slot_sums(const uint8_t *row, int64_t m,
                                                                int64_t em, size_t sb,
                                                                __m128i par, uint64_t jm,
                                                                uint64_t place, uint64_t *sum,
                                                                uint64_t *acc) {
    const SlotLanes zero = {_mm_setzero_si128(), _mm_setzero_si128(), _mm_setzero_si128()};
    uint64_t a = *acc;
    for (int64_t off0 = 0; off0 < m; off0 += 4) {
        const uint8_t *q = row + (size_t)off0 * sb;
        int64_t top = m - off0 < 4 ? m - off0 : 4;
        SlotLanes l0 = slot_lanes((const int16_t *)q, em, par);
        SlotLanes l1 = top > 1 ? slot_lanes((const int16_t *)(q + sb), em, par) : zero;
        SlotLanes l2 = top > 2 ? slot_lanes((const int16_t *)(q + 2 * sb), em, par) : zero;
        SlotLanes l3 = top > 3 ? slot_lanes((const int16_t *)(q + 3 * sb), em, par) : zero;
        /* (each below 2^31 in magnitude: digest_row2_sums' bound) */
        int32_t tt[4], ts[4], tp[4];
        _mm_storeu_si128((__m128i *)tt, hsum4(l0.t, l1.t, l2.t, l3.t));
        _mm_storeu_si128((__m128i *)ts, hsum4(l0.s, l1.s, l2.s, l3.s));
        _mm_storeu_si128((__m128i *)tp, hsum4(l0.p, l1.p, l2.p, l3.p));
#define SLOT_SUM(j)                                                                              \
    do {                                                                                         \
        uint64_t s_ = (uint64_t)(int64_t)ts[j];                                                  \
        sum[off0 + j] += jm * s_ + DIGEST_MUL * (uint64_t)(int64_t)tt[j] +                       \
                         (uint64_t)(int64_t)tp[j];                                               \
        a += s_ * (place + (uint64_t)(off0 + j));                                                \
    } while (0)
        if (top == 4) {
            SLOT_SUM(0);
            SLOT_SUM(1);
            SLOT_SUM(2);
            SLOT_SUM(3);
        } else {
            for (int64_t j = 0; j < top; j++) SLOT_SUM(j);
        }
#undef SLOT_SUM
    }
    *acc = a;
}

/* The raw sums of slots [0, m) of block b into sum[] (a slot's own digest: its elements in every
 * row, one row after the other, from coefficient 0: slot provenance's K/V hash, provenance.c),
 * and with `block`, m being the block's size, the block's own digest sum (digests: its rows
 * one after the other) from the same pass. A slot being an even number of elements and a row a
 * whole number of slots, every coefficient a sum starts from has DIGEST_ADD's parity, so the
 * `| 1` adds the sum of the elements of one parity, the same one everywhere (`par`): per slot
 * and row three sums, of the elements (S), of e * p[e] (T) and of those of that parity (P),
 * SSE2 multiply-adds into four 32-bit lanes each, then the 64-bit arithmetic slot by slot
 * (row_slot_sums; a slot of 8 elements, this bench's and a common head's size, its own copy of
 * the loop, one load a slot). The block's sum from the slots': element i of slot o of row r
 * has coefficient (jm_r + i * MUL) | 1 in the slot's sum, jm_r = ADD + r * em * MUL, and
 * (bjm_r + (o * em + i) * MUL) | 1 in the block's, bjm_r = ADD + r * bs * em * MUL: the same
 * plus MUL * em * (r * (bs - 1) + o), of the same parity; so the block's sum is the slots'
 * plus MUL * em * the sum over rows and slots of S * (r * (bs - 1) + o) (`acc`). The same
 * values as digest_row2_sums' over the block and over each slot, bit for bit
 * (tests/test_core_guard.py against kernels/digest.py). A CPU pool's, where slot_sums_fast. */
static void slot_sums(Native *n, int64_t b, int64_t m, uint64_t *sum, uint64_t *block) {
    int64_t em = n->kv_slot_bytes / n->kv_esize;
    size_t sb = (size_t)n->kv_slot_bytes;
    for (int64_t off = 0; off < m; off++) sum[off] = 0;
    const __m128i par = (DIGEST_ADD & 1) ? _mm_set_epi16(1, 0, 1, 0, 1, 0, 1, 0)  /* odd e */
                                         : _mm_set_epi16(0, 1, 0, 1, 0, 1, 0, 1); /* even e */
    uint64_t jm = DIGEST_ADD, acc = 0, place = 0, row_place = (uint64_t)(n->bs - 1);
    for (int64_t r = 0; r < n->kv_rows; r++, jm += (uint64_t)em * DIGEST_MUL, place += row_place) {
        const uint8_t *row = kv_row(n, r, b);
        if (em == 8)
            row_slot_sums(row, m, 8, 16, par, jm, place, sum, &acc);
        else
            row_slot_sums(row, m, em, sb, par, jm, place, sum, &acc);
    }
    if (block != NULL) {
        uint64_t bsum = DIGEST_MUL * (uint64_t)em * acc;
        for (int64_t off = 0; off < m; off++) bsum += sum[off];
        *block = bsum;
    }
}
#endif

/* The short K/V hashes of a block's slots taken in the digest's pass (slot_sums), kept for slot
 * provenance's use later in the same operation (a publication's hashes, a hit's check): the
 * block and its generation, its slots' raw sums. Emptied when a transaction begins and once
 * used (kv_sums_take). */
static void kv_sums_keep(Native *n, int32_t b, const uint64_t *sums) {
    if (n->kvs_sums == NULL) {
        int64_t cap = n->bs * KVS_KEEP <= 65536 ? KVS_KEEP : 65536 / n->bs;
        if (cap < 1) cap = 1;
        PyMem_Free(n->kvs_ids);
        PyMem_Free(n->kvs_gen);
        n->kvs_ids = PyMem_Malloc(sizeof(int32_t) * (size_t)cap);
        n->kvs_gen = PyMem_Malloc(sizeof(uint32_t) * (size_t)cap);
        n->kvs_sums = PyMem_Malloc(sizeof(uint64_t) * (size_t)(cap * n->bs));
        if (n->kvs_ids == NULL || n->kvs_gen == NULL || n->kvs_sums == NULL) {
            PyMem_Free(n->kvs_sums);
            n->kvs_sums = NULL; /* (kept nothing: the hashes are taken again) */
            return;
        }
        n->kvs_cap = cap;
    }
    if (n->n_kvs >= n->kvs_cap) return;
    n->kvs_ids[n->n_kvs] = b;
    n->kvs_gen[n->n_kvs] = U4(blk(n, b) + BF_GENERATION);
    memcpy(n->kvs_sums + n->n_kvs * n->bs, sums, sizeof(uint64_t) * (size_t)n->bs);
    n->n_kvs++;
}

/* Block b's slot sums kept by the digest's pass of this operation (slots [0, m)) into sum[]: 1,
 * or 0 where none are kept. */
static int kv_sums_take(Native *n, int32_t b, int64_t m, uint64_t *sum) {
    uint32_t gen = U4(blk(n, b) + BF_GENERATION);
    for (int64_t i = 0; i < n->n_kvs; i++)
        if (n->kvs_ids[i] == b && n->kvs_gen[i] == gen) {
            memcpy(sum, n->kvs_sums + i * n->bs, sizeof(uint64_t) * (size_t)m);
            return 1;
        }
    return 0;
}

/* kernels/digest.py block_digests of blocks ids[0..k) into out (the core's own pass over CPU
 * bytes). With `keep` (a publication's stamps, a hit's check: slot provenance hashes the same
 * slots later in the operation), a block whose slots hold provenance records is summed slot by
 * slot where the pool allows (slot_sums), and its slots' sums kept (kv_sums_keep). */
static void digests(Native *n, const int32_t *ids, int64_t k, uint64_t *out, int keep) {
    int64_t m = n->bs * n->kv_slot_bytes / n->kv_esize;
    kv_prefetch(n, ids, k, (size_t)(n->bs * n->kv_slot_bytes));
#if defined(__SSE2__)
    keep = keep && n->prov_every && slot_sums_fast(n);
#else
    keep = 0;
#endif
    for (int64_t i = 0; i < k; i++) {
#if defined(__SSE2__)
        if (keep && prov_any(n, ids[i], U4(blk(n, ids[i]) + BF_GENERATION))) {
            uint64_t sums[4096], sum;
            slot_sums(n, ids[i], n->bs, sums, &sum);
            out[i] = fmix64(sum);
            kv_sums_keep(n, ids[i], sums);
            continue;
        }
#endif
        /* element j of kv[:, :, b, :block_size] flattened: coef(j) = (j * MUL + ADD) | 1 */
        uint64_t sum = 0, jm = DIGEST_ADD;
        for (int64_t r = 0; r < n->kv_rows; r++) sum = digest_row(n, kv_row(n, r, ids[i]), m, &jm, sum);
        out[i] = fmix64(sum);
    }
}

/* The digest of each block just published, over
 * its generation, into its record (saved by the publish). A CUDA pool's are taken later and
 * written by the settle that reads them (devanswers.c). OK, UNHANDLED, ERROR. */
static int stamp_digests(Native *n, const int32_t *ids, int64_t k) {
    if (!(n->probes & P_DIGEST) || k == 0) return OK;
    /* (with slot provenance, the blocks' slots hashed in the same launch: provenance.c) */
    if (n->kv == NULL) /* (queued, or kept for its batch's one check: devchecks.c) */
        return dev_publish_check(n, n->prov_every && n->dev ? DK_STAMP_PROV : DK_STAMP, ids, k);
    uint64_t d[CHUNK];
    digests(n, ids, k, d, 1); /* (slot provenance hashes the published slots next) */
    for (int64_t i = 0; i < k; i++) {
        uint8_t *r = blk(n, ids[i]);
        U8(r + n->off_kv_digest) = ((d[i] >> 32) << 32) | (uint64_t)U4(r + BF_GENERATION);
    }
    return OK;
}

/* The high half of the digest of a block whose every element's bits are v (integrity.
 * _blank_digests: a block as created, zero, or as poisoned, NaN); 0 without memory. */
static uint64_t blank_digest(Native *n, uint64_t v) {
    int64_t m = n->bs * n->kv_slot_bytes / n->kv_esize;
    uint8_t *row = PyMem_Malloc((size_t)(n->bs * n->kv_slot_bytes));
    if (row == NULL) return 0;
    fill_bits(n, row, m, v);
    uint64_t sum = 0, jm = DIGEST_ADD;
    for (int64_t r = 0; r < n->kv_rows; r++) sum = digest_row(n, row, m, &jm, sum);
    PyMem_Free(row);
    return fmix64(sum) >> 32;
}

/* integrity.modified_message: a block's K/V no longer matches the digest its record `rec` holds
 * (high halves `found` and `want`), seen at `when`: naming the request that published it (its
 * record's), or saying the digest was taken of a block nothing had been written into. */
static PyObject *modified_message(Native *n, const uint8_t *rec, const char *when,
                                  uint64_t found, uint64_t want) {
    if (!n->blank_known) {
        n->blank_zero = blank_digest(n, 0);
        n->blank_nan = n->poison_ok ? blank_digest(n, n->nan_bits) : UINT64_MAX;
        n->blank_known = 1;
    }
    const char *blank = want == n->blank_nan ? "NaN (poison)" : want == n->blank_zero ? "zero" : NULL;
    PyObject *fmt = PyObject_GetAttrString(blank ? n->msg_blank : n->msg_modified, "format");
    PyObject *args = PyTuple_New(0), *kw = NULL;
    if (blank) {
        kw = Py_BuildValue("{s:s,s:s,s:K}", "blank", blank, "when", when, "found",
                           (unsigned long long)found);
    } else {
        PyObject *publisher = request_text((const char *)rec + BF_REQUEST);
        PyObject *published =
            publisher == NULL ? NULL
            : PyUnicode_GET_LENGTH(publisher) ? PyUnicode_FromFormat("request %R published it",
                                                                     publisher)
                                              : PyUnicode_FromString("its publication");
        kw = published ? Py_BuildValue("{s:O,s:s}", "published", published, "when", when) : NULL;
        Py_XDECREF(publisher);
        Py_XDECREF(published);
    }
    PyObject *msg = fmt && args && kw ? PyObject_Call(fmt, args, kw) : NULL;
    Py_XDECREF(fmt);
    Py_XDECREF(args);
    Py_XDECREF(kw);
    return msg;
}

static int digests_intact(Native *n, const int32_t *ids, int64_t k, const char *when) {
    return digests_intact_keep(n, ids, k, when, 0);
}

static int digests_intact_keep(Native *n, const int32_t *ids, int64_t k, const char *when,
                              int keep) {
    if (!(n->probes & P_DIGEST) || k == 0) return OK;
    enum { BATCH = CHUNK + EVICT_BATCH };
    int32_t pub[BATCH];
    uint64_t want[BATCH], got[BATCH];
    for (int64_t i = 0; i < k;) {
        int64_t np_ = 0;
        for (; i < k && np_ < BATCH; i++) {
            uint8_t *r = blk(n, ids[i]);
            if (!digest_current(n, r)) continue;
            pub[np_] = ids[i];
            want[np_++] = U8(r + n->off_kv_digest);
        }
        if (np_ == 0) continue;
        if (n->kv == NULL) {
            int rc = kv_later(n, DK_VERIFY, pub, np_, when);
            if (rc != OK) return rc;
            continue;
        }
        digests(n, pub, np_, got, keep);
        for (int64_t j = 0; j < np_; j++) {
            if (got[j] >> 32 == want[j] >> 32) continue;
            Seen s;
            seen_of(n, pub[j], &s);
            PyObject *msg = modified_message(n, blk(n, pub[j]), when, got[j] >> 32, want[j] >> 32);
            if (finding_later(n, FK_PUBLISHED_BLOCK_MODIFIED, &s, msg)) return ERROR;
        }
    }
    return OK;
}

/* -- a request's unwritten slots -------------------------------------------------------------- */

/* blank[s] = 1 where token slot s of block b holds the poison in every layer, K and V, else 0
 * (a CPU pool's): row by row (each row's slots one after the other in memory), only the slots
 * still blank compared, stopping once none is. */
static void slots_blank(Native *n, int32_t b, uint8_t *blank) {
    int64_t m = n->kv_slot_bytes / n->kv_esize, left = n->bs;
    uint64_t v = n->nan_bits;
    for (int64_t s = 0; s < n->bs; s++) blank[s] = 1;
    for (int64_t r = 0; r < n->kv_rows && left; r++) {
        const uint8_t *row = kv_row(n, r, b);
        /* (a row all poison leaves every slot as it was: one pass over the row's bytes rather
         * than one call per slot) */
        if (all_bits(n, row, n->bs * m, v)) continue;
        for (int64_t s = 0; s < n->bs; s++) {
            if (!blank[s]) continue;
            if (!all_bits(n, row + (size_t)s * n->kv_slot_bytes, m, v)) {
                blank[s] = 0;
                left--;
            }
        }
    }
}

/* integrity.unwritten_in: blank[i * bs + s] is 1 where token slot s of ids[i] still holds the
 * poison in every layer, K and V. Unless none of the slots of positions [0, num) is blank, or
 * every one is (a program that writes no K/V at all), each block with blank ones among them is
 * a kv_never_written finding about `request` (a str), with the block's record as it is when
 * reported: now, or, `later`, when the answers of a CUDA pool's checks are applied
 * (devanswers.c). OK, or ERROR with an exception set. */
static int unwritten_report(Native *n, const int32_t *ids, int64_t k, int64_t num,
                            const uint8_t *blank, PyObject *request, int later) {
    int64_t nblk = (num + n->bs - 1) / n->bs, nblank = 0, checked = 0;
    if (nblk > k) nblk = k;
    for (int64_t p = 0; p < num && p < nblk * n->bs; p++, checked++) nblank += blank[p];
    if (nblank == 0 || nblank == checked) return OK;
    for (int64_t i = 0; i < nblk; i++) {
        int64_t used = num - i * n->bs < n->bs ? num - i * n->bs : n->bs, first = -1, last = 0;
        int64_t slots = 0;
        for (int64_t s = 0; s < used; s++)
            if (blank[i * n->bs + s]) {
                if (first < 0) first = i * n->bs + s;
                last = i * n->bs + s;
                slots++;
            }
        if (slots == 0) continue;
        /* (all of them, one, or some of the positions from the first to the last) */
        char positions[96];
        if (first == last)
            snprintf(positions, sizeof positions, "position %lld", (long long)first);
        else if (slots == last - first + 1)
            snprintf(positions, sizeof positions, "positions %lld-%lld", (long long)first,
                     (long long)last);
        else
            snprintf(positions, sizeof positions, "%lld positions between %lld and %lld",
                     (long long)slots, (long long)first, (long long)last);
        PyObject *fmt = PyObject_GetAttrString(n->msg_unwritten, "format");
        PyObject *args = PyTuple_New(0);
        PyObject *kw = Py_BuildValue("{s:O,s:s}", "request", request, "positions", positions);
        PyObject *msg = fmt && args && kw ? PyObject_Call(fmt, args, kw) : NULL;
        Py_XDECREF(fmt);
        Py_XDECREF(args);
        Py_XDECREF(kw);
        if (msg == NULL) return ERROR;
        /* (about the request that finished, whoever's record the block's is: a fork's shared
         * block names the request that allocated it) */
        char named[REQUEST_BYTES];
        if (request_of(request, named)) {
            Py_DECREF(msg);
            return ERROR;
        }
        if (later) {
            if (dev_found_add(n, FK_KV_NEVER_WRITTEN, ids[i], NULL, msg)) return ERROR;
            dev_found_about(n, named);
            continue;
        }
        Seen seen;
        seen_of(n, ids[i], &seen);
        memcpy(seen.request, named, REQUEST_BYTES);
        int rc = finding_report(n, FK_KV_NEVER_WRITTEN, &seen, msg);
        Py_DECREF(msg);
        if (rc != OK) return rc;
    }
    return OK;
}

/* unwritten(table, num_tokens, request): guard mode's check of a finished request (writes.
 * finished): the K/V of its positions [0, num_tokens) was written into its blocks. A CPU
 * pool's bytes are read here and what is found reported now; a CUDA pool's check is queued
 * (devchecks.c) and reported at the settle that reads its answer. Under the handle's op mutex
 * (the caller holds it). */
static PyObject *N_unwritten(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "unwritten(table: list, num_tokens: int, request: str)");
        return NULL;
    }
    if (n->seg == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "unwritten(): the handle is closed");
        return NULL;
    }
    int64_t num = PyLong_AsLongLong(args[1]);
    if (num == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t len = PyList_GET_SIZE(args[0]);
    int64_t nblk = num <= 0 ? 0 : (num + n->bs - 1) / n->bs;
    if (nblk > len) nblk = len;
    if (nblk == 0 || !n->poison_ok) Py_RETURN_NONE;
    int32_t *ids = PyMem_Malloc((size_t)nblk * sizeof *ids);
    uint8_t *blank = n->kv != NULL ? PyMem_Calloc((size_t)(nblk * n->bs), 1) : NULL;
    if (ids == NULL || (n->kv != NULL && blank == NULL)) {
        PyMem_Free(ids);
        PyMem_Free(blank);
        return PyErr_NoMemory();
    }
    int rc = OK;
    for (int64_t i = 0; i < nblk && rc == OK; i++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(args[0], i));
        if (b < 0 || b >= n->nb) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "block id out of range");
            rc = ERROR;
        }
        ids[i] = (int32_t)b;
    }
    int mh = n->mutex_held;
    PyObject *pool = n->pool;
    n->mutex_held = 1; /* (the caller holds the op mutex) */
    n->pool = NULL;    /* (no operation's) */
    n->probes = (int)*n->probe_bits;
    if (rc == OK && n->kv == NULL) {
        rc = dev_check(n, DK_UNWRITTEN, ids, nblk, NULL, num, args[2]);
    } else if (rc == OK) {
        /* (the blocks' lines asked for together: poisoned at their last free, long ago) */
        kv_prefetch(n, ids, nblk, (size_t)(n->bs * n->kv_slot_bytes));
        for (int64_t i = 0; i < nblk; i++) slots_blank(n, ids[i], blank + i * n->bs);
        rc = unwritten_report(n, ids, nblk, num, blank, args[2], 0);
    }
    n->mutex_held = mh;
    n->pool = pool;
    PyMem_Free(ids);
    PyMem_Free(blank);
    if (rc == UNHANDLED && !PyErr_Occurred())
        PyErr_SetString(PyExc_RuntimeError, "unwritten(): the op mutex is not held");
    if (rc != OK) return NULL;
    Py_RETURN_NONE;
}

/* digests(ids) -> list[int]: kernels/digest.py block_digests computed by the core (tests). */
static PyObject *N_digests(Native *n, PyObject *arg) {
    if (!PyList_Check(arg) || PyList_GET_SIZE(arg) > CHUNK) {
        PyErr_SetString(PyExc_TypeError, "digests(ids: list of at most CHUNK block ids)");
        return NULL;
    }
    if (n->kv == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "digests() needs KV data in this process");
        return NULL;
    }
    int32_t ids[CHUNK] = {0}; /* (zeroed: gcc cannot see that digests reads only the k set) */
    uint64_t d[CHUNK];
    Py_ssize_t k = PyList_GET_SIZE(arg);
    for (Py_ssize_t i = 0; i < k; i++) {
        long b = PyLong_AsLong(PyList_GET_ITEM(arg, i));
        if (b < 0 || b >= n->nb) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "block id out of range");
            return NULL;
        }
        ids[i] = (int32_t)b;
    }
    digests(n, ids, k, d, 0);
    PyObject *out = PyList_New(k);
    for (Py_ssize_t i = 0; out && i < k; i++)
        PyList_SET_ITEM(out, i, PyLong_FromUnsignedLongLong(d[i]));
    return out;
}
