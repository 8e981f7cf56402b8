/*
 * A fake CANN for tests on machines without an Ascend NPU.
 *
 * It exports the subset of CANN's documented C API that aclnn-serve's NPU backend binds
 * (libascendcl: aclInit .. aclrtMemcpy, aclrtMemset; libopapi: aclCreateTensor .. aclnnX), with the
 * same signatures and the behaviour a caller can observe:
 *
 *   - "device" memory is host memory from posix_memalign, tracked in an allocation table;
 *     memcpy and kernels check that every device pointer lies inside a live allocation;
 *   - runtime calls need aclInit and a current context on the calling thread
 *     (aclrtSetDevice / aclrtCreateContext / aclrtSetCurrentContext), as on the NPU;
 *   - aclnnX(...) only queues the kernel on the stream; it runs at aclrtSynchronizeStream
 *     (or aclrtDestroyStream), in FIFO order per stream, so a caller that copies results
 *     back before synchronizing reads stale memory, as it would on the device; and
 *     aclrtMemcpy / aclrtMemset / aclrtFree of device memory that a kernel still queued on
 *     any stream addresses (its tensors' storage or its workspace) is counted as misuse
 *     (a data race on the device);
 *   - executors are single-use unless aclSetAclOpExecutorRepeatable was called (then they
 *     live until aclDestroyAclOpExecutor); a launch checks the workspace it is given;
 *   - aclnnLayerNormBackward, aclnnBatchNormBackward, aclnnBatchNormElemtBackward, aclnnLayerNorm,
 *     aclnnRmsNorm, aclnnRmsNormGrad, aclnnGroupNorm, aclnnGroupNormBackward, aclnnBatchNormStats,
 *     aclnnBatchNormGatherStatsWithCounts, aclnnBatchNormElemt, aclnnBatchNorm and
 *     aclnnBatchNormReduceBackward are computed in C
 *     in double (FLOAT, FLOAT16 via _Float16, BF16 by bit conversion; any strides);
 *     other dtypes get ACLNN_ERR_INNER_FIND_KERNEL_ERROR (561003).
 *
 * Test hooks (not CANN API, prefixed fake_): counters of created / destroyed objects,
 * per-function call counts, a text call log, a misuse counter, the number of kernels queued
 * and not yet run (fake_queued), and one-shot injected failures (fake_fail_next, or
 * FAKE_CANN_FAIL="function:code[,function:code]" at aclInit). A kernel's execution counts as a
 * call of "kernel:aclnnX": injecting a failure there makes that kernel fail while it runs (the
 * stream's synchronize returns the code), as a device fault does. FAKE_CANN_INIT_DELAY_MS makes
 * aclInit take that long, as a device that takes its time to come up.
 */
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

typedef int aclError;
typedef int aclnnStatus;
typedef void *aclrtStream;
typedef void *aclrtContext;

/* aclError values (acl_base.h / acl_rt.h) */
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_UNINITIALIZE 100001
#define ACL_ERROR_REPEAT_INITIALIZE 100002
#define ACL_ERROR_RT_CONTEXT_NULL 107002
#define ACL_ERROR_RT_MEMORY_ALLOCATION 207001
#define ACL_ERROR_RT_INTERNAL_ERROR 507899
/* aclnnStatus values */
#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACLNN_ERR_INNER_FIND_KERNEL_ERROR 561003
#define ACLNN_ERR_INNER_NULLPTR 561103

enum { DT_FLOAT = 0, DT_FLOAT16 = 1, DT_INT32 = 3, DT_BF16 = 27 };
enum { FMT_NHWC = 1, FMT_NDHWC = 27 };
enum { ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE };

/* ---------------------------------------------------------------- bookkeeping */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static __thread void *current_context;

enum { K_TENSOR, K_INT_ARRAY, K_BOOL_ARRAY, K_EXECUTOR, K_STREAM, K_CONTEXT, K_ALLOC, K_DEVICE, K_INIT, K_N };
static const char *kind_names[K_N] = {"tensor", "intArray", "boolArray", "executor", "stream",
                                      "context", "alloc", "device", "init"};
static long created[K_N], destroyed[K_N];

#define MAX_FUNCS 128
static struct { const char *name; long calls; int fail_code; int fail_pending; } funcs[MAX_FUNCS];
static int nfuncs;
static long misuse_count;
static char misuse_last[256];
static char recent_err[512];

static char *log_buf;
static size_t log_len, log_cap;

static int func_slot(const char *name) {
    for (int i = 0; i < nfuncs; i++)
        if (strcmp(funcs[i].name, name) == 0) return i;
    if (nfuncs == MAX_FUNCS) return -1;
    funcs[nfuncs].name = strdup(name);
    return nfuncs++;
}

static void logf_locked(const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if (n > (int)sizeof line - 2) n = sizeof line - 2;
    line[n++] = '\n';
    if (log_len + n + 1 > log_cap) {
        size_t cap = log_cap ? log_cap * 2 : 1 << 16;
        while (cap < log_len + n + 1) cap *= 2;
        char *grown = realloc(log_buf, cap);
        if (!grown) return;
        log_buf = grown;
        log_cap = cap;
    }
    memcpy(log_buf + log_len, line, n);
    log_len += n;
    log_buf[log_len] = 0;
}

static void set_err(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(recent_err, sizeof recent_err, fmt, ap);
    va_end(ap);
}

static void misuse(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(misuse_last, sizeof misuse_last, fmt, ap);
    va_end(ap);
    misuse_count++;
    logf_locked("MISUSE %s", misuse_last);
    set_err("%s", misuse_last);
}

/* Counts a call; returns an injected failure code for it, or 0. Caller holds mu. */
static int enter(const char *name) {
    int i = func_slot(name);
    if (i < 0) return 0;
    funcs[i].calls++;
    if (funcs[i].fail_pending > 0) {
        funcs[i].fail_pending--;
        set_err("EZ9999: injected failure of %s (code %d)", name, funcs[i].fail_code);
        logf_locked("%s -> injected %d", name, funcs[i].fail_code);
        return funcs[i].fail_code;
    }
    return 0;
}

static bool initialized;
static int device_id = -1, device_refs;

/* ---------------------------------------------------------------- device memory */

typedef struct { char *ptr; size_t size; } Alloc;
static Alloc *allocs;
static size_t nallocs, allocs_cap;

static long find_alloc(const void *p) {
    for (size_t i = 0; i < nallocs; i++)
        if ((const char *)p >= allocs[i].ptr && (const char *)p < allocs[i].ptr + allocs[i].size) return (long)i;
    return -1;
}

/* Is [p, p+n) inside one live device allocation? */
static bool device_span(const void *p, size_t n) {
    long i = find_alloc(p);
    return i >= 0 && (const char *)p + n <= allocs[i].ptr + allocs[i].size;
}

static aclError runtime_ready(const char *fn) {
    if (!initialized) {
        misuse("%s before aclInit", fn);
        return ACL_ERROR_UNINITIALIZE;
    }
    if (!current_context) {
        misuse("%s without a current context on this thread", fn);
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    return ACL_SUCCESS;
}

/* ---------------------------------------------------------------- objects */

typedef struct aclTensor {
    int64_t dims[8], strides[8], sdims[8];
    uint64_t ndim, sndim;
    int dtype, format;
    int64_t offset;
    void *data;
} aclTensor;

typedef struct aclIntArray { int64_t *v; uint64_t n; } aclIntArray;
typedef struct aclBoolArray { bool *v; uint64_t n; } aclBoolArray;

enum { OP_LN, OP_BN, OP_ELEMT, OP_LNF, OP_RMS, OP_RMS_GRAD, OP_GN, OP_GN_BWD, OP_BNS, OP_BNG, OP_BNE, OP_BNF, OP_BNRB };
static const char *op_names[] = {"aclnnLayerNormBackward", "aclnnBatchNormBackward", "aclnnBatchNormElemtBackward",
                                 "aclnnLayerNorm",         "aclnnRmsNorm",           "aclnnRmsNormGrad",
                                 "aclnnGroupNorm",         "aclnnGroupNormBackward", "aclnnBatchNormStats",
                                 "aclnnBatchNormGatherStatsWithCounts", "aclnnBatchNormElemt", "aclnnBatchNorm",
                                 "aclnnBatchNormReduceBackward"};
#define MAX_T 12

typedef struct aclOpExecutor {
    int op;
    aclTensor t[MAX_T];
    bool has[MAX_T];
    int64_t ints[8];
    uint64_t nints;
    bool mask[3];
    bool training;
    double eps, momentum;
    uint64_t workspace;
    bool repeatable, launched, destroy_when_idle;
    int pending;
    long id;
} aclOpExecutor;

static long next_executor_id;

typedef struct Task { aclOpExecutor *ex; void *ws; struct Task *next; } Task;
typedef struct Stream { Task *head, *tail; long id; } Stream;
typedef struct Context { int device; long id; } Context;
static long next_stream_id, next_context_id;

#define MAX_OBJS 4096
static Stream *streams[MAX_OBJS];
static Context *contexts[MAX_OBJS];

static bool known(void **table, void *p) {
    for (int i = 0; i < MAX_OBJS; i++)
        if (table[i] == p) return p != NULL;
    return false;
}
static bool track(void **table, void *p) {
    for (int i = 0; i < MAX_OBJS; i++)
        if (!table[i]) { table[i] = p; return true; }
    return false;
}
static void untrack(void **table, void *p) {
    for (int i = 0; i < MAX_OBJS; i++)
        if (table[i] == p) table[i] = NULL;
}

/* ---------------------------------------------------------------- acl (runtime) */

static void parse_fail_env(void) {
    const char *env = getenv("FAKE_CANN_FAIL");
    if (!env || !*env) return;
    char *copy = strdup(env), *save = NULL;
    for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(item, ':');
        if (!colon) continue;
        *colon = 0;
        char *times = strchr(colon + 1, ':');
        int i = func_slot(item);
        if (i >= 0) { funcs[i].fail_code = atoi(colon + 1); funcs[i].fail_pending = times ? atoi(times + 1) : 1; }
    }
    free(copy);
}

EXPORT aclError aclInit(const char *configPath) {
    const char *delay = getenv("FAKE_CANN_INIT_DELAY_MS");
    if (delay && *delay) usleep((useconds_t)atoi(delay) * 1000);
    pthread_mutex_lock(&mu);
    parse_fail_env();
    aclError rc = enter("aclInit");
    if (!rc && initialized) { set_err("EH9999: aclInit called twice"); rc = ACL_ERROR_REPEAT_INITIALIZE; }
    if (!rc) { initialized = true; created[K_INIT]++; }
    logf_locked("aclInit config=%s -> %d", configPath ? configPath : "(null)", rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclFinalize(void) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclFinalize");
    if (!rc && !initialized) { misuse("aclFinalize without aclInit"); rc = ACL_ERROR_UNINITIALIZE; }
    if (!rc && (device_refs || created[K_STREAM] != destroyed[K_STREAM] || created[K_CONTEXT] != destroyed[K_CONTEXT]))
        misuse("aclFinalize with %d device(s) set, %ld stream(s), %ld context(s) alive", device_refs,
               created[K_STREAM] - destroyed[K_STREAM], created[K_CONTEXT] - destroyed[K_CONTEXT]);
    if (!rc) { initialized = false; destroyed[K_INIT]++; }
    logf_locked("aclFinalize -> %d", rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtSetDevice(int32_t deviceId) {
    static Context default_context = {0, 0};
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtSetDevice");
    if (!rc && !initialized) { misuse("aclrtSetDevice before aclInit"); rc = ACL_ERROR_UNINITIALIZE; }
    if (!rc && (deviceId < 0 || deviceId > 7)) { set_err("EE1001: invalid device id %d", deviceId); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc) {
        if (device_refs && device_id != deviceId) { misuse("the fake has one device; %d is already set", device_id); rc = ACL_ERROR_INVALID_PARAM; }
    }
    if (!rc) {
        created[K_DEVICE]++;
        device_refs++;
        device_id = deviceId;
        default_context.device = deviceId;
        current_context = &default_context; /* as on the NPU: the device's default context */
    }
    logf_locked("aclrtSetDevice %d -> %d", deviceId, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtResetDevice(int32_t deviceId) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtResetDevice");
    if (!rc && (!device_refs || deviceId != device_id)) { misuse("aclrtResetDevice(%d) of a device not set", deviceId); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc) {
        destroyed[K_DEVICE]++;
        if (--device_refs == 0) { device_id = -1; current_context = NULL; }
    }
    logf_locked("aclrtResetDevice %d -> %d", deviceId, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtCreateContext");
    if (!rc && !initialized) { misuse("aclrtCreateContext before aclInit"); rc = ACL_ERROR_UNINITIALIZE; }
    if (!rc && !context) rc = ACL_ERROR_INVALID_PARAM;
    if (!rc) {
        Context *c = calloc(1, sizeof *c);
        c->device = deviceId;
        c->id = ++next_context_id;
        track((void **)contexts, c);
        created[K_CONTEXT]++;
        *context = c;
        current_context = c;
        logf_locked("aclrtCreateContext ctx=%ld device=%d", c->id, deviceId);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtSetCurrentContext(aclrtContext context) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtSetCurrentContext");
    if (!rc && !known((void **)contexts, context)) { misuse("aclrtSetCurrentContext of an unknown context"); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc) current_context = context;
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtDestroyContext(aclrtContext context) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtDestroyContext");
    if (!rc && !known((void **)contexts, context)) { misuse("aclrtDestroyContext of an unknown context"); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc) {
        logf_locked("aclrtDestroyContext ctx=%ld", ((Context *)context)->id);
        untrack((void **)contexts, context);
        if (current_context == context) current_context = NULL;
        free(context);
        destroyed[K_CONTEXT]++;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtCreateStream(aclrtStream *stream) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtCreateStream");
    if (!rc) rc = runtime_ready("aclrtCreateStream");
    if (!rc && !stream) rc = ACL_ERROR_INVALID_PARAM;
    if (!rc) {
        Stream *s = calloc(1, sizeof *s);
        s->id = ++next_stream_id;
        track((void **)streams, s);
        created[K_STREAM]++;
        *stream = s;
        logf_locked("aclrtCreateStream stream=%ld", s->id);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

static void free_executor(aclOpExecutor *ex) {
    logf_locked("executor %ld released", ex->id);
    free(ex);
    destroyed[K_EXECUTOR]++;
}

static aclnnStatus run_kernel(aclOpExecutor *ex, void *ws);

/* Runs a stream's queued kernels in order (abort: drops them, as a failed stream does). Caller holds mu. */
static aclError drain(Stream *s, bool abort) {
    aclError rc = ACL_SUCCESS;
    while (s->head) {
        Task *t = s->head;
        s->head = t->next;
        if (!s->head) s->tail = NULL;
        char fn[112];
        snprintf(fn, sizeof fn, "kernel:%s", op_names[t->ex->op]);
        int fault = abort ? 0 : enter(fn); /* an injected device fault: the kernel fails while it runs */
        aclnnStatus st = abort ? ACL_ERROR_RT_INTERNAL_ERROR : fault ? fault : run_kernel(t->ex, t->ws);
        logf_locked("kernel %s executor=%ld stream=%ld -> %d", op_names[t->ex->op], t->ex->id, s->id, st);
        if (st && !rc) rc = fault ? fault : ACL_ERROR_RT_INTERNAL_ERROR;
        t->ex->pending--;
        if (t->ex->pending == 0 && (!t->ex->repeatable || t->ex->destroy_when_idle)) free_executor(t->ex);
        free(t);
    }
    return rc;
}

EXPORT aclError aclrtSynchronizeStream(aclrtStream stream) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtSynchronizeStream");
    if (rc && known((void **)streams, stream)) drain(stream, true); /* an injected failure aborts the work */
    if (!rc) rc = runtime_ready("aclrtSynchronizeStream");
    if (!rc && !known((void **)streams, stream)) { misuse("aclrtSynchronizeStream of an unknown stream"); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc) {
        logf_locked("aclrtSynchronizeStream stream=%ld", ((Stream *)stream)->id);
        rc = drain(stream, false);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtDestroyStream(aclrtStream stream) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtDestroyStream");
    if (!rc) rc = runtime_ready("aclrtDestroyStream");
    if (!rc && !known((void **)streams, stream)) { misuse("aclrtDestroyStream of an unknown stream"); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc) {
        drain(stream, false);
        logf_locked("aclrtDestroyStream stream=%ld", ((Stream *)stream)->id);
        untrack((void **)streams, stream);
        free(stream);
        destroyed[K_STREAM]++;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* Does a kernel queued on some stream, not yet run, address device memory in [p, p+n)? Caller holds mu. */
static bool queued_use(const void *p, size_t n);

EXPORT aclError aclrtMalloc(void **devPtr, size_t size, int policy) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtMalloc");
    if (!rc) rc = runtime_ready("aclrtMalloc");
    if (!rc && (!devPtr || size == 0)) { set_err("EE1001: aclrtMalloc of %zu bytes", size); rc = ACL_ERROR_INVALID_PARAM; }
    void *p = NULL;
    if (!rc && posix_memalign(&p, 512, size)) { set_err("EL0004: out of device memory (%zu bytes)", size); rc = ACL_ERROR_RT_MEMORY_ALLOCATION; }
    if (!rc) {
        memset(p, 0xA5, size); /* device memory is not zeroed */
        if (nallocs == allocs_cap) {
            allocs_cap = allocs_cap ? allocs_cap * 2 : 64;
            allocs = realloc(allocs, allocs_cap * sizeof *allocs);
        }
        allocs[nallocs++] = (Alloc){p, size};
        created[K_ALLOC]++;
        *devPtr = p;
    }
    logf_locked("aclrtMalloc size=%zu policy=%d -> %d", size, policy, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtFree(void *devPtr) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtFree");
    if (!rc) rc = runtime_ready("aclrtFree");
    long i = rc ? -1 : find_alloc(devPtr);
    if (!rc && (i < 0 || allocs[i].ptr != devPtr)) { misuse("aclrtFree of %p, not a device allocation", devPtr); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc && queued_use(allocs[i].ptr, allocs[i].size)) { misuse("aclrtFree of memory a queued kernel uses"); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc) {
        logf_locked("aclrtFree size=%zu", allocs[i].size);
        free(allocs[i].ptr);
        allocs[i] = allocs[--nallocs];
        destroyed[K_ALLOC]++;
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, int kind) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtMemcpy");
    if (!rc) rc = runtime_ready("aclrtMemcpy");
    if (!rc && count > destMax) { misuse("aclrtMemcpy count %zu > destMax %zu", count, destMax); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc) {
        bool dst_dev = kind == ACL_MEMCPY_HOST_TO_DEVICE || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
        bool src_dev = kind == ACL_MEMCPY_DEVICE_TO_HOST || kind == ACL_MEMCPY_DEVICE_TO_DEVICE;
        if (dst_dev && !device_span(dst, count)) { misuse("aclrtMemcpy kind %d: dst not device memory", kind); rc = ACL_ERROR_INVALID_PARAM; }
        else if (src_dev && !device_span(src, count)) { misuse("aclrtMemcpy kind %d: src not device memory", kind); rc = ACL_ERROR_INVALID_PARAM; }
        else if (!dst_dev && find_alloc(dst) >= 0) { misuse("aclrtMemcpy kind %d: dst is device memory", kind); rc = ACL_ERROR_INVALID_PARAM; }
        else if (!src_dev && find_alloc(src) >= 0) { misuse("aclrtMemcpy kind %d: src is device memory", kind); rc = ACL_ERROR_INVALID_PARAM; }
        else if ((dst_dev && queued_use(dst, count)) || (src_dev && queued_use(src, count))) {
            misuse("aclrtMemcpy kind %d of device memory a queued kernel uses", kind);
            rc = ACL_ERROR_INVALID_PARAM;
        } else memcpy(dst, src, count);
    }
    logf_locked("aclrtMemcpy kind=%d count=%zu -> %d", kind, count, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count) {
    pthread_mutex_lock(&mu);
    aclError rc = enter("aclrtMemset");
    if (!rc) rc = runtime_ready("aclrtMemset");
    if (!rc && count > maxCount) { misuse("aclrtMemset count %zu > maxCount %zu", count, maxCount); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc && !device_span(devPtr, count)) { misuse("aclrtMemset of memory that is not device memory"); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc && queued_use(devPtr, count)) { misuse("aclrtMemset of device memory a queued kernel uses"); rc = ACL_ERROR_INVALID_PARAM; }
    if (!rc) memset(devPtr, value, count);
    logf_locked("aclrtMemset count=%zu value=%d -> %d", count, (int)value, rc);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT const char *aclGetRecentErrMsg(void) { return recent_err[0] ? recent_err : NULL; }

/* ---------------------------------------------------------------- opapi objects */

EXPORT aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, int dataType, const int64_t *stride,
                                  int64_t offset, int format, const int64_t *storageDims, uint64_t storageDimsNum,
                                  void *tensorData) {
    pthread_mutex_lock(&mu);
    aclTensor *t = NULL;
    if (!enter("aclCreateTensor") && viewDimsNum <= 8 && storageDimsNum <= 8 && (viewDims || !viewDimsNum) &&
        (storageDims || !storageDimsNum)) {
        t = calloc(1, sizeof *t);
        t->ndim = viewDimsNum;
        t->sndim = storageDimsNum;
        memcpy(t->dims, viewDims, viewDimsNum * sizeof(int64_t));
        memcpy(t->sdims, storageDims, storageDimsNum * sizeof(int64_t));
        if (stride) memcpy(t->strides, stride, viewDimsNum * sizeof(int64_t));
        else for (int64_t i = (int64_t)viewDimsNum - 1, s = 1; i >= 0; s *= t->dims[i], i--) t->strides[i] = s;
        t->dtype = dataType;
        t->format = format;
        t->offset = offset;
        t->data = tensorData;
        created[K_TENSOR]++;
    }
    pthread_mutex_unlock(&mu);
    return t;
}

EXPORT aclnnStatus aclDestroyTensor(const aclTensor *tensor) {
    pthread_mutex_lock(&mu);
    aclnnStatus rc = enter("aclDestroyTensor");
    if (!rc && tensor) { free((void *)tensor); destroyed[K_TENSOR]++; }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size) {
    pthread_mutex_lock(&mu);
    aclIntArray *a = NULL;
    if (!enter("aclCreateIntArray") && (value || !size)) {
        a = calloc(1, sizeof *a);
        a->v = malloc((size ? size : 1) * sizeof(int64_t));
        if (size) memcpy(a->v, value, size * sizeof(int64_t));
        a->n = size;
        created[K_INT_ARRAY]++;
    }
    pthread_mutex_unlock(&mu);
    return a;
}

EXPORT aclnnStatus aclDestroyIntArray(const aclIntArray *array) {
    pthread_mutex_lock(&mu);
    aclnnStatus rc = enter("aclDestroyIntArray");
    if (!rc && array) { free(array->v); free((void *)array); destroyed[K_INT_ARRAY]++; }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclBoolArray *aclCreateBoolArray(const bool *value, uint64_t size) {
    pthread_mutex_lock(&mu);
    aclBoolArray *a = NULL;
    if (!enter("aclCreateBoolArray") && (value || !size)) {
        a = calloc(1, sizeof *a);
        a->v = malloc(size ? size : 1);
        if (size) memcpy(a->v, value, size);
        a->n = size;
        created[K_BOOL_ARRAY]++;
    }
    pthread_mutex_unlock(&mu);
    return a;
}

EXPORT aclnnStatus aclDestroyBoolArray(const aclBoolArray *array) {
    pthread_mutex_lock(&mu);
    aclnnStatus rc = enter("aclDestroyBoolArray");
    if (!rc && array) { free(array->v); free((void *)array); destroyed[K_BOOL_ARRAY]++; }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* Executors handed out and not yet released: a launch or destroy of anything else is refused. */
static aclOpExecutor *live_executors[MAX_OBJS];

EXPORT aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor) {
    pthread_mutex_lock(&mu);
    aclnnStatus rc = enter("aclSetAclOpExecutorRepeatable");
    if (!rc && !known((void **)live_executors, executor)) { misuse("aclSetAclOpExecutorRepeatable of an unknown executor"); rc = ACLNN_ERR_PARAM_INVALID; }
    if (!rc && executor->launched) { misuse("aclSetAclOpExecutorRepeatable after the executor ran"); rc = ACLNN_ERR_PARAM_INVALID; }
    if (!rc) { executor->repeatable = true; logf_locked("aclSetAclOpExecutorRepeatable executor=%ld", executor->id); }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor) {
    pthread_mutex_lock(&mu);
    aclnnStatus rc = enter("aclDestroyAclOpExecutor");
    if (!rc && !known((void **)live_executors, executor)) { misuse("aclDestroyAclOpExecutor of an unknown or released executor"); rc = ACLNN_ERR_PARAM_INVALID; }
    if (!rc) {
        logf_locked("aclDestroyAclOpExecutor executor=%ld", executor->id);
        untrack((void **)live_executors, executor);
        if (executor->pending) executor->destroy_when_idle = true, executor->repeatable = true;
        else free_executor(executor);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

/* ---------------------------------------------------------------- element access */

static int64_t numel(const aclTensor *t) {
    int64_t n = 1;
    for (uint64_t i = 0; i < t->ndim; i++) n *= t->dims[i];
    return n;
}

static size_t itemsize(int dtype) {
    switch (dtype) {
    case DT_FLOAT: case DT_INT32: return 4;
    case DT_FLOAT16: case DT_BF16: return 2;
    default: return 0;
    }
}

static bool is_float(int dtype) { return dtype == DT_FLOAT || dtype == DT_FLOAT16 || dtype == DT_BF16; }

/* storage element index of the flat (row-major) view index i */
static int64_t storage_index(const aclTensor *t, int64_t i) {
    int64_t at = t->offset;
    for (int64_t d = (int64_t)t->ndim - 1; d >= 0; d--) {
        int64_t dim = t->dims[d];
        at += (i % dim) * t->strides[d];
        i /= dim;
    }
    return at;
}

static double rd(const aclTensor *t, int64_t i) {
    const char *p = (const char *)t->data + storage_index(t, i) * (int64_t)itemsize(t->dtype);
    switch (t->dtype) {
    case DT_FLOAT: return *(const float *)p;
    case DT_FLOAT16: return (double)*(const _Float16 *)p;
    case DT_INT32: return *(const int32_t *)p;
    case DT_BF16: {
        uint32_t bits = (uint32_t)*(const uint16_t *)p << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    }
    return NAN;
}

static uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fff + ((u >> 16) & 1);                                          /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static void wr(const aclTensor *t, int64_t i, double v) {
    char *p = (char *)t->data + storage_index(t, i) * (int64_t)itemsize(t->dtype);
    switch (t->dtype) {
    case DT_FLOAT: *(float *)p = (float)v; break;
    case DT_FLOAT16: *(_Float16 *)p = (_Float16)v; break;
    case DT_BF16: *(uint16_t *)p = float_to_bf16((float)v); break;
    }
}

/* The storage span a tensor addresses lies in device memory (checked at launch and at run). */
static bool tensor_on_device(const aclTensor *t) {
    int64_t n = numel(t);
    if (n == 0) return true;
    if (!t->data) return false;
    int64_t last = t->offset;
    for (uint64_t d = 0; d < t->ndim; d++) last += (t->dims[d] - 1) * t->strides[d];
    int64_t storage = 1;
    for (uint64_t d = 0; d < t->sndim; d++) storage *= t->sdims[d];
    if (last >= storage) return false;
    return device_span(t->data, (size_t)storage * itemsize(t->dtype));
}

/* ---------------------------------------------------------------- kernels */

/* slots of each operator's tensors in aclOpExecutor.t */
enum { LN_G, LN_X, LN_MEAN, LN_RSTD, LN_W, LN_B, LN_DX, LN_DW, LN_DB };
enum { BN_G, BN_X, BN_W, BN_RM, BN_RV, BN_SM, BN_SI, BN_DX, BN_DW, BN_DB };
enum { EL_G, EL_X, EL_MEAN, EL_INVSTD, EL_W, EL_SDY, EL_SDYXMU, EL_COUNTER, EL_DX };
enum { LNF_X, LNF_W, LNF_B, LNF_Y, LNF_MEAN, LNF_RSTD };
enum { RMS_X, RMS_GAMMA, RMS_Y, RMS_RSTD };
enum { RG_DY, RG_X, RG_RSTD, RG_GAMMA, RG_DX, RG_DGAMMA };
enum { GN_X, GN_GAMMA, GN_BETA, GN_Y, GN_MEAN, GN_RSTD };
enum { GB_G, GB_X, GB_MEAN, GB_RSTD, GB_GAMMA, GB_DX, GB_DGAMMA, GB_DBETA };
enum { BNS_X, BNS_MEAN, BNS_INVSTD };
enum { BNG_X, BNG_MEAN, BNG_INVSTD, BNG_RM, BNG_RV, BNG_COUNTS, BNG_MEAN_ALL, BNG_INVSTD_ALL };
enum { BNE_X, BNE_W, BNE_B, BNE_MEAN, BNE_INVSTD, BNE_Y };
enum { BNF_X, BNF_W, BNF_B, BNF_RM, BNF_RV, BNF_Y, BNF_SM, BNF_SI };
enum { BNR_G, BNR_X, BNR_MEAN, BNR_INVSTD, BNR_W, BNR_SDY, BNR_SDYXMU, BNR_DW, BNR_DB };
static const int n_slots[] = {9, 10, 9, 6, 4, 6, 6, 8, 3, 8, 6, 8, 9};

#define T(k) (ex->has[k] ? &ex->t[k] : NULL)

static void ln_kernel(aclOpExecutor *ex, double *ws) {
    const aclTensor *g = T(LN_G), *x = T(LN_X), *mean = T(LN_MEAN), *rstd = T(LN_RSTD), *w = T(LN_W);
    const aclTensor *dx = ex->mask[0] ? T(LN_DX) : NULL, *dw = ex->mask[1] ? T(LN_DW) : NULL,
                    *db = ex->mask[2] ? T(LN_DB) : NULL;
    int64_t n = 1;
    for (uint64_t i = 0; i < ex->nints; i++) n *= ex->ints[i];
    int64_t m = n ? numel(x) / n : 0;
    double *sum_gx = ws, *sum_g = ws ? ws + n : NULL;
    if (ws)
        for (int64_t j = 0; j < 2 * n; j++) ws[j] = 0;
    for (int64_t r = 0; r < m; r++) {
        double mu = rd(mean, r), rs = rd(rstd, r), s1 = 0, s2 = 0;
        for (int64_t j = 0; j < n; j++) {
            double gv = rd(g, r * n + j), xh = (rd(x, r * n + j) - mu) * rs, gw = gv * (w ? rd(w, j) : 1.0);
            s1 += gw;
            s2 += gw * xh;
            if (ws) { sum_gx[j] += gv * xh; sum_g[j] += gv; }
        }
        if (dx)
            for (int64_t j = 0; j < n; j++) {
                double gv = rd(g, r * n + j), xh = (rd(x, r * n + j) - mu) * rs, gw = gv * (w ? rd(w, j) : 1.0);
                wr(dx, r * n + j, rs * (gw - s1 / n - xh * s2 / n));
            }
    }
    for (int64_t j = 0; j < n; j++) {
        if (dw) wr(dw, j, ws ? sum_gx[j] : 0.0);
        if (db) wr(db, j, ws ? sum_g[j] : 0.0);
    }
}

static int channel_axis(const aclTensor *x) {
    if ((x->format == FMT_NHWC && x->ndim == 4) || (x->format == FMT_NDHWC && x->ndim == 5)) return (int)x->ndim - 1;
    return 1;
}

static void bn_kernel(aclOpExecutor *ex, double *ws) {
    const aclTensor *g = T(BN_G), *x = T(BN_X), *w = T(BN_W), *rm = T(BN_RM), *rv = T(BN_RV), *sm = T(BN_SM),
                    *si = T(BN_SI);
    const aclTensor *dx = ex->mask[0] ? T(BN_DX) : NULL, *dw = ex->mask[1] ? T(BN_DW) : NULL,
                    *db = ex->mask[2] ? T(BN_DB) : NULL;
    int ca = channel_axis(x);
    int64_t c_n = x->dims[ca], l_n = 1, t_n = 1;
    for (int d = 0; d < ca; d++) l_n *= x->dims[d];
    for (uint64_t d = ca + 1; d < x->ndim; d++) t_n *= x->dims[d];
    double n = (double)(l_n * t_n);
    for (int64_t c = 0; c < c_n; c++) {
        double wc = w ? rd(w, c) : 1.0, mu, s;
        if (ex->training) {
            mu = sm && numel(sm) ? rd(sm, c) : 0.0;
            s = si && numel(si) ? rd(si, c) : 1.0;
        } else {
            mu = rm ? rd(rm, c) : 0.0;
            s = 1.0 / sqrt((rv ? rd(rv, c) : 1.0) + ex->eps);
        }
        double sg = 0, sgx = 0;
        for (int64_t l = 0; l < l_n; l++)
            for (int64_t t = 0; t < t_n; t++) {
                int64_t i = (l * c_n + c) * t_n + t;
                double gv = rd(g, i);
                sg += gv;
                sgx += gv * (rd(x, i) - mu) * s;
            }
        ws[2 * c] = sg;
        ws[2 * c + 1] = sgx;
        if (dx)
            for (int64_t l = 0; l < l_n; l++)
                for (int64_t t = 0; t < t_n; t++) {
                    int64_t i = (l * c_n + c) * t_n + t;
                    double gv = rd(g, i);
                    if (ex->training)
                        wr(dx, i, wc * s * (gv - sg / n - (rd(x, i) - mu) * s * sgx / n));
                    else
                        wr(dx, i, gv * wc * s);
                }
        if (dw) wr(dw, c, sgx);
        if (db) wr(db, c, sg);
    }
}

static void elemt_kernel(aclOpExecutor *ex, double *ws) {
    const aclTensor *g = T(EL_G), *x = T(EL_X), *mean = T(EL_MEAN), *invstd = T(EL_INVSTD), *w = T(EL_W),
                    *sdy = T(EL_SDY), *sdyxmu = T(EL_SDYXMU), *counter = T(EL_COUNTER), *dx = T(EL_DX);
    double total = 0;
    for (int64_t i = 0, k = numel(counter); i < k; i++) total += rd(counter, i);
    int64_t c_n = x->dims[1], t_n = 1, l_n = x->dims[0];
    for (uint64_t d = 2; d < x->ndim; d++) t_n *= x->dims[d];
    for (int64_t c = 0; c < c_n; c++) { /* per-channel coefficients in the workspace */
        ws[3 * c] = rd(sdy, c) / total;
        ws[3 * c + 1] = rd(sdyxmu, c) / total;
        ws[3 * c + 2] = w ? rd(w, c) : 1.0;
    }
    for (int64_t c = 0; c < c_n; c++) {
        double mu = rd(mean, c), is = rd(invstd, c), wc = ws[3 * c + 2], a = ws[3 * c], b = ws[3 * c + 1];
        for (int64_t l = 0; l < l_n; l++)
            for (int64_t t = 0; t < t_n; t++) {
                int64_t i = (l * c_n + c) * t_n + t;
                wr(dx, i, (rd(g, i) - a - (rd(x, i) - mu) * is * is * b) * is * wc);
            }
    }
}

/* aclnnLayerNorm: ints = normalizedShape; rows of n elements, two-pass statistics */
static void lnf_kernel(aclOpExecutor *ex) {
    const aclTensor *x = T(LNF_X), *w = T(LNF_W), *b = T(LNF_B), *y = T(LNF_Y), *mean = T(LNF_MEAN), *rstd = T(LNF_RSTD);
    int64_t n = 1, m = 1;
    for (uint64_t i = 0; i < ex->nints; i++) n *= ex->ints[i];
    for (uint64_t d = 0; d + ex->nints < x->ndim; d++) m *= x->dims[d];
    for (int64_t r = 0; r < m; r++) {
        if (n == 0) { /* CANN: mean 0, rstd NaN */
            if (mean) wr(mean, r, 0.0);
            if (rstd) wr(rstd, r, NAN);
            continue;
        }
        double mu = 0, var = 0;
        for (int64_t j = 0; j < n; j++) mu += rd(x, r * n + j);
        mu /= n;
        for (int64_t j = 0; j < n; j++) { double u = rd(x, r * n + j) - mu; var += u * u; }
        double rs = 1.0 / sqrt(var / n + ex->eps);
        for (int64_t j = 0; j < n; j++)
            wr(y, r * n + j, (rd(x, r * n + j) - mu) * rs * (w ? rd(w, j) : 1.0) + (b ? rd(b, j) : 0.0));
        if (mean) wr(mean, r, mu);
        if (rstd) wr(rstd, r, rs);
    }
}

/* aclnnRmsNorm: rows of numel(gamma) elements */
static void rms_kernel(aclOpExecutor *ex) {
    const aclTensor *x = T(RMS_X), *gamma = T(RMS_GAMMA), *y = T(RMS_Y), *rstd = T(RMS_RSTD);
    int64_t n = numel(gamma), m = n ? numel(x) / n : 0;
    for (int64_t r = 0; r < m; r++) {
        double sq = 0;
        for (int64_t j = 0; j < n; j++) { double v = rd(x, r * n + j); sq += v * v; }
        double rs = 1.0 / sqrt(sq / n + ex->eps);
        for (int64_t j = 0; j < n; j++) wr(y, r * n + j, rd(x, r * n + j) * rs * rd(gamma, j));
        wr(rstd, r, rs);
    }
}

/* aclnnRmsNormGrad: dgamma's column sums in the workspace (n doubles) */
static void rms_grad_kernel(aclOpExecutor *ex, double *ws) {
    const aclTensor *dy = T(RG_DY), *x = T(RG_X), *rstd = T(RG_RSTD), *gamma = T(RG_GAMMA), *dx = T(RG_DX),
                    *dgamma = T(RG_DGAMMA);
    int64_t n = numel(gamma), m = n ? numel(x) / n : 0;
    for (int64_t j = 0; j < n; j++) ws[j] = 0;
    for (int64_t r = 0; r < m; r++) {
        double rs = rd(rstd, r), s = 0;
        for (int64_t j = 0; j < n; j++) {
            double g = rd(dy, r * n + j), xh = rd(x, r * n + j) * rs;
            s += g * rd(gamma, j) * xh;
            ws[j] += g * xh;
        }
        for (int64_t j = 0; j < n; j++)
            wr(dx, r * n + j, rs * (rd(dy, r * n + j) * rd(gamma, j) - rd(x, r * n + j) * rs * s / n));
    }
    for (int64_t j = 0; j < n; j++) wr(dgamma, j, ws[j]);
}

/* aclnnGroupNorm: ints = N, C, HxW, group; self read flat as [N, group, C/group * HxW] */
static void gn_kernel(aclOpExecutor *ex) {
    const aclTensor *x = T(GN_X), *gamma = T(GN_GAMMA), *beta = T(GN_BETA), *y = T(GN_Y), *mean = T(GN_MEAN),
                    *rstd = T(GN_RSTD);
    int64_t c_n = ex->ints[1], hxw = ex->ints[2], groups = ex->ints[3];
    if (numel(x) == 0) { /* CANN: mean 0, rstd NaN */
        for (int64_t i = 0, k = numel(mean); i < k; i++) { wr(mean, i, 0.0); wr(rstd, i, NAN); }
        return;
    }
    int64_t d = c_n / groups * hxw, stats = numel(mean);
    for (int64_t k = 0; k < stats; k++) { /* k = sample * group + g; its elements are contiguous in flat order */
        double mu = 0, var = 0;
        for (int64_t j = 0; j < d; j++) mu += rd(x, k * d + j);
        mu /= d;
        for (int64_t j = 0; j < d; j++) { double u = rd(x, k * d + j) - mu; var += u * u; }
        double rs = 1.0 / sqrt(var / d + ex->eps);
        for (int64_t j = 0; j < d; j++) {
            int64_t c = (k % groups) * (c_n / groups) + j / hxw;
            wr(y, k * d + j, (rd(x, k * d + j) - mu) * rs * (gamma ? rd(gamma, c) : 1.0) + (beta ? rd(beta, c) : 0.0));
        }
        wr(mean, k, mu);
        wr(rstd, k, rs);
    }
}

/* aclnnGroupNormBackward: per-channel sums of gradOut and gradOut * x-hat in the workspace (2 C doubles) */
static void gn_bwd_kernel(aclOpExecutor *ex, double *ws) {
    const aclTensor *g = T(GB_G), *x = T(GB_X), *mean = T(GB_MEAN), *rstd = T(GB_RSTD), *gamma = T(GB_GAMMA);
    const aclTensor *dx = ex->mask[0] ? T(GB_DX) : NULL, *dgamma = ex->mask[1] ? T(GB_DGAMMA) : NULL,
                    *dbeta = ex->mask[2] ? T(GB_DBETA) : NULL;
    int64_t n_n = ex->ints[0], c_n = ex->ints[1], hxw = ex->ints[2], groups = ex->ints[3];
    double *sum_g = ws, *sum_gx = ws ? ws + c_n : NULL;
    if (ws)
        for (int64_t c = 0; c < 2 * c_n; c++) ws[c] = 0;
    int64_t d = n_n > 0 && c_n > 0 && hxw > 0 ? c_n / groups * hxw : 0;
    for (int64_t k = 0; d && k < n_n * groups; k++) {
        double mu = rd(mean, k), rs = rd(rstd, k), s1 = 0, s2 = 0;
        for (int64_t j = 0; j < d; j++) {
            int64_t c = (k % groups) * (c_n / groups) + j / hxw;
            double gv = rd(g, k * d + j), xh = (rd(x, k * d + j) - mu) * rs, gw = gv * (gamma ? rd(gamma, c) : 1.0);
            s1 += gw;
            s2 += gw * xh;
            sum_g[c] += gv;
            sum_gx[c] += gv * xh;
        }
        if (dx)
            for (int64_t j = 0; j < d; j++) {
                int64_t c = (k % groups) * (c_n / groups) + j / hxw;
                double gv = rd(g, k * d + j), xh = (rd(x, k * d + j) - mu) * rs, gw = gv * (gamma ? rd(gamma, c) : 1.0);
                wr(dx, k * d + j, rs * (gw - s1 / d - xh * s2 / d));
            }
    }
    for (int64_t c = 0; c < c_n; c++) {
        if (dgamma) wr(dgamma, c, ws ? sum_gx[c] : 0.0);
        if (dbeta) wr(dbeta, c, ws ? sum_g[c] : 0.0);
    }
}

/* dims of x as [L, C, T] with the channel on dim 1 */
static void channel_split(const aclTensor *x, int64_t *l_n, int64_t *c_n, int64_t *t_n) {
    *l_n = x->dims[0];
    *c_n = x->dims[1];
    *t_n = 1;
    for (uint64_t d = 2; d < x->ndim; d++) *t_n *= x->dims[d];
}

/* aclnnBatchNormStats: per-channel mean and 1/sqrt(population variance + eps), two passes */
static void bns_kernel(aclOpExecutor *ex) {
    const aclTensor *x = T(BNS_X), *mean = T(BNS_MEAN), *invstd = T(BNS_INVSTD);
    int64_t l_n, c_n, t_n;
    channel_split(x, &l_n, &c_n, &t_n);
    double n = (double)(l_n * t_n);
    for (int64_t c = 0; c < c_n; c++) {
        if (n == 0) { wr(mean, c, 0.0); wr(invstd, c, NAN); continue; } /* CANN: mean 0, invstd NaN */
        double mu = 0, var = 0;
        for (int64_t l = 0; l < l_n; l++)
            for (int64_t t = 0; t < t_n; t++) mu += rd(x, (l * c_n + c) * t_n + t);
        mu /= n;
        for (int64_t l = 0; l < l_n; l++)
            for (int64_t t = 0; t < t_n; t++) { double u = rd(x, (l * c_n + c) * t_n + t) - mu; var += u * u; }
        wr(mean, c, mu);
        wr(invstd, c, 1.0 / sqrt(var / n + ex->eps));
    }
}

/* aclnnBatchNormGatherStatsWithCounts: [devices, C] statistics to global ones; running stats in place */
static void bng_kernel(aclOpExecutor *ex) {
    const aclTensor *mean = T(BNG_MEAN), *invstd = T(BNG_INVSTD), *rm = T(BNG_RM), *rv = T(BNG_RV),
                    *counts = T(BNG_COUNTS), *mean_all = T(BNG_MEAN_ALL), *invstd_all = T(BNG_INVSTD_ALL);
    int64_t c_n = numel(mean_all), d_n = numel(mean) ? mean->dims[0] : 0;
    for (int64_t c = 0; c < c_n; c++) {
        if (d_n == 0) { wr(mean_all, c, 0.0); wr(invstd_all, c, NAN); continue; }
        double n = 0, ma = 0, var = 0;
        for (int64_t d = 0; d < d_n; d++) { n += rd(counts, d); ma += rd(counts, d) * rd(mean, d * c_n + c); }
        ma /= n;
        for (int64_t d = 0; d < d_n; d++) {
            double s = rd(invstd, d * c_n + c), dm = rd(mean, d * c_n + c) - ma;
            var += rd(counts, d) * (1.0 / (s * s) - ex->eps + dm * dm);
        }
        var /= n;
        wr(mean_all, c, ma);
        wr(invstd_all, c, 1.0 / sqrt(var + ex->eps));
        if (rm) wr(rm, c, (1 - ex->momentum) * rd(rm, c) + ex->momentum * ma);
        if (rv) wr(rv, c, (1 - ex->momentum) * rd(rv, c) + ex->momentum * var * n / (n - 1));
    }
}

/* aclnnBatchNormElemt: (x - mean) * invstd * weight + bias per channel (dim 1) */
static void bne_kernel(aclOpExecutor *ex) {
    const aclTensor *x = T(BNE_X), *w = T(BNE_W), *b = T(BNE_B), *mean = T(BNE_MEAN), *invstd = T(BNE_INVSTD),
                    *y = T(BNE_Y);
    int64_t l_n, c_n, t_n;
    channel_split(x, &l_n, &c_n, &t_n);
    for (int64_t c = 0; c < c_n; c++) {
        double mu = rd(mean, c), s = rd(invstd, c) * (w ? rd(w, c) : 1.0), bc = b ? rd(b, c) : 0.0;
        for (int64_t l = 0; l < l_n; l++)
            for (int64_t t = 0; t < t_n; t++) {
                int64_t i = (l * c_n + c) * t_n + t;
                wr(y, i, (rd(x, i) - mu) * s + bc);
            }
    }
}

/* aclnnBatchNorm: the batch's statistics (training; two passes, running stats in place, unbiased variance)
   or the running ones (null: mean 0, variance 1), then (x - mean) * invstd * weight + bias on the channel
   axis; an empty input only fills saveMean with 0 and saveInvstd with NaN */
static void bnf_kernel(aclOpExecutor *ex) {
    const aclTensor *x = T(BNF_X), *w = T(BNF_W), *b = T(BNF_B), *rm = T(BNF_RM), *rv = T(BNF_RV), *y = T(BNF_Y),
                    *sm = T(BNF_SM), *si = T(BNF_SI);
    if (numel(x) == 0) {
        for (int64_t i = 0, k = sm ? numel(sm) : 0; i < k; i++) wr(sm, i, 0.0);
        for (int64_t i = 0, k = si ? numel(si) : 0; i < k; i++) wr(si, i, NAN);
        return;
    }
    int ca = channel_axis(x);
    int64_t c_n = x->dims[ca], l_n = 1, t_n = 1;
    for (int d = 0; d < ca; d++) l_n *= x->dims[d];
    for (uint64_t d = ca + 1; d < x->ndim; d++) t_n *= x->dims[d];
    double n = (double)(l_n * t_n), m = ex->momentum;
    for (int64_t c = 0; c < c_n; c++) {
        double mu = 0, var = 0;
        if (ex->training) {
            for (int64_t l = 0; l < l_n; l++)
                for (int64_t t = 0; t < t_n; t++) mu += rd(x, (l * c_n + c) * t_n + t);
            mu /= n;
            for (int64_t l = 0; l < l_n; l++)
                for (int64_t t = 0; t < t_n; t++) { double u = rd(x, (l * c_n + c) * t_n + t) - mu; var += u * u; }
            var /= n;
            wr(sm, c, mu);
            wr(si, c, 1.0 / sqrt(var + ex->eps));
            if (rm) wr(rm, c, (1 - m) * rd(rm, c) + m * mu);
            if (rv) wr(rv, c, (1 - m) * rd(rv, c) + m * var * n / (n - 1));
        } else {
            mu = rm ? rd(rm, c) : 0.0;
            var = rv ? rd(rv, c) : 1.0;
        }
        double s = (w ? rd(w, c) : 1.0) / sqrt(var + ex->eps), bc = b ? rd(b, c) : 0.0;
        for (int64_t l = 0; l < l_n; l++)
            for (int64_t t = 0; t < t_n; t++) {
                int64_t i = (l * c_n + c) * t_n + t;
                wr(y, i, (rd(x, i) - mu) * s + bc);
            }
    }
}

/* aclnnBatchNormReduceBackward: per channel (dim 1) sumDy = sum g, sumDyXmu = sum g * (x - mean),
   gradWeight = sumDyXmu * invstd, gradBias = sum g, each when its flag (ex->mask) is true; weight is
   not read; an empty input gives zeros */
static void bnrb_kernel(aclOpExecutor *ex) {
    const aclTensor *g = T(BNR_G), *x = T(BNR_X), *mean = T(BNR_MEAN), *invstd = T(BNR_INVSTD);
    const aclTensor *sdy = ex->mask[0] ? T(BNR_SDY) : NULL, *sdyxmu = ex->mask[0] ? T(BNR_SDYXMU) : NULL,
                    *dw = ex->mask[1] ? T(BNR_DW) : NULL, *db = ex->mask[2] ? T(BNR_DB) : NULL;
    int64_t l_n, c_n, t_n;
    channel_split(x, &l_n, &c_n, &t_n);
    for (int64_t c = 0; c < c_n; c++) {
        double mu = rd(mean, c), s1 = 0, s2 = 0;
        for (int64_t l = 0; l < l_n; l++)
            for (int64_t t = 0; t < t_n; t++) {
                int64_t i = (l * c_n + c) * t_n + t;
                double gv = rd(g, i);
                s1 += gv;
                s2 += gv * (rd(x, i) - mu);
            }
        if (sdy) wr(sdy, c, s1);
        if (sdyxmu) wr(sdyxmu, c, s2);
        if (dw) wr(dw, c, numel(x) ? s2 * rd(invstd, c) : 0.0);
        if (db) wr(db, c, s1);
    }
}

static uint64_t required_workspace(const aclOpExecutor *ex) {
    if (ex->op == OP_LNF || ex->op == OP_RMS || ex->op == OP_GN || ex->op >= OP_BNS) return 0;
    if (ex->op == OP_RMS_GRAD) return (uint64_t)(numel(&ex->t[RG_GAMMA]) * sizeof(double));
    if (ex->op == OP_GN_BWD) return ex->ints[1] > 0 ? (uint64_t)(2 * ex->ints[1] * sizeof(double)) : 0;
    if (ex->op == OP_LN) {
        int64_t n = 1;
        for (uint64_t i = 0; i < ex->nints; i++) n *= ex->ints[i];
        return (ex->mask[1] || ex->mask[2]) && n > 0 ? (uint64_t)(2 * n * sizeof(double)) : 0;
    }
    if (ex->op == OP_BN) {
        const aclTensor *x = &ex->t[BN_X];
        return x->ndim >= 2 ? (uint64_t)(2 * x->dims[channel_axis(x)] * sizeof(double)) : 0;
    }
    const aclTensor *x = &ex->t[EL_X];
    return x->ndim >= 2 ? (uint64_t)(3 * x->dims[1] * sizeof(double)) : 0;
}

static bool overlaps(const char *lo, const char *hi, const void *p, size_t n) {
    return n && lo < (const char *)p + n && (const char *)p < hi;
}

static bool queued_use(const void *p, size_t n) {
    const char *lo = p, *hi = lo + n;
    if (!n) return false;
    for (int i = 0; i < MAX_OBJS; i++)
        for (Task *t = streams[i] ? streams[i]->head : NULL; t; t = t->next) {
            const aclOpExecutor *ex = t->ex;
            if (ex->workspace && overlaps(lo, hi, t->ws, ex->workspace)) return true;
            for (int k = 0; k < n_slots[ex->op]; k++) {
                const aclTensor *x = &ex->t[k];
                int64_t storage = 1;
                for (uint64_t d = 0; d < x->sndim; d++) storage *= x->sdims[d];
                if (ex->has[k] && x->data && overlaps(lo, hi, x->data, (size_t)storage * itemsize(x->dtype))) return true;
            }
        }
    return false;
}

static aclnnStatus run_kernel(aclOpExecutor *ex, void *ws) {
    for (int k = 0; k < n_slots[ex->op]; k++)
        if (ex->has[k] && !tensor_on_device(&ex->t[k])) {
            misuse("%s: tensor %d of executor %ld is not in live device memory at run time", op_names[ex->op], k, ex->id);
            return ACLNN_ERR_PARAM_INVALID;
        }
    if (ex->workspace && !device_span(ws, ex->workspace)) {
        misuse("%s: workspace not in live device memory at run time", op_names[ex->op]);
        return ACLNN_ERR_PARAM_INVALID;
    }
    switch (ex->op) {
    case OP_LN: ln_kernel(ex, ws); break;
    case OP_BN: bn_kernel(ex, ws); break;
    case OP_ELEMT: elemt_kernel(ex, ws); break;
    case OP_LNF: lnf_kernel(ex); break;
    case OP_RMS: rms_kernel(ex); break;
    case OP_RMS_GRAD: rms_grad_kernel(ex, ws); break;
    case OP_GN: gn_kernel(ex); break;
    case OP_GN_BWD: gn_bwd_kernel(ex, ws); break;
    case OP_BNS: bns_kernel(ex); break;
    case OP_BNG: bng_kernel(ex); break;
    case OP_BNE: bne_kernel(ex); break;
    case OP_BNF: bnf_kernel(ex); break;
    case OP_BNRB: bnrb_kernel(ex); break;
    }
    return ACLNN_SUCCESS;
}

/* ---------------------------------------------------------------- aclnn entry points */

static aclnnStatus make_executor(int op, const aclTensor **ts, const int *required, const aclIntArray *ints,
                                 const aclBoolArray *mask, bool training, double eps, uint64_t *workspaceSize,
                                 aclOpExecutor **executor) {
    const char *name = op_names[op];
    char fn[96];
    snprintf(fn, sizeof fn, "%sGetWorkspaceSize", name);
    aclnnStatus rc = enter(fn);
    if (rc) return rc;
    if (!workspaceSize || !executor) { set_err("EZ1001: %s: workspaceSize or executor is null", fn); return ACLNN_ERR_PARAM_NULLPTR; }
    for (int k = 0; k < n_slots[op]; k++)
        if (required[k] && !ts[k]) { set_err("EZ1001: %s: tensor %d is null", fn, k); return ACLNN_ERR_PARAM_NULLPTR; }
    if (mask && mask->n != 3) { set_err("EZ1001: %s: outputMask length %lu", fn, (unsigned long)mask->n); return ACLNN_ERR_PARAM_INVALID; }
    for (int k = 0; k < n_slots[op]; k++)
        if (ts[k] && !is_float(ts[k]->dtype) && !(op == OP_ELEMT && k == EL_COUNTER && ts[k]->dtype == DT_INT32) &&
            !(op == OP_BNRB && k == BNR_W)) { /* CANN casts that weight, whatever its dtype, and never reads it */
            set_err("EZ1001: %s: no kernel for data type %d of tensor %d", fn, ts[k]->dtype, k);
            return ACLNN_ERR_INNER_FIND_KERNEL_ERROR;
        }
    aclOpExecutor *ex = calloc(1, sizeof *ex);
    ex->op = op;
    for (int k = 0; k < n_slots[op]; k++)
        if (ts[k]) { ex->t[k] = *ts[k]; ex->has[k] = true; }
    if (ints) { ex->nints = ints->n; memcpy(ex->ints, ints->v, ints->n * sizeof(int64_t)); }
    for (int i = 0; i < 3; i++) ex->mask[i] = mask ? mask->v[i] : true;
    ex->training = training;
    ex->eps = eps;
    ex->workspace = required_workspace(ex);
    ex->id = ++next_executor_id;
    track((void **)live_executors, ex);
    created[K_EXECUTOR]++;
    *workspaceSize = ex->workspace;
    *executor = ex;
    logf_locked("%s workspace=%lu executor=%ld", fn, (unsigned long)ex->workspace, ex->id);
    return ACLNN_SUCCESS;
}

static aclnnStatus launch(int op, void *workspace, uint64_t workspaceSize, aclOpExecutor *ex, aclrtStream stream) {
    const char *name = op_names[op];
    aclnnStatus rc = enter(name);
    if (rc) return rc;
    if (!known((void **)live_executors, ex) || ex->op != op) { misuse("%s: unknown, released or foreign executor", name); return ACLNN_ERR_PARAM_INVALID; }
    if (ex->launched && !ex->repeatable) { misuse("%s: single-use executor launched twice", name); return ACLNN_ERR_PARAM_INVALID; }
    if (!known((void **)streams, stream)) { misuse("%s: unknown stream", name); return ACLNN_ERR_PARAM_INVALID; }
    if (workspaceSize < ex->workspace || (ex->workspace && !device_span(workspace, ex->workspace))) {
        misuse("%s: workspace of %lu bytes at %p, needs %lu in device memory", name, (unsigned long)workspaceSize,
               workspace, (unsigned long)ex->workspace);
        return ACLNN_ERR_PARAM_INVALID;
    }
    for (int k = 0; k < n_slots[op]; k++)
        if (ex->has[k] && !tensor_on_device(&ex->t[k])) {
            misuse("%s: tensor %d does not lie in device memory", name, k);
            return ACLNN_ERR_PARAM_INVALID;
        }
    ex->launched = true;
    ex->pending++;
    if (!ex->repeatable) untrack((void **)live_executors, ex); /* released once it has run */
    Task *t = calloc(1, sizeof *t);
    t->ex = ex;
    t->ws = workspace;
    Stream *s = stream;
    if (s->tail) s->tail->next = t;
    else s->head = t;
    s->tail = t;
    logf_locked("%s executor=%ld stream=%ld workspaceSize=%lu", name, ex->id, s->id, (unsigned long)workspaceSize);
    return ACLNN_SUCCESS;
}

EXPORT aclnnStatus aclnnLayerNormBackwardGetWorkspaceSize(
    const aclTensor *gradOut, const aclTensor *input, const aclIntArray *normalizedShape, const aclTensor *mean,
    const aclTensor *rstd, const aclTensor *weightOptional, const aclTensor *biasOptional,
    const aclBoolArray *outputMask, aclTensor *gradInputOut, aclTensor *gradWeightOut, aclTensor *gradBiasOut,
    uint64_t *workspaceSize, aclOpExecutor **executor) {
    const aclTensor *ts[] = {gradOut, input, mean, rstd, weightOptional, biasOptional, gradInputOut, gradWeightOut, gradBiasOut};
    int required[] = {1, 1, 1, 1, 0, 0, 0, 0, 0};
    pthread_mutex_lock(&mu);
    aclnnStatus rc;
    if (!normalizedShape || !outputMask) { enter("aclnnLayerNormBackwardGetWorkspaceSize"); rc = ACLNN_ERR_PARAM_NULLPTR; }
    else {
        for (int i = 0; i < 3 && outputMask->n == 3; i++) required[6 + i] = outputMask->v[i];
        rc = make_executor(OP_LN, ts, required, normalizedShape, outputMask, false, 0, workspaceSize, executor);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclnnStatus aclnnLayerNormBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                          aclrtStream stream) {
    pthread_mutex_lock(&mu);
    aclnnStatus rc = launch(OP_LN, workspace, workspaceSize, executor, stream);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclnnStatus aclnnBatchNormBackwardGetWorkspaceSize(
    const aclTensor *gradOut, const aclTensor *input, const aclTensor *weight, const aclTensor *runningMean,
    const aclTensor *runningVar, const aclTensor *saveMean, const aclTensor *saveInvstd, bool training, double eps,
    const aclBoolArray *outputMask, aclTensor *gradInput, aclTensor *gradWeight, aclTensor *gradBias,
    uint64_t *workspaceSize, aclOpExecutor **executor) {
    const aclTensor *ts[] = {gradOut, input, weight, runningMean, runningVar, saveMean, saveInvstd, gradInput, gradWeight, gradBias};
    int required[] = {1, 1, 0, 0, 0, 0, 0, 0, 0, 0};
    pthread_mutex_lock(&mu);
    aclnnStatus rc;
    if (!outputMask) { enter("aclnnBatchNormBackwardGetWorkspaceSize"); rc = ACLNN_ERR_PARAM_NULLPTR; }
    else {
        for (int i = 0; i < 3 && outputMask->n == 3; i++) required[7 + i] = outputMask->v[i];
        rc = make_executor(OP_BN, ts, required, NULL, outputMask, training, eps, workspaceSize, executor);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclnnStatus aclnnBatchNormBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                          aclrtStream stream) {
    pthread_mutex_lock(&mu);
    aclnnStatus rc = launch(OP_BN, workspace, workspaceSize, executor, stream);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclnnStatus aclnnBatchNormElemtBackwardGetWorkspaceSize(
    const aclTensor *gradOut, const aclTensor *input, const aclTensor *mean, const aclTensor *invstd,
    const aclTensor *weight, const aclTensor *sumDy, const aclTensor *sumDyXmu, aclTensor *counter,
    aclTensor *gradInput, uint64_t *workspaceSize, aclOpExecutor **executor) {
    const aclTensor *ts[] = {gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, counter, gradInput};
    int required[] = {1, 1, 1, 1, 0, 1, 1, 1, 1};
    pthread_mutex_lock(&mu);
    aclnnStatus rc = make_executor(OP_ELEMT, ts, required, NULL, NULL, false, 0, workspaceSize, executor);
    pthread_mutex_unlock(&mu);
    return rc;
}

EXPORT aclnnStatus aclnnBatchNormElemtBackward(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                               aclrtStream stream) {
    pthread_mutex_lock(&mu);
    aclnnStatus rc = launch(OP_ELEMT, workspace, workspaceSize, executor, stream);
    pthread_mutex_unlock(&mu);
    return rc;
}

#define LAUNCH_ENTRY(fn, op)                                                                                  \
    EXPORT aclnnStatus fn(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream) { \
        pthread_mutex_lock(&mu);                                                                                  \
        aclnnStatus rc = launch(op, workspace, workspaceSize, executor, stream);                                  \
        pthread_mutex_unlock(&mu);                                                                                \
        return rc;                                                                                                \
    }

EXPORT aclnnStatus aclnnLayerNormGetWorkspaceSize(const aclTensor *input, const aclIntArray *normalizedShape,
                                                  const aclTensor *weightOptional, const aclTensor *biasOptional,
                                                  double eps, aclTensor *out, aclTensor *meanOutOptional,
                                                  aclTensor *rstdOutOptional, uint64_t *workspaceSize,
                                                  aclOpExecutor **executor) {
    const aclTensor *ts[] = {input, weightOptional, biasOptional, out, meanOutOptional, rstdOutOptional};
    int required[] = {1, 0, 0, 1, 0, 0};
    pthread_mutex_lock(&mu);
    aclnnStatus rc;
    if (!normalizedShape) { enter("aclnnLayerNormGetWorkspaceSize"); rc = ACLNN_ERR_PARAM_NULLPTR; }
    else rc = make_executor(OP_LNF, ts, required, normalizedShape, NULL, false, eps, workspaceSize, executor);
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnLayerNorm, OP_LNF)

EXPORT aclnnStatus aclnnRmsNormGetWorkspaceSize(const aclTensor *x, const aclTensor *gamma, double epsilon,
                                                const aclTensor *yOut, const aclTensor *rstdOut,
                                                uint64_t *workspaceSize, aclOpExecutor **executor) {
    const aclTensor *ts[] = {x, gamma, yOut, rstdOut};
    int required[] = {1, 1, 1, 1};
    pthread_mutex_lock(&mu);
    aclnnStatus rc = make_executor(OP_RMS, ts, required, NULL, NULL, false, epsilon, workspaceSize, executor);
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnRmsNorm, OP_RMS)

EXPORT aclnnStatus aclnnRmsNormGradGetWorkspaceSize(const aclTensor *dy, const aclTensor *x, const aclTensor *rstd,
                                                    const aclTensor *gamma, const aclTensor *dxOut,
                                                    const aclTensor *dgammaOut, uint64_t *workspaceSize,
                                                    aclOpExecutor **executor) {
    const aclTensor *ts[] = {dy, x, rstd, gamma, dxOut, dgammaOut};
    int required[] = {1, 1, 1, 1, 1, 1};
    pthread_mutex_lock(&mu);
    aclnnStatus rc = make_executor(OP_RMS_GRAD, ts, required, NULL, NULL, false, 0, workspaceSize, executor);
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnRmsNormGrad, OP_RMS_GRAD)

EXPORT aclnnStatus aclnnGroupNormGetWorkspaceSize(const aclTensor *self, const aclTensor *gamma, const aclTensor *beta,
                                                  int64_t N, int64_t C, int64_t HxW, int64_t group, double eps,
                                                  aclTensor *out, aclTensor *meanOut, aclTensor *rstdOut,
                                                  uint64_t *workspaceSize, aclOpExecutor **executor) {
    const aclTensor *ts[] = {self, gamma, beta, out, meanOut, rstdOut};
    int required[] = {1, 0, 0, 1, 1, 1};
    int64_t sizes[] = {N, C, HxW, group};
    aclIntArray ints = {sizes, 4};
    pthread_mutex_lock(&mu);
    aclnnStatus rc;
    if (group <= 0 || C % group) {
        enter("aclnnGroupNormGetWorkspaceSize");
        set_err("EZ1001: aclnnGroupNormGetWorkspaceSize: group %ld does not divide C %ld", (long)group, (long)C);
        rc = ACLNN_ERR_PARAM_INVALID;
    } else rc = make_executor(OP_GN, ts, required, &ints, NULL, false, eps, workspaceSize, executor);
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnGroupNorm, OP_GN)

EXPORT aclnnStatus aclnnGroupNormBackwardGetWorkspaceSize(
    const aclTensor *gradOut, const aclTensor *input, const aclTensor *mean, const aclTensor *rstd,
    const aclTensor *gamma, int64_t N, int64_t C, int64_t HxW, int64_t group, const aclBoolArray *outputMask,
    aclTensor *gradInput, aclTensor *gradGammaOut, aclTensor *gradBetaOut, uint64_t *workspaceSize,
    aclOpExecutor **executor) {
    const aclTensor *ts[] = {gradOut, input, mean, rstd, gamma, gradInput, gradGammaOut, gradBetaOut};
    int required[] = {1, 1, 1, 1, 0, 0, 0, 0};
    int64_t sizes[] = {N, C, HxW, group};
    aclIntArray ints = {sizes, 4};
    pthread_mutex_lock(&mu);
    aclnnStatus rc;
    if (!outputMask) { enter("aclnnGroupNormBackwardGetWorkspaceSize"); rc = ACLNN_ERR_PARAM_NULLPTR; }
    else if (group <= 0 || C % group) {
        enter("aclnnGroupNormBackwardGetWorkspaceSize");
        set_err("EZ1001: aclnnGroupNormBackwardGetWorkspaceSize: group %ld does not divide C %ld", (long)group, (long)C);
        rc = ACLNN_ERR_PARAM_INVALID;
    } else {
        for (int i = 0; i < 3 && outputMask->n == 3; i++) required[5 + i] = outputMask->v[i];
        rc = make_executor(OP_GN_BWD, ts, required, &ints, outputMask, false, 0, workspaceSize, executor);
    }
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnGroupNormBackward, OP_GN_BWD)

EXPORT aclnnStatus aclnnBatchNormStatsGetWorkspaceSize(const aclTensor *input, double eps, aclTensor *mean,
                                                       aclTensor *invstd, uint64_t *workspaceSize,
                                                       aclOpExecutor **executor) {
    const aclTensor *ts[] = {input, mean, invstd};
    int required[] = {1, 1, 1};
    pthread_mutex_lock(&mu);
    aclnnStatus rc = make_executor(OP_BNS, ts, required, NULL, NULL, false, eps, workspaceSize, executor);
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnBatchNormStats, OP_BNS)

EXPORT aclnnStatus aclnnBatchNormGatherStatsWithCountsGetWorkspaceSize(
    const aclTensor *input, const aclTensor *mean, const aclTensor *invstd, aclTensor *runningMean,
    aclTensor *runningVar, double momentum, double eps, const aclTensor *counts, aclTensor *meanAll,
    aclTensor *invstdAll, uint64_t *workspaceSize, aclOpExecutor **executor) {
    const aclTensor *ts[] = {input, mean, invstd, runningMean, runningVar, counts, meanAll, invstdAll};
    int required[] = {1, 1, 1, 0, 0, 1, 1, 1};
    pthread_mutex_lock(&mu);
    aclnnStatus rc = make_executor(OP_BNG, ts, required, NULL, NULL, false, eps, workspaceSize, executor);
    if (rc == ACLNN_SUCCESS) (*executor)->momentum = momentum;
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnBatchNormGatherStatsWithCounts, OP_BNG)

EXPORT aclnnStatus aclnnBatchNormElemtGetWorkspaceSize(const aclTensor *input, const aclTensor *weight,
                                                       const aclTensor *bias, aclTensor *mean, aclTensor *invstd,
                                                       double eps, aclTensor *output, uint64_t *workspaceSize,
                                                       aclOpExecutor **executor) {
    const aclTensor *ts[] = {input, weight, bias, mean, invstd, output};
    int required[] = {1, 0, 0, 1, 1, 1};
    pthread_mutex_lock(&mu);
    aclnnStatus rc = make_executor(OP_BNE, ts, required, NULL, NULL, false, eps, workspaceSize, executor);
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnBatchNormElemt, OP_BNE)

EXPORT aclnnStatus aclnnBatchNormReduceBackwardGetWorkspaceSize(
    const aclTensor *gradOut, const aclTensor *input, const aclTensor *mean, const aclTensor *invstd,
    const aclTensor *weight, bool inputG, bool weightG, bool biasG, aclTensor *sumDy, aclTensor *sumDyXmu,
    aclTensor *gradWeight, aclTensor *gradBias, uint64_t *workspaceSize, aclOpExecutor **executor) {
    const aclTensor *ts[] = {gradOut, input, mean, invstd, weight, sumDy, sumDyXmu, gradWeight, gradBias};
    int required[] = {1, 1, 1, 1, 0, inputG, inputG, weightG, biasG};
    bool flags[] = {inputG, weightG, biasG}; /* kept as the executor's output mask */
    aclBoolArray mask = {flags, 3};
    pthread_mutex_lock(&mu);
    aclnnStatus rc = make_executor(OP_BNRB, ts, required, NULL, &mask, false, 0, workspaceSize, executor);
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnBatchNormReduceBackward, OP_BNRB)

EXPORT aclnnStatus aclnnBatchNormGetWorkspaceSize(const aclTensor *input, const aclTensor *weight, const aclTensor *bias,
                                                  aclTensor *runningMean, aclTensor *runningVar, bool training,
                                                  double momentum, double eps, aclTensor *output, aclTensor *saveMean,
                                                  aclTensor *saveInvstd, uint64_t *workspaceSize,
                                                  aclOpExecutor **executor) {
    const aclTensor *ts[] = {input, weight, bias, runningMean, runningVar, output, saveMean, saveInvstd};
    int required[] = {1, 0, 0, 0, 0, 1, training, training};
    pthread_mutex_lock(&mu);
    aclnnStatus rc;
    if (input && output && (!training || (saveMean && saveInvstd)) && numel(input) == 0) {
        /* as CANN: an empty input returns before any other check; only the saved statistics are written */
        const aclTensor *kept[] = {input, NULL, NULL, NULL, NULL, NULL, saveMean, saveInvstd};
        int none[8] = {0};
        rc = make_executor(OP_BNF, kept, none, NULL, NULL, training, eps, workspaceSize, executor);
    } else rc = make_executor(OP_BNF, ts, required, NULL, NULL, training, eps, workspaceSize, executor);
    if (rc == ACLNN_SUCCESS) (*executor)->momentum = momentum;
    pthread_mutex_unlock(&mu);
    return rc;
}
LAUNCH_ENTRY(aclnnBatchNorm, OP_BNF)

/* ---------------------------------------------------------------- test hooks */

static int kind_of(const char *kind) {
    for (int k = 0; k < K_N; k++)
        if (strcmp(kind_names[k], kind) == 0) return k;
    return -1;
}

/* created minus destroyed of a kind: tensor, intArray, boolArray, executor, stream, context, alloc, device, init */
EXPORT long fake_live(const char *kind) {
    pthread_mutex_lock(&mu);
    int k = kind_of(kind);
    long n = k < 0 ? -1 : created[k] - destroyed[k];
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT long fake_created(const char *kind) {
    pthread_mutex_lock(&mu);
    int k = kind_of(kind);
    long n = k < 0 ? -1 : created[k];
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT long fake_calls(const char *function) {
    pthread_mutex_lock(&mu);
    long n = 0;
    for (int i = 0; i < nfuncs; i++)
        if (strcmp(funcs[i].name, function) == 0) n = funcs[i].calls;
    pthread_mutex_unlock(&mu);
    return n;
}

/* The next `times` calls of `function` return `code` (times 0 cancels). */
EXPORT void fake_fail_times(const char *function, int code, int times) {
    pthread_mutex_lock(&mu);
    int i = func_slot(function);
    if (i >= 0) { funcs[i].fail_code = code; funcs[i].fail_pending = code ? times : 0; }
    pthread_mutex_unlock(&mu);
}

/* The next call of `function` returns `code`. */
EXPORT void fake_fail_next(const char *function, int code) { fake_fail_times(function, code, 1); }

/* Kernels queued on any stream and not yet run. */
EXPORT long fake_queued(void) {
    pthread_mutex_lock(&mu);
    long n = 0;
    for (int i = 0; i < MAX_OBJS; i++)
        for (Task *t = streams[i] ? streams[i]->head : NULL; t; t = t->next) n++;
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT long fake_misuse_count(void) { return misuse_count; }
EXPORT const char *fake_misuse_last(void) { return misuse_last; }

/* Copies the call log into buf (NUL-terminated, truncated to cap); returns its full length. */
EXPORT size_t fake_log_read(char *buf, size_t cap) {
    pthread_mutex_lock(&mu);
    size_t n = log_len;
    if (buf && cap) {
        size_t k = n < cap - 1 ? n : cap - 1;
        memcpy(buf, log_buf ? log_buf : "", k);
        buf[k] = 0;
    }
    pthread_mutex_unlock(&mu);
    return n;
}

EXPORT void fake_log_clear(void) {
    pthread_mutex_lock(&mu);
    log_len = 0;
    if (log_buf) log_buf[0] = 0;
    pthread_mutex_unlock(&mu);
}
