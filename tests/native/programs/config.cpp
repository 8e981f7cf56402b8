// Settings read from the environment: prints "init <status>", "set_device <status>" and CANN's last
// error message. A setting that cannot be used fails aclInit or aclrtSetDevice with a message naming it.
#include <cstdio>

#include "acl/acl.h"

int main()
{
    int init = aclInit(nullptr);
    const char *message = aclGetRecentErrMsg();
    std::printf("init %d %s\n", init, init != ACL_SUCCESS && message ? message : "");
    int device = aclrtSetDevice(0);
    message = aclGetRecentErrMsg();
    std::printf("set_device %d %s\n", device, device != ACL_SUCCESS && message ? message : "");
    return 0;
}
