// Host memory and frees that are not the program's to make: prints one line per case, "<case> <status>".
//
//   host_memory [rounds]
//
// aclrtMallocHost of more than memory, aclrtFreeHost of a device pointer, of a pointer into a block, of a
// block twice and of null; then `rounds` of two threads freeing one device allocation while a third
// allocates (the address may be reused): "race <rounds in which exactly one free succeeded> <of those, the
// rounds in which the new allocation was lost>".
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "acl/acl.h"
#include "check.h"

int main(int argc, char **argv)
{
    CHECK(aclInit(nullptr));
    CHECK(aclrtSetDevice(0));
    void *host = nullptr;
    std::printf("mallochost_huge %d\n", aclrtMallocHost(&host, SIZE_MAX - 10));
    CHECK(aclrtMallocHost(&host, 100));
    void *device = nullptr;
    CHECK(aclrtMalloc(&device, 64, ACL_MEM_MALLOC_HUGE_FIRST));
    std::printf("freehost_device %d\n", aclrtFreeHost(device));
    std::printf("freehost_inside %d\n", aclrtFreeHost(static_cast<char *>(host) + 8));
    std::printf("freehost %d\n", aclrtFreeHost(host));
    std::printf("freehost_again %d\n", aclrtFreeHost(host));
    std::printf("freehost_null %d\n", aclrtFreeHost(nullptr));
    std::printf("device_still_usable %d\n", aclrtMemset(device, 64, 7, 64));
    int rounds = argc > 1 ? std::atoi(argv[1]) : 0, one_free = 0, lost = 0;
    for (int i = 0; i < rounds; i++) {
        void *p = nullptr, *q = nullptr;
        CHECK(aclrtMalloc(&p, 64, ACL_MEM_MALLOC_HUGE_FIRST));
        int a = -1, b = -1, c = -1;
        std::thread first([&] { a = aclrtFree(p); });
        std::thread second([&] { b = aclrtFree(p); });
        std::thread third([&] { c = aclrtMalloc(&q, 64, ACL_MEM_MALLOC_HUGE_FIRST); });
        first.join();
        second.join();
        third.join();
        if (c != ACL_SUCCESS) continue;
        if ((a == ACL_SUCCESS) != (b == ACL_SUCCESS)) {  // one free refused: it must have ended nothing else
            one_free++;
            lost += aclrtMemset(q, 64, 1, 64) != ACL_SUCCESS;
        }
        aclrtFree(q);
    }
    std::printf("race %d %d\n", one_free, lost);
    return 0;
}
