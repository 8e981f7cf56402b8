// A program that holds device memory and makes no call for a while: prints "kept <status> <byte>" after
// writing 7s into a buffer, sleeping `seconds` and reading it back.
//
//   idle <seconds>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "acl/acl.h"
#include "check.h"

int main(int argc, char **argv)
{
    CHECK(aclInit(nullptr));
    CHECK(aclrtSetDevice(0));
    void *device = nullptr;
    CHECK(aclrtMalloc(&device, 64, ACL_MEM_MALLOC_HUGE_FIRST));
    CHECK(aclrtMemset(device, 64, 7, 64));
    std::this_thread::sleep_for(std::chrono::duration<double>(argc > 1 ? std::atof(argv[1]) : 1.0));
    unsigned char back[64] = {0};
    int status = aclrtMemcpy(back, sizeof back, device, sizeof back, ACL_MEMCPY_DEVICE_TO_HOST);
    std::printf("kept %d %d\n", status, back[63]);
    return 0;
}
