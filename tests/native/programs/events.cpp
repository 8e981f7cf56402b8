// Events across two streams, and the event and timeout calls' answers.
//
//   events DIR [faults]
//
// Reads DIR/shape (rows cols steps), DIR/x.bin and DIR/gamma.bin (float). Stream A runs `steps` LayerNorm
// calls (weight 1, bias 0), each reading the last one's output, the last one writing y (a buffer nothing else
// writes: zeros until then); an event is recorded on A after them. Stream B waits for the event, then runs
// z = RmsNorm(y, gamma), reading A's output. Writes DIR/y.bin and DIR/z.bin (float), then prints
// "<case> <status> <aclGetRecentErrMsg()>" lines: the waits, queries, timeouts and refusals.
//
// With `faults` (the server's device is told to fail the next two LayerNorm kernels while they run), it only
// prints how a timed-out synchronize and an event report those failures (see faults() below).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <thread>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_layer_norm.h"
#include "aclnnop/aclnn_rms_norm.h"
#include "check.h"

static void report(const char *name, long long status)
{
    const char *message = aclGetRecentErrMsg();
    std::printf("%s %lld %s\n", name, status, status && message ? message : "");
}

static std::vector<float> read_floats(const std::string &path, size_t n)
{
    std::vector<float> values(n);
    std::ifstream(path, std::ios::binary).read(reinterpret_cast<char *>(values.data()), n * sizeof(float));
    return values;
}

// One LayerNorm of x into y on `stream`, queued.
static int layer_norm(aclrtStream stream, aclTensor *x, aclIntArray *norm, aclTensor *w, aclTensor *b, aclTensor *y,
                      aclTensor *mean, aclTensor *rstd)
{
    uint64_t workspace = 0;
    aclOpExecutor *executor = nullptr;
    CHECK(aclnnLayerNormGetWorkspaceSize(x, norm, w, b, 1e-5, y, mean, rstd, &workspace, &executor));
    CHECK(aclnnLayerNorm(nullptr, workspace, executor, stream));
    return 0;
}

// Two kernels that fail while they run: a failure found by a synchronize that timed out is kept for the next
// wait (not lost), and one found by an event's wait is reported there, once; the event stays failed.
static int faults(aclrtStream a, aclTensor *x, aclIntArray *norm, aclTensor *w, aclTensor *b, aclTensor *y,
                  aclTensor *mean, aclTensor *rstd)
{
    CHECK(layer_norm(a, x, norm, w, b, y, mean, rstd));
    report("fault_no_wait", aclrtSynchronizeStreamWithTimeout(a, 0));
    report("fault_kept_for_next_wait", aclrtSynchronizeStream(a));
    report("fault_reported_once", aclrtSynchronizeStream(a));
    aclrtEvent event = nullptr;
    CHECK(aclrtCreateEvent(&event));
    CHECK(layer_norm(a, x, norm, w, b, y, mean, rstd));
    CHECK(aclrtRecordEvent(event, a));
    report("fault_event_synchronize", aclrtSynchronizeEvent(event));
    report("fault_stream_after_event", aclrtSynchronizeStream(a));
    report("fault_event_stays_failed", aclrtSynchronizeEvent(event));
    aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_COMPLETE;
    report("fault_query", aclrtQueryEventStatus(event, &status));
    report("fault_query_not_ready", status == ACL_EVENT_RECORDED_STATUS_NOT_READY ? 0 : 1);
    CHECK(layer_norm(a, x, norm, w, b, y, mean, rstd));
    report("fault_record_again", aclrtRecordEvent(event, a));
    report("fault_synchronize_again", aclrtSynchronizeEvent(event));
    report("fault_query_again", aclrtQueryEventStatus(event, &status));
    report("fault_complete_again", status == ACL_EVENT_RECORDED_STATUS_COMPLETE ? 0 : 1);
    CHECK(aclrtDestroyEvent(event));
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 2 && !(argc == 3 && std::string(argv[2]) == "faults")) return 2;
    std::string dir = argv[1];
    int64_t rows = 0, cols = 0, steps = 0;
    std::ifstream(dir + "/shape") >> rows >> cols >> steps;
    size_t n = rows * cols;
    std::vector<float> x = read_floats(dir + "/x.bin", n), gamma = read_floats(dir + "/gamma.bin", cols);
    std::vector<float> ones(cols, 1.0f), zeros(cols, 0.0f);

    CHECK(aclInit(nullptr));
    CHECK(aclrtSetDevice(0));
    aclrtStream a = nullptr, b = nullptr;
    CHECK(aclrtCreateStream(&a));
    CHECK(aclrtCreateStream(&b));
    // One allocation: x, t0, t1, y, z (n floats each), mean, rstd, rstd2 (rows), w, bias, gamma (cols).
    char *base = nullptr;
    size_t bytes = (5 * n + 3 * rows + 3 * cols) * sizeof(float);
    CHECK(aclrtMalloc(reinterpret_cast<void **>(&base), bytes, ACL_MEM_MALLOC_HUGE_FIRST));
    float *xd = reinterpret_cast<float *>(base), *t[2] = {xd + n, xd + 2 * n}, *y = xd + 3 * n, *z = xd + 4 * n;
    float *mean = xd + 5 * n, *rstd = mean + rows, *rstd2 = rstd + rows, *w = rstd2 + rows, *bias = w + cols,
          *g = bias + cols;
    CHECK(aclrtMemcpy(xd, n * 4, x.data(), n * 4, ACL_MEMCPY_HOST_TO_DEVICE));
    CHECK(aclrtMemcpy(w, cols * 4, ones.data(), cols * 4, ACL_MEMCPY_HOST_TO_DEVICE));
    CHECK(aclrtMemcpy(bias, cols * 4, zeros.data(), cols * 4, ACL_MEMCPY_HOST_TO_DEVICE));
    CHECK(aclrtMemcpy(g, cols * 4, gamma.data(), cols * 4, ACL_MEMCPY_HOST_TO_DEVICE));

    std::vector<int64_t> shape = {rows, cols}, strides = {cols, 1}, stats = {rows, 1}, unit2 = {1, 1};
    std::vector<int64_t> vec = {cols}, unit = {1};
    auto matrix = [&](float *data) {
        return aclCreateTensor(shape.data(), 2, ACL_FLOAT, strides.data(), 0, ACL_FORMAT_ND, shape.data(), 2, data);
    };
    auto column = [&](float *data) {
        return aclCreateTensor(stats.data(), 2, ACL_FLOAT, unit2.data(), 0, ACL_FORMAT_ND, stats.data(), 2, data);
    };
    auto vector = [&](float *data) {
        return aclCreateTensor(vec.data(), 1, ACL_FLOAT, unit.data(), 0, ACL_FORMAT_ND, vec.data(), 1, data);
    };
    int64_t norm_dims[1] = {cols};
    aclIntArray *norm = aclCreateIntArray(norm_dims, 1);
    aclTensor *w_t = vector(w), *bias_t = vector(bias), *g_t = vector(g), *mean_t = column(mean),
              *rstd_t = column(rstd), *rstd2_t = column(rstd2);
    uint64_t workspace = 0;
    aclOpExecutor *executor = nullptr;
    if (argc == 3) {
        aclTensor *x_t = matrix(xd), *t0 = matrix(t[0]);
        CHECK(faults(a, x_t, norm, w_t, bias_t, t0, mean_t, rstd_t));
        for (aclTensor *tensor : {x_t, t0, w_t, bias_t, g_t, mean_t, rstd_t, rstd2_t}) aclDestroyTensor(tensor);
        aclDestroyIntArray(norm);
        CHECK(aclrtDestroyStream(a));
        CHECK(aclrtDestroyStream(b));
        CHECK(aclrtFree(base));
        return 0;
    }

    // Stream A: the chain of LayerNorms, then the event.
    for (int64_t i = 0; i < steps; i++) {
        float *in = i == 0 ? xd : t[(i - 1) % 2], *out = i == steps - 1 ? y : t[i % 2];
        aclTensor *in_t = matrix(in), *out_t = matrix(out);
        CHECK(layer_norm(a, in_t, norm, w_t, bias_t, out_t, mean_t, rstd_t));
        aclDestroyTensor(in_t);
        aclDestroyTensor(out_t);
    }
    aclrtEvent done = nullptr;
    CHECK(aclrtCreateEvent(&done));
    aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_COMPLETE;
    report("query_unrecorded", aclrtQueryEventStatus(done, &status));
    report("unrecorded_not_ready", status == ACL_EVENT_RECORDED_STATUS_NOT_READY ? 0 : 1);
    report("record", aclrtRecordEvent(done, a));

    // Stream B waits for it, then reads A's output.
    report("stream_wait", aclrtStreamWaitEvent(b, done));
    aclTensor *y_t = matrix(y), *z_t = matrix(z);
    CHECK(aclnnRmsNormGetWorkspaceSize(y_t, g_t, 1e-6, z_t, rstd2_t, &workspace, &executor));
    CHECK(aclnnRmsNorm(nullptr, workspace, executor, b));
    report("synchronize_event", aclrtSynchronizeEvent(done));
    status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
    report("query_after_synchronize", aclrtQueryEventStatus(done, &status));
    report("complete_after_synchronize", status == ACL_EVENT_RECORDED_STATUS_COMPLETE ? 0 : 1);
    report("synchronize_b_with_timeout", aclrtSynchronizeStreamWithTimeout(b, 60000));
    std::vector<float> y_host(n), z_host(n);
    CHECK(aclrtMemcpy(y_host.data(), n * 4, y, n * 4, ACL_MEMCPY_DEVICE_TO_HOST));
    CHECK(aclrtMemcpy(z_host.data(), n * 4, z, n * 4, ACL_MEMCPY_DEVICE_TO_HOST));
    std::ofstream(dir + "/y.bin", std::ios::binary).write(reinterpret_cast<char *>(y_host.data()), n * 4);
    std::ofstream(dir + "/z.bin", std::ios::binary).write(reinterpret_cast<char *>(z_host.data()), n * 4);

    // A query never blocks: polled, it turns COMPLETE once a synchronize of the stream begun after the record
    // has answered.
    aclTensor *t0 = matrix(t[0]), *t1 = matrix(t[1]);
    CHECK(layer_norm(a, t0, norm, w_t, bias_t, t1, mean_t, rstd_t));
    aclrtEvent timed = nullptr;
    report("create_with_flags", aclrtCreateEventWithFlag(&timed, ACL_EVENT_SYNC | ACL_EVENT_TIME_LINE));
    report("record_again", aclrtRecordEvent(timed, a));
    auto polling_until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    long long polled = 0;
    status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
    while (status != ACL_EVENT_RECORDED_STATUS_COMPLETE && std::chrono::steady_clock::now() < polling_until) {
        if ((polled = aclrtQueryEventStatus(timed, &status)) != 0) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    report("query_polled", polled);
    report("polled_complete", status == ACL_EVENT_RECORDED_STATUS_COMPLETE ? 0 : 1);
    // The same for a stream: polled with timeout 0 after a launch, a synchronize begun after it answers
    // (each poll drew a newer ticket than the answer there, and threw it away: it never succeeded).
    CHECK(layer_norm(a, t0, norm, w_t, bias_t, t1, mean_t, rstd_t));
    long long stream_polled = ACL_ERROR_RT_STREAM_SYNC_TIMEOUT;
    polling_until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (stream_polled == ACL_ERROR_RT_STREAM_SYNC_TIMEOUT && std::chrono::steady_clock::now() < polling_until) {
        stream_polled = aclrtSynchronizeStreamWithTimeout(a, 0);
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    report("stream_polled_with_timeout_0", stream_polled);
    report("synchronize_event_with_timeout", aclrtSynchronizeEventWithTimeout(timed, 60000));
    report("synchronize_event_for_ever", aclrtSynchronizeEventWithTimeout(timed, -1));
    float ms = 0;
    report("elapsed_time", aclrtEventElapsedTime(&ms, done, timed));
    report("reset", aclrtResetEvent(timed, b));
    status = ACL_EVENT_RECORDED_STATUS_COMPLETE;
    report("query_after_reset", aclrtQueryEventStatus(timed, &status));
    report("reset_not_ready", status == ACL_EVENT_RECORDED_STATUS_NOT_READY ? 0 : 1);
    report("synchronize_reset_event", aclrtSynchronizeEvent(timed));  // stands for no work

    // Timeouts: 0 only asks (a synchronize begun now has not answered yet); a generous one waits it out.
    CHECK(layer_norm(a, t0, norm, w_t, bias_t, t1, mean_t, rstd_t));
    report("synchronize_stream_no_wait", aclrtSynchronizeStreamWithTimeout(a, 0));
    report("synchronize_stream_with_timeout", aclrtSynchronizeStreamWithTimeout(a, 60000));
    report("synchronize_stream_for_ever", aclrtSynchronizeStreamWithTimeout(a, -1));
    report("synchronize_stream_timeout_below_minus_1", aclrtSynchronizeStreamWithTimeout(a, -2));
    report("synchronize_event_timeout_below_minus_1", aclrtSynchronizeEventWithTimeout(timed, -2));
    report("synchronize_default_stream_with_timeout", aclrtSynchronizeStreamWithTimeout(nullptr, 60000));

    // Refusals: null, unknown and destroyed handles, never dereferenced.
    report("create_null", aclrtCreateEvent(nullptr));
    report("create_with_flag_null", aclrtCreateEventWithFlag(nullptr, ACL_EVENT_SYNC));
    aclrtEvent unused = nullptr;
    report("create_unknown_flag", aclrtCreateEventWithFlag(&unused, 0x80000000U));
    report("record_null", aclrtRecordEvent(nullptr, a));
    report("query_null_status", aclrtQueryEventStatus(done, nullptr));
    report("query_null_event", aclrtQueryEventStatus(nullptr, &status));
    report("synchronize_null", aclrtSynchronizeEvent(nullptr));
    report("stream_wait_null", aclrtStreamWaitEvent(b, nullptr));
    report("elapsed_null_ms", aclrtEventElapsedTime(nullptr, done, timed));
    report("destroy_null", aclrtDestroyEvent(nullptr));
    int not_an_event = 0;
    report("record_unknown", aclrtRecordEvent(&not_an_event, a));
    report("synchronize_stream_as_event", aclrtSynchronizeEvent(a));  // a live handle, of another kind
    report("destroy_unknown", aclrtDestroyEvent(&not_an_event));
    report("destroy", aclrtDestroyEvent(done));
    report("destroy_again", aclrtDestroyEvent(done));
    report("record_destroyed", aclrtRecordEvent(done, a));
    report("query_destroyed", aclrtQueryEventStatus(done, &status));
    report("synchronize_destroyed", aclrtSynchronizeEvent(done));
    report("synchronize_destroyed_with_timeout", aclrtSynchronizeEventWithTimeout(done, 1000));
    report("stream_wait_destroyed", aclrtStreamWaitEvent(b, done));
    report("reset_destroyed", aclrtResetEvent(done, a));
    report("elapsed_destroyed", aclrtEventElapsedTime(&ms, done, timed));
    aclrtEvent newer = nullptr;
    report("create_after_destroy", aclrtCreateEvent(&newer));
    report("newer_event_is_another", newer != done ? 0 : 1);  // handles are never reused
    report("destroy_newer", aclrtDestroyEvent(newer));
    aclrtStream ended = nullptr;
    CHECK(aclrtCreateStream(&ended));
    CHECK(aclrtDestroyStream(ended));
    report("record_on_destroyed_stream", aclrtRecordEvent(timed, ended));
    report("stream_wait_on_destroyed_stream", aclrtStreamWaitEvent(ended, timed));
    report("reset_on_destroyed_stream", aclrtResetEvent(timed, ended));
    report("synchronize_destroyed_stream_with_timeout", aclrtSynchronizeStreamWithTimeout(ended, 1000));
    report("destroy_timed", aclrtDestroyEvent(timed));

    for (aclTensor *tensor : {w_t, bias_t, g_t, mean_t, rstd_t, rstd2_t, y_t, z_t, t0, t1}) aclDestroyTensor(tensor);
    aclDestroyIntArray(norm);
    CHECK(aclrtDestroyStream(a));
    CHECK(aclrtDestroyStream(b));
    CHECK(aclrtFree(base));
    CHECK(aclrtResetDevice(0));
    CHECK(aclFinalize());
    return 0;
}
