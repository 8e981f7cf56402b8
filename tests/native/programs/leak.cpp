// Allocates device memory, fills it and exits without freeing anything or finalizing: the server
// frees it all once this process's session lapses. Prints the number of allocations.
#include <cstdio>
#include <vector>

#include "acl/acl.h"

int main()
{
    if (aclInit(nullptr) != ACL_SUCCESS) return 1;
    std::vector<char> bytes(1 << 20, 7);
    for (int i = 0; i < 3; i++) {
        void *p = nullptr;
        if (aclrtMalloc(&p, bytes.size(), ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) return 2;
        if (aclrtMemcpy(p, bytes.size(), bytes.data(), bytes.size(), ACL_MEMCPY_HOST_TO_DEVICE) != ACL_SUCCESS) return 3;
    }
    std::printf("allocated 3\n");
    return 0;
}
