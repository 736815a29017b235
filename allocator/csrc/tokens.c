/* What a caller passes to allocate, append and fork, read once by the core: the tokens as
 * int32s (the records' type) and the request id as a str. Part of _native.c.
 *
 * Tokens: a list or tuple of ints (or of integer scalars: their __index__), a one-dimensional
 * integer array through the buffer protocol (numpy, array.array, memoryview) or through
 * DLPack's C exchange API (a torch tensor: `type(t).__dlpack_c_exchange_api__`, no copy, no
 * Python call), any other sequence through its items. A tensor on a device the core cannot
 * read is read through its tolist(). docs/POOL.md lists what is refused and how. */

/* -- DLPack's C exchange API (dlpack.h, v1.x: the stable part the core uses) -------------- */

typedef struct {
    int32_t device_type; /* kDLCPU = 1, kDLCUDAHost = 3 (both host memory) */
    int32_t device_id;
} DLDevice_;

typedef struct {
    uint8_t code; /* kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLBfloat = 4, kDLBool = 6 */
    uint8_t bits;
    uint16_t lanes;
} DLDataType_;

typedef struct {
    void *data;
    DLDevice_ device;
    int32_t ndim;
    DLDataType_ dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL: compact row-major */
    uint64_t byte_offset;
} DLTensor_;

typedef struct DLApiHeader_ {
    struct {
        uint32_t major, minor;
    } version;
    struct DLApiHeader_ *prev_api;
} DLApiHeader_;

typedef struct {
    DLApiHeader_ header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor_ *out);
    void *current_work_stream;
} DLExchangeAPI_;

/* The types met (beyond list, tuple and buffers) with their exchange API, or NULL for a type
 * without one (read as a sequence): torch.Tensor, its subclasses, a user's sequence type. */
#define DL_TYPES 8
static PyTypeObject *dl_types[DL_TYPES];
static const DLExchangeAPI_ *dl_apis[DL_TYPES];

/* The exchange API of obj's type, or NULL (none, or not a version the core reads). */
static const DLExchangeAPI_ *dl_api_of(PyObject *obj) {
    PyTypeObject *tp = Py_TYPE(obj);
    for (int i = 0; i < DL_TYPES && dl_types[i]; i++)
        if (dl_types[i] == tp) return dl_apis[i];
    const DLExchangeAPI_ *api = NULL;
    PyObject *cap = PyObject_GetAttrString((PyObject *)tp, "__dlpack_c_exchange_api__");
    if (cap != NULL) {
        api = PyCapsule_GetPointer(cap, "dlpack_exchange_api");
        Py_DECREF(cap);
    }
    PyErr_Clear();
    if (api != NULL &&
        (api->header.version.major != 1 || api->dltensor_from_py_object_no_sync == NULL))
        api = NULL;
    for (int i = 0; i < DL_TYPES; i++)
        if (dl_types[i] == NULL) {
            dl_types[i] = (PyTypeObject *)Py_NewRef(tp);
            dl_apis[i] = api;
            break;
        }
    return api;
}

/* -- the tokens ----------------------------------------------------------------------------- */

static void tokens_done(Tokens *t) {
    if (t->v != t->small) PyMem_Free(t->v);
    t->v = t->small;
    Py_CLEAR(t->items);
}

static int tokens_room(Tokens *t, Py_ssize_t n) {
    t->n = n;
    if (n <= TOKENS_SMALL) return OK;
    t->v = PyMem_Malloc(sizeof(int32_t) * (size_t)n);
    if (t->v == NULL) {
        t->v = t->small;
        PyErr_NoMemory();
        return ERROR;
    }
    return OK;
}

/* PoolError, as register_errors() handed it to the core (a new reference), or NULL with an
 * exception set. */
static PyObject *pool_error_type(void) {
    if (PoolErrorType == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvscope: _native.register_errors() was not called");
        return NULL;
    }
    return Py_NewRef(PoolErrorType);
}

static int pool_error(const char *fmt, ...) {
    PyObject *cls = pool_error_type();
    if (cls == NULL) return ERROR;
    va_list va;
    va_start(va, fmt);
    PyObject *msg = PyUnicode_FromFormatV(fmt, va);
    va_end(va);
    if (msg != NULL) PyErr_SetObject(cls, msg);
    Py_XDECREF(msg);
    Py_DECREF(cls);
    return ERROR;
}

static int token_range_error(long long v, Py_ssize_t i) {
    return pool_error("token %lld at position %zd is outside the int32 range the pool stores", v,
                      i);
}

static int token_big_error(PyObject *o, Py_ssize_t i) {
    PyErr_Clear();
    return pool_error("token %R at position %zd is outside the int32 range the pool stores", o, i);
}

/* Item i of a list or tuple as an int32 into *out; *exact stays 1 while every item is an int.
 * An item that is not an integer: the TypeError of its __index__. */
static inline int token_item(PyObject *o, Py_ssize_t i, int32_t *out, int *exact) {
    PyObject *v = NULL;
    if (!PyLong_CheckExact(o)) {
        /* a numpy or torch integer scalar, a bool: its __index__, as operator.index takes it */
        *exact = 0;
        v = PyNumber_Index(o);
        if (v == NULL) return ERROR;
        o = v;
    }
#if PY_VERSION_HEX < 0x030C0000
    /* Up to 3.11 an int below 2**30 is one 30-bit digit with the sign in ob_size. */
    Py_ssize_t size = Py_SIZE(o);
    if (size >= -1 && size <= 1) {
        *out = (int32_t)(size * (long)((PyLongObject *)o)->ob_digit[0]);
        Py_XDECREF(v);
        return OK;
    }
#endif
    long long x = PyLong_AsLongLong(o);
    int rc = OK;
    if (x == -1 && PyErr_Occurred())
        rc = token_big_error(o, i);
    else if (x < INT32_MIN || x > INT32_MAX)
        rc = token_range_error(x, i);
    else
        *out = (int32_t)x;
    Py_XDECREF(v);
    return rc;
}

/* The items of a list or tuple; `want`: keep them in t->items (a list of the caller's is
 * copied first: Python code the operation runs could change it); `own`: seq is a list made
 * here. */
static int tokens_of_items(PyObject *seq, Tokens *t, int want, int own) {
    PyObject *keep;
    if (want && !own && PyList_CheckExact(seq))
        keep = PyList_GetSlice(seq, 0, PyList_GET_SIZE(seq));
    else
        keep = Py_NewRef(seq);
    if (keep == NULL) return ERROR;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keep);
    PyObject **items = PySequence_Fast_ITEMS(keep);
    int exact = 1, rc = tokens_room(t, n);
    for (Py_ssize_t i = 0; rc == OK && i < n; i++) rc = token_item(items[i], i, t->v + i, &exact);
    if (rc == OK && want && exact)
        t->items = keep;
    else
        Py_DECREF(keep);
    return rc;
}

/* The array's dtype as numpy or torch names it (its `dtype`), else the buffer's format. */
static int dtype_error(PyObject *obj, const char *format) {
    PyObject *dt = PyObject_GetAttrString(obj, "dtype");
    if (dt == NULL) {
        PyErr_Clear();
        return pool_error("tokens must be integers, got an array of format %s", format);
    }
    int rc = pool_error("tokens must be integers, got an array of dtype %S", dt);
    Py_DECREF(dt);
    return rc;
}

static int shape_error(int ndim, const Py_ssize_t *shape, const int64_t *shape64) {
    PyObject *s = PyTuple_New(ndim);
    for (int i = 0; s && i < ndim; i++) {
        PyObject *d = PyLong_FromLongLong(shape ? (long long)shape[i] : (long long)shape64[i]);
        if (d == NULL) Py_CLEAR(s);
        else PyTuple_SET_ITEM(s, i, d);
    }
    if (s == NULL) return ERROR;
    int rc = pool_error("tokens must be one-dimensional, got an array of shape %R", s);
    Py_DECREF(s);
    return rc;
}

/* The low `size` bytes of x in the other byte order. */
static inline uint64_t swapped(uint64_t x, int size) {
    return __builtin_bswap64(x) >> (64 - 8 * size);
}

/* n integers of `size` bytes, signed or not, in this machine's byte order or the other
 * (`swap`), `stride` bytes apart from p, into t->v. */
static int tokens_of_memory(Tokens *t, const char *p, Py_ssize_t n, Py_ssize_t stride, int size,
                            int is_signed, int swap) {
    if (tokens_room(t, n)) return ERROR;
    for (Py_ssize_t i = 0; i < n; i++, p += stride) {
        /* (little-endian: the low bytes first; the byte-order swap below fixes the rest) */
        uint64_t u = 0;
        memcpy(&u, p, (size_t)size);
#if !PY_LITTLE_ENDIAN
        u >>= 64 - 8 * size;
#endif
        if (swap) u = swapped(u, size);
        long long x;
        if (!is_signed) {
            if (u > (uint64_t)INT32_MAX)
                return pool_error("token %llu at position %zd is outside the int32 range the "
                                  "pool stores",
                                  (unsigned long long)u, i);
            x = (long long)u;
        } else {
            /* sign-extend from `size` bytes */
            int shift = 64 - 8 * size;
            x = (long long)(int64_t)(u << shift) >> shift;
        }
        if (x < INT32_MIN || x > INT32_MAX) return token_range_error(x, i);
        t->v[i] = (int32_t)x;
    }
    return OK;
}

/* A buffer's one-letter integer format ("q", "<i", ">H", "?"...): 1 signed, 0 unsigned, plus
 * 2 when its bytes are in the other byte order; -1 for anything else (floats, structs). */
static int int_format(const char *f) {
    if (f == NULL) return 0; /* unsigned bytes */
    int swap = 0;
    if (*f == '@' || *f == '=') f++;
    else if (*f == '<' || *f == '>' || *f == '!') swap = (*f++ == '<') != PY_LITTLE_ENDIAN;
    if (f[0] == 0 || f[1] != 0) return -1;
    if (strchr("bhilqn", f[0])) return 1 | swap << 1;
    if (strchr("BHILQN?", f[0])) return 0 | swap << 1;
    return -1;
}

static int tokens_of_buffer(PyObject *obj, Tokens *t) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) < 0) return ERROR;
    int rc;
    int sign = int_format(view.format);
    if (view.ndim != 1)
        rc = shape_error(view.ndim, view.shape, NULL);
    else if (sign < 0 || (view.itemsize != 1 && view.itemsize != 2 && view.itemsize != 4 &&
                          view.itemsize != 8))
        rc = dtype_error(obj, view.format ? view.format : "B");
    else
        rc = tokens_of_memory(t, view.buf, view.shape[0],
                              view.strides ? view.strides[0] : view.itemsize, (int)view.itemsize,
                              sign & 1, sign >> 1);
    PyBuffer_Release(&view);
    return rc;
}

/* -- numpy's ndarray, read from its fields ------------------------------------------------ */

/* The first fields of numpy's PyArrayObject_fields and PyArray_Descr (numpy/ndarraytypes.h),
 * the same in numpy 1.x and 2.x. Reading them spares the buffer protocol's export, which numpy
 * builds anew at every call (its format string compared with the one it keeps): about a tenth
 * of an allocation. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
} NpArray_;

typedef struct {
    PyObject_HEAD
    PyTypeObject *typeobj;
    char kind; /* 'i' signed, 'u' unsigned, 'b' bool */
    char type;
    char byteorder; /* '<', '>', '=' (native), '|' (one byte) */
    char flags;
    int type_num; /* NPY_BOOL 0, NPY_BYTE 1 ... NPY_ULONGLONG 10 */
} NpDescr_;

/* numpy.ndarray (the exact type), once met; whether its fields read as they do here: 1 yes
 * (checked against the buffer protocol on the first integer vector met), -1 no (its arrays go
 * through the buffer protocol), 0 not checked yet. */
static PyTypeObject *np_type;
static int np_fields_ok;

/* An integer vector's element as the fields say: OK with its size, signedness and byte order
 * (1: not this machine's), or UNHANDLED (not a one-dimensional integer array). */
static int np_int(PyObject *obj, int *size, int *is_signed, int *swap) {
    NpArray_ *a = (NpArray_ *)obj;
    if (a->nd != 1 || a->descr == NULL) return UNHANDLED;
    NpDescr_ *d = (NpDescr_ *)a->descr;
    static const signed char sizes[11] = {1, 1, 1, 2, 2, 4, 4, (signed char)sizeof(long),
                                          (signed char)sizeof(long), 8, 8};
    if (d->type_num < 0 || d->type_num > 10 || !(d->kind == 'i' || d->kind == 'u' || d->kind == 'b'))
        return UNHANDLED;
    *size = sizes[d->type_num];
    *is_signed = d->kind == 'i';
    *swap = d->byteorder == (PY_LITTLE_ENDIAN ? '>' : '<');
    return OK;
}

/* Whether this one-dimensional integer array's fields agree with what the buffer protocol
 * exports of it: 1, 0, or -1 with an exception set. */
static int np_fields_agree(PyObject *obj, int size, int is_signed, int swap) {
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_RECORDS_RO) < 0) return -1;
    NpArray_ *a = (NpArray_ *)obj;
    int sign = int_format(view.format);
    int ok = view.buf == (void *)a->data && view.ndim == 1 && view.shape[0] == a->dimensions[0] &&
             view.strides != NULL && view.strides[0] == a->strides[0] && view.itemsize == size &&
             sign >= 0 && (sign & 1) == is_signed && (sign >> 1) == swap;
    PyBuffer_Release(&view);
    return ok;
}

/* A numpy array read from its fields: OK, ERROR, or UNHANDLED (the caller reads it through the
 * buffer protocol: another type, a layout not checked or not as here, or an array that is not
 * a one-dimensional integer vector, whose error the buffer path words). */
static int tokens_of_numpy(PyObject *obj, Tokens *t) {
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp != np_type) {
        if (np_type != NULL || strcmp(tp->tp_name, "numpy.ndarray") != 0) return UNHANDLED;
        np_type = (PyTypeObject *)Py_NewRef(tp);
    }
    int size, is_signed, swap;
    if (np_fields_ok < 0 || np_int(obj, &size, &is_signed, &swap) != OK) return UNHANDLED;
    if (np_fields_ok == 0) {
        int agree = np_fields_agree(obj, size, is_signed, swap);
        if (agree < 0) return ERROR;
        np_fields_ok = agree ? 1 : -1;
        if (!agree) return UNHANDLED;
    }
    NpArray_ *a = (NpArray_ *)obj;
    return tokens_of_memory(t, a->data, a->dimensions[0], a->strides[0], size, is_signed, swap);
}

/* A tensor through DLPack: OK, ERROR, or UNHANDLED when its memory is not the host's (the
 * caller reads its tolist()). */
static int tokens_of_dlpack(PyObject *obj, const DLExchangeAPI_ *api, Tokens *t) {
    DLTensor_ dl;
    if (api->dltensor_from_py_object_no_sync(obj, &dl)) return ERROR;
    if (dl.ndim != 1) return shape_error(dl.ndim, NULL, dl.shape);
    int code = dl.dtype.code, bits = dl.dtype.bits;
    if (dl.dtype.lanes != 1 || !(code == 0 || code == 1 || code == 6) ||
        !(bits == 8 || bits == 16 || bits == 32 || bits == 64))
        return dtype_error(obj, "?");
    if (dl.device.device_type != 1 && dl.device.device_type != 3) return UNHANDLED;
    int64_t stride = dl.strides ? dl.strides[0] : 1;
    return tokens_of_memory(t, (const char *)dl.data + dl.byte_offset, (Py_ssize_t)dl.shape[0],
                            (Py_ssize_t)(stride * (bits / 8)), bits / 8, code == 0, 0);
}

/* Any other sequence (a range, a tensor's tolist()...) through its items. */
static int tokens_of_sequence(PyObject *obj, Tokens *t, int want) {
    PyObject *seq = PySequence_Fast(obj, "tokens must be a sequence of ints or a one-dimensional "
                                         "integer array");
    if (seq == NULL) return ERROR;
    int rc = tokens_of_items(seq, t, want, seq != obj);
    Py_DECREF(seq);
    return rc;
}

static int tokens_read(PyObject *obj, Tokens *t, int want_items) {
    t->v = t->small;
    t->n = 0;
    t->items = NULL;
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj))
        return tokens_of_items(obj, t, want_items, 0);
    int rc = tokens_of_numpy(obj, t);
    if (rc != UNHANDLED) return rc;
    if (PyObject_CheckBuffer(obj)) return tokens_of_buffer(obj, t);
    const DLExchangeAPI_ *api = dl_api_of(obj);
    if (api == NULL) return tokens_of_sequence(obj, t, want_items);
    rc = tokens_of_dlpack(obj, api, t);
    if (rc != UNHANDLED) return rc;
    PyObject *list = PyObject_CallMethod(obj, "tolist", NULL);
    if (list == NULL) return ERROR;
    rc = tokens_of_sequence(list, t, want_items);
    Py_DECREF(list);
    return rc;
}

static PyObject *tokens_list(const Tokens *t) {
    if (t->items != NULL && PyList_CheckExact(t->items)) return Py_NewRef(t->items);
    PyObject *out = PyList_New(t->n);
    if (out == NULL) return NULL;
    if (t->items != NULL) {
        PyObject **items = PySequence_Fast_ITEMS(t->items);
        for (Py_ssize_t i = 0; i < t->n; i++) PyList_SET_ITEM(out, i, Py_NewRef(items[i]));
        return out;
    }
    for (Py_ssize_t i = 0; i < t->n; i++) {
        PyObject *v = PyLong_FromLong(t->v[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

/* Append ints of the values v[0..k) to `list` (a sequence's own). */
static int ints_extend(PyObject *list, const int32_t *v, Py_ssize_t k) {
    if (k == 1) return append_new(list, PyLong_FromLong(v[0]));
    PyObject *more = PyList_New(k);
    if (more == NULL) return ERROR;
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *x = PyLong_FromLong(v[i]);
        if (x == NULL) {
            Py_DECREF(more);
            return ERROR;
        }
        PyList_SET_ITEM(more, i, x);
    }
    Py_ssize_t end = PyList_GET_SIZE(list);
    int rc = PyList_SetSlice(list, end, end, more);
    Py_DECREF(more);
    return rc ? ERROR : OK;
}

/* -- the request id ------------------------------------------------------------------------- */

/* The str of the int ids met last, by value (a small direct-mapped cache: a request's id
 * given again, as its forks are, costs no str), and the str of an int id made without going
 * through int.__str__. */
#define INT_IDS 64
static struct {
    long long v;
    PyObject *s;
} int_ids[INT_IDS];

/* str(rid) of an exact int: a new reference, or NULL with an exception set. */
static PyObject *int_id_str(PyObject *rid) {
    int over;
    long long v = PyLong_AsLongLongAndOverflow(rid, &over);
    if (over || (v == -1 && PyErr_Occurred()) || v == LLONG_MIN) {
        PyErr_Clear();
        return PyObject_Str(rid);
    }
    size_t at = (size_t)v % INT_IDS;
    if (int_ids[at].s != NULL && int_ids[at].v == v) return Py_NewRef(int_ids[at].s);
    char buf[24], *e = buf + sizeof buf, *p = e;
    unsigned long long u = v < 0 ? (unsigned long long)-v : (unsigned long long)v;
    do *--p = (char)('0' + u % 10);
    while ((u /= 10) != 0);
    if (v < 0) *--p = '-';
    PyObject *s = PyUnicode_New(e - p, 127);
    if (s == NULL) return NULL;
    memcpy(PyUnicode_DATA(s), p, (size_t)(e - p));
    int_ids[at].v = v;
    Py_XSETREF(int_ids[at].s, Py_NewRef(s));
    return s;
}

static PyObject *request_str(PyObject *rid) {
    if (PyUnicode_CheckExact(rid)) return Py_NewRef(rid);
    return PyLong_CheckExact(rid) ? int_id_str(rid) : PyObject_Str(rid);
}
