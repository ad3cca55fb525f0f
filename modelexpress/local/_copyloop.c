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
 * run(pieces, streams, left, done, err, digests, hashed, threads, xxh3[, stream_fns[,
 *     interleave]])
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
 *   stream_fns  optional: addresses of XXH3_createState, XXH3_freeState,
 *            XXH3_128bits_reset, XXH3_128bits_update and XXH3_128bits_digest. Given,
 *            each range is fed in address order as its pieces land (feed_held), and
 *            its pieces must be consecutive and cover it; `left` is then unused. Not
 *            given, the thread that ends a range's last piece hashes it whole.
 *   interleave  with stream_fns: take the pieces by their rank in their range (the
 *            first piece of every range, then the second, ...; see run()), not in the
 *            order given. Default true; false for the bench's A/B.
 *
 * Returns (short, file_bytes, file_misses): the pieces left short (done < nbytes), the
 * bytes read by FILE pieces, and the FILE pieces left short with no error (the page
 * cache did not hold the rest).
 *
 * Nothing raises once the loop starts: a short piece is reported, and the caller
 * reads the rest its own way (which names the failure in its error).
 *
 * The helper threads are kept between calls (a pool, parked on a condition variable):
 * starting 15 threads cost ~0.6 ms a call on the 16-core GPU host, a tenth of a 70 MB
 * pull into touched memory (bench/local.py --host). One call at a time has the pool; a
 * call that finds it taken (two pulls at once in one process) starts threads of its
 * own, as every call did before. A child process after fork() has none of the parent's
 * threads: it starts its own pool (pthread_atfork). Helpers block every signal: a
 * signal for the process always finds a thread that is not ours (the main thread).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <signal.h>
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
/* A range's next piece is read and hashed this much at a time (in the core's L2). */
#define FEED_STEP ((int64_t)256 << 10)

typedef struct {
    uint64_t low64;
    uint64_t high64;
} xxh128_t; /* XXH128_hash_t: two 64-bit halves, returned by value */
typedef xxh128_t (*xxh3_fn)(const void *, size_t);
/* XXH3_createState, _freeState, _128bits_reset, _128bits_update, _128bits_digest */
typedef void *(*xxh3_create_fn)(void);
typedef int (*xxh3_free_fn)(void *);
typedef int (*xxh3_reset_fn)(void *);
typedef int (*xxh3_update_fn)(void *, const void *, size_t);
typedef xxh128_t (*xxh3_digest_fn)(const void *);

typedef struct {
    xxh3_create_fn create;
    xxh3_free_fn free;
    xxh3_reset_fn reset;
    xxh3_update_fn update;
    xxh3_digest_fn digest;
} xxh3_stream_t;

typedef struct {
    const int64_t *pieces;
    Py_ssize_t npieces;
    const int64_t *order; /* the order pieces are taken in (NULL: as given) */
    const int64_t *streams;
    int64_t *left, *done, *err;
    unsigned char *digests, *hashed;
    xxh3_fn xxh3;
    int64_t next; /* the next piece to take (atomic) */
    /* Fed in order (stream functions given): per range its state, the next of its
     * pieces to feed (its first to begin with), one past its last, whether a thread
     * feeds it now; per piece whether it was read whole. NULL sfn: each range hashed
     * whole at its end. */
    const xxh3_stream_t *sfn;
    void **state;
    int64_t *feed_next, *end;
    int *busy;
    unsigned char *landed;
} job_t;

static long page_size;

/* The pool. Helpers wait for a new generation; a call takes `want` of them (the first
 * to wake), runs its own share, and waits until every one it took has left work(). */
#define POOL_MAX 63
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;  /* helpers: a new job */
static pthread_cond_t pool_idle = PTHREAD_COND_INITIALIZER;  /* the caller: all back */
static pthread_mutex_t pool_owner = PTHREAD_MUTEX_INITIALIZER; /* one call at a time */
static int pool_size;        /* helpers started (alive: they never exit) */
static uint64_t pool_gen;    /* bumped by each call that hands out a job */
static void *pool_job;       /* that call's job */
static int pool_want, pool_taken, pool_back;
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
put_digest(job_t *job, int64_t s, xxh128_t h)
{
    unsigned char *out = job->digests + 16 * s;
    for (int i = 0; i < 8; i++) { /* canonical: big-endian, high half first */
        out[i] = (unsigned char)(h.high64 >> (56 - 8 * i));
        out[8 + i] = (unsigned char)(h.low64 >> (56 - 8 * i));
    }
    job->hashed[s] = 1;
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
    put_digest(job, s, job->xxh3((const void *)(uintptr_t)st[0], (size_t)st[1]));
}

static int
hold(job_t *job, int64_t s)
{
    int idle = 0;
    return __atomic_compare_exchange_n(&job->busy[s], &idle, 1, 0, __ATOMIC_SEQ_CST,
                                       __ATOMIC_SEQ_CST);
}

/* Ranges fed in order: the pieces of a range land on any thread in any order, and
 * its hash state must see them in address order. The thread that holds the range
 * (busy) feeds every piece landed from `feed_next` on and then lets go; a thread that
 * lands a piece while another holds the range leaves it to that one, which looks
 * again after letting go (seq_cst: of a landing and a letting-go racing, one sees the
 * other). A piece read short is never marked landed: its range stops there, is never
 * digested here (hashed 0), and the caller hashes it whole. Called holding the range. */
static void
feed_held(job_t *job, int64_t s)
{
    for (;;) {
        int64_t j = __atomic_load_n(&job->feed_next[s], __ATOMIC_RELAXED), end = job->end[s];
        while (j < end && __atomic_load_n(&job->landed[j], __ATOMIC_SEQ_CST)) {
            const int64_t *p = job->pieces + PIECE_WORDS * j;
            job->sfn->update(job->state[s], (const void *)(uintptr_t)p[2], (size_t)p[3]);
            j++;
        }
        __atomic_store_n(&job->feed_next[s], j, __ATOMIC_RELAXED);
        if (j == end) { /* whole: the range stays held, nothing more lands in it */
            put_digest(job, s, job->sfn->digest(job->state[s]));
            return;
        }
        __atomic_store_n(&job->busy[s], 0, __ATOMIC_SEQ_CST);
        if (!__atomic_load_n(&job->landed[j], __ATOMIC_SEQ_CST))
            return; /* its lander will feed it */
        if (!hold(job, s))
            return; /* another thread took the range: it feeds piece j */
    }
}

/* Piece k of range s read by its taker, who holds the range and feeds it next: read
 * and fed a step at a time, each step hashed while it is in this core's cache. Returns
 * the bytes read (short: the page cache missed, or an error in *error). */
static int64_t
read_feeding(job_t *job, int64_t s, int fd, int64_t off, uintptr_t dst, int64_t n, int file,
             int64_t *error)
{
    int64_t got = 0;
    *error = 0;
    while (got < n) {
        int64_t want = n - got < FEED_STEP ? n - got : FEED_STEP;
        int64_t r = read_piece(fd, off + got, dst + got, want, file, error);
        if (r > 0)
            job->sfn->update(job->state[s], (const void *)(dst + got), (size_t)r);
        got += r;
        if (r < want)
            break;
    }
    return got;
}

static void *
work(void *arg)
{
    job_t *job = arg;
    for (;;) {
        int64_t k = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (k >= job->npieces)
            return NULL;
        if (job->order != NULL)
            k = job->order[k];
        const int64_t *p = job->pieces + PIECE_WORDS * k;
        int64_t fd = p[0], off = p[1], dst = p[2], n = p[3], flags = p[4], s = p[5];
        int64_t got = 0, error = 0;
        /* The range's next piece, taken with the range free: read and fed in one pass.
         * (feed_next cannot move past k meanwhile: only a landed piece is fed, and k
         * lands here.) */
        int feeding = s >= 0 && job->sfn != NULL && fd >= 0
                      && __atomic_load_n(&job->feed_next[s], __ATOMIC_RELAXED) == k
                      && hold(job, s);
        if (fd >= 0) {
            if (flags & FLAG_PREFAULT)
                prefault((uintptr_t)dst, (size_t)n);
            got = feeding ? read_feeding(job, s, (int)fd, off, (uintptr_t)dst, n,
                                         (int)(flags & FLAG_FILE), &error)
                          : read_piece((int)fd, off, (uintptr_t)dst, n,
                                       (int)(flags & FLAG_FILE), &error);
        }
        job->done[k] = got;
        job->err[k] = error;
        if (s < 0)
            continue;
        if (job->sfn == NULL) {
            ended(job, s, got == n);
        } else if (feeding) {
            if (got == n) {
                __atomic_store_n(&job->landed[k], 1, __ATOMIC_SEQ_CST);
                __atomic_store_n(&job->feed_next[s], k + 1, __ATOMIC_RELAXED);
            }
            feed_held(job, s);
        } else if (got == n) {
            __atomic_store_n(&job->landed[k], 1, __ATOMIC_SEQ_CST);
            if (hold(job, s))
                feed_held(job, s);
        }
    }
}

/* Helpers are started with every signal blocked (they inherit the mask), so that a
 * signal meant for the process is never taken by one, kept or not. */
static void
block_signals(sigset_t *old)
{
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, old);
}

/* Threads of a call that could not have the pool: started here, joined before return. */
static void
unpooled(job_t *job, int helpers)
{
    pthread_t tid[POOL_MAX];
    int started = 0;
    sigset_t old;
    block_signals(&old);
    pthread_attr_t attr;
    int attr_ok = pthread_attr_init(&attr) == 0;
    if (attr_ok)
        pthread_attr_setstacksize(&attr, HELPER_STACK);
    for (int i = 0; i < helpers && i < POOL_MAX; i++) {
        /* Fewer threads where one cannot start: the others take its pieces. */
        if (pthread_create(&tid[started], attr_ok ? &attr : NULL, work, job) == 0)
            started++;
    }
    if (attr_ok)
        pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    work(job);
    /* ORDER: every piece is taken once work() returns here; the join waits for those
     * the helpers still read (bounded: reads of memory and of the page cache). */
    for (int i = 0; i < started; i++)
        pthread_join(tid[i], NULL);
}

static void *
pool_helper(void *unused)
{
    (void)unused;
    uint64_t seen = 0;
    pthread_mutex_lock(&pool_mu);
    for (;;) {
        while (pool_gen == seen || pool_taken >= pool_want) {
            seen = pool_gen; /* a job it came too late for counts as seen */
            pthread_cond_wait(&pool_wake, &pool_mu);
        }
        seen = pool_gen;
        pool_taken++;
        job_t *job = pool_job;
        pthread_mutex_unlock(&pool_mu);
        work(job);
        pthread_mutex_lock(&pool_mu);
        if (++pool_back == pool_want)
            pthread_cond_signal(&pool_idle);
    }
    return NULL;
}

/* The job on `helpers` pool threads and the caller (who holds pool_owner). */
static void
pooled(job_t *job, int helpers)
{
    if (helpers > POOL_MAX)
        helpers = POOL_MAX;
    if (helpers > 0 && pool_size < helpers) {
        sigset_t old;
        block_signals(&old);
        pthread_attr_t attr;
        int attr_ok = pthread_attr_init(&attr) == 0;
        if (attr_ok) {
            pthread_attr_setstacksize(&attr, HELPER_STACK);
            pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        }
        while (pool_size < helpers) {
            pthread_t tid;
            if (pthread_create(&tid, attr_ok ? &attr : NULL, pool_helper, NULL) != 0)
                break; /* fewer threads where one cannot start */
            pthread_mutex_lock(&pool_mu);
            pool_size++;
            pthread_mutex_unlock(&pool_mu);
        }
        if (attr_ok)
            pthread_attr_destroy(&attr);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    pthread_mutex_lock(&pool_mu);
    if (helpers > pool_size)
        helpers = pool_size;
    pool_job = job;
    pool_want = helpers;
    pool_taken = pool_back = 0;
    pool_gen++;
    if (helpers > 0)
        pthread_cond_broadcast(&pool_wake);
    pthread_mutex_unlock(&pool_mu);
    work(job);
    /* ORDER: every piece is taken once work() returns here. The helpers that have not
     * taken the job yet (still waking, or waiting for pool_mu behind the others) are
     * let go: there is nothing left for them, so the call need not wait for them to
     * wake. Then it waits for the helpers still reading theirs (bounded as above). A
     * helper that wakes after this counts the generation as seen and never touches
     * `job` (pool_taken >= pool_want). */
    pthread_mutex_lock(&pool_mu);
    pool_want = pool_taken;
    while (pool_back < pool_want)
        pthread_cond_wait(&pool_idle, &pool_mu);
    pool_want = 0;
    pool_job = NULL;
    pthread_mutex_unlock(&pool_mu);
}

/* fork(): the child has none of the helpers; its first call starts a pool of its own.
 * The parent's locks are taken around the fork, so the child's copies are consistent. */
static void
fork_prepare(void)
{
    pthread_mutex_lock(&pool_owner);
    pthread_mutex_lock(&pool_mu);
}

static void
fork_parent(void)
{
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_owner);
}

static void
fork_child(void)
{
    /* The forking thread took both locks in fork_prepare: it is the child's one thread,
     * so it may release them; the condition variables had waiters (the parent's
     * helpers) that do not exist here. */
    pthread_mutex_unlock(&pool_mu);
    pthread_mutex_unlock(&pool_owner);
    pthread_cond_init(&pool_wake, NULL);
    pthread_cond_init(&pool_idle, NULL);
    pool_size = 0;
    pool_gen = 0;
    pool_job = NULL;
    pool_want = pool_taken = pool_back = 0;
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
    unsigned long long fa[5] = {0, 0, 0, 0, 0}; /* stream functions: all or none */
    int interleave = 1;
    if (!PyArg_ParseTuple(args, "OOOOOOOiK|(KKKKK)p:run", &o[0], &o[1], &o[2], &o[3], &o[4],
                          &o[5], &o[6], &threads, &xxh3_addr, &fa[0], &fa[1], &fa[2], &fa[3],
                          &fa[4], &interleave))
        return NULL;
    xxh3_stream_t sfn = {(xxh3_create_fn)(uintptr_t)fa[0], (xxh3_free_fn)(uintptr_t)fa[1],
                         (xxh3_reset_fn)(uintptr_t)fa[2], (xxh3_update_fn)(uintptr_t)fa[3],
                         (xxh3_digest_fn)(uintptr_t)fa[4]};
    int streaming = fa[0] && fa[1] && fa[2] && fa[3] && fa[4];
    void *scratch = NULL; /* the in-order feeding's arrays, one allocation */
    void **states = NULL; /* its hash states (the first ns words) */
    Py_ssize_t made = 0;  /* of them created (freed at the end) */
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

    job_t job = {pieces, np, NULL, v[1].buf, v[2].buf, v[3].buf, v[4].buf, v[5].buf, v[6].buf,
                 (xxh3_fn)(uintptr_t)xxh3_addr, 0, NULL, NULL, NULL, NULL, NULL, NULL};
    memset(job.hashed, 0, (size_t)ns);
    if (streaming && ns > 0) {
        /* Each range's pieces must be consecutive and cover it in address order (how
         * hostcopy cuts them): the in-order feeding walks them so. */
        /* state, feed_next, end, expected next address (ns each); the take order (np)
         * and its counts (np + 1) */
        size_t words = 4 * (size_t)ns + 2 * (size_t)np + 1;
        scratch = calloc(words * 8 + (size_t)ns * sizeof(int) + (size_t)np + 1, 1);
        if (scratch == NULL) {
            PyErr_NoMemory();
            goto out;
        }
        states = scratch;
        job.state = states;
        job.feed_next = (int64_t *)scratch + ns; /* each range's first piece, to begin */
        job.end = (int64_t *)scratch + 2 * ns;
        int64_t *at = (int64_t *)scratch + 3 * ns;
        int64_t *order = (int64_t *)scratch + 4 * ns;
        int64_t *counts = order + np;
        job.busy = (int *)((int64_t *)scratch + words);
        job.landed = (unsigned char *)(job.busy + ns);
        const int64_t *st = job.streams;
        for (Py_ssize_t r = 0; r < ns; r++) {
            job.feed_next[r] = job.end[r] = -1;
            at[r] = st[STREAM_WORDS * r];
        }
        for (Py_ssize_t k = 0; k < np; k++) {
            const int64_t *pc = pieces + PIECE_WORDS * k;
            int64_t r = pc[5];
            if (r < 0)
                continue;
            if (job.feed_next[r] < 0)
                job.feed_next[r] = k;
            else if (job.end[r] != k) {
                PyErr_Format(PyExc_ValueError, "piece %zd: stream %lld's pieces are not "
                             "consecutive", k, (long long)r);
                goto out;
            }
            if (pc[2] != at[r]) {
                PyErr_Format(PyExc_ValueError, "piece %zd: not the next bytes of stream %lld",
                             k, (long long)r);
                goto out;
            }
            job.end[r] = k + 1;
            at[r] += pc[3];
        }
        for (Py_ssize_t r = 0; r < ns; r++) {
            if (job.feed_next[r] < 0) { /* no piece here: never digested (hashed 0) */
                job.feed_next[r] = job.end[r] = 0;
                job.busy[r] = 1;
                continue;
            }
            if (at[r] != st[STREAM_WORDS * r] + st[STREAM_WORDS * r + 1]) {
                PyErr_Format(PyExc_ValueError, "stream %zd: its pieces do not cover it", r);
                goto out;
            }
        }
        if (interleave) {
            /* Taken by rank (a piece's place among its range's pieces; 0 for a piece of
             * none), in address order within a rank: the first piece of every range,
             * then the second of each, ... In address order the pieces of one range
             * were taken at once by as many threads, and the thread that held it then
             * fed the rest of it alone, read back from the shared cache, while the
             * others went on copying: on the 16-core host the last ranges so hashed
             * formed a tail after the copy. By rank, a range's pieces land one after
             * another across the copy, most of them taken while the range is free
             * (read and fed at once, in the core's cache), and at the end each range
             * has at most its last pieces to feed. */
            for (Py_ssize_t k = 0; k < np; k++) {
                int64_t r = pieces[PIECE_WORDS * k + 5];
                counts[r < 0 ? 0 : k - job.feed_next[r]]++;
            }
            int64_t sum = 0;
            for (Py_ssize_t i = 0; i <= np; i++) { /* counts -> each rank's first slot */
                int64_t c = counts[i];
                counts[i] = sum;
                sum += c;
            }
            for (Py_ssize_t k = 0; k < np; k++) {
                int64_t r = pieces[PIECE_WORDS * k + 5];
                order[counts[r < 0 ? 0 : k - job.feed_next[r]]++] = k;
            }
            job.order = order;
        }
        /* ORDER: the states are made only once the pieces passed (a refusal above has
         * none to free). Only for the ranges with pieces in this call: a pull hands
         * every call all of its ranges (a multi-GiB pull in 1 GiB chunks: thousands of
         * ranges a call), and one with no piece here (busy from the start) is never fed. */
        for (Py_ssize_t r = 0; r < ns; r++) {
            if (job.busy[r])
                continue;
            void *state = sfn.create();
            if (state == NULL || sfn.reset(state) != 0) {
                if (state != NULL)
                    sfn.free(state);
                PyErr_NoMemory();
                goto out;
            }
            states[r] = state;
            made = r + 1;
        }
        job.sfn = &sfn;
    }
    Py_BEGIN_ALLOW_THREADS
    if (pthread_mutex_trylock(&pool_owner) == 0) {
        pooled(&job, threads - 1);
        pthread_mutex_unlock(&pool_owner);
    } else {
        unpooled(&job, threads - 1);
    }
    Py_END_ALLOW_THREADS
    {
        /* What the caller has left to do, so that it need not walk every piece again. */
        long long short_pieces = 0, file_bytes = 0, file_misses = 0;
        const int64_t *done = v[3].buf, *err = v[4].buf;
        for (Py_ssize_t k = 0; k < np; k++) {
            const int64_t *pc = pieces + PIECE_WORDS * k;
            int left_short = done[k] < pc[3];
            short_pieces += left_short;
            if (pc[4] & FLAG_FILE) {
                file_bytes += done[k];
                file_misses += left_short && err[k] == 0;
            }
        }
        result = Py_BuildValue("(LLL)", short_pieces, file_bytes, file_misses);
    }
out:
    for (Py_ssize_t r = 0; r < made; r++)
        if (states[r] != NULL)
            sfn.free(states[r]);
    free(scratch);
    for (int i = 0; i < held; i++)
        PyBuffer_Release(&v[i]);
    return result;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS,
     "run(pieces, streams, left, done, err, digests, hashed, threads, xxh3[, stream_fns[, "
     "interleave]]): read every piece on `threads` threads without the GIL, hashing each "
     "stream (in order as its pieces land, with stream_fns, taken by rank where interleave; "
     "else whole once its last piece landed). Returns (pieces left short, bytes read by "
     "file pieces, file pieces the page cache left short)."},
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
    if (pthread_atfork(fork_prepare, fork_parent, fork_child) != 0) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    return PyModule_Create(&module);
}
