// Refusals a CANN program meets, each printed as "<case> <status> <aclGetRecentErrMsg()>".
#include <cstdio>
#include <cstring>
#include <vector>

#include "acl/acl.h"
#include "aclnnop/aclnn_layer_norm_backward.h"

static void report(const char *name, long long status)
{
    const char *message = aclGetRecentErrMsg();
    std::printf("%s %lld %s\n", name, status, status && message ? message : "");
}

int main()
{
    aclInit(nullptr);
    aclrtSetDevice(0);
    aclrtStream stream = nullptr;
    aclrtCreateStream(&stream);
    std::vector<int64_t> shape = {2, 4}, strides = {4, 1}, vec = {4}, unit = {1}, stats = {2, 1}, ones = {1, 1};
    void *device = nullptr;
    aclrtMalloc(&device, 256, ACL_MEM_MALLOC_HUGE_FIRST);
    char *d = static_cast<char *>(device);
    auto tensor = [&](const std::vector<int64_t> &dims, const std::vector<int64_t> &st, void *data) {
        return aclCreateTensor(dims.data(), dims.size(), ACL_FLOAT, st.data(), 0, ACL_FORMAT_ND, dims.data(), dims.size(), data);
    };
    aclTensor *x = tensor(shape, strides, d), *dy = tensor(shape, strides, d + 32), *dx = tensor(shape, strides, d + 64);
    aclTensor *mean = tensor(stats, ones, d + 96), *rstd = tensor(stats, ones, d + 104);
    aclTensor *dw = tensor(vec, unit, d + 112), *db = tensor(vec, unit, d + 128);
    int64_t norm_dims[1] = {4}, bad_dims[1] = {3};
    bool mask_data[3] = {true, true, true};
    aclIntArray *norm = aclCreateIntArray(norm_dims, 1), *bad_norm = aclCreateIntArray(bad_dims, 1);
    aclBoolArray *mask = aclCreateBoolArray(mask_data, 3);
    uint64_t workspace = 0;
    aclOpExecutor *executor = nullptr;

    report("null_gradOut", aclnnLayerNormBackwardGetWorkspaceSize(nullptr, x, norm, mean, rstd, nullptr, nullptr, mask,
                                                                  dx, dw, db, &workspace, &executor));
    report("bad_normalizedShape", aclnnLayerNormBackwardGetWorkspaceSize(dy, x, bad_norm, mean, rstd, nullptr, nullptr,
                                                                         mask, dx, dw, db, &workspace, &executor));
    float host[8] = {0};
    aclTensor *on_host = tensor(shape, strides, host);
    report("host_pointer", aclnnLayerNormBackwardGetWorkspaceSize(on_host, x, norm, mean, rstd, nullptr, nullptr, mask,
                                                                  dx, dw, db, &workspace, &executor));
    aclTensor *past_end = tensor(shape, strides, d + 240);
    report("past_end", aclnnLayerNormBackwardGetWorkspaceSize(past_end, x, norm, mean, rstd, nullptr, nullptr, mask,
                                                              dx, dw, db, &workspace, &executor));
    report("ok", aclnnLayerNormBackwardGetWorkspaceSize(dy, x, norm, mean, rstd, nullptr, nullptr, mask, dx, dw, db,
                                                        &workspace, &executor));
    report("launch", aclnnLayerNormBackward(nullptr, workspace, executor, stream));
    report("synchronize", aclrtSynchronizeStream(stream));
    report("launch_null_executor", aclnnLayerNormBackward(nullptr, 0, nullptr, stream));
    // Handles used after their end: refused, never read after they were freed.
    report("launch_consumed_executor", aclnnLayerNormBackward(nullptr, workspace, executor, stream));
    report("repeatable_consumed_executor", aclSetAclOpExecutorRepeatable(executor));
    report("destroy_consumed_executor", aclDestroyAclOpExecutor(executor));
    aclrtStream ended = nullptr;
    aclrtCreateStream(&ended);
    report("destroy_stream", aclrtDestroyStream(ended));
    report("destroy_stream_again", aclrtDestroyStream(ended));
    report("synchronize_destroyed_stream", aclrtSynchronizeStream(ended));
    // A handle past its end never names a newer one, whatever addresses the library reuses.
    aclrtStream newer = nullptr;
    aclrtCreateStream(&newer);
    report("newer_stream_is_another", newer != ended ? 0 : 1);
    report("destroy_stale_stream", aclrtDestroyStream(ended));
    report("newer_stream_lives", aclrtSynchronizeStream(newer));
    aclrtDestroyStream(newer);
    report("ok_again", aclnnLayerNormBackwardGetWorkspaceSize(dy, x, norm, mean, rstd, nullptr, nullptr, mask, dx, dw, db,
                                                              &workspace, &executor));
    report("launch_on_destroyed_stream", aclnnLayerNormBackward(nullptr, workspace, executor, ended));
    report("launch_after_refusal", aclnnLayerNormBackward(nullptr, workspace, executor, stream));
    aclOpExecutor *stale = executor, *next = nullptr;
    aclnnLayerNormBackwardGetWorkspaceSize(dy, x, norm, mean, rstd, nullptr, nullptr, mask, dx, dw, db, &workspace,
                                           &next);
    report("launch_stale_executor", aclnnLayerNormBackward(nullptr, workspace, stale, stream));
    report("launch_newer_executor", aclnnLayerNormBackward(nullptr, workspace, next, stream));
    report("memcpy_host_as_device", aclrtMemcpy(host, sizeof host, host, sizeof host, ACL_MEMCPY_HOST_TO_DEVICE));
    report("memcpy_device_as_host", aclrtMemcpy(device, 32, d + 32, 32, ACL_MEMCPY_HOST_TO_DEVICE));
    report("memcpy_past_end", aclrtMemcpy(host, sizeof host, d + 250, sizeof host, ACL_MEMCPY_DEVICE_TO_HOST));
    report("memcpy_count_over_destMax", aclrtMemcpy(host, 4, d, sizeof host, ACL_MEMCPY_DEVICE_TO_HOST));
    report("free_null", aclrtFree(nullptr));
    report("free_inside", aclrtFree(d + 8));
    report("free", aclrtFree(device));
    report("use_after_free", aclrtMemcpy(host, sizeof host, device, sizeof host, ACL_MEMCPY_DEVICE_TO_HOST));
    report("malloc_zero", aclrtMalloc(&device, 0, ACL_MEM_MALLOC_HUGE_FIRST));
    report("malloc_beyond_the_server", aclrtMalloc(&device, size_t{1} << 50, ACL_MEM_MALLOC_HUGE_FIRST));
    report("malloc_beyond_any_address", aclrtMalloc(&device, (size_t{1} << 62) + 1, ACL_MEM_MALLOC_HUGE_FIRST));
    void *small = nullptr;
    aclrtMalloc(&small, 64, ACL_MEM_MALLOC_HUGE_FIRST);
    report("memcpy_nothing_to_null", aclrtMemcpy(nullptr, 0, small, 0, ACL_MEMCPY_DEVICE_TO_HOST));
    aclrtFree(small);
    report("set_device_1", aclrtSetDevice(1));
    // Contexts: the default one (aclrtSetDevice's), a created one, and handles that are not (live) contexts.
    aclrtContext first = nullptr, made = nullptr, current = nullptr, unused = nullptr;
    report("get_context", aclrtGetCurrentContext(&first));
    report("create_context", aclrtCreateContext(&made, 0));
    aclrtGetCurrentContext(&current);
    report("created_is_current", current == made && made != first ? 0 : 1);
    report("stream_in_created_context", aclrtSynchronizeStream(stream));
    report("set_default_context", aclrtSetCurrentContext(first));
    report("destroy_context", aclrtDestroyContext(made));
    report("destroy_context_again", aclrtDestroyContext(made));
    report("destroy_default_context", aclrtDestroyContext(first));
    report("set_destroyed_context", aclrtSetCurrentContext(made));
    aclrtContext later = nullptr;
    aclrtCreateContext(&later, 0);
    report("set_destroyed_context_after_another", later != made ? aclrtSetCurrentContext(made) : 0);
    aclrtDestroyContext(later);
    report("create_context_null", aclrtCreateContext(nullptr, 0));
    report("create_context_device_1", aclrtCreateContext(&unused, 1));
    // ACL_MEMCPY_DEFAULT: the direction from the addresses, a freed allocation's refused.
    void *fresh = nullptr;
    aclrtMalloc(&fresh, 64, ACL_MEM_MALLOC_HUGE_FIRST);
    float in[4] = {1, 2, 3, 4}, out[4] = {0};
    char *f = static_cast<char *>(fresh);
    report("memcpy_default_to_device", aclrtMemcpy(f, 16, in, 16, ACL_MEMCPY_DEFAULT));
    report("memcpy_default_on_device", aclrtMemcpy(f + 16, 16, f, 16, ACL_MEMCPY_DEFAULT));
    report("memcpy_default_to_host", aclrtMemcpy(out, 16, f + 16, 16, ACL_MEMCPY_DEFAULT));
    report("memcpy_default_round_trip", std::memcmp(in, out, sizeof in) ? 1 : 0);
    report("memcpy_buf_to_device", aclrtMemcpy(f, 16, in, 16, ACL_MEMCPY_HOST_TO_BUF_TO_DEVICE));
    aclrtFree(fresh);
    report("memcpy_default_freed", aclrtMemcpy(out, 16, f, 16, ACL_MEMCPY_DEFAULT));
    report("memcpy_kind_8", aclrtMemcpy(out, 16, in, 16, static_cast<aclrtMemcpyKind>(8)));
    aclrtRunMode mode = ACL_DEVICE;
    report("run_mode", aclrtGetRunMode(&mode));
    report("run_mode_is_host", mode == ACL_HOST ? 0 : 1);
    // The codes a CANN program compares against, by name (std::array without <array>, as CANN's samples).
    std::array<std::pair<const char *, int>, 5> codes = {{{"ACL_ERROR_INTERNAL_ERROR", ACL_ERROR_INTERNAL_ERROR},
                                                         {"ACL_ERROR_INVALID_DEVICE", ACL_ERROR_INVALID_DEVICE},
                                                         {"ACL_ERROR_RT_INVALID_DEVICEID", ACL_ERROR_RT_INVALID_DEVICEID},
                                                         {"ACL_ERROR_RT_MEMORY_ALLOCATION", ACL_ERROR_RT_MEMORY_ALLOCATION},
                                                         {"ACL_ERROR_RT_INTERNAL_ERROR", ACL_ERROR_RT_INTERNAL_ERROR}}};
    for (const auto &[name, value] : codes) std::printf("%s %d \n", name, value);
    for (aclTensor *t : {x, dy, dx, mean, rstd, dw, db, on_host, past_end}) aclDestroyTensor(t);
    aclDestroyIntArray(norm);
    aclDestroyIntArray(bad_norm);
    aclDestroyBoolArray(mask);
    aclrtDestroyStream(stream);
    aclFinalize();
    return 0;
}
