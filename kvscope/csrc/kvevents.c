/* kvscope._kvevents: `kvscope events check`'s fast path, a KV-event batch read and applied in C.
 *
 * The checker (kvscope/events/checker.py) keeps, per (medium, group) of a publisher, the
 * multiset of block hashes stored now as Python dicts. Nearly every event of a healthy stream
 * is a BlockStored of new hashes under a stored parent or a BlockRemoved of stored hashes, and
 * what that costs in Python is the event objects msgspec builds and the interpreter's loop over
 * them: most of a check's time. msgspec decodes into Python objects and has no way to walk a
 * payload without building them, and no msgpack library applies events to a multiset; hence
 * this file. It reads the payload's msgpack itself and applies those common events to the
 * checker's own dicts, the same entries the checker's Python fast path writes.
 *
 * The Python checker stays the one place every rule lives. This file only takes what it can
 * prove no check fires on, and stops at the first event where one might (a hash stored again,
 * an unknown parent, a token count off, a clear, a partial block retired, a cache it has not
 * seen): the checker applies the rest of the batch. A payload holding anything this reader is
 * not sure msgspec reads the same way (an extension type, a string that is not ASCII where
 * msgspec would decode it, a duplicate key, nesting past MAX_DEPTH) is left whole to msgspec
 * and the checker: scan() returns None.
 *
 *     head = scan(payload)                   # (ts, rank or None, number of events) or None
 *     done, live, peak, stored, removed = apply(payload, caches, seq, batch, live, peak)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 32

enum { NIL, BOOL, UINT, NEG, FLT, STR, BIN, ARR, MAP, EXT };
enum { STORED, REMOVED, CLEARED };

typedef struct {
    const uint8_t *p, *end;
} Reader;

/* One msgpack value's head. UINT: u is the value; NEG: u holds the int64's bits; ARR, MAP:
 * u is the count; STR, BIN: s and u are the bytes (already stepped over); FLT: f. */
typedef struct {
    int t;
    uint64_t u;
    double f;
    const uint8_t *s;
} Val;

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* Read a big-endian field of n bytes; -1 past the end. */
static inline int take(Reader *r, int n, uint64_t *out) {
    if (r->end - r->p < n)
        return -1;
    *out = be(r->p, n);
    r->p += n;
    return 0;
}

static inline int bytes(Reader *r, Val *v, int t, uint64_t n) {
    if ((uint64_t)(r->end - r->p) < n)
        return -1;
    v->t = t;
    v->u = n;
    v->s = r->p;
    r->p += n;
    return 0;
}

static inline __attribute__((always_inline)) int head(Reader *r, Val *v) {
    uint64_t n;
    if (r->p >= r->end)
        return -1;
    uint8_t b = *r->p++;
    if (b <= 0x7f) {
        v->t = UINT;
        v->u = b;
        return 0;
    }
    if (b >= 0xe0) {
        v->t = NEG;
        v->u = (uint64_t)(int64_t)(int8_t)b;
        return 0;
    }
    if (b <= 0x8f) {
        v->t = MAP;
        v->u = b & 0x0f;
        return 0;
    }
    if (b <= 0x9f) {
        v->t = ARR;
        v->u = b & 0x0f;
        return 0;
    }
    if (b <= 0xbf)
        return bytes(r, v, STR, b & 0x1f);
    switch (b) {
    case 0xc0:
        v->t = NIL;
        return 0;
    case 0xc2:
    case 0xc3:
        v->t = BOOL;
        v->u = b & 1;
        return 0;
    case 0xc4:
    case 0xc5:
    case 0xc6:
        if (take(r, 1 << (b - 0xc4), &n))
            return -1;
        return bytes(r, v, BIN, n);
    case 0xca: {
        uint64_t bits;
        if (take(r, 4, &bits))
            return -1;
        uint32_t b32 = (uint32_t)bits;
        float f;
        memcpy(&f, &b32, 4);
        v->t = FLT;
        v->f = f;
        return 0;
    }
    case 0xcb: {
        uint64_t bits;
        if (take(r, 8, &bits))
            return -1;
        memcpy(&v->f, &bits, 8);
        v->t = FLT;
        return 0;
    }
    case 0xcc:
    case 0xcd:
    case 0xce:
    case 0xcf:
        v->t = UINT;
        return take(r, 1 << (b - 0xcc), &v->u);
    case 0xd0:
    case 0xd1:
    case 0xd2:
    case 0xd3: {
        int size = 1 << (b - 0xd0);
        if (take(r, size, &n))
            return -1;
        /* sign-extend */
        int64_t i = size == 8 ? (int64_t)n : (int64_t)(n << (64 - 8 * size)) >> (64 - 8 * size);
        v->t = i < 0 ? NEG : UINT;
        v->u = (uint64_t)i;
        return 0;
    }
    case 0xd9:
    case 0xda:
    case 0xdb:
        if (take(r, 1 << (b - 0xd9), &n))
            return -1;
        return bytes(r, v, STR, n);
    case 0xdc:
    case 0xdd:
        v->t = ARR;
        return take(r, b == 0xdc ? 2 : 4, &v->u);
    case 0xde:
    case 0xdf:
        v->t = MAP;
        return take(r, b == 0xde ? 2 : 4, &v->u);
    default:
        /* extension types (msgspec builds Ext objects and checks timestamps) and 0xc1 */
        return -1;
    }
}

static int ascii(const Val *v) {
    for (uint64_t i = 0; i < v->u; i++)
        if (v->s[i] & 0x80)
            return 0;
    return 1;
}

/* Step over one value. `plain`: a value msgspec decodes as Any, taken only as a scalar with
 * an ASCII string (msgspec checks a string's UTF-8 and rejects a map key it cannot hash);
 * otherwise anything well formed, as msgspec's Raw and its skipping of unknown fields take. */
static int skip(Reader *r, int depth, int plain) {
    Val v;
    if (depth > MAX_DEPTH || head(r, &v))
        return -1;
    if (v.t == ARR || v.t == MAP) {
        if (plain)
            return -1;
        uint64_t n = v.t == MAP ? 2 * v.u : v.u;
        /* every item takes a byte at least */
        if (n > (uint64_t)(r->end - r->p))
            return -1;
        for (uint64_t i = 0; i < n; i++) {
            /* token ids, most of a payload's bytes: small ints stepped over here */
            uint8_t b = r->p < r->end ? *r->p : 0xc1;
            int size = b <= 0x7f || b >= 0xe0 ? 1 : b == 0xcd ? 3 : b == 0xce ? 5 : b == 0xcc ? 2 : 0;
            if (size && r->end - r->p >= size)
                r->p += size;
            else if (skip(r, depth + 1, 0))
                return -1;
        }
        return 0;
    }
    if (plain && v.t == STR && !ascii(&v))
        return -1;
    return 0;
}

/* A part of a cache's key: medium (`str | None`, taken as ASCII text) or group_idx
 * (`int | None`). */
static int key_part(Reader *r, Val *v, const uint8_t **at, Py_ssize_t *len, int text) {
    *at = r->p;
    if (head(r, v))
        return -1;
    *len = r->p - *at;
    if (v->t == NIL)
        return 0;
    if (text)
        return v->t == STR && ascii(v) ? 0 : -1;
    return v->t == UINT || v->t == NEG ? 0 : -1;
}

static int is_hash(const Val *v) { return v->t == UINT || v->t == NEG || v->t == BIN; }

/* One event as read: where its parts lie in the payload. */
typedef struct {
    int kind;
    const uint8_t *hashes, *hashes_end; /* the block_hashes array's items */
    uint64_t num_hashes;
    Val parent, block_size;
    const uint8_t *tokens;
    Py_ssize_t tokens_len;
    Val medium, group;
    const uint8_t *medium_at, *group_at;
    Py_ssize_t medium_len, group_len;
} Event;

static const uint8_t NO_TOKENS[] = {0x90};
static const uint8_t NIL_BYTE[] = {0xc0};

static int hash_list(Reader *r, Event *e) {
    Val v;
    if (head(r, &v) || v.t != ARR || v.u > (uint64_t)(r->end - r->p))
        return -1;
    e->num_hashes = v.u;
    e->hashes = r->p;
    for (uint64_t i = 0; i < e->num_hashes; i++)
        if (head(r, &v) || !is_hash(&v))
            return -1;
    e->hashes_end = r->p;
    return 0;
}

static int tokens(Reader *r, Event *e) {
    e->tokens = r->p;
    if (skip(r, 0, 0))
        return -1;
    e->tokens_len = r->p - e->tokens;
    return 0;
}

static int kind_of(const Val *v) {
    if (v->t != STR)
        return -1;
    if (v->u == 11 && !memcmp(v->s, "BlockStored", 11))
        return STORED;
    if (v->u == 12 && !memcmp(v->s, "BlockRemoved", 12))
        return REMOVED;
    if (v->u == 16 && !memcmp(v->s, "AllBlocksCleared", 16))
        return CLEARED;
    return -1;
}

/* What an event that leaves a field out reads as (msgspec's defaults in wire.py). */
static inline void defaults(Event *e) {
    e->hashes = e->hashes_end = NULL;
    e->num_hashes = 0;
    e->parent.t = NIL;
    e->block_size.t = UINT;
    e->block_size.u = 0;
    e->tokens = NO_TOKENS;
    e->tokens_len = 1;
    e->medium.t = e->group.t = NIL;
    e->medium_at = e->group_at = NIL_BYTE;
    e->medium_len = e->group_len = 1;
}

/* A positional event (vLLM <= 0.23): [tag, block_hashes, parent, token_ids, block_size,
 * lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...] or
 * [tag, block_hashes, medium, group_idx, ...] or [tag, ...]; msgspec ignores trailing items. */
static int array_event(Reader *r, Event *e, uint64_t n) {
    Val v;
    if (n < 1 || head(r, &v) || (e->kind = kind_of(&v)) < 0)
        return -1;
    uint64_t i = 1;
    if (e->kind == STORED) {
        if (n < 5 || hash_list(r, e) || head(r, &e->parent) ||
            (e->parent.t != NIL && !is_hash(&e->parent)) || tokens(r, e) ||
            head(r, &e->block_size) || (e->block_size.t != UINT && e->block_size.t != NEG))
            return -1;
        i = 5;
        for (; i < n && i <= 10; i++) {
            int bad;
            if (i == 6)
                bad = key_part(r, &e->medium, &e->medium_at, &e->medium_len, 1);
            else if (i == 9)
                bad = key_part(r, &e->group, &e->group_at, &e->group_len, 0);
            else
                bad = skip(r, 0, i != 8); /* extra_keys (8) is Raw */
            if (bad)
                return -1;
        }
    } else if (e->kind == REMOVED) {
        if (n < 2 || hash_list(r, e))
            return -1;
        i = 2;
        if (i < n && key_part(r, &e->medium, &e->medium_at, &e->medium_len, 1))
            return -1;
        if (++i < n && key_part(r, &e->group, &e->group_at, &e->group_len, 0))
            return -1;
        i++;
    }
    for (; i < n; i++)
        if (skip(r, 0, 1))
            return -1;
    return 0;
}

enum {
    F_TYPE = 1,
    F_HASHES = 2,
    F_PARENT = 4,
    F_TOKENS = 8,
    F_SIZE = 16,
    F_MEDIUM = 32,
    F_GROUP = 64,
    F_SPEC = 128
};

#define IS(name) (k->u == sizeof name - 1 && !memcmp(k->s, name, sizeof name - 1))

/* The field a map key names (0: one the checker does not read), by its length first. */
static unsigned field_of(const Val *k) {
    switch (k->u) {
    case 4:
        return IS("type") ? F_TYPE : 0;
    case 6:
        return IS("medium") ? F_MEDIUM : 0;
    case 9:
        return IS("token_ids") ? F_TOKENS : IS("group_idx") ? F_GROUP : 0;
    case 10:
        return IS("block_size") ? F_SIZE : 0;
    case 12:
        return IS("block_hashes") ? F_HASHES : 0;
    case 17:
        return IS("parent_block_hash") ? F_PARENT : 0;
    case 18:
        return IS("kv_cache_spec_kind") ? F_SPEC : 0;
    default:
        return 0;
    }
}

/* A tagged map (vLLM >= 0.24): {"type": tag, field: value, ...}, fields by name; a field the
 * event's class lacks is skipped by msgspec, read here all the same (only stricter). */
static int map_event(Reader *r, Event *e, uint64_t n) {
    unsigned seen = 0;
    Val k, v;
    e->kind = -1;
    for (uint64_t i = 0; i < n; i++) {
        if (head(r, &k) || k.t != STR)
            return -1;
        unsigned f = field_of(&k);
        if (f & seen)
            return -1;
        seen |= f;
        int bad = 0;
        switch (f) {
        case F_TYPE:
            bad = head(r, &v) || (e->kind = kind_of(&v)) < 0;
            break;
        case F_HASHES:
            bad = hash_list(r, e);
            break;
        case F_PARENT:
            bad = head(r, &e->parent) || (e->parent.t != NIL && !is_hash(&e->parent));
            break;
        case F_TOKENS:
            bad = tokens(r, e);
            break;
        case F_SIZE:
            bad = head(r, &e->block_size) ||
                  (e->block_size.t != UINT && e->block_size.t != NEG);
            break;
        case F_MEDIUM:
            bad = key_part(r, &e->medium, &e->medium_at, &e->medium_len, 1);
            break;
        case F_GROUP:
            bad = key_part(r, &e->group, &e->group_at, &e->group_len, 0);
            break;
        default:
            if (!ascii(&k))
                return -1;
            bad = skip(r, 0, 1);
        }
        if (bad)
            return -1;
    }
    if (e->kind < 0 || (e->kind != CLEARED && !(seen & F_HASHES)))
        return -1;
    return 0;
}

/* The events of the last payload read (grown as needed, reused), and that payload when it
 * is a bytes object (immutable: apply() of the same object reads the same events). */
static Event *events = NULL;
static size_t events_cap = 0;
static PyObject *events_of = NULL;

typedef struct {
    double ts;
    Val rank;
    uint64_t num_events;
} Batch;

/* A batch [ts, events, data_parallel_rank?, ...] whole, into `events`; -1 for a payload left
 * to msgspec (a MemoryError set only when allocation failed). */
static int read_batch(const uint8_t *p, Py_ssize_t len, Batch *b) {
    Reader r = {p, p + len};
    Val v, ts;
    if (head(&r, &v) || v.t != ARR || v.u < 2)
        return -1;
    uint64_t n = v.u;
    if (head(&r, &ts))
        return -1;
    if (ts.t == FLT)
        b->ts = ts.f;
    else if (ts.t == UINT && ts.u <= (1ULL << 53))
        b->ts = (double)ts.u;
    else if (ts.t == NEG && (int64_t)ts.u >= -(1LL << 53))
        b->ts = (double)(int64_t)ts.u;
    else
        return -1;
    if (head(&r, &v) || v.t != ARR || v.u > (uint64_t)(r.end - r.p))
        return -1;
    b->num_events = v.u;
    if (b->num_events > events_cap) {
        size_t cap = b->num_events < 64 ? 64 : b->num_events * 2;
        Event *grown = PyMem_Realloc(events, cap * sizeof(Event));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        events = grown;
        events_cap = cap;
    }
    for (uint64_t i = 0; i < b->num_events; i++) {
        Event *e = &events[i];
        defaults(e);
        if (head(&r, &v))
            return -1;
        if (v.t == ARR ? array_event(&r, e, v.u) : v.t == MAP ? map_event(&r, e, v.u) : -1)
            return -1;
    }
    b->rank.t = NIL;
    if (n > 2) {
        const uint8_t *at = r.p;
        if (skip(&r, 0, 1))
            return -1;
        Reader again = {at, r.p};
        head(&again, &b->rank);
    }
    for (uint64_t i = 3; i < n; i++)
        if (skip(&r, 0, 1))
            return -1;
    return r.p == r.end ? 0 : -1;
}

static PyObject *int_of(const Val *v) {
    return v->t == NEG ? PyLong_FromLongLong((long long)(int64_t)v->u)
                       : PyLong_FromUnsignedLongLong(v->u);
}

static PyObject *value_of(const Val *v) {
    switch (v->t) {
    case UINT:
    case NEG:
        return int_of(v);
    case BIN:
        return PyBytes_FromStringAndSize((const char *)v->s, (Py_ssize_t)v->u);
    case STR:
        return PyUnicode_DecodeASCII((const char *)v->s, (Py_ssize_t)v->u, NULL);
    default:
        Py_RETURN_NONE;
    }
}

static int same_hash(const Val *a, const Val *b) {
    if (a->t != b->t || a->u != b->u)
        return 0;
    return a->t != BIN || !memcmp(a->s, b->s, a->u);
}

/* The token count from token_ids' msgpack head, as wire.num_tokens reads it. */
static long long num_tokens(const Event *e) {
    const uint8_t *t = e->tokens;
    if (t[0] >= 0x90 && t[0] <= 0x9f)
        return t[0] - 0x90;
    if (t[0] == 0xdc)
        return (long long)be(t + 1, 2);
    if (t[0] == 0xdd)
        return (long long)be(t + 1, 4);
    return t[0] == 0xc0 ? 0 : -1;
}

static Batch last;

static PyObject *scan(PyObject *self, PyObject *arg) {
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE))
        return NULL;
    Py_CLEAR(events_of);
    Batch b;
    int bad = read_batch(buf.buf, buf.len, &b);
    PyBuffer_Release(&buf);
    if (!bad && PyBytes_CheckExact(arg)) {
        events_of = Py_NewRef(arg);
        last = b;
    }
    if (bad) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *rank;
    if (b.rank.t == UINT || b.rank.t == NEG)
        rank = int_of(&b.rank);
    else
        rank = Py_NewRef(Py_None);
    if (rank == NULL)
        return NULL;
    return Py_BuildValue("(dNK)", b.ts, rank, (unsigned long long)b.num_events);
}

/* One (medium, group) cache of the checker (checker._Cache), its dicts borrowed for a while. */
typedef struct {
    PyObject *obj, *copies, *stored, *removed_at;
    long long full_size;
    int special; /* cleared, superseded or retired hashes: checks the C path leaves */
} Cache;

static void drop(Cache *c) {
    Py_CLEAR(c->copies);
    Py_CLEAR(c->stored);
    Py_CLEAR(c->removed_at);
    c->obj = NULL;
}

static PyObject *s_copies, *s_stored, *s_removed_at, *s_log, *s_full_size, *s_special[3];

/* The cache of event e in `caches` ((medium, group) -> _Cache); 0 when it has none yet. */
static int find_cache(PyObject *caches, const Event *e, Cache *c) {
    drop(c);
    PyObject *medium = value_of(&e->medium), *group = value_of(&e->group);
    if (medium == NULL || group == NULL) {
        Py_XDECREF(medium);
        Py_XDECREF(group);
        return -1;
    }
    PyObject *key = PyTuple_Pack(2, medium, group);
    Py_DECREF(medium);
    Py_DECREF(group);
    if (key == NULL)
        return -1;
    PyObject *obj = PyDict_GetItemWithError(caches, key);
    Py_DECREF(key);
    if (obj == NULL)
        return PyErr_Occurred() ? -1 : 0;
    c->copies = PyObject_GetAttr(obj, s_copies);
    c->stored = PyObject_GetAttr(obj, s_stored);
    /* the log of last copies removed (checker._Removals.log): hash, then (seq, batch) */
    PyObject *removals = PyObject_GetAttr(obj, s_removed_at);
    c->removed_at = removals ? PyObject_GetAttr(removals, s_log) : NULL;
    Py_XDECREF(removals);
    if (!c->copies || !c->stored || !c->removed_at || !PyDict_Check(c->copies) ||
        !PyDict_Check(c->stored) || !PyList_CheckExact(c->removed_at)) {
        drop(c);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "a cache whose copies, stored, removed_at.log are "
                                             "not the checker's");
        return -1;
    }
    c->special = 0;
    for (int i = 0; i < 3; i++) {
        PyObject *d = PyObject_GetAttr(obj, s_special[i]);
        int full = d == NULL ? -1 : PyObject_IsTrue(d);
        Py_XDECREF(d);
        if (full < 0) {
            drop(c);
            return -1;
        }
        c->special |= full;
    }
    PyObject *fs = PyObject_GetAttr(obj, s_full_size);
    int overflow = 0;
    c->full_size = fs == NULL ? -1 : PyLong_AsLongLongAndOverflow(fs, &overflow);
    Py_XDECREF(fs);
    if (PyErr_Occurred()) {
        drop(c);
        return -1;
    }
    if (overflow) {
        /* a block_size past 64 bits stored: every event left to the checker */
        c->full_size = LLONG_MAX;
        c->special = 1;
    }
    c->obj = obj;
    return 1;
}

/* The hashes of e as Python objects, into a new tuple. It holds only ints or bytes, so the
 * cyclic collector is told to leave it (as it would itself at its first pass): freeing it later
 * then touches no neighbour in the collector's lists. */
static PyObject *hash_objects(const Event *e, Val *vals) {
    PyObject *tuple = PyTuple_New((Py_ssize_t)e->num_hashes);
    if (tuple == NULL)
        return NULL;
    Reader r = {e->hashes, e->hashes_end};
    for (uint64_t i = 0; i < e->num_hashes; i++) {
        head(&r, &vals[i]); /* read whole before: cannot fail */
        PyObject *h = value_of(&vals[i]);
        if (h == NULL) {
            Py_DECREF(tuple);
            return NULL;
        }
        PyTuple_SET_ITEM(tuple, (Py_ssize_t)i, h);
    }
    PyObject_GC_UnTrack(tuple);
    return tuple;
}

typedef struct {
    long long live, peak, num_stored, num_removed;
} Tally;

/* 1 applied, 0 left to the checker (a check may fire), -1 error. */
static int store(const Event *e, Cache *c, PyObject *seq, PyObject *batch, Tally *t, Val *vals) {
    if (e->block_size.t != UINT || e->block_size.u > (1u << 30) || e->num_hashes > (1u << 30) ||
        c->special)
        return 0;
    long long bs = (long long)e->block_size.u, num = (long long)e->num_hashes;
    long long n = num_tokens(e);
    if (n != bs * num && n && bs)
        return 0;
    PyObject *parent = value_of(&e->parent);
    if (parent == NULL)
        return -1;
    if (parent != Py_None) {
        int known = PyDict_Contains(c->copies, parent);
        if (known <= 0) {
            Py_DECREF(parent);
            return known;
        }
    }
    PyObject *hashes = hash_objects(e, vals);
    if (hashes == NULL) {
        Py_DECREF(parent);
        return -1;
    }
    PyObject *one = PyLong_FromLong(1);
    Py_ssize_t i = 0;
    int ok = 1;
    for (; i < num; i++) {
        PyObject *h = PyTuple_GET_ITEM(hashes, i);
        Py_ssize_t size = PyDict_GET_SIZE(c->copies);
        /* one lookup: the dict grows only where the hash was not there */
        if (PyDict_SetDefault(c->copies, h, one) == NULL || PyDict_GET_SIZE(c->copies) == size) {
            ok = PyErr_Occurred() ? -1 : 0;
            break;
        }
    }
    PyObject *info = NULL;
    if (ok == 1) {
        PyObject *toks = PyBytes_FromStringAndSize((const char *)e->tokens, e->tokens_len);
        PyObject *size = PyLong_FromLongLong(bs);
        if (toks && size)
            info = PyTuple_Pack(6, parent, size, toks, hashes, seq, batch);
        /* (ints, bytes, None and the untracked tuple of hashes: nothing to collect) */
        if (info != NULL)
            PyObject_GC_UnTrack(info);
        Py_XDECREF(toks);
        Py_XDECREF(size);
        for (Py_ssize_t j = 0; info && j < num; j++)
            if (PyDict_SetItem(c->stored, PyTuple_GET_ITEM(hashes, j), info))
                Py_CLEAR(info);
        if (info == NULL)
            ok = -1;
    }
    if (ok == 0) {
        /* a hash already stored (before, or earlier in this event): undone, the checker's */
        for (Py_ssize_t j = 0; j < i; j++)
            PyDict_DelItem(c->copies, PyTuple_GET_ITEM(hashes, j));
    }
    Py_XDECREF(info);
    Py_DECREF(one);
    Py_DECREF(hashes);
    Py_DECREF(parent);
    if (ok != 1)
        return ok;
    if (bs > c->full_size) {
        PyObject *size = PyLong_FromLongLong(bs);
        if (size == NULL || PyObject_SetAttr(c->obj, s_full_size, size)) {
            Py_XDECREF(size);
            return -1;
        }
        Py_DECREF(size);
        c->full_size = bs;
    }
    t->num_stored += num;
    t->live += num;
    if (t->live > t->peak)
        t->peak = t->live;
    return 1;
}

/* A hash of e as a Python object (its Val read whole before: cannot fail to read). */
static PyObject *hash_object(Reader *r, Val *v) {
    head(r, v);
    return value_of(v);
}

/* dict.pop(key): a new reference, or NULL (an error set, or none: not there). */
static PyObject *pop(PyObject *dict, PyObject *key) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *out = NULL;
    PyDict_Pop(dict, key, &out);
    return out;
#else
    PyObject *none = Py_None, *out = _PyDict_Pop(dict, key, none);
    if (out == none) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
#endif
}

/* Per hash of an event: its Val, its object, the copies and the stored entry taken out. */
typedef struct {
    Val *vals;
    PyObject **objs, **copies, **infos;
    size_t cap;
} Scratch;

static int grow(Scratch *x, size_t n) {
    if (n <= x->cap)
        return 0;
    x->cap = n * 2;
    PyMem_Free(x->vals);
    PyMem_Free(x->objs);
    PyMem_Free(x->copies);
    PyMem_Free(x->infos);
    x->vals = PyMem_Malloc(x->cap * sizeof(Val));
    x->objs = PyMem_Malloc(x->cap * sizeof(PyObject *));
    x->copies = PyMem_Malloc(x->cap * sizeof(PyObject *));
    x->infos = PyMem_Malloc(x->cap * sizeof(PyObject *));
    if (x->vals && x->objs && x->copies && x->infos)
        return 0;
    PyErr_NoMemory();
    return -1;
}

static void release(Scratch *x) {
    PyMem_Free(x->vals);
    PyMem_Free(x->objs);
    PyMem_Free(x->copies);
    PyMem_Free(x->infos);
}

/* A BlockRemoved: as the checker does, each hash's copies popped, the last copy's stored
 * entry popped and its removal remembered, more copies put back one less (at the end of the
 * dict's order). Where the checker must see the event (a hash not stored, the last copy of a
 * partial block, a hash twice), what was popped is put back first: the checker then pops
 * every hash of the event again, so where they were put back does not matter, and `stored`
 * is only ever looked up. */
static int remove_blocks(const Event *e, Cache *c, PyObject *at, Tally *t, Scratch *x) {
    Py_ssize_t num = (Py_ssize_t)e->num_hashes, made = 0;
    Reader r = {e->hashes, e->hashes_end};
    int ok = 1;
    for (; ok == 1 && made < num; made++) {
        x->infos[made] = x->copies[made] = NULL;
        PyObject *h = x->objs[made] = hash_object(&r, &x->vals[made]);
        if (h == NULL) {
            ok = -1;
            break;
        }
        for (Py_ssize_t j = 0; j < made; j++)
            if (same_hash(&x->vals[made], &x->vals[j]))
                ok = 0;
        PyObject *copies = x->copies[made] = pop(c->copies, h);
        if (copies == NULL) {
            ok = PyErr_Occurred() ? -1 : 0;
            continue;
        }
        int overflow = 0;
        long long n = PyLong_AsLongLongAndOverflow(copies, &overflow);
        if (PyErr_Occurred())
            ok = -1;
        else if (overflow || n < 1)
            ok = 0;
        else if (n == 1) {
            PyObject *info = x->infos[made] = pop(c->stored, h);
            if (info == NULL || !PyTuple_Check(info) || PyTuple_GET_SIZE(info) < 2)
                ok = PyErr_Occurred() ? -1 : 0;
            else {
                long long bs = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(info, 1), &overflow);
                ok = PyErr_Occurred() ? -1 : !overflow && bs >= c->full_size;
            }
        }
    }
    for (Py_ssize_t i = 0; i < made; i++) {
        PyObject *h = x->objs[i], *copies = x->copies[i];
        if (ok != 1) {
            if ((copies != NULL && PyDict_SetItem(c->copies, h, copies)) ||
                (x->infos[i] != NULL && PyDict_SetItem(c->stored, h, x->infos[i])))
                ok = -1;
        } else if (x->infos[i] != NULL) {
            if (PyList_Append(c->removed_at, h) || PyList_Append(c->removed_at, at))
                ok = -1;
        } else {
            PyObject *less = PyLong_FromLongLong(PyLong_AsLongLong(copies) - 1);
            if (less == NULL || PyDict_SetItem(c->copies, h, less))
                ok = -1;
            Py_XDECREF(less);
        }
    }
    for (Py_ssize_t i = 0; i < made; i++) {
        Py_XDECREF(x->objs[i]);
        Py_XDECREF(x->copies[i]);
        Py_XDECREF(x->infos[i]);
    }
    if (ok == 1) {
        t->num_removed += num;
        t->live -= num;
    }
    return ok;
}


/* The first num events of `events` applied to `caches`, up to the first a check may fire on
 * (*done: how many were applied); -1 with an exception set. */
static int apply_events(uint64_t num, PyObject *caches, PyObject *seq, PyObject *batch,
                        Tally *t, uint64_t *done) {
    Cache c = {NULL, NULL, NULL, NULL, 0, 0};
    PyObject *at = PyTuple_Pack(2, seq, batch);
    Scratch x = {NULL, NULL, NULL, NULL, 0};
    int err = at == NULL;
    const Event *prev = NULL;
    uint64_t i = 0;
    for (; !err && i < num; i++) {
        const Event *e = &events[i];
        if (e->kind == CLEARED)
            break;
        if (prev == NULL || c.obj == NULL || e->medium_len != prev->medium_len ||
            e->group_len != prev->group_len ||
            memcmp(e->medium_at, prev->medium_at, e->medium_len) ||
            memcmp(e->group_at, prev->group_at, e->group_len)) {
            int found = find_cache(caches, e, &c);
            if (found <= 0) {
                err = found < 0;
                break;
            }
        }
        prev = e;
        if (grow(&x, e->num_hashes)) {
            err = 1;
            break;
        }
        int ok = e->kind == STORED ? store(e, &c, seq, batch, t, x.vals)
                                   : remove_blocks(e, &c, at, t, &x);
        if (ok <= 0) {
            err = ok < 0;
            break;
        }
    }
    drop(&c);
    Py_XDECREF(at);
    release(&x);
    *done = i;
    return err ? -1 : 0;
}

static PyObject *args_payload(PyObject *args) { return PyTuple_GET_ITEM(args, 0); }

static PyObject *apply(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *caches, *seq, *batch;
    long long live, peak;
    if (!PyArg_ParseTuple(args, "y*O!OOLL", &buf, &PyDict_Type, &caches, &seq, &batch, &live,
                          &peak))
        return NULL;
    Batch b = last;
    int bad = 0;
    if (args_payload(args) != events_of) {
        Py_CLEAR(events_of);
        bad = read_batch(buf.buf, buf.len, &b);
    }
    PyBuffer_Release(&buf);
    if (bad) {
        if (PyErr_Occurred())
            return NULL;
        /* not read here: all of it the checker's */
        return Py_BuildValue("(iLLii)", 0, live, peak, 0, 0);
    }
    Tally t = {live, peak, 0, 0};
    uint64_t done;
    if (apply_events(b.num_events, caches, seq, batch, &t, &done))
        return NULL;
    return Py_BuildValue("(KLLLL)", (unsigned long long)done, t.live, t.peak, t.num_stored,
                         t.num_removed);
}

/* --- a recorded stream's records (kvscope/events/streamfile.py), read here ---------------- */

static PyObject *s_publishers, *s_last_topic, *s_feed, *s_apply_rest, *s_num_records,
    *s_num_events, *s_next_seq, *s_last_ts, *s_counts, *s_caches, *s_live, *s_peak_stored,
    *s_batches, *s_events, *s_stored_count, *s_removed_count;

static inline uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* attr += by (an int attribute of obj, or an int in a dict when obj is a dict) */
static int add_to(PyObject *obj, PyObject *name, long long by) {
    int dict = PyDict_CheckExact(obj);
    PyObject *old = dict ? Py_XNewRef(PyDict_GetItemWithError(obj, name))
                         : PyObject_GetAttr(obj, name);
    if (old == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, name);
        return -1;
    }
    PyObject *n = PyLong_FromLongLong(by), *sum = n ? PyNumber_Add(old, n) : NULL;
    Py_DECREF(old);
    Py_XDECREF(n);
    if (sum == NULL)
        return -1;
    int err = dict ? PyDict_SetItem(obj, name, sum) : PyObject_SetAttr(obj, name, sum);
    Py_DECREF(sum);
    return err;
}

static int set_ll(PyObject *obj, PyObject *name, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    int err = o == NULL || PyObject_SetAttr(obj, name, o);
    Py_XDECREF(o);
    return err ? -1 : 0;
}

static int get_ll(PyObject *obj, PyObject *name, long long *out) {
    PyObject *o = PyObject_GetAttr(obj, name);
    if (o == NULL)
        return -1;
    *out = PyLong_AsLongLong(o);
    Py_DECREF(o);
    return PyErr_Occurred() ? -1 : 0;
}

/* A published batch whose publisher is known and whose seq is its next, applied as the
 * checker's feed() applies it: 1 done, 0 not such a batch (feed() takes it), -1 error. */
static int feed_one(PyObject *checker, PyObject *publishers, PyObject *last_topic,
                    int endpoint, const uint8_t *topic, uint32_t topic_len, uint64_t seq,
                    const uint8_t *payload, uint32_t payload_len) {
    Batch b;
    Py_CLEAR(events_of);
    if (read_batch(payload, payload_len, &b))
        return PyErr_Occurred() ? -1 : 0;
    if (seq > (uint64_t)LLONG_MAX - 1)
        return 0;
    PyObject *ep = PyLong_FromLong(endpoint);
    PyObject *top = PyBytes_FromStringAndSize((const char *)topic, topic_len);
    PyObject *rank = b.rank.t == UINT || b.rank.t == NEG ? int_of(&b.rank) : Py_NewRef(Py_None);
    PyObject *key = ep && top && rank ? PyTuple_Pack(3, ep, top, rank) : NULL;
    Py_XDECREF(rank);
    PyObject *pub = key ? PyDict_GetItemWithError(publishers, key) : NULL;
    Py_XDECREF(key);
    int ok = pub != NULL;
    long long next = -1;
    if (ok) {
        PyObject *n = PyObject_GetAttr(pub, s_next_seq);
        ok = n != NULL && PyLong_CheckExact(n) && (next = PyLong_AsLongLong(n)) == (long long)seq;
        Py_XDECREF(n);
    }
    if (!ok || PyErr_Occurred()) {
        Py_XDECREF(ep);
        Py_XDECREF(top);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(pub);
    /* feed(): the record's index is its batch; the endpoint's last topic; _sequence() */
    long long batch_ll = 0;
    PyObject *seq_obj = PyLong_FromUnsignedLongLong(seq), *batch = NULL, *caches = NULL,
             *counts = NULL, *ts = PyFloat_FromDouble(b.ts);
    int err = seq_obj == NULL || ts == NULL || get_ll(checker, s_num_records, &batch_ll) ||
              set_ll(checker, s_num_records, batch_ll + 1) ||
              PyDict_SetItem(last_topic, ep, top) || set_ll(pub, s_next_seq, (long long)seq + 1) ||
              PyObject_SetAttr(pub, s_last_ts, ts);
    if (!err) {
        batch = PyLong_FromLongLong(batch_ll);
        counts = PyObject_GetAttr(pub, s_counts);
        caches = PyObject_GetAttr(pub, s_caches);
        err = batch == NULL || counts == NULL || caches == NULL || !PyDict_CheckExact(caches) ||
              !PyDict_CheckExact(counts);
        if (err && !PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "a publisher whose counts or caches are no dict");
    }
    Tally t = {0, 0, 0, 0};
    uint64_t done = 0;
    err = err || add_to(counts, s_batches, 1) || add_to(counts, s_events, (long long)b.num_events) ||
          add_to(checker, s_num_events, (long long)b.num_events) ||
          get_ll(pub, s_live, &t.live) || get_ll(pub, s_peak_stored, &t.peak) ||
          apply_events(b.num_events, caches, seq_obj, batch, &t, &done) ||
          set_ll(pub, s_live, t.live) || set_ll(pub, s_peak_stored, t.peak) ||
          add_to(counts, s_stored_count, t.num_stored) ||
          add_to(counts, s_removed_count, t.num_removed);
    if (!err && done < b.num_events) {
        /* the rest of the batch, where a check may fire: the checker's */
        PyObject *p = PyBytes_FromStringAndSize((const char *)payload, payload_len);
        PyObject *from = PyLong_FromUnsignedLongLong(done);
        PyObject *r = p && from ? PyObject_CallMethodObjArgs(checker, s_apply_rest, pub, seq_obj,
                                                             batch, p, from, NULL)
                                : NULL;
        Py_XDECREF(p);
        Py_XDECREF(from);
        err = r == NULL;
        Py_XDECREF(r);
    }
    Py_XDECREF(ep);
    Py_XDECREF(top);
    Py_XDECREF(seq_obj);
    Py_XDECREF(ts);
    Py_XDECREF(batch);
    Py_XDECREF(counts);
    Py_XDECREF(caches);
    Py_DECREF(pub);
    return err ? -1 : 1;
}

#define RECORD_HEAD 12 /* u64 recv_ns, u8 source, u8 endpoint, u16 frames */
#define MAX_FRAMES 8

static PyObject *feed_records(PyObject *self, PyObject *args) {
    PyObject *checker, *mapping;
    Py_ssize_t pos;
    if (!PyArg_ParseTuple(args, "OOn", &checker, &mapping, &pos))
        return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(mapping, &buf, PyBUF_SIMPLE))
        return NULL;
    const uint8_t *data = buf.buf;
    Py_ssize_t end = buf.len;
    PyObject *publishers = PyObject_GetAttr(checker, s_publishers);
    PyObject *last_topic = PyObject_GetAttr(checker, s_last_topic);
    int err = publishers == NULL || last_topic == NULL, truncated = 0;
    if (!err && (!PyDict_CheckExact(publishers) || !PyDict_CheckExact(last_topic))) {
        PyErr_SetString(PyExc_TypeError, "a checker whose publishers or topics are no dict");
        err = 1;
    }
    while (!err && pos < end) {
        if (end - pos < RECORD_HEAD) {
            truncated = 1;
            break;
        }
        const uint8_t *r = data + pos;
        uint64_t recv_ns = le(r, 8);
        int source = r[8], endpoint = r[9];
        int nframes = (int)le(r + 10, 2);
        Py_ssize_t p = pos + RECORD_HEAD;
        Py_ssize_t at[MAX_FRAMES];
        uint32_t len[MAX_FRAMES];
        for (int i = 0; i < nframes; i++) {
            if (end - p < 4) {
                truncated = 1;
                break;
            }
            uint32_t n = (uint32_t)le(data + p, 4);
            p += 4;
            if ((uint64_t)(end - p) < n) {
                truncated = 1;
                break;
            }
            if (i < MAX_FRAMES) {
                at[i] = p;
                len[i] = n;
            }
            p += n;
        }
        if (truncated)
            break;
        int done = 0;
        if (source == 0 && nframes == 3 && len[1] == 8)
            done = feed_one(checker, publishers, last_topic, endpoint, data + at[0], len[0],
                            be(data + at[1], 8), data + at[2], len[2]);
        if (done < 0) {
            err = 1;
            break;
        }
        if (!done) {
            /* any other record: the checker's feed(), with the frames as records() gives them */
            PyObject *frames = PyList_New(0);
            Py_ssize_t q = pos + RECORD_HEAD;
            for (int i = 0; frames && i < nframes; i++) {
                uint32_t n = (uint32_t)le(data + q, 4);
                PyObject *f = PyBytes_FromStringAndSize((const char *)data + q + 4, n);
                if (f == NULL || PyList_Append(frames, f))
                    Py_CLEAR(frames);
                Py_XDECREF(f);
                q += 4 + n;
            }
            PyObject *ns = PyLong_FromUnsignedLongLong(recv_ns), *src = PyLong_FromLong(source),
                     *ep = PyLong_FromLong(endpoint);
            PyObject *out = frames && ns && src && ep
                                ? PyObject_CallMethodObjArgs(checker, s_feed, ns, src, ep, frames,
                                                             NULL)
                                : NULL;
            Py_XDECREF(frames);
            Py_XDECREF(ns);
            Py_XDECREF(src);
            Py_XDECREF(ep);
            if (out == NULL) {
                err = 1;
                break;
            }
            Py_DECREF(out);
        }
        pos = p;
    }
    Py_XDECREF(publishers);
    Py_XDECREF(last_topic);
    PyBuffer_Release(&buf);
    if (err)
        return NULL;
    return Py_BuildValue("(nO)", pos, truncated ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O,
     "scan(payload) -> (ts, rank or None, number of events), or None for a payload left to "
     "msgspec"},
    {"feed_records", feed_records, METH_VARARGS,
     "feed_records(checker, mapping, pos) -> (end, truncated): the records of a recorded "
     "stream from pos on, each a published batch applied here or given to checker.feed()"},
    {"apply", apply, METH_VARARGS,
     "apply(payload, caches, seq, batch, live, peak) -> (events applied, live, peak, stored, "
     "removed): the batch's events up to the first where a check may fire"},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_kvevents",
                                    "The KV-event checker's fast path (kvscope/events/checker.py).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__kvevents(void) {
    s_copies = PyUnicode_InternFromString("copies");
    s_stored = PyUnicode_InternFromString("stored");
    s_removed_at = PyUnicode_InternFromString("removed_at");
    s_log = PyUnicode_InternFromString("log");
    s_full_size = PyUnicode_InternFromString("full_size");
    s_special[0] = PyUnicode_InternFromString("cleared");
    s_special[1] = PyUnicode_InternFromString("superseded");
    s_special[2] = PyUnicode_InternFromString("retired");
    if (!s_copies || !s_stored || !s_removed_at || !s_log || !s_full_size || !s_special[0] ||
        !s_special[1] || !s_special[2])
        return NULL;
    PyObject **names[] = {&s_publishers, &s_last_topic, &s_feed,       &s_apply_rest,
                          &s_num_records, &s_num_events, &s_next_seq,  &s_last_ts,
                          &s_counts,     &s_caches,     &s_live,       &s_peak_stored,
                          &s_batches,    &s_events,     &s_stored_count, &s_removed_count};
    const char *texts[] = {"publishers", "_last_topic", "feed",    "_apply_rest",
                           "num_records", "num_events", "next_seq", "last_ts",
                           "counts",     "caches",     "live",     "peak_stored",
                           "batches",    "events",     "stored",   "removed"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if ((*names[i] = PyUnicode_InternFromString(texts[i])) == NULL)
            return NULL;
    return PyModule_Create(&moddef);
}
