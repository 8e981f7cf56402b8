// A program whose server restarts: it allocates, then, told on stdin, calls while the server is away
// ('d' lines: each call's status) and once it is back ('u': the first call's status and how long it
// took). A program that outlives a server restart carries on with the next call.
#include <chrono>
#include <cstdio>

#include "acl/acl.h"

int main()
{
    if (aclInit(nullptr) != ACL_SUCCESS) return 1;
    void *p = nullptr;
    if (aclrtMalloc(&p, 64, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS) return 2;
    std::printf("allocated\n");
    std::fflush(stdout);
    char line[8];
    while (std::fgets(line, sizeof line, stdin) && line[0] == 'd') {
        auto started = std::chrono::steady_clock::now();
        int code = aclrtMalloc(&p, 64, ACL_MEM_MALLOC_HUGE_FIRST);
        std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
        std::printf("away %d %.2f\n", code, took.count());
        std::fflush(stdout);
    }
    auto started = std::chrono::steady_clock::now();
    int code = aclrtMalloc(&p, 64, ACL_MEM_MALLOC_HUGE_FIRST);
    std::chrono::duration<double> took = std::chrono::steady_clock::now() - started;
    std::printf("back %d %.2f\n", code, took.count());
    return 0;
}
