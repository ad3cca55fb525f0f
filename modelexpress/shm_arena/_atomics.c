/* Release/acquire atomics, page population and the bulk copy over a Python buffer.
 *
 * Python has no atomics: a memoryview byte write is a plain store the compiler
 * and the CPU may reorder around the tensor memcpy that precedes it (vLLM had to
 * add fences to its ring buffer for exactly this: PRs #29819 and #40303). The
 * shared-memory tensor arena therefore does every cross-process flag access
 * through these functions, which compile to the C11/GCC atomic builtins.
 *
 * Every function takes a buffer-exporting object (the arena's mmap) and a byte
 * offset, checks bounds and 8-byte alignment, and holds the buffer export for
 * the duration of the call, so the mapping cannot be closed underneath it.
 * No Python exception is left pending on a success path; errors are
 * ValueError/BufferError/OSError raised before anything is touched.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux >= 5.14 */
#endif

static int
word_at(PyObject *obj, Py_ssize_t off, int writable, Py_buffer *view, uint64_t **word)
{
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (off < 0 || off > view->len - 8) {
        PyErr_Format(PyExc_ValueError, "offset %zd outside the %zd-byte buffer", off, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    uintptr_t addr = (uintptr_t)view->buf + (uintptr_t)off;
    if (addr % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not 8-byte aligned", off);
        PyBuffer_Release(view);
        return -1;
    }
    *word = (uint64_t *)addr;
    return 0;
}

static PyObject *
load_acquire(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t off;
    Py_buffer view;
    uint64_t *word;
    if (!PyArg_ParseTuple(args, "On:load_acquire", &obj, &off))
        return NULL;
    if (word_at(obj, off, 0, &view, &word) < 0)
        return NULL;
    uint64_t value = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(value);
}

static PyObject *
store_release(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t off;
    unsigned long long value;
    Py_buffer view;
    uint64_t *word;
    if (!PyArg_ParseTuple(args, "OnK:store_release", &obj, &off, &value))
        return NULL;
    if (word_at(obj, off, 1, &view, &word) < 0)
        return NULL;
    __atomic_store_n(word, (uint64_t)value, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* populate(buf, start, length) -> "madvise" | "touch"
 *
 * Faults the range in writable without changing a byte: MADV_POPULATE_WRITE
 * where the kernel has it, else an atomic fetch_add(0) per page (an atomic
 * read-modify-write of +0 cannot lose a concurrent store, unlike a plain
 * read-then-write of the old value). The GIL is released: populating 2 GiB of
 * fresh tmpfs pages takes a few hundred ms and must not stall other threads.
 */
static PyObject *
populate(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t start, length;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "Onn:populate", &obj, &start, &length))
        return NULL;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    long page = sysconf(_SC_PAGESIZE);
    if (start < 0 || length < 0 || start > view.len - length || start % page != 0) {
        PyErr_Format(PyExc_ValueError, "bad range [%zd, +%zd) of a %zd-byte buffer",
                     start, length, view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    char *base = (char *)view.buf + start;
    int rc, err = 0, touched = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = length ? madvise(base, (size_t)length, MADV_POPULATE_WRITE) : 0;
    if (rc != 0) {
        err = errno;
        if (err == EINVAL) { /* kernel without MADV_POPULATE_WRITE */
            for (Py_ssize_t i = 0; i < length; i += page)
                __atomic_fetch_add((uint64_t *)(base + i), 0, __ATOMIC_RELAXED);
            touched = 1;
            err = 0;
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyUnicode_FromString(touched ? "touch" : "madvise");
}

/* copy_bytes(d, s, n)
 *
 * Copies n bytes from s (a live, contiguous CPU tensor the caller holds) to d
 * (the arena). On x86-64 the
 * bulk goes through non-temporal stores: a plain copy first reads every
 * destination cache line it is about to overwrite (read-for-ownership); streaming
 * stores skip that, which made a 200 MiB copy into the arena 1.3x faster on the
 * 2-core CI machine, and leave the writer's cache to the writer. An sfence at the
 * end orders them before any later store of this thread, so the caller's release
 * store of the generation (after joining the copying threads) publishes the bytes.
 * Elsewhere it is memcpy.
 */
static void
copy_bytes(uint8_t *d, const uint8_t *s, size_t n)
{
#if defined(__x86_64__) && defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)(d + 0), a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    _mm_sfence();
    memcpy(d, s, n - blocks * 64);
#else
    memcpy(d, s, n);
#endif
}

/* stream_copy(dst_buf, dst_off, src_addr, nbytes, threads=1, chunk=2 MiB)
 *
 * copy_bytes of nbytes from the raw address src_addr into dst_buf at dst_off,
 * with the GIL released, done by `threads` threads (the caller's included), each
 * claiming the next `chunk` bytes from a shared counter until none remain. Why
 * claimed chunks and not one fixed share per thread: on a shared machine a
 * thread that loses its CPU for a while no longer holds back a fixed half of the
 * copy; the others take its remaining chunks. Every thread's copy ends with an
 * sfence and is joined before this returns, so the caller's later release store
 * publishes all of it. If a thread cannot be started, the ones that did (at
 * least the caller) do its chunks.
 */
struct copy_job {
    uint8_t *dst;
    const uint8_t *src;
    size_t nbytes;
    size_t chunk;
    size_t next; /* index of the next unclaimed chunk (atomic) */
};

static void *
copy_worker(void *arg)
{
    struct copy_job *job = (struct copy_job *)arg;
    for (;;) {
        size_t i = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        size_t lo = i * job->chunk;
        if (lo >= job->nbytes)
            break;
        size_t n = job->nbytes - lo < job->chunk ? job->nbytes - lo : job->chunk;
        copy_bytes(job->dst + lo, job->src + lo, n);
    }
    return NULL;
}

#define MAX_COPY_THREADS 64

static PyObject *
stream_copy(PyObject *self, PyObject *args)
{
    PyObject *obj;
    Py_ssize_t off, nbytes, threads = 1, chunk = 2 << 20;
    unsigned long long src;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OnKn|nn:stream_copy", &obj, &off, &src, &nbytes,
                          &threads, &chunk))
        return NULL;
    if (threads < 1 || threads > MAX_COPY_THREADS || chunk < 64 || chunk % 64 != 0) {
        PyErr_Format(PyExc_ValueError, "threads must be 1..%d and chunk a positive multiple "
                     "of 64 (got %zd, %zd)", MAX_COPY_THREADS, threads, chunk);
        return NULL;
    }
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (off < 0 || nbytes < 0 || off > view.len - nbytes || (nbytes && src == 0)) {
        PyErr_Format(PyExc_ValueError, "bad copy of %zd bytes to offset %zd of a %zd-byte buffer",
                     nbytes, off, view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    struct copy_job job = {(uint8_t *)view.buf + off, (const uint8_t *)(uintptr_t)src,
                           (size_t)nbytes, (size_t)chunk, 0};
    pthread_t tids[MAX_COPY_THREADS];
    int started = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t t = 1; t < threads; t++) {
        if (pthread_create(&tids[started], NULL, copy_worker, &job) != 0)
            break; /* the threads already running (and this one) do the rest */
        started++;
    }
    copy_worker(&job);
    for (int t = 0; t < started; t++)
        pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(buf, offset, src_addr, nbytes, threads=1, chunk=2 MiB): copy raw bytes "
     "in, GIL released, over threads claiming chunks."},
    {"load_acquire", load_acquire, METH_VARARGS,
     "load_acquire(buf, offset) -> int: atomic 64-bit load with acquire ordering."},
    {"store_release", store_release, METH_VARARGS,
     "store_release(buf, offset, value): atomic 64-bit store with release ordering."},
    {"populate", populate, METH_VARARGS,
     "populate(buf, start, length) -> str: fault pages in writable, contents unchanged."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_atomics",
    "Release/acquire atomics for modelexpress.shm_arena.", -1, methods,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    return PyModule_Create(&module);
}
