/* The configuration of the core's own checks of a CUDA pool's K/V (devchecks.c): libcuda's entry
 * points looked up, the check kernel's handles and parameters taken from
 * allocator/devicechecks.py, the launch test it compares with Triton's, the queue's counts.
 * Part of _native.c. */

static void dev_free(DevChecks *d) {
    if (d == NULL) return;
    if (d->cuda && !d->broken && d->q_count && dev_cover(d) == OK) {
        /* (checks launched since the last settle: the GPU is past them before their ring goes) */
        int32_t ev = dev_at(d, d->q_count - 1)->ev;
        if (ev >= 0) d->cu.ev_sync(d->ev[ev]);
    }
    for (int64_t i = 0; i < d->q_count; i++) Py_CLEAR(dev_at(d, i)->tag);
    for (int64_t i = 0; i < d->n_found; i++) Py_CLEAR(d->found[i].message);
    PyMem_Free(d->found);
    PyMem_Free(d->stamps);
    PyMem_Free(d->pub_ids);
    PyMem_Free(d->pub_gen);
    for (int64_t i = 0; i < DEV_ENTRIES; i++)
        if (d->ev[i] != NULL && d->cu.ev_destroy) d->cu.ev_destroy(d->ev[i]);
    Py_XDECREF(d->ring_obj);
    Py_XDECREF(d->kv_obj);
    Py_XDECREF(d->stream_fn);
    PyMem_Free(d);
}

static int dev_int(PyObject *cfg, const char *key, long long *out) {
    PyObject *v = PyDict_GetItemString(cfg, key);
    if (v == NULL) {
        PyErr_Format(PyExc_KeyError, "device_checks: no %s", key);
        return -1;
    }
    *out = PyLong_AsLongLong(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* A tuple of N_MODES (or nparams) ints of cfg[key] into out. */
static int dev_ints(PyObject *cfg, const char *key, Py_ssize_t len, long long *out) {
    PyObject *v = PyDict_GetItemString(cfg, key);
    if (v == NULL || !PyTuple_Check(v) || PyTuple_GET_SIZE(v) != len) {
        PyErr_Format(PyExc_ValueError, "device_checks: %s must be a tuple of %zd", key, len);
        return -1;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        out[i] = (long long)PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(v, i));
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

static int dev_driver(CuApi *cu) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == NULL) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == NULL) return -1;
    cu->launch = (CUres(*)(CUhandle, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, CUhandle, void **, void **))dlsym(lib, "cuLaunchKernel");
    cu->ev_create = (CUres(*)(CUhandle *, unsigned))dlsym(lib, "cuEventCreate");
    cu->ev_record = (CUres(*)(CUhandle, CUhandle))dlsym(lib, "cuEventRecord");
    cu->ev_query = (CUres(*)(CUhandle))dlsym(lib, "cuEventQuery");
    cu->ev_sync = (CUres(*)(CUhandle))dlsym(lib, "cuEventSynchronize");
    cu->ev_destroy = (CUres(*)(CUhandle))dlsym(lib, "cuEventDestroy_v2");
    cu->stream_sync = (CUres(*)(CUhandle))dlsym(lib, "cuStreamSynchronize");
    cu->ctx_get = (CUres(*)(CUhandle *))dlsym(lib, "cuCtxGetCurrent");
    cu->ctx_set = (CUres(*)(CUhandle))dlsym(lib, "cuCtxSetCurrent");
    cu->primary_retain = (CUres(*)(CUhandle *, int))dlsym(lib, "cuDevicePrimaryCtxRetain");
    cu->memset8 = (CUres(*)(uint64_t, unsigned char, size_t, CUhandle))dlsym(lib, "cuMemsetD8Async");
    cu->memset16 =
        (CUres(*)(uint64_t, unsigned short, size_t, CUhandle))dlsym(lib, "cuMemsetD16Async");
    cu->memset32 =
        (CUres(*)(uint64_t, unsigned int, size_t, CUhandle))dlsym(lib, "cuMemsetD32Async");
    return cu->launch && cu->ev_create && cu->ev_record && cu->ev_query && cu->ev_sync &&
                   cu->ev_destroy && cu->stream_sync && cu->ctx_get && cu->ctx_set &&
                   cu->primary_retain && cu->memset8 && cu->memset16 && cu->memset32
               ? 0
               : -1;
}

/* device_checks(config | None): the core launches the checks itself from now on (None: no
 * more; refused while checks wait, or answers wait to be applied). config (allocator/
 * devicechecks.py configure): ring (a page-locked int64 tensor), ring_ptr, ring_words,
 * max_pending, kv (the tensor), kv_ptr; on a GPU: cuda=True, device, stream (a callable),
 * functions, threads, shared (one per kernels/checks.py mode), param_sizes, param_values (the
 * kernel's parameters, in its order), ids_param, out_param; on a CPU pool: cuda=False.
 * Digests answered and not yet written go over to the new configuration. */
static PyObject *N_device_checks(Native *n, PyObject *cfg) {
    if (n->dev != NULL && (n->dev->q_count || n->dev->n_found)) {
        PyErr_SetString(PyExc_RuntimeError, "device_checks: checks still wait (device_take first)");
        return NULL;
    }
    if (cfg != Py_None && !PyDict_Check(cfg)) {
        PyErr_SetString(PyExc_TypeError, "device_checks(config: dict | None)");
        return NULL;
    }
    if (cfg == Py_None) {
        dev_free(n->dev);
        n->dev = NULL;
        n->checks_unnamed = 0;
        Py_RETURN_NONE;
    }
    DevChecks *d = PyMem_Calloc(1, sizeof *d);
    if (d == NULL) return PyErr_NoMemory();
    long long v, cuda, words, ptr;
    if (dev_int(cfg, "cuda", &cuda) || dev_int(cfg, "ring_ptr", &ptr) ||
        dev_int(cfg, "ring_words", &words) || dev_int(cfg, "max_pending", &v))
        goto fail;
    d->cuda = (int)cuda;
    d->ring = (int64_t *)(intptr_t)ptr;
    d->ring_words = words;
    d->max_pending = v;
    d->ring_obj = Py_XNewRef(PyDict_GetItemString(cfg, "ring"));
    d->kv_obj = Py_XNewRef(PyDict_GetItemString(cfg, "kv"));
    if (dev_int(cfg, "kv_ptr", &ptr)) goto fail;
    d->kv_dev = (uint64_t)ptr;
    for (int64_t i = 0; i < DEV_ENTRIES; i++) d->ev_free[i] = (int32_t)(DEV_ENTRIES - 1 - i);
    d->n_ev_free = DEV_ENTRIES;
    if (d->cuda) {
        long long fn[N_MODES], th[N_MODES], sh[N_MODES], np_, ip, op, dev;
        if (dev_driver(&d->cu) != 0) {
            PyErr_SetString(PyExc_RuntimeError, "device_checks: libcuda's entry points not found");
            goto fail;
        }
        d->stream_fn = Py_XNewRef(PyDict_GetItemString(cfg, "stream"));
        PyObject *sizes = PyDict_GetItemString(cfg, "param_sizes");
        if (d->stream_fn == NULL || sizes == NULL || !PyTuple_Check(sizes)) {
            PyErr_SetString(PyExc_ValueError, "device_checks: stream and param_sizes needed");
            goto fail;
        }
        np_ = PyTuple_GET_SIZE(sizes);
        if (np_ < 1 || np_ > DEV_PARAMS) {
            PyErr_SetString(PyExc_ValueError, "device_checks: too many kernel parameters");
            goto fail;
        }
        long long ps[DEV_PARAMS], pv[DEV_PARAMS];
        if (dev_ints(cfg, "functions", N_MODES, fn) || dev_ints(cfg, "threads", N_MODES, th) ||
            dev_ints(cfg, "shared", N_MODES, sh) || dev_ints(cfg, "param_sizes", np_, ps) ||
            dev_ints(cfg, "param_values", np_, pv) || dev_int(cfg, "ids_param", &ip) ||
            dev_int(cfg, "out_param", &op) || dev_int(cfg, "device", &dev))
            goto fail;
        if (ip < 0 || ip >= np_ || op < 0 || op >= np_) {
            PyErr_SetString(PyExc_ValueError, "device_checks: ids_param, out_param out of range");
            goto fail;
        }
        for (int i = 0; i < N_MODES; i++) {
            d->fn[i] = (CUhandle)(intptr_t)fn[i];
            d->threads[i] = (unsigned)th[i];
            d->shared[i] = (unsigned)sh[i];
        }
        d->nparams = (int)np_;
        d->ids_param = (int)ip;
        d->out_param = (int)op;
        d->device = (int)dev;
        for (int i = 0; i < d->nparams; i++) {
            /* (each value as 8 bytes: the driver copies as many as the kernel's parameter
             * takes, from its first, little-endian, byte) */
            if (ps[i] != 4 && ps[i] != 8) {
                PyErr_SetString(PyExc_ValueError, "device_checks: parameters of 4 or 8 bytes");
                goto fail;
            }
            d->pval[i] = (uint64_t)pv[i];
        }
    } else {
        d->cpu_kv = (uint8_t *)(uintptr_t)d->kv_dev;
    }
    if (n->dev != NULL) {
        /* (a configuration replaces the last only once it is whole) */
        d->stamps = n->dev->stamps;
        d->n_stamps = n->dev->n_stamps;
        d->cap_stamps = n->dev->cap_stamps;
        n->dev->stamps = NULL;
        n->dev->n_stamps = n->dev->cap_stamps = 0;
        /* (and a batch of publications' kept checks: configured inside the batch, from Python
         * the core called) */
        d->batching = n->dev->batching;
        d->pub_kind = n->dev->pub_kind;
        d->pub_ids = n->dev->pub_ids;
        d->pub_gen = n->dev->pub_gen;
        d->n_pub = n->dev->n_pub;
        d->cap_pub = n->dev->cap_pub;
        d->cap_gen = n->dev->cap_gen;
        n->dev->pub_ids = NULL;
        n->dev->pub_gen = NULL;
        n->dev->n_pub = n->dev->cap_pub = n->dev->cap_gen = 0;
    }
    dev_free(n->dev);
    n->dev = d;
    Py_RETURN_NONE;
fail:
    dev_free(d);
    return NULL;
}

/* device_test(mode, block) -> int: one check of `block` launched here and waited for (the
 * configuration's test: devicechecks compares it with Triton's own launch); its first answer
 * word. Only while no check waits. */
static PyObject *N_device_test(Native *n, PyObject *const *args, Py_ssize_t nargs) {
    DevChecks *d = n->dev;
    int mode;
    int32_t b;
    if (nargs != 2 || (mode = (int)PyLong_AsLong(args[0])) < 0 || mode >= N_MODES ||
        (b = (int32_t)PyLong_AsLong(args[1])) < 0 || b >= n->nb) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "device_test(mode, block)");
        return NULL;
    }
    if (d == NULL || d->q_count || d->n_found) {
        PyErr_SetString(PyExc_RuntimeError, "device_test: no checks configured, or some wait");
        return NULL;
    }
    int said = d->said;
    d->said = 1; /* (a failure is this call's error, not a warning) */
    int kind = mode == M_DIGEST          ? DK_VERIFY
               : mode == M_COUNTS        ? DK_POISON
               : mode == M_CANARY        ? DK_CANARY
               : mode == M_CANARY_POISON ? DK_RELEASE
                                         : DK_FILL;
    PyObject *pool = n->pool;
    n->pool = NULL;
    int mh = n->mutex_held;
    n->mutex_held = 1; /* (the caller holds the op mutex) */
    int rc = dev_check(n, kind, &b, 1, "a test", 0, NULL);
    n->mutex_held = mh;
    n->pool = pool;
    if (!d->broken) d->said = said;
    if (rc != OK) return NULL;
    if (d->broken || d->q_count != 1) {
        PyErr_Format(PyExc_RuntimeError, "device_test: the launch failed (CUresult %d)", d->broken);
        return NULL;
    }
    DevEntry *e = dev_at(d, 0);
    if (d->cuda) {
        CUres r;
        Py_BEGIN_ALLOW_THREADS
        r = d->cu.stream_sync(d->open_stream);
        Py_END_ALLOW_THREADS
        if (r != 0) d->broken = r;
    }
    int64_t word = d->ring[e->at + 1];
    Py_CLEAR(e->tag);
    if (e->ev >= 0) d->ev_free[d->n_ev_free++] = e->ev;
    d->q_count = 0;
    d->q_tail = 0;
    d->open_from = 0;
    d->head = 0;
    if (d->broken) {
        PyErr_Format(PyExc_RuntimeError, "device_test: CUresult %d", d->broken);
        return NULL;
    }
    return PyLong_FromLongLong(word);
}

static PyObject *N_device_stats(Native *n, PyObject *unused) {
    DevChecks *d = n->dev;
    if (d == NULL) Py_RETURN_NONE;
    return Py_BuildValue("{sLsLsKsKsi}", "waiting", (long long)d->q_count, "unapplied",
                         (long long)(d->n_stamps + d->n_found), "launched",
                         (unsigned long long)d->launched, "events",
                         (unsigned long long)d->recorded, "broken", d->broken);
}
