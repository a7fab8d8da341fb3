/* Many small leaves into one buffer, and back, with their crc32c: one call per pack.
 *
 * A pack of 2,048 leaves of 4 KiB built in Python costs a memoryview slice, a copy and a
 * crc32c call per leaf, about 2.4 us each and all of it holding the GIL: 4-5 ms per 8 MiB
 * pack, built one after another, 50 ms of a 135 ms plain save of 20,000 such leaves. Here
 * the buffers are taken with the GIL (a buffer export per leaf) and the copies and
 * checksums run without it: 1.5-3 ms per pack.
 *
 * The crc32c is the CPU's (SSE 4.2 crc32 instruction, three streams at once), as fast as the
 * crc32c package's from 4 KiB to 1 MiB, and found right after each leaf's copy, while the
 * copy is still in the core's cache. Without the instruction the module says so
 * (``hardware_crc32c`` is 0) and ckptstore uses its Python loop.
 *
 * The leaves' xxh3-128 can be found in the same pass (``gather(..., True)``), right after each
 * copy, while the leaf is still in cache and without the GIL: a save with nothing to compare
 * with hashes its packed leaves so. The function is the xxhash package's own ``XXH3_128bits``,
 * whose address ckptstore.store.checksum finds in that package's module and hands to
 * ``bind_xxh3``; this module hashes nothing itself.
 *
 * ``copy_from`` copies many small host arrays into a staging arena in one call, without the GIL
 * and without hashing: numpy arrays through their buffers, torch tensors (which export none) by
 * their data pointers. It is ckptstore.stage.stager's bulk copy, used through
 * ckptstore.store.buffers.copy_into, which copies buffers in a Python loop where this module is
 * missing (and the stager then leaves torch tensors to torch's own copies).
 *
 * The pack kernels are used through ckptstore.store.checksum (gather_crc32c, gather_digests,
 * first_mismatch), which also holds the Python loop that gives the same results where this
 * module is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <nmmintrin.h>
#define HAVE_SSE42 1

/* Bytes of each of the three streams one step of crc32c hashes at once: the instruction takes
 * three cycles but can start one a cycle, so three independent streams run three times as fast
 * as one; their registers are then joined with "shift by STRIDE (2 STRIDE) zero bytes" tables
 * (a crc32c register is linear in what it has seen). Long buffers go in steps of LONG_STRIDE,
 * where the join's cost vanishes beside the hashing; the rest in steps of STRIDE. */
#define STRIDE 256
#define LONG_STRIDE 8192

static uint32_t shift_one[4][256]; /* register after STRIDE more zero bytes, by byte */
static uint32_t shift_two[4][256]; /* after 2 STRIDE */
static uint32_t long_one[4][256];  /* after LONG_STRIDE */
static uint32_t long_two[4][256];  /* after 2 LONG_STRIDE */

__attribute__((target("sse4.2"))) static uint32_t
after_zeros(uint32_t c, size_t n)
{
    uint64_t r = c;
    for (size_t i = 0; i < n; i += 8)
        r = _mm_crc32_u64(r, 0);
    return (uint32_t)r;
}

static void
fill_shift(uint32_t table[4][256], size_t zeros)
{
    uint32_t basis[32];
    for (int bit = 0; bit < 32; bit++)
        basis[bit] = after_zeros(1u << bit, zeros);
    for (int part = 0; part < 4; part++)
        for (int byte = 0; byte < 256; byte++) {
            uint32_t v = 0;
            for (int k = 0; k < 8; k++)
                if (byte & (1 << k))
                    v ^= basis[8 * part + k];
            table[part][byte] = v;
        }
}

static inline uint32_t
shifted(uint32_t table[4][256], uint32_t c)
{
    return table[0][c & 255] ^ table[1][(c >> 8) & 255] ^ table[2][(c >> 16) & 255] ^
           table[3][c >> 24];
}

/* The register ``c`` after the whole steps of 3 ``stride`` bytes at ``*p``, each hashed as
 * three streams and joined; ``*p`` and ``*n`` move past them. */
__attribute__((target("sse4.2"))) static inline uint64_t
three_streams(uint64_t c, const unsigned char **at, size_t *left, size_t stride,
              uint32_t one[4][256], uint32_t two[4][256])
{
    const unsigned char *p = *at;
    size_t n = *left;
    while (n >= 3 * stride) {
        uint64_t a = c, b = 0, z = 0, word;
        for (size_t i = 0; i < stride; i += 8) {
            memcpy(&word, p + i, 8);
            a = _mm_crc32_u64(a, word);
            memcpy(&word, p + stride + i, 8);
            b = _mm_crc32_u64(b, word);
            memcpy(&word, p + 2 * stride + i, 8);
            z = _mm_crc32_u64(z, word);
        }
        c = shifted(two, (uint32_t)a) ^ shifted(one, (uint32_t)b) ^ (uint32_t)z;
        p += 3 * stride;
        n -= 3 * stride;
    }
    *at = p;
    *left = n;
    return c;
}

__attribute__((target("sse4.2"))) static uint32_t
crc32c(const unsigned char *p, size_t n)
{
    uint64_t c = 0xFFFFFFFFu;
    while (n && ((uintptr_t)p & 7)) {
        c = _mm_crc32_u8((uint32_t)c, *p++);
        n--;
    }
    c = three_streams(c, &p, &n, LONG_STRIDE, long_one, long_two);
    c = three_streams(c, &p, &n, STRIDE, shift_one, shift_two);
    while (n >= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
        p += 8;
        n -= 8;
    }
    while (n--)
        c = _mm_crc32_u8((uint32_t)c, *p++);
    return ~(uint32_t)c;
}

static int
hardware_crc32c(void)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("sse4.2"))
        return 0;
    fill_shift(shift_one, STRIDE);
    fill_shift(shift_two, 2 * STRIDE);
    fill_shift(long_one, LONG_STRIDE);
    fill_shift(long_two, 2 * LONG_STRIDE);
    return 1;
}
#else
#define HAVE_SSE42 0

static uint32_t
crc32c(const unsigned char *p, size_t n)
{
    (void)p;
    (void)n;
    return 0; /* never called: hardware_crc32c is 0 */
}

static int
hardware_crc32c(void)
{
    return 0;
}
#endif

/* The Python ints of ``seq`` (a list or tuple) as Py_ssize_t; NULL with an error set. */
static Py_ssize_t *
ssize_array(PyObject *seq, const char *what, Py_ssize_t *count)
{
    PyObject *fast = PySequence_Fast(seq, what);
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_ssize_t *out = PyMem_Malloc((n ? n : 1) * sizeof(Py_ssize_t));
    if (out == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsSsize_t(items[i]);
        if (out[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *count = n;
    return out;
}

/* A pack's leaves and where the plan puts them, as C arrays. */
struct placement {
    Py_ssize_t *order; /* the leaves, in offset order */
    Py_ssize_t *offsets, *lengths; /* per leaf of the plan */
    Py_ssize_t n, n_offsets, n_lengths;
};

static void
placement_free(struct placement *p)
{
    PyMem_Free(p->order);
    PyMem_Free(p->offsets);
    PyMem_Free(p->lengths);
}

/* Fill ``p`` from the Python sequences; -1 with an error set (``p`` is then freed too). */
static int
placement_take(struct placement *p, PyObject *leaves, PyObject *offsets, PyObject *lengths)
{
    memset(p, 0, sizeof *p);
    p->order = ssize_array(leaves, "leaves must be a sequence", &p->n);
    if (p->order != NULL)
        p->offsets = ssize_array(offsets, "offsets must be a sequence", &p->n_offsets);
    if (p->offsets != NULL)
        p->lengths = ssize_array(lengths, "lengths must be a sequence", &p->n_lengths);
    if (p->lengths == NULL) {
        placement_free(p);
        return -1;
    }
    return 0;
}

/* Leaf ``leaf``'s place, checked to lie in ``size`` bytes; -1 with an error set. */
static int
placement_of(const struct placement *p, Py_ssize_t leaf, Py_ssize_t size, Py_ssize_t *offset,
             Py_ssize_t *length)
{
    if (leaf < 0 || leaf >= p->n_offsets || leaf >= p->n_lengths) {
        PyErr_Format(PyExc_IndexError, "leaf %zd has no offset or length", leaf);
        return -1;
    }
    *offset = p->offsets[leaf];
    *length = p->lengths[leaf];
    if (*offset < 0 || *length < 0 || *offset > size - *length) {
        PyErr_Format(PyExc_ValueError, "leaf %zd ([%zd, +%zd)) lies outside the %zd-byte buffer",
                     leaf, *offset, *length, size);
        return -1;
    }
    return 0;
}

/* XXH128_hash_t and XXH3_128bits of the xxhash library (xxhash.h): two 64-bit halves,
 * returned by value. */
typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_t;
typedef xxh128_t (*xxh3_128_fn)(const void *data, size_t length);

static xxh3_128_fn xxh3_128 = NULL; /* set by bind_xxh3 */

struct member {
    Py_ssize_t offset;
    Py_ssize_t length;
    Py_buffer view; /* view.obj is NULL for a leaf this call does not copy */
    uint32_t crc;
    xxh128_t hash;
};

/* bind_xxh3(address) -> None: the address of the xxhash library's XXH3_128bits. */
static PyObject *
bind_xxh3(PyObject *self, PyObject *arg)
{
    void *address = PyLong_AsVoidPtr(arg);
    if (address == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "bind_xxh3: a null address");
        return NULL;
    }
    xxh3_128 = (xxh3_128_fn)address;
    Py_RETURN_NONE;
}

/* The hex digest xxhash.xxh3_128_hexdigest gives: the high half, then the low one. */
static PyObject *
hex_digest(xxh128_t h)
{
    static const char digits[] = "0123456789abcdef";
    char text[32];
    for (int i = 0; i < 16; i++) {
        text[i] = digits[(h.high64 >> (60 - 4 * i)) & 15];
        text[16 + i] = digits[(h.low64 >> (60 - 4 * i)) & 15];
    }
    return PyUnicode_FromStringAndSize(text, 32);
}

/* gather(out, arrays, leaves, offsets, lengths, hashed=False) -> (crcs, skipped[, hashes])
 *
 * For each position k of ``leaves`` (leaf i = leaves[k]): copy the C-contiguous buffer of
 * arrays[i] to out[offsets[i]:offsets[i] + lengths[i]], zero the bytes between the previous
 * member's end and that offset, and find its crc32c (and, if ``hashed``, its xxh3-128 hex
 * digest: bind_xxh3 first). ``crcs`` (``hashes``) has one entry per position; ``skipped``
 * lists the positions whose array exports no C-contiguous buffer: they are neither copied
 * nor hashed (their entries are None).
 */
static PyObject *
gather(PyObject *self, PyObject *args)
{
    Py_buffer out;
    PyObject *arrays, *leaves, *offsets_seq, *lengths_seq;
    int hashed = 0;
    if (!PyArg_ParseTuple(args, "w*OOOO|p:gather", &out, &arrays, &leaves, &offsets_seq,
                          &lengths_seq, &hashed))
        return NULL;
    if (hashed && xxh3_128 == NULL) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_RuntimeError, "gather: no xxh3 function bound (bind_xxh3)");
        return NULL;
    }
    PyObject *result = NULL, *fast_arrays = NULL;
    struct placement place;
    Py_ssize_t n = 0, taken = 0;
    struct member *members = NULL;

    if (placement_take(&place, leaves, offsets_seq, lengths_seq) < 0) {
        PyBuffer_Release(&out);
        return NULL;
    }
    n = place.n;
    fast_arrays = PySequence_Fast(arrays, "arrays must be a sequence");
    if (fast_arrays == NULL)
        goto done;
    members = PyMem_Calloc(n ? n : 1, sizeof(struct member));
    if (members == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n_arrays = PySequence_Fast_GET_SIZE(fast_arrays);
    PyObject **items = PySequence_Fast_ITEMS(fast_arrays);
    for (; taken < n; taken++) {
        Py_ssize_t leaf = place.order[taken];
        struct member *m = &members[taken];
        if (placement_of(&place, leaf, out.len, &m->offset, &m->length) < 0)
            goto done;
        if (leaf >= n_arrays) {
            PyErr_Format(PyExc_IndexError, "leaf %zd has no array", leaf);
            goto done;
        }
        if (PyObject_GetBuffer(items[leaf], &m->view, PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear(); /* strided, or no buffer at all: the caller copies it */
            m->view.obj = NULL;
            continue;
        }
        if (m->view.len != m->length) {
            PyErr_Format(PyExc_ValueError, "leaf %zd is %zd bytes, but its length is %zd",
                         leaf, m->view.len, m->length);
            PyBuffer_Release(&m->view);
            m->view.obj = NULL;
            goto done;
        }
    }

    Py_BEGIN_ALLOW_THREADS
    unsigned char *base = out.buf;
    Py_ssize_t position = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        struct member *m = &members[k];
        if (m->offset > position)
            memset(base + position, 0, (size_t)(m->offset - position));
        if (m->view.obj != NULL) {
            memcpy(base + m->offset, m->view.buf, (size_t)m->length);
            m->crc = crc32c(base + m->offset, (size_t)m->length);
            if (hashed)
                m->hash = xxh3_128(base + m->offset, (size_t)m->length);
        }
        position = m->offset + m->length;
    }
    Py_END_ALLOW_THREADS

    PyObject *crcs = PyList_New(n);
    PyObject *skipped = PyList_New(0);
    PyObject *hashes = hashed ? PyList_New(n) : NULL;
    if (crcs == NULL || skipped == NULL || (hashed && hashes == NULL)) {
        Py_XDECREF(crcs);
        Py_XDECREF(skipped);
        Py_XDECREF(hashes);
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        struct member *m = &members[k];
        PyObject *value;
        if (m->view.obj != NULL) {
            value = PyLong_FromUnsignedLong(m->crc);
        } else {
            value = Py_NewRef(Py_None);
        }
        if (value == NULL)
            goto fail_lists;
        PyList_SET_ITEM(crcs, k, value);
        if (hashed) {
            value = m->view.obj != NULL ? hex_digest(m->hash) : Py_NewRef(Py_None);
            if (value == NULL)
                goto fail_lists;
            PyList_SET_ITEM(hashes, k, value);
        }
        if (m->view.obj == NULL) {
            PyObject *at = PyLong_FromSsize_t(k);
            if (at == NULL || PyList_Append(skipped, at) < 0) {
                Py_XDECREF(at);
                goto fail_lists;
            }
            Py_DECREF(at);
        }
    }
    result = hashed ? Py_BuildValue("(NNN)", crcs, skipped, hashes)
                    : Py_BuildValue("(NN)", crcs, skipped);
    goto done;
fail_lists:
    Py_DECREF(crcs);
    Py_DECREF(skipped);
    Py_XDECREF(hashes);
done:
    if (members != NULL) {
        for (Py_ssize_t k = 0; k < taken && k < n; k++)
            if (members[k].view.obj != NULL)
                PyBuffer_Release(&members[k].view);
        PyMem_Free(members);
    }
    placement_free(&place);
    Py_XDECREF(fast_arrays);
    PyBuffer_Release(&out);
    return result;
}

/* first_mismatch(buf, leaves, offsets, lengths, recorded) -> None | (leaf, crc)
 *
 * The first leaf i of ``leaves`` whose bytes buf[offsets[i]:offsets[i] + lengths[i]] do not
 * have the crc32c recorded[i], with the crc32c they have; None if every one matches.
 */
static PyObject *
first_mismatch(PyObject *self, PyObject *args)
{
    Py_buffer buf;
    PyObject *leaves, *offsets_seq, *lengths_seq, *recorded_seq;
    if (!PyArg_ParseTuple(args, "y*OOOO:first_mismatch", &buf, &leaves, &offsets_seq,
                          &lengths_seq, &recorded_seq))
        return NULL;
    PyObject *result = NULL;
    struct placement place;
    Py_ssize_t *recorded = NULL, n_recorded = 0;
    if (placement_take(&place, leaves, offsets_seq, lengths_seq) < 0) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    recorded = ssize_array(recorded_seq, "recorded must be a sequence", &n_recorded);
    if (recorded == NULL)
        goto done;
    Py_ssize_t n = place.n, offset, length;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t leaf = place.order[k];
        if (placement_of(&place, leaf, buf.len, &offset, &length) < 0)
            goto done;
        if (leaf >= n_recorded) {
            PyErr_Format(PyExc_IndexError, "leaf %zd has no recorded crc32c", leaf);
            goto done;
        }
    }
    Py_ssize_t bad = -1;
    uint32_t found = 0;
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *base = buf.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t leaf = place.order[k];
        uint32_t crc = crc32c(base + place.offsets[leaf], (size_t)place.lengths[leaf]);
        if ((Py_ssize_t)crc != recorded[leaf]) {
            bad = leaf;
            found = crc;
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad < 0)
        result = Py_NewRef(Py_None);
    else
        result = Py_BuildValue("(nk)", bad, (unsigned long)found);
done:
    placement_free(&place);
    PyMem_Free(recorded);
    PyBuffer_Release(&buf);
    return result;
}

/* copy_from(out, sources, offsets, lengths) -> None
 *
 * Copy lengths[k] bytes of sources[k] into out at offsets[k], for each k, without the GIL, and
 * write nothing else. A source is either an object that exports a C-contiguous buffer of
 * exactly lengths[k] bytes (a numpy array), or an int: the host address of an array that
 * exports none (a torch tensor's data pointer), which the caller holds, C-contiguous and
 * unchanged, for the call. Every source and destination range is checked before anything
 * is copied.
 */
static PyObject *
copy_from(PyObject *self, PyObject *args)
{
    Py_buffer out;
    PyObject *sources_seq, *offsets_seq, *lengths_seq;
    if (!PyArg_ParseTuple(args, "w*OOO:copy_from", &out, &sources_seq, &offsets_seq,
                          &lengths_seq))
        return NULL;
    PyObject *result = NULL, *fast = NULL;
    Py_ssize_t n = 0, n_offsets = 0, n_lengths = 0, viewed = 0;
    const void **from = NULL;
    Py_buffer *views = NULL;
    Py_ssize_t *offsets = ssize_array(offsets_seq, "offsets must be a sequence", &n_offsets);
    Py_ssize_t *lengths = offsets == NULL ? NULL
                        : ssize_array(lengths_seq, "lengths must be a sequence", &n_lengths);
    if (lengths == NULL)
        goto done;
    fast = PySequence_Fast(sources_seq, "sources must be a sequence");
    if (fast == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(fast);
    if (n != n_offsets || n != n_lengths) {
        PyErr_Format(PyExc_ValueError,
                     "copy_from: %zd sources, %zd offsets and %zd lengths (one each per copy)",
                     n, n_offsets, n_lengths);
        goto done;
    }
    from = PyMem_Calloc(n ? n : 1, sizeof(void *));
    views = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    if (from == NULL || views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (offsets[k] < 0 || lengths[k] < 0 || offsets[k] > out.len - lengths[k]) {
            PyErr_Format(PyExc_ValueError,
                         "copy %zd ([%zd, +%zd)) lies outside the %zd-byte buffer", k,
                         offsets[k], lengths[k], out.len);
            goto done;
        }
        if (PyLong_Check(items[k])) {
            from[k] = PyLong_AsVoidPtr(items[k]);
            if (from[k] == NULL && PyErr_Occurred())
                goto done;
            if (from[k] == NULL && lengths[k] > 0) {
                PyErr_Format(PyExc_ValueError, "copy %zd: a null address", k);
                goto done;
            }
            continue;
        }
        if (PyObject_GetBuffer(items[k], &views[viewed], PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            PyObject *name = PyType_GetName(Py_TYPE(items[k]));
            if (name != NULL) {
                PyErr_Format(PyExc_TypeError,
                             "copy %zd: a %U is neither an address nor a C-contiguous buffer",
                             k, name);
                Py_DECREF(name);
            }
            goto done;
        }
        Py_buffer *view = &views[viewed++];
        if (view->len != lengths[k]) {
            PyErr_Format(PyExc_ValueError, "copy %zd: the source is %zd bytes, not %zd", k,
                         view->len, lengths[k]);
            goto done;
        }
        from[k] = view->buf;
    }
    Py_BEGIN_ALLOW_THREADS
    unsigned char *base = out.buf;
    for (Py_ssize_t k = 0; k < n; k++)
        if (lengths[k] > 0)
            memcpy(base + offsets[k], from[k], (size_t)lengths[k]);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t k = 0; k < viewed; k++)
        PyBuffer_Release(&views[k]);
    PyMem_Free(views);
    PyMem_Free(from);
    PyMem_Free(offsets);
    PyMem_Free(lengths);
    Py_XDECREF(fast);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(out, arrays, leaves, offsets, lengths, hashed=False) -> (crcs, skipped[, hashes])"},
    {"bind_xxh3", bind_xxh3, METH_O, "bind_xxh3(address) -> None"},
    {"copy_from", copy_from, METH_VARARGS,
     "copy_from(out, sources, offsets, lengths) -> None"},
    {"first_mismatch", first_mismatch, METH_VARARGS,
     "first_mismatch(buf, leaves, offsets, lengths, recorded) -> None | (leaf, crc)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ckptstore.store._gather",
    "Leaves into a pack and checked out of one, with their crc32c (see the source).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__gather(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "hardware_crc32c", HAVE_SSE42 && hardware_crc32c()) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
