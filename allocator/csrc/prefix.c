/* The prefix index: lookup, insert, remove; chain hashes and keys. Part of _native.c. */

/* -- the prefix index ------------------------------------------------------------------------- */


/* PrefixIndex._start: the key's shard's first entry (*base) and its home slot in the shard. */
static inline int64_t probe_start(Native *n, uint64_t key, int64_t *base) {
    *base = shard_of(n, key) * n->index_w;
    return (int64_t)((key >> 16) % (uint64_t)n->index_w);
}

static int32_t index_lookup(Native *n, uint64_t key) {
    int64_t base, w = n->index_w, i = probe_start(n, key, &base);
    for (int64_t s = 0; s < w; s++) {
        uint8_t *e = idx_entry(n, base + i);
        uint64_t k = U8(e);
        if (k == key) return I4(e + 8);
        if (k == 0) return -1;
        i = (i + 1) % w;
    }
    return -1;
}

/* PrefixIndex.insert: 1 inserted, 0 present or shard full, UNHANDLED journal full. */
static int index_insert(Native *n, uint64_t key, int32_t block, int *inserted) {
    int64_t base, w = n->index_w, i = probe_start(n, key, &base);
    *inserted = 0;
    for (int64_t s = 0; s < w; s++) {
        uint8_t *e = idx_entry(n, base + i);
        uint64_t k = U8(e);
        if (k == key) return OK;
        if (k == 0) {
            if (jsave(n, n->off_index + (size_t)(base + i) * INDEX_ENTRY, INDEX_ENTRY))
                return UNHANDLED;
            I4(e + 8) = block;
            U8(e) = key;
            *inserted = 1;
            crash_point(n, CP_AFTER_INSERT);
            return OK;
        }
        i = (i + 1) % w;
    }
    return OK;
}

/* PrefixIndex.remove: unindex `key` -> `block` with backward-shift deletion (shard lock). */
static int index_remove(Native *n, uint64_t key, int32_t block, int *removed) {
    int64_t base, w = n->index_w, i = probe_start(n, key, &base), s;
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
                return UNHANDLED;
            uint8_t *eh = idx_entry(n, base + hole);
            U8(eh) = kj;
            I4(eh + 8) = I4(ej + 8);
            hole = j;
        }
        j = (j + 1) % w;
    }
    if (jsave(n, n->off_index + (size_t)(base + hole) * INDEX_ENTRY, INDEX_ENTRY)) return UNHANDLED;
    uint8_t *eh = idx_entry(n, base + hole);
    U8(eh) = 0;
    I4(eh + 8) = -1;
    *removed = 1;
    return OK;
}

static inline uint64_t chain_next(Native *n, uint64_t prev, const int32_t *toks) {
    uint64_t c = 0;
    for (int64_t i = 0; i < n->bs; i++) c += (uint64_t)(int64_t)toks[i] * n->coefs[i];
    return prev * CHAIN_P + c;
}

/* Keys of a sequence's chain values j and j-1 (family_key). */
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
