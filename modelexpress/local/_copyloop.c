/* The host copier's piece loop, run without the GIL: reads and xxh3 block digests.
 *
 * hostcopy.HostCopier cuts a chunk of a local pull into pieces (a read of a source
 * memfd or of its checkpoint file's page cache into destination memory). In Python
 * each piece costs GIL-held work on every thread (a ctypes call per syscall, the
 * digest bookkeeping) and a thread that finished its read waits for the GIL before
 * it can start the next one: on a 16-core host a fresh process's 70 MB pull spent
 * about twice as long in its copy phase as plain reads of the same bytes on as many
 * threads (docs/benchmarks.md, "Local transport on host memory"). Here the whole
 * loop is one call: it releases the GIL, starts its helper threads (pthreads, so no
 * Python thread has to be started or woken), and returns when every piece has ended.
 *
 * run(pieces, streams, left, done, err, digests, hashed, threads, xxh3)
 *
 *   pieces   int64[6 * P]: fd, offset, dst, nbytes, flags, stream (-1: none). flags:
 *            FILE (a file read that must not wait for a disk: RWF_NOWAIT; short where
 *            the page cache misses), PREFAULT (new destination pages: populate them
 *            writable first where mincore says they are not there). fd -1: not read
 *            here (done stays 0).
 *   streams  int64[2 * S]: base, nbytes of each range whose xxh3-128 is taken here.
 *   left     int64[S], writable: the pieces of each stream in this call; the thread
 *            that ends its last one hashes the whole range (in the caches still).
 *   done     int64[P], writable: bytes read of each piece (from its start).
 *   err      int64[P], writable: errno of a read that stopped short, else 0 (0 with
 *            done < nbytes: the file ended, or the page cache did not hold the rest).
 *   digests  bytes[16 * S], writable: each hashed range's canonical xxh3-128.
 *   hashed   bytes[S], writable: 1 where that digest was taken (every piece read
 *            whole), else 0: the caller finishes short pieces and hashes those ranges.
 *   threads  threads in all, the caller's included.
 *   xxh3     address of XXH3_128bits (the xxhash package's own), 0 when S is 0.
 *
 * Nothing raises once the loop starts: a short piece is reported, and the caller
 * reads the rest its own way (which names the failure in its error).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux >= 5.14 */
#endif
#ifndef RWF_NOWAIT
#define RWF_NOWAIT 0x00000008 /* Linux >= 4.14 */
#endif

#define FLAG_FILE 1
#define FLAG_PREFAULT 2
#define PIECE_WORDS 6
#define STREAM_WORDS 2
/* A failed piece takes this much more from its stream's count: it never reaches 0. */
#define POISON ((int64_t)1 << 40)
#define HELPER_STACK (256 << 10)

typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_t; /* XXH128_hash_t: two 64-bit halves, returned by value */
typedef xxh128_t (*xxh3_fn)(const void *, size_t);

typedef struct {
    const int64_t *pieces;
    Py_ssize_t npieces;
    const int64_t *streams;
    int64_t *left, *done, *err;
    unsigned char *digests, *hashed;
    xxh3_fn xxh3;
    int64_t next; /* the next piece to take (atomic) */
} job_t;

static long page_size;
static int populate_ok = 1; /* cleared where the kernel refuses MADV_POPULATE_WRITE */

static int
resident(uintptr_t addr)
{
    unsigned char vec = 0;
    return mincore((void *)(addr & ~(uintptr_t)(page_size - 1)), (size_t)page_size, &vec) == 0
           && (vec & 1);
}

static void
prefault(uintptr_t dst, size_t n)
{
    /* The middle page: the first may be shared with the range before, landed already. */
    if (!__atomic_load_n(&populate_ok, __ATOMIC_RELAXED) || resident(dst + n / 2))
        return;
    uintptr_t start = dst & ~(uintptr_t)(page_size - 1);
    size_t span = (dst + n - start + (size_t)page_size - 1) & ~(size_t)(page_size - 1);
    if (madvise((void *)start, span, MADV_POPULATE_WRITE) != 0 && errno == EINVAL)
        __atomic_store_n(&populate_ok, 0, __ATOMIC_RELAXED); /* best effort: reads fault */
}

/* Bytes read of [off, +n) of fd into dst, and the errno that stopped it short (0: end
 * of file, or a NOWAIT read the page cache could not serve further). */
static int64_t
read_piece(int fd, int64_t off, uintptr_t dst, int64_t n, int file, int64_t *error)
{
    int64_t got = 0;
    *error = 0;
    while (got < n) {
        ssize_t r;
        if (file) {
            struct iovec iov = {(void *)(dst + got), (size_t)(n - got)};
            r = preadv2(fd, &iov, 1, off + got, RWF_NOWAIT);
        } else {
            r = pread(fd, (void *)(dst + got), (size_t)(n - got), off + got);
        }
        if (r > 0) {
            got += r;
            continue;
        }
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && !(file && errno == EAGAIN))
            *error = errno;
        break;
    }
    return got;
}

static void
ended(job_t *job, int64_t s, int whole)
{
    /* ORDER: acq_rel: the thread that takes the count to 0 sees every byte the other
     * threads read into the range before they counted their piece off. */
    int64_t now = __atomic_sub_fetch(&job->left[s], whole ? 1 : 1 + POISON, __ATOMIC_ACQ_REL);
    if (now != 0)
        return;
    const int64_t *st = job->streams + STREAM_WORDS * s;
    xxh128_t h = job->xxh3((const void *)(uintptr_t)st[0], (size_t)st[1]);
    unsigned char *out = job->digests + 16 * s;
    for (int i = 0; i < 8; i++) { /* canonical: big-endian, high half first */
        out[i] = (unsigned char)(h.high64 >> (56 - 8 * i));
        out[8 + i] = (unsigned char)(h.low64 >> (56 - 8 * i));
    }
    job->hashed[s] = 1;
}

static void *
work(void *arg)
{
    job_t *job = arg;
    for (;;) {
        int64_t k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (k >= job->npieces)
            return NULL;
        const int64_t *p = job->pieces + PIECE_WORDS * k;
        int64_t fd = p[0], off = p[1], dst = p[2], n = p[3], flags = p[4], s = p[5];
        int64_t got = 0, error = 0;
        if (fd >= 0) {
            if (flags & FLAG_PREFAULT)
                prefault((uintptr_t)dst, (size_t)n);
            got = read_piece((int)fd, off, (uintptr_t)dst, n, (int)(flags & FLAG_FILE), &error);
        }
        job->done[k] = got;
        job->err[k] = error;
        if (s >= 0)
            ended(job, s, got == n);
    }
}

/* The buffer of one argument of run(): a whole number of `unit`-byte items (`*count`
 * of them where *count >= 0; otherwise how many there are goes back in *count), on an
 * 8-byte boundary where `aligned` (int64 words). */
static int
take(PyObject *obj, const char *what, int writable, Py_ssize_t unit, int aligned,
     Py_ssize_t *count, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len % unit != 0 || (*count >= 0 && view->len != *count * unit)
        || (aligned && view->len > 0 && (uintptr_t)view->buf % 8 != 0)) {
        if (*count >= 0)
            PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd items of %zd bytes%s",
                         what, view->len, *count, unit, aligned ? ", 8-byte aligned" : "");
        else
            PyErr_Format(PyExc_ValueError, "%s: %zd bytes, not whole %zd-byte items%s", what,
                         view->len, unit, aligned ? " 8-byte aligned" : "");
        PyBuffer_Release(view);
        return -1;
    }
    *count = view->len / unit;
    return 0;
}

static PyObject *
run(PyObject *self, PyObject *args)
{
    PyObject *o[7];
    int threads;
    unsigned long long xxh3_addr;
    if (!PyArg_ParseTuple(args, "OOOOOOOiK:run", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                          &o[6], &threads, &xxh3_addr))
        return NULL;
    /* In run()'s order: pieces, streams, left, done, err, digests, hashed. */
    static const char *names[7] = {"pieces", "streams", "left", "done", "err", "digests",
                                   "hashed"};
    static const Py_ssize_t units[7] = {8 * PIECE_WORDS, 8 * STREAM_WORDS, 8, 8, 8, 16, 1};
    Py_buffer v[7];
    int held = 0;
    PyObject *result = NULL;
    Py_ssize_t np = -1, ns = -1;

    for (int i = 0; i < 7; i++) {
        /* pieces and streams say how many; done and err hold one word per piece, the
         * rest one item per stream. */
        Py_ssize_t count = i < 2 ? -1 : (i == 3 || i == 4) ? np : ns;
        if (take(o[i], names[i], i >= 2, units[i], i < 5, &count, &v[i]) < 0)
            goto out;
        held = i + 1;
        if (i == 0)
            np = count;
        else if (i == 1)
            ns = count;
    }
    const int64_t *pieces = v[0].buf;
    for (Py_ssize_t k = 0; k < np; k++) {
        int64_t s = pieces[PIECE_WORDS * k + 5], n = pieces[PIECE_WORDS * k + 3];
        if (s < -1 || s >= ns || n < 0) {
            PyErr_Format(PyExc_ValueError, "piece %zd: stream %lld of %zd, %lld bytes", k,
                         (long long)s, ns, (long long)n);
            goto out;
        }
    }
    if (ns > 0 && xxh3_addr == 0) {
        PyErr_SetString(PyExc_ValueError, "streams to hash but no xxh3 function");
        goto out;
    }
    if (threads < 1)
        threads = 1;
    if (threads > np)
        threads = np > 0 ? (int)np : 1;

    job_t job = {pieces, np, v[1].buf, v[2].buf, v[3].buf, v[4].buf, v[5].buf, v[6].buf,
                 (xxh3_fn)(uintptr_t)xxh3_addr, 0};
    memset(job.hashed, 0, (size_t)ns);
    Py_BEGIN_ALLOW_THREADS
    pthread_t helpers[64];
    int started = 0;
    pthread_attr_t attr;
    int attr_ok = pthread_attr_init(&attr) == 0;
    if (attr_ok)
        pthread_attr_setstacksize(&attr, HELPER_STACK);
    for (int i = 0; i < threads - 1 && i < 64; i++) {
        /* Fewer threads where one cannot start: the others take its pieces. */
        if (pthread_create(&helpers[started], attr_ok ? &attr : NULL, work, &job) == 0)
            started++;
    }
    if (attr_ok)
        pthread_attr_destroy(&attr);
    work(&job);
    /* ORDER: every piece is taken once work() returns here; the join waits for those
     * the helpers still read (bounded: reads of memory and of the page cache). */
    for (int i = 0; i < started; i++)
        pthread_join(helpers[i], NULL);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
out:
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&v[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS,
     "run(pieces, streams, left, done, err, digests, hashed, threads, xxh3): read every "
     "piece on `threads` threads without the GIL, hashing each stream once it is whole."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copyloop",
    "The host copier's piece loop without the GIL (modelexpress.local.hostcopy).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__copyloop(void)
{
    page_size = sysconf(_SC_PAGESIZE);
    return PyModule_Create(&module);
}
