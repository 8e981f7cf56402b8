// A GetWorkspaceSize the server refuses: prints "<status> <workspaceSize> <executor is untouched>".
//
//   refused_plan
//
// Run against a server that refuses the plan with a status that is no failure code (tests/test_native.py's
// lying server): the call must fail, and leave the outputs a program has not initialized alone.
#include <cstdio>

#include "acl/acl.h"
#include "aclnnop/aclnn_rms_norm.h"
#include "check.h"

int main()
{
    CHECK(aclInit(nullptr));
    CHECK(aclrtSetDevice(0));
    void *device = nullptr;
    CHECK(aclrtMalloc(&device, 64, ACL_MEM_MALLOC_HUGE_FIRST));
    int64_t dims[1] = {4}, strides[1] = {1};
    aclTensor *x = aclCreateTensor(dims, 1, ACL_FLOAT, strides, 0, ACL_FORMAT_ND, dims, 1, device);
    uint64_t workspace = 12345;  // stand-ins for a program's uninitialized locals
    aclOpExecutor *placeholder = reinterpret_cast<aclOpExecutor *>(0x4141);
    aclOpExecutor *executor = placeholder;
    int status = aclnnRmsNormGetWorkspaceSize(x, x, 1e-6, x, x, &workspace, &executor);
    std::printf("%d %llu %d\n", status, static_cast<unsigned long long>(workspace), executor == placeholder);
    return 0;
}
